"""The port table (hy3spark/ports.py) for every example and profile, and the rules that keep it sound: every port Ray
is told to open is in the table with the number it was told, no two rows overlap, nothing but SSH and the API is
reachable from beyond the cluster, and a spec that makes two of them collide is refused with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_spec_rules import BASE, spec_text

from hy3spark.context import RAY_PYTHONPATH_ARGV, build_context
from hy3spark.errors import SpecError
from hy3spark.spec import load_spec, parse_spec

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yml"))
# `ray start` flags that name a port, and the spec field each comes from.
RAY_PORT_FLAGS = {"--port": "ray.port", "--ray-client-server-port": "ray.client_server_port",
                  "--node-manager-port": "ray.node_manager_port", "--object-manager-port": "ray.object_manager_port",
                  "--dashboard-agent-listen-port": "ray.dashboard_agent_listen_port",
                  "--dashboard-agent-grpc-port": "ray.dashboard_agent_grpc_port",
                  "--runtime-env-agent-port": "ray.runtime_env_agent_port",
                  "--dashboard-port": "ray.dashboard_port"}


def problems(text: str) -> list[str]:
    try:
        parse_spec(text, "cluster.yml")
    except SpecError as exc:
        return exc.problems
    return []


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_has_a_sound_port_table(example: Path) -> None:
    loaded = load_spec(example)
    ctx = build_context(loaded)
    spec = loaded.spec
    for name, node in ctx["nodes"].items():
        rows = node["ports"]
        assert rows[0]["first"] == 22 and rows[0]["reach"] == "ssh", "SSH is listed first, as the node has it"
        taken: dict[int, str] = {}
        for row in rows:
            assert row["first"] <= row["last"], row
            for port in range(row["first"], row["last"] + 1):
                assert port not in taken, f"{name}: {port} is both {taken[port]} and {row['name']}"
                taken[port] = row["name"]
            # Nothing of ours on all addresses is open to anyone: only the API is the clients', SSH is the node's.
            if row["reach"] in {"clients", "ssh"}:
                assert row["field"] in {"serving.port", None}, row
            if row["reach"] == "loopback":
                assert row["bind"] == "127.0.0.1", row
        reachable = [r for r in rows if r["reach"] == "clients"]
        if node["role"] == "head" and not spec.serving.host.is_loopback:
            assert [r["first"] for r in reachable] == [spec.serving.port]
        else:
            assert reachable == []
        command = node["container"]["command"]
        if spec.serving.launcher == "ray":
            # With ray.metrics off the sitecustomize directory goes first on PYTHONPATH (`sh -c ... ray start ...`).
            prefix = [] if spec.ray.metrics else RAY_PYTHONPATH_ARGV
            assert command[:len(prefix)] == prefix and command[len(prefix):][:2] == ["ray", "start"], command
            command = command[len(prefix):]
            by_field = {r["field"]: r for r in rows}
            flags = {flag: int(command[i + 1]) for i, flag in enumerate(command) if flag in RAY_PORT_FLAGS}
            assert flags, command
            for flag, port in flags.items():
                assert by_field[RAY_PORT_FLAGS[flag]]["first"] == port, (flag, port)
            worker = by_field["ray.min_worker_port..max_worker_port"]
            low, high = (int(command[command.index(f) + 1]) for f in ("--min-worker-port", "--max-worker-port"))
            assert (worker["first"], worker["last"]) == (low, high)
            # The two metrics servers Ray ports only from the environment get their numbers there.
            if node["role"] == "head":
                for key, field in (("DASHBOARD_METRIC_PORT", "ray.dashboard_metrics_port"),
                                   ("AUTOSCALER_METRIC_PORT", "ray.autoscaler_metrics_port")):
                    assert int(node["env"][key]) == by_field[field]["first"]
            # Ray binds these three to --node-ip-address: the table says the fabric address, as ss shows it.
            ip = command[command.index("--node-ip-address") + 1]
            for field in ("ray.dashboard_agent_listen_port", "ray.runtime_env_agent_port"):
                assert by_field[field]["bind"] == ip
            # The two Prometheus servers: on loopback through the sitecustomize, unless ray.metrics asks for them.
            if node["role"] == "head":
                for field in ("ray.dashboard_metrics_port", "ray.autoscaler_metrics_port"):
                    wanted = ("0.0.0.0", "fabric") if spec.ray.metrics else ("127.0.0.1", "loopback")
                    assert (by_field[field]["bind"], by_field[field]["reach"]) == wanted


def test_the_default_pair_lists_every_port_ray_opens() -> None:
    ctx = build_context(parse_spec(spec_text(), "cluster.yml"))
    head = {r["field"]: (r["first"], r["bind"], r["reach"]) for r in ctx["nodes"]["spark-a"]["ports"]}
    assert head == {
        None: (22, "0.0.0.0", "ssh"),
        "serving.port": (8888, "0.0.0.0", "clients"),
        "ray.port": (6379, "0.0.0.0", "fabric"),
        "ray.client_server_port": (10001, "10.0.0.1", "fabric"),
        "ray.dashboard_metrics_port": (44227, "127.0.0.1", "loopback"),
        "ray.autoscaler_metrics_port": (44217, "127.0.0.1", "loopback"),
        "ray.node_manager_port": (6380, "0.0.0.0", "fabric"),
        "ray.object_manager_port": (6381, "0.0.0.0", "fabric"),
        "ray.dashboard_agent_listen_port": (52365, "10.0.0.1", "fabric"),
        "ray.dashboard_agent_grpc_port": (52366, "0.0.0.0", "fabric"),
        "ray.runtime_env_agent_port": (52368, "10.0.0.1", "fabric"),
        "ray.min_worker_port..max_worker_port": (20000, "0.0.0.0", "fabric"),
        "serving.internal_port": (29510, "0.0.0.0", "fabric"),
    }
    worker = {r["field"] for r in ctx["nodes"]["spark-b"]["ports"]}
    assert worker == set(head) - {"serving.port", "ray.port", "ray.client_server_port", "ray.dashboard_metrics_port",
                                  "ray.autoscaler_metrics_port"}
    env = ctx["nodes"]["spark-b"]["env"]
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == "/etc/hy3spark/ray-token"
    assert env["RAY_enable_metrics_collection"] == "0" and "RAY_AUTH_TOKEN" not in env


def test_metrics_and_the_dashboard_add_their_ports_only_when_asked() -> None:
    ctx = build_context(parse_spec(spec_text(ray={"metrics": True, "dashboard": "localhost"}), "cluster.yml"))
    head = {r["field"]: r for r in ctx["nodes"]["spark-a"]["ports"]}
    assert head["ray.metrics_export_port"]["first"] == 52367
    assert (head["ray.dashboard_port"]["bind"], head["ray.dashboard_port"]["reach"]) == ("127.0.0.1", "loopback")
    assert "RAY_enable_metrics_collection" not in ctx["nodes"]["spark-a"]["env"]
    # Asked for, Ray's Prometheus servers bind as Ray makes them (every address, the firewall their fence), and no
    # sitecustomize goes on Ray's PYTHONPATH.
    for field in ("ray.dashboard_metrics_port", "ray.autoscaler_metrics_port"):
        assert (head[field]["bind"], head[field]["reach"]) == ("0.0.0.0", "fabric")
    assert ctx["nodes"]["spark-a"]["container"]["command"][:2] == ["ray", "start"]
    assert ctx["hy3spark"]["ray"]["metrics"] is True


@pytest.mark.parametrize(("ray", "field", "words"), [
    ({"client_server_port": 52366}, "ray.dashboard_agent_grpc_port", "is also ray.client_server_port"),
    ({"dashboard_agent_listen_port": 20500}, "ray.dashboard_agent_listen_port", "inside Ray's worker port range"),
    ({"runtime_env_agent_port": 22}, "ray.runtime_env_agent_port", "SSH's port"),
    ({"metrics": True, "metrics_export_port": 6380}, "ray.metrics_export_port", "is also ray.node_manager_port"),
])
def test_colliding_ray_ports_are_refused_with_the_field(ray: dict[str, object], field: str, words: str) -> None:
    found = problems(spec_text(ray=ray))
    assert len(found) == 1, found
    assert f" {field}: " in found[0] and words in found[0], found[0]


def test_the_serving_port_may_not_take_any_ray_port() -> None:
    for port in (44227, 52366, 52368):
        found = problems(spec_text(serving={**BASE["serving"], "port": port}))
        assert any("serving.port" in p and "collides with a Ray port" in p for p in found), (port, found)
    found = problems(spec_text(ray={"client_server_port": 10002}, serving={**BASE["serving"], "port": 10002}))
    assert any("Ray's client server port" in p for p in found), found


def test_vllms_internal_ports_are_pinned_listed_and_fenced_on_every_node() -> None:
    """vLLM 0.23 takes its torch.distributed store and its cross-node broadcast queue from VLLM_PORT upward
    (get_open_port); unpinned they land on a random port on all addresses, which no firewall rule could name."""
    from hy3spark.render import render_all

    loaded = parse_spec(spec_text(serving={**BASE["serving"], "internal_port": 31000}), "cluster.yml")
    ctx = build_context(loaded)
    outputs = {o.path: o.content for o in render_all(loaded)}
    for name in ("spark-a", "spark-b"):
        node = ctx["nodes"][name]
        assert node["env"]["VLLM_PORT"] == "31000"
        row = next(r for r in node["ports"] if r["field"] == "serving.internal_port")
        assert (row["first"], row["last"], row["bind"], row["reach"]) == (31000, 31007, "0.0.0.0", "fabric")
        etc = f"files/{name}/etc/hy3spark"
        assert "31000-31007/tcp bind 0.0.0.0 from fabric: vLLM internal" in outputs[f"{etc}/ports.txt"]
        assert "31000-31007" in outputs[f"{etc}/firewall.nft"].split("set fabric_tcp")[1]


@pytest.mark.parametrize(("change", "words"), [
    ({"serving": {**BASE["serving"], "port": 29512}}, "holds serving.port (29512)"),
    ({"serving": {**BASE["serving"], "internal_port": 6375}}, "holds ray.port (6379)"),
    ({"serving": {**BASE["serving"], "internal_port": 20990}}, "overlaps Ray's worker ports (20000-20999)"),
    ({"serving": {**BASE["serving"], "internal_port": 52360}}, "holds ray.dashboard_agent_listen_port (52365)"),
    ({"serving": {**BASE["serving"], "launcher": "native", "master_port": 29511}}, "holds serving.master_port (29511)"),
])
def test_vllms_internal_range_may_not_hold_another_port(change: dict[str, object], words: str) -> None:
    found = problems(spec_text(**change))
    assert any(" serving.internal_port: " in p and words in p and "(VLLM_PORT and the 7 ports above it" in p
               for p in found), found


def test_container_env_may_not_set_vllm_port() -> None:
    found = problems(spec_text(container={"env": {"VLLM_PORT": "40000"}}))
    assert len(found) == 1 and "container.env.VLLM_PORT" in found[0] and "serving.internal_port" in found[0], found


@pytest.mark.parametrize("key", ["RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
                                 "RAY_enable_metrics_collection", "DASHBOARD_METRIC_PORT"])
def test_container_env_may_not_turn_off_rays_guards(key: str) -> None:
    found = problems(spec_text(container={"env": {key: "disabled"}}))
    assert len(found) == 1 and f"container.env.{key}" in found[0], found
    # RAY_AUTH_TOKEN is refused first as a secret written inline (its name says token).
    assert ("ray section" if key != "RAY_AUTH_TOKEN" else "secrets are never written") in found[0], found


def test_firewall_off_and_ray_auth_off_warn() -> None:
    loaded = parse_spec(spec_text(firewall="off", ray={"auth": "off"}), "cluster.yml")
    assert not loaded.spec.firewall.enabled
    assert any("firewall: off" in w for w in loaded.warnings), loaded.warnings
    assert any("ray.auth: off" in w and "ShadowRay" in w for w in loaded.warnings), loaded.warnings
    ctx = build_context(loaded)
    assert ctx["nodes"]["spark-a"]["env"]["RAY_AUTH_MODE"] == "disabled"
    assert ctx["hy3spark"]["firewall"]["enabled"] is False
    quiet = parse_spec(spec_text(), "cluster.yml")
    assert not [w for w in quiet.warnings if "firewall" in w or "ray.auth" in w]


def test_api_allow_takes_networks_and_names_a_bad_one() -> None:
    loaded = parse_spec(spec_text(firewall={"api_allow": ["192.168.1.0/24", "10.9.0.7/32"]}), "cluster.yml")
    assert build_context(loaded)["hy3spark"]["firewall"]["api_allow"] == ["192.168.1.0/24", "10.9.0.7/32"]
    found = problems(spec_text(firewall={"api_allow": ["192.168.1.1/24"]}))
    assert len(found) == 1 and "firewall.api_allow" in found[0] and "CIDR" in found[0], found
    assert problems(spec_text(firewall={"api_allow": []})), "an empty list would close the API to everyone"


def test_the_rendered_port_table_names_every_row() -> None:
    from hy3spark.render import render_all

    outputs = {o.path: o.content for o in render_all(parse_spec(spec_text(), "cluster.yml"))}
    table = outputs["files/spark-a/etc/hy3spark/ports.txt"]
    assert "6379/tcp bind 0.0.0.0 from fabric: Ray GCS (ray.port)" in table
    assert "20000-20999/tcp bind 0.0.0.0 from fabric: Ray worker processes" in table
    assert "8888/tcp bind 0.0.0.0 from clients:" in table
    off = {o.path: o.content for o in render_all(parse_spec(spec_text(firewall="off"), "cluster.yml"))}
    assert "firewall: off: nothing enforces" in off["files/spark-a/etc/hy3spark/ports.txt"]
