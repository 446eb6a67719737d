"""ray scenario: the one-node path. The head's Ray gates the cluster on its own, the engine serves with TP=1, the
gate names a dead head or a Ray version other than the pinned one, and teardown leaves nothing of ours.

Converge, idempotence (changed=0) and check ran before; these tests run in file order against the live node.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import scenario
import testinfra
from scenario import GCS_WITHOUT_TOKEN, RAY_NODES, REPO, flat, playbook, recap

SCENARIO = Path(__file__).resolve().parent.parent
NODE, IP, CONTAINER, SERVED = "ray-single", "10.95.2.11", "gptoss-head", "gpt-oss-120b"
API_KEY = os.environ.get("HY3SPARK_RAY_API_KEY", "")
RENDERED = SCENARIO / ".rendered"


def node() -> testinfra.host.Host:
    return scenario.node(NODE)


def api(path: str, body: dict | None = None) -> tuple[int, dict]:
    return scenario.api(NODE, path, body, API_KEY)


def test_ray_reports_one_node_and_one_gpu() -> None:
    out = node().check_output("docker exec %s python3 -c %s", CONTAINER, RAY_NODES)
    assert json.loads(out.strip().splitlines()[-1]) == [[IP, 1.0]]


def test_head_container_runs_the_rendered_command_with_its_own_address() -> None:
    info = json.loads(node().check_output(f"docker inspect {CONTAINER}"))[0]
    rendered = json.loads((RENDERED / "files" / NODE / "container.json").read_text())
    assert info["Config"]["Cmd"] == rendered["command"]
    # sh puts the loopback sitecustomize first on PYTHONPATH, then execs `ray start` (ray.metrics is off).
    assert rendered["command"][:2] == ["/bin/sh", "-c"] and rendered["command"][3:6] == ["ray", "start", "--head"]
    assert rendered["command"][rendered["command"].index("--node-ip-address") + 1] == IP
    assert "--include-dashboard=false" in rendered["command"]
    env = dict(e.split("=", 1) for e in info["Config"]["Env"])
    assert env["VLLM_HOST_IP"] == IP


def test_serves_with_tensor_parallel_one() -> None:
    status, body = api("/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [SERVED]
    status, body = api("/v1/completions", {"model": SERVED, "prompt": "Hello", "max_tokens": 8})
    assert status == 200 and body["choices"][0]["text"].strip()
    record = json.loads(node().check_output("cat /var/lib/hy3spark/serve.json"))
    assert record["parsers"] == {}, "no hy_v3 parser in this command: nothing to check or patch"
    # What vLLM 0.23.0 itself computed for this profile on a GB10 (its own KV code, recorded in the fixture): the
    # double prints the vector's lines, so this compares the deployment with vLLM, not with our planner.
    cases = json.loads((REPO / "tests/fixtures/vllm-0.23.0/kv-cases.json").read_text())["cases"]
    vllm = next(case for case in cases if case["id"] == "gptoss120b-profile-gb10-nvml-unsupported")["vllm"]
    assert record["kv_cache_line"].endswith(vllm["lines"][0]), record
    assert record["max_concurrency_line"].endswith(vllm["lines"][1]), record


def test_ray_asks_every_process_for_the_clusters_token() -> None:
    token = node().file("/etc/hy3spark/ray-token")
    assert (token.mode, token.user) == (0o600, "root")
    secret = node().check_output("cat /etc/hy3spark/ray-token").strip()
    assert len(secret) == 64
    out = node().check_output("docker exec %s env -u RAY_AUTH_TOKEN_PATH -u RAY_AUTH_MODE python3 -c %s %s",
                              CONTAINER, GCS_WITHOUT_TOKEN, f"{IP}:6379")
    assert out.startswith("REFUSED AuthenticationError"), out
    # The token is in no process's command line or environment but in the file, and not in docker inspect.
    assert secret not in node().check_output(f"docker inspect {CONTAINER}")
    assert secret not in node().check_output("ps -eo args")
    found = node().run(f"grep -rlsF {secret} /proc/[0-9]*/environ")
    assert found.stdout.strip() == "", found.stdout


def test_every_listening_port_is_in_the_rendered_table() -> None:
    """What the node listens on beyond loopback (host network: Ray) against files/<node>/etc/hy3spark/ports.txt."""
    table = (RENDERED / "files" / NODE / "etc/hy3spark/ports.txt").read_text()
    stray = scenario.stray_listeners(node(), table)
    assert not stray, f"listening but not in ports.txt as bound: {stray}\n{table}"


PROMETHEUS_GET = ("import sys, urllib.request\n"
                  "for port in sys.argv[1:]:\n"
                  "    with urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=10) as r:\n"
                  "        print(port, r.status, b'# TYPE' in r.read())\n")


def test_rays_prometheus_servers_are_on_loopback_only() -> None:
    """ray.metrics is off: the dashboard head's (44227) and the autoscaler's (44217) Prometheus servers, which Ray
    binds to every address, listen on 127.0.0.1 through roles/ray_node's sitecustomize, and still answer there."""
    held = {port: addr for addr, port in scenario.listeners(node()) if port in (44217, 44227)}
    assert held == {44217: "127.0.0.1", 44227: "127.0.0.1"}, held
    shim = node().file("/etc/hy3spark/ray-python/sitecustomize.py")
    assert (shim.mode, shim.user) == (0o644, "root")
    out = node().check_output("docker exec %s python3 -c %s 44217 44227", CONTAINER, PROMETHEUS_GET)
    assert out.split("\n") == ["44217 200 True", "44227 200 True"], out


