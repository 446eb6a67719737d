"""The spec's `restarts` (docs/restarts.md): its forms and bounds, what the context derives from it for the roles,
and which units render for which launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_spec_validation import BASE, assert_rejected, write

from hy3spark.context import build_context
from hy3spark.render import render_all
from hy3spark.spec import load_spec

REPO = Path(__file__).resolve().parent.parent
UNITS = "etc/systemd/system"


def context(tmp_path: Path, text: str) -> dict:
    return build_context(load_spec(write(tmp_path, text)))["hy3spark"]["restarts"]


def rendered(tmp_path: Path, text: str) -> dict[str, str]:
    return {o.path: o.content for o in render_all(load_spec(write(tmp_path, text)))}


def test_restarts_are_on_by_default_with_three_failed_starts_in_fifteen_minutes(tmp_path: Path) -> None:
    r = context(tmp_path, BASE)
    assert (r["enabled"], r["supervised"], r["max_failed_starts"], r["window_s"]) == (True, True, 3, 900)
    assert r["backoff_s"] == [10, 30, 60]
    # The plan's request on GPU nodes: what the gate requires free on every node.
    loaded = load_spec(write(tmp_path, BASE))
    assert r["need_bytes"] == build_context(loaded)["hy3spark"]["plan"]["requested_bytes"] > 100 * 2**30


@pytest.mark.parametrize("form", ["off", "false", "{enabled: false}"])
def test_restarts_off_renders_no_unit(tmp_path: Path, form: str) -> None:
    text = BASE + f"restarts: {form}\n"
    assert context(tmp_path, text)["enabled"] is False
    assert context(tmp_path, text)["supervised"] is False
    assert not [p for p in rendered(tmp_path, text) if "/systemd/" in p or "supervisor" in p]


def test_the_budget_is_the_specs(tmp_path: Path) -> None:
    files = rendered(tmp_path, BASE + "restarts: {max_failed_starts: 5, window_minutes: 30}\n")
    config = json.loads(files["files/spark-a/usr/local/lib/hy3spark/supervisor/supervisor.json"])
    assert (config["max_failed_starts"], config["window_s"]) == (5, 1800)
    assert "gives up after 5 failed starts in 30 min" in files[f"files/spark-a/{UNITS}/hy3spark-supervisor.service"]


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("max_failed_starts", "0", "restarts.max_failed_starts"),
    ("max_failed_starts", "101", "restarts.max_failed_starts"),
    ("window_minutes", "0", "restarts.window_minutes"),
    ("retries", "2", "restarts.retries"),
])
def test_bad_restarts_name_the_field(cli, tmp_path: Path, field: str, value: str, needle: str) -> None:
    assert_rejected(cli, tmp_path, BASE + f"restarts: {{{field}: {value}}}\n", needle)


def test_no_gpu_needs_no_memory(tmp_path: Path) -> None:
    assert context(tmp_path, BASE + "container:\n  gpus: false\n")["need_bytes"] == 0


@pytest.mark.parametrize(("example", "supervised"), [
    ("hy3-two-spark.yml", True), ("gpt-oss-single.yml", True),
    ("hy3-two-spark-native.yml", False), ("pair-trtllm-235b.yml", False), ("two-card-tp.yml", False),
])
def test_every_node_gets_a_boot_unit_and_the_head_a_supervisor_under_a_gated_launcher(example: str,
                                                                                       supervised: bool) -> None:
    loaded = load_spec(REPO / "examples" / example)
    files = {o.path: o.content for o in render_all(loaded)}
    nodes = [n.name for n in loaded.spec.nodes]
    for name in nodes:
        unit = files[f"files/{name}/{UNITS}/hy3spark-node.service"]
        container = build_context(loaded)["nodes"][name]["container"]["name"]
        assert f"ExecStart=/usr/bin/docker start --attach {container}\n" in unit
        fabric = build_context(loaded)["nodes"][name]["fabric_ip"]
        # The fabric address first, where there is one (the two-card desktop has none).
        assert (f"sh {fabric}\n" in unit) == (fabric is not None)
    head = nodes[0]
    assert (f"files/{head}/{UNITS}/hy3spark-supervisor.service" in files) == supervised
    assert not [p for p in files if "supervisor" in p and not p.startswith(f"files/{head}/")]


def test_the_supervisor_config_names_the_heads_container_and_the_rendered_paths(tmp_path: Path) -> None:
    files = rendered(tmp_path, BASE)
    config = json.loads(files["files/spark-a/usr/local/lib/hy3spark/supervisor/supervisor.json"])
    assert config["exec"][:5] == ["docker", "exec", "-i", "-e", config["exec"][4]]
    assert config["exec"][4].startswith("HY3SPARK_ENGINE=") and config["exec"][5] == "hy3-head"
    assert json.loads(config["exec"][4].split("=", 1)[1])["process"] == {"exe": "vllm", "arg": "serve"}
    assert config["ready_args"][:2] == ["2", "2"]
    assert (config["script"], config["secrets"]) == ("/etc/hy3spark/serve.sh", "/etc/hy3spark-secrets/secrets.env")
    assert config["health_timeout_s"] == 1800 and config["health_url"].endswith("/health")
