"""ray scenario: the one-node path. The head's Ray gates the cluster on its own, the engine serves with TP=1, the
gate names a dead head or a Ray version other than the pinned one, and teardown leaves nothing of ours.

Converge, idempotence (changed=0) and check ran before; these tests run in file order against the live node.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import scenario
import testinfra
from scenario import (
    GCS_WITHOUT_TOKEN,
    NODE_UNIT,
    RAY_NODES,
    REPO,
    SUPERVISOR_CONFIG,
    SUPERVISOR_UNIT,
    answers,
    flat,
    playbook,
    reboot,
    recap,
    report_recovery,
    supervisor_state,
    unit,
    wait_for,
)

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
        # The boot unit starts the container again every 5 s and the fault kills each start: the gate finds it
        # killed, or in the moment between a start and its kill.
        assert re.search(rf"Missing: {NODE} \({IP}\): container {CONTAINER} (exited with exit code 137 \(SIGKILL\)"
                         rf"|is running but its Ray is not in the cluster)", out), out
    result = playbook(str(SCENARIO / "converge.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    test_ray_reports_one_node_and_one_gpu()
    test_serves_with_tensor_parallel_one()


# --- restarts (docs/restarts.md): the node comes back by itself, with no Ansible run --------------------------------


def record() -> dict:
    return json.loads(node().check_output("cat /var/lib/hy3spark/serve.json"))


def engine_pid() -> int | None:
    found = scenario.engines(NODE, CONTAINER)
    return next(iter(found)) if len(found) == 1 else None


def serving_again(old_pid: int | None, timeout: float = 300) -> tuple[dict, float]:
    """Wait until the supervisor serves an engine other than `old_pid` and the endpoint answers a completion."""
    def check() -> dict | None:
        state = supervisor_state(NODE)
        if state.get("state") == "serving" and state.get("pid") not in (None, old_pid) and answers(NODE, SERVED,
                                                                                                 API_KEY):
            return state
        return None
    state, waited = wait_for("the supervisor serving a new engine", check, timeout)
    assert isinstance(state, dict)
    return state, waited


def test_boot_unit_and_supervisor_run_and_watch_the_engine() -> None:
    assert {k: unit(NODE, NODE_UNIT)[k] for k in ("ActiveState", "UnitFileState")} == {
        "ActiveState": "active", "UnitFileState": "enabled"}
    assert {k: unit(NODE, SUPERVISOR_UNIT)[k] for k in ("ActiveState", "UnitFileState")} == {
        "ActiveState": "active", "UnitFileState": "enabled"}
    state = supervisor_state(NODE)
    # It adopted the engine the role started: no start of its own, the run record's PID.
    assert state["state"] == "serving" and state["pid"] == record()["engine_pid"] == engine_pid(), state
    rendered = RENDERED / "files" / NODE
    for path in ("etc/systemd/system/hy3spark-node.service", "etc/systemd/system/hy3spark-supervisor.service",
                 SUPERVISOR_CONFIG.lstrip("/")):
        assert node().file("/" + path).content_string == (rendered / path).read_text(), path


def test_engine_sigkilled_is_restarted_with_a_new_pid() -> None:
    old = engine_pid()
    assert old is not None
    restarts = supervisor_state(NODE).get("restarts", 0)
    node().check_output("docker exec %s kill -9 %s", CONTAINER, str(old))
    state, waited = serving_again(old)
    report_recovery("engine SIGKILLed (one node)", waited)
    assert state["restarts"] == restarts + 1, state
    assert state["pid"] == engine_pid() == record()["engine_pid"], (state, record())
    # Reaped: the killed engine and its log tee leave no zombie behind (Docker's init is PID 1).
    zombies = node().check_output("docker exec %s sh -c %s", CONTAINER,
                                  "grep -l '^State:.*Z' /proc/[0-9]*/status || true")
    assert zombies.strip() == "", zombies


def test_memory_not_free_the_engine_waits_then_starts() -> None:
    """The gate asks MemAvailable >= the plan's need on every node (0 on these GPU-less nodes, so the test sets a
    need): a tmpfs file the test holds takes memory away, the engine waits; the file removed, it starts."""
    config = json.loads(node().check_output(f"cat {SUPERVISOR_CONFIG}"))
    hog = 3 * 2**30
    available = int(node().check_output("awk '/^MemAvailable:/ {print $2}' /proc/meminfo")) * 1024
    need = available - hog // 2
    changed = {**config, "ready_args": [*config["ready_args"][:2], str(need)]}
    node().check_output(f"cat > {SUPERVISOR_CONFIG} <<'EOF'\n{json.dumps(changed, indent=4)}\nEOF")
    try:
        node().check_output(f"systemctl reload {SUPERVISOR_UNIT}")
        node().check_output("mkdir -p /tmp/hy3spark-hog && mount -t tmpfs -o size=4g hog /tmp/hy3spark-hog"
                            f" && head -c {hog} /dev/zero > /tmp/hy3spark-hog/fill")
        old = engine_pid()
        node().check_output("docker exec %s kill -9 %s", CONTAINER, str(old))
        state, _ = wait_for("the supervisor waiting for memory",
                            lambda: (s := supervisor_state(NODE)).get("state") == "waiting"
                            and "GiB available" in s.get("cause", "") and s, 120)
        assert isinstance(state, dict) and f"{IP} has " in state["cause"], state
        assert engine_pid() is None, "no engine may start while the memory is not free"
        node().check_output("umount /tmp/hy3spark-hog")
        state, waited = serving_again(old)
        print(f"\nRECOVERY memory freed: {waited:.1f} s from the memory's return to a served completion")
    finally:
        node().run("umount /tmp/hy3spark-hog")
        node().check_output(f"cat > {SUPERVISOR_CONFIG} <<'EOF'\n{json.dumps(config, indent=4)}\nEOF")
        node().check_output(f"systemctl reload {SUPERVISOR_UNIT}")


def test_engine_that_exits_at_every_start_gives_up_after_three() -> None:
    """The serve script changed under the deployment (an option this engine does not know): every start exits at
    once. After 3 failed starts the supervisor gives up and says why; the node stays reachable."""
    script = "/etc/hy3spark/serve.sh"
    # A supervisor started afresh (as after a reboot or an Ansible run): its whole budget, and the engine it finds
    # counts as long healthy (an engine that dies within 60 s of its start would count as a failed start).
    node().check_output(f"systemctl stop {SUPERVISOR_UNIT} && systemctl start {SUPERVISOR_UNIT}")
    wait_for("the supervisor watching", lambda: supervisor_state(NODE).get("state") == "serving", 60)
    node().check_output(f"cp {script} /root/serve.sh.good && sed -i 's/ --served-model-name / --no-such-flag "
                        f"--served-model-name /' {script}")
    try:
        node().check_output("docker exec %s kill -9 %s", CONTAINER, str(engine_pid()))
        state, waited = wait_for("the supervisor giving up", lambda: (s := supervisor_state(NODE)).get("state")
                                 == "gave-up" and s, 300, every=2)
        print(f"\nGAVE UP after {waited:.1f} s: {state}")
        assert isinstance(state, dict)
        assert state["cause"].startswith("gave up after 3 starts in 15 min: "), state
        assert "unrecognized arguments: --no-such-flag" in state["cause"], state
        flag = "vllm: error: unrecognized arguments: --no-such-flag"
        assert [f["cause"] for f in state["failed_starts"]] == [flag] * 3, state
        assert unit(NODE, SUPERVISOR_UNIT)["ActiveState"] == "inactive"
        assert engine_pid() is None
        # The node stays as it was: reachable over SSH, earlyoom's policy untouched, the Ray head up.
        assert node().run("systemctl is-active ssh").stdout.strip() == "active"
        assert (IP, 22) in scenario.listeners(node()) or ("0.0.0.0", 22) in scenario.listeners(node())
        test_ray_reports_one_node_and_one_gpu()
        # `hy3spark status` renders its own inventory under its runs directory; beside it, how this machine reaches
        # the node (docker exec, as Molecule's runs do).
        runs = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "status-runs"
        extra = runs / "inventory" / "ray-single" / "inventory" / "group_vars" / "all"
        extra.mkdir(parents=True, exist_ok=True)
        (extra / "test-machine.yml").write_text("ansible_connection: community.docker.docker\n"
                                                "ansible_pipelining: true\n")
        # The rendered inventory reaches the node at its fabric address as the spec's ssh_user; Docker's connection
        # wants the container's name, and Molecule's runs are root there (one node: -e sets its host variables).
        status = subprocess.run([sys.executable, "-m", "hy3spark", "status", str(SCENARIO / "cluster.yml"),
                                 "--runs-dir", str(runs), "-e", f"ansible_host={NODE} ansible_user=root"], cwd=REPO,
                                capture_output=True, text=True, timeout=300, check=False)
        out = status.stdout + status.stderr
        assert status.returncode == 0, out
        assert "supervisor: gave up after 3 starts in 15 min: " in status.stdout, out
        assert "--no-such-flag" in status.stdout, out
        assert re.search(r"hy3spark-supervisor\.service inactive, enabled", status.stdout), out
    finally:
        node().check_output(f"cp /root/serve.sh.good {script}")
    # The next run serves again and starts the supervisor with a new budget.
    result = playbook(str(SCENARIO / "converge.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    state = supervisor_state(NODE)
    assert state["state"] == "serving" and state["failed_starts"] == [], state


def test_node_restart_brings_the_endpoint_back_with_no_ansible_run() -> None:
    old = engine_pid()
    start = time.monotonic()
    reboot(NODE)
    state, _ = serving_again(old, timeout=600)
    report_recovery("node restarted (one node)", time.monotonic() - start)
    assert state["pid"] == record()["engine_pid"]
    assert unit(NODE, NODE_UNIT)["ActiveState"] == "active"


def test_a_rerun_on_the_recovered_node_restarts_nothing() -> None:
    pid = engine_pid()
    started = node().check_output("docker inspect -f '{{.State.StartedAt}}' %s", CONTAINER)
    result = playbook(str(SCENARIO / "converge.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "leaving the engine alone" in result.stdout, result.stdout
    assert engine_pid() == pid
    assert node().check_output("docker inspect -f '{{.State.StartedAt}}' %s", CONTAINER) == started


def test_teardown_leaves_nothing_of_ours() -> None:
    result = playbook(str(REPO / "playbooks/teardown.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{NODE}: MemAvailable " in result.stdout
    assert node().check_output("docker ps -aq --filter label=io.hy3spark.cluster").strip() == ""
    assert node().file("/var/lib/hy3spark/hub").is_directory
    again = playbook(str(REPO / "playbooks/teardown.yml"))
    assert again.returncode == 0 and recap(again.stdout) == {NODE: 0}, again.stdout


def test_after_down_a_reboot_brings_nothing_back() -> None:
    """What `hy3spark down` runs (teardown) disabled the units: after a reboot nothing of ours runs."""
    for name in (NODE_UNIT, SUPERVISOR_UNIT):
        assert unit(NODE, name)["UnitFileState"] == "disabled", name
    reboot(NODE)
    wait_for("the node's systemd up", lambda: node().run("systemctl is-system-running --wait").stdout.strip()
             in ("running", "degraded"), 180)
    time.sleep(10)  # a unit that would start the container retries every 5 s
    assert node().check_output("docker ps -q").strip() == ""
    for name in (NODE_UNIT, SUPERVISOR_UNIT):
        assert unit(NODE, name)["ActiveState"] == "inactive", name
    assert not [p for p in scenario.listeners(node()) if p[1] in (6379, 8888)]