def test_rotating_the_token_restarts_ray_with_the_new_one() -> None:
    old = node().check_output("cat /etc/hy3spark/ray-token").strip()
    result = playbook(str(SCENARIO / "converge.yml"), "-e", "hy3spark_rotate_ray_token=true")
    assert result.returncode == 0, result.stdout + result.stderr
    new = node().check_output("cat /etc/hy3spark/ray-token").strip()
    assert new != old and len(new) == 64
    assert old not in result.stdout + result.stderr and new not in result.stdout + result.stderr
    test_ray_reports_one_node_and_one_gpu()
    test_serves_with_tensor_parallel_one()


def test_fault_ray_without_token_auth_is_refused_before_it_starts() -> None:
    """The image's Ray read before the container starts: one older than the first with token auth would ignore
    RAY_AUTH_MODE and run open. The real image's 2.60 is made "old" by raising the bar (ray_node_min_token_ray)."""
    before = node().check_output("docker inspect -f '{{.State.StartedAt}}' %s", CONTAINER)
    result = playbook(str(REPO / "playbooks/ray.yml"), "-e", "ray_node_min_token_ray=99.0",
                      "-e", '{"ray_head_ulimits": ["memlock:8388608:8388608", "stack:67108864:67108864"]}')
    out = flat(result.stdout + result.stderr)
    assert result.returncode != 0, out
    assert re.search(r"ray-single: the image \S+ has Ray 2\.60\.\d+, which has no token authentication \(Ray 99\.0 "
                     r"and later have it\)", out), out
    assert "or set ray.auth: off in the spec to accept that risk" in out
    assert node().check_output("docker inspect -f '{{.State.StartedAt}}' %s", CONTAINER) == before


def test_node_container_reaps_its_children() -> None:
    """Docker's init is PID 1 (tini), so what the engine leaves behind is reaped, not kept as a zombie."""
    info = json.loads(node().check_output(f"docker inspect {CONTAINER}"))[0]
    assert info["HostConfig"]["Init"] is True
    assert node().check_output("docker exec %s cat /proc/1/comm", CONTAINER).strip() in {"docker-init", "tini"}
    zombies = node().check_output("docker exec %s sh -c %s", CONTAINER,
                                  "grep -l '^State:.*Z' /proc/[0-9]*/status || true")
    assert zombies.strip() == "", zombies


def test_fault_pinned_ray_version_differs() -> None:
    result = playbook(str(REPO / "playbooks/ray.yml"), "-e", "ray_head_ray_version=2.49.0",
                      "-e", '{"ray_head_ulimits": ["memlock:8388608:8388608", "stack:67108864:67108864"]}')
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "Ray and Python must be the same on every node and Ray must be 2.49.0 (ray.version in the spec):" in out
    assert re.search(r"ray-single: Ray 2\.60\.\d+ / Python 3\.\d+\.\d+", out), out


def test_fault_head_dies_then_recovers() -> None:
    with scenario.killed_on_start(node(), CONTAINER):
        result = playbook(str(SCENARIO / "converge.yml"))
        out = result.stdout + result.stderr
        assert result.returncode != 0, out
        assert "Ray reports 0 of 1 nodes and 0 of 1 GPUs" in out, out
        assert f"Missing: {NODE} ({IP}): container {CONTAINER} exited with exit code 137 (SIGKILL)" in out, out
    result = playbook(str(SCENARIO / "converge.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    test_ray_reports_one_node_and_one_gpu()
    test_serves_with_tensor_parallel_one()


def test_teardown_leaves_nothing_of_ours() -> None:
    result = playbook(str(REPO / "playbooks/teardown.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{NODE}: MemAvailable " in result.stdout
    assert node().check_output("docker ps -aq --filter label=io.hy3spark.cluster").strip() == ""
    assert node().file("/var/lib/hy3spark/hub").is_directory
    again = playbook(str(REPO / "playbooks/teardown.yml"))
    assert again.returncode == 0 and recap(again.stdout) == {NODE: 0}, again.stdout
