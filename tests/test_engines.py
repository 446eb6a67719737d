"""The engine seam (hy3spark/engines): what each engine answers, checked against the real engine's own output."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path

import pytest

from hy3spark.context import build_context
from hy3spark.engines import ENGINES, engine_for
from hy3spark.spec import SERVING_SECTIONS, load_spec

REPO = Path(__file__).resolve().parent.parent
KV_FIXTURE = REPO / "tests" / "fixtures" / "vllm-0.23.0" / "kv-cases.json"


def test_every_engine_has_a_serving_section_and_the_reverse() -> None:
    assert set(ENGINES) == set(SERVING_SECTIONS)


def test_vllms_log_patterns_read_the_lines_vllm_0_23_logged() -> None:
    # Every KV-cache and concurrency line of the recorded vectors (what vLLM 0.23.0 itself printed) is matched, and
    # the numbers read from it are the ones in the line.
    engine = engine_for(load_spec().spec)
    kv, concurrency = (re.compile(engine.log_lines()[k]) for k in ("kv_cache", "concurrency"))
    lines = [line for case in json.loads(KV_FIXTURE.read_text())["cases"] for line in case["vllm"].get("log", [])]
    kv_lines = [line for line in lines if "GPU KV cache size" in line]
    concurrency_lines = [line for line in lines if "Maximum concurrency" in line]
    assert len(kv_lines) >= 20 and len(concurrency_lines) >= 20
    for line in kv_lines:
        match = kv.search(line)
        assert match and f"GPU KV cache size: {match.group(1)} tokens" in line, line
    for line in concurrency_lines:
        match = concurrency.search(line)
        assert match and line.endswith(f"{match.group(1)} tokens per request: {match.group(2)}x"), line
    assert not any(kv.search(line) for line in concurrency_lines)


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.yml")))
def test_the_context_publishes_the_engine_as_the_engine_answers(example: str) -> None:
    loaded = load_spec(REPO / "examples" / example)
    engine = engine_for(loaded.spec)
    published = build_context(loaded)["hy3spark"]
    assert published["engine"] == {"name": engine.name, "launcher": engine.launcher, "process": engine.process(),
                                   "log_lines": engine.log_lines()}
    assert published["secrets"] == engine.secret_env()
    assert published["serving"]["argv"] == engine.serve_argv()
    assert published["serving"]["argv"][:2] == [engine.process()["exe"], engine.process()["arg"]]


def test_vllm_reads_each_secret_from_the_variable_the_spec_names() -> None:
    loaded = load_spec(REPO / "examples" / "hy3-two-spark.yml")
    spec = loaded.spec
    assert engine_for(spec).secret_env() == {"VLLM_API_KEY": spec.serving.api_key_env, "HF_TOKEN": spec.model.token_env}
    public = spec.model_copy(update={"model": spec.model.model_copy(update={"token_env": None})})
    assert engine_for(public).secret_env() == {"VLLM_API_KEY": spec.serving.api_key_env}


def test_each_nodes_env_carries_its_own_address_and_the_shared_settings() -> None:
    loaded = load_spec(REPO / "examples" / "hy3-two-spark.yml")
    nodes = build_context(loaded)["nodes"]
    for node in loaded.spec.nodes:
        env = nodes[node.name]["env"]
        assert env["VLLM_HOST_IP"] == str(node.fabric_ip.ip)
        assert env["MASTER_ADDR"] == str(loaded.spec.head.fabric_ip.ip)
        assert env["VLLM_CONFIG_ROOT"] == build_context(loaded)["hy3spark"]["paths"]["vllm_config_root"]


def test_the_status_endpoint_is_the_clients_url_honouring_serving_host() -> None:
    from hy3spark.context import client_url, probe_url

    loaded = load_spec(REPO / "examples" / "hy3-two-spark.yml")
    spec = loaded.spec
    head_ip, port = str(spec.head.fabric_ip.ip), spec.serving.port
    assert str(spec.serving.host) == "0.0.0.0"
    assert (client_url(spec), probe_url(spec)) == (f"http://{head_ip}:{port}/v1", f"http://127.0.0.1:{port}")
    host = ipaddress.IPv4Address("192.168.1.10")
    bound = spec.model_copy(update={"serving": spec.serving.model_copy(update={"host": host})})
    assert (client_url(bound), probe_url(bound)) == (f"http://192.168.1.10:{port}/v1", f"http://192.168.1.10:{port}")
