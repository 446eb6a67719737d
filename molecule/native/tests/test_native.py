"""native scenario: the Spark pair under the native launcher (serving.launcher: native: vLLM's own --nnodes,
--node-rank and --headless, no Ray). Converge, idempotence (changed=0) and check ran before; these tests run in file
order against the live nodes: the serving pair as converge left it, the drift check (converge.yml runs site.yml's
first and last plays around the launcher: a re-run in sync skips the roles, a forced run restarts nothing), then the
faults (each must fail with a message that names the node and why, and the next clean run must recover: the drift
check names what differs), then teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import scenario
from scenario import REPO, connects, flat, node, playbook, recap

SCENARIO = Path(__file__).resolve().parent.parent
HEAD, WORKER = "native-head", "native-worker"
NODES = (HEAD, WORKER)
FABRIC_IP = {HEAD: "10.95.3.11", WORKER: "10.95.3.12"}
CONTAINER = {HEAD: "hy3-head", WORKER: "hy3-worker"}
API_PORT, MASTER_PORT = scenario.API_PORT, 29521
API_KEY = os.environ.get("HY3SPARK_NATIVE_API_KEY", "")
SERVED = "hy3"
RENDERED = SCENARIO / ".rendered"
RUN_FILE = "/var/lib/hy3spark/serve.json"
SERVE_SCRIPT = "/etc/hy3spark/serve.sh"
DRIFT_RECORD = "/var/lib/hy3spark/deployed.json"

def api(path: str, body: dict | None = None, key: str | None = API_KEY) -> tuple[int, dict]:
    return scenario.api(HEAD, path, body, key or "")


def processes(name: str) -> list[tuple[int, int, list[str]]]:
    return scenario.processes(name, CONTAINER[name])


def engines(name: str) -> dict[int, list[str]]:
    return scenario.engines(name, CONTAINER[name])


def run_record() -> dict:
    return json.loads(node(HEAD).check_output(f"cat {RUN_FILE}"))


def converge() -> tuple[int, str]:
    result = playbook(str(SCENARIO / "converge.yml"))
    return result.returncode, result.stdout + result.stderr


@contextlib.contextmanager
def worker_engine_killed() -> Iterator[None]:
    """While in the block, every `vllm serve` in the worker's container is killed within a second of starting (as a
    node whose engine crashes at once would be): a transient systemd unit on the worker polls its /proc."""
    kill = ("import os, signal\n"
            "for p in (p for p in os.listdir('/proc') if p.isdigit()):\n"
            "    try: argv = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')\n"
            "    except OSError: continue\n"
            "    if b'serve' in argv and any(a.endswith(b'vllm') for a in argv): os.kill(int(p), signal.SIGKILL)\n")
    worker = node(WORKER)
    worker.run("systemctl reset-failed hy3spark-fault-rank")
    worker.check_output("systemd-run --unit hy3spark-fault-rank sh -c %s",
                        f"while true; do docker exec {CONTAINER[WORKER]} python3 -c {shlex.quote(kill)}; sleep 0.5; "
                        "done")
    try:
        yield
    finally:
        worker.run("systemctl stop hy3spark-fault-rank")


# --- the serving pair, as converge and idempotence left it ----------------------------------------------------------


def test_restarts_off_deploys_no_unit_and_no_supervisor() -> None:
    """`restarts: off` in this scenario's spec: no boot unit on any node, no supervisor on the head."""
    for name in NODES:
        for unit in (scenario.NODE_UNIT, scenario.SUPERVISOR_UNIT):
            assert scenario.unit(name, unit)["UnitFileState"] == "", (name, unit)
            assert not node(name).file(f"/etc/systemd/system/{unit}").exists, (name, unit)


def test_no_ray_anywhere_and_each_container_holds_its_node() -> None:
    for name in NODES:
        info = json.loads(node(name).check_output(f"docker inspect {CONTAINER[name]}"))[0]
        rendered = json.loads((RENDERED / "files" / name / "container.json").read_text())
        assert info["Config"]["Cmd"] == rendered["command"] == ["sleep", "infinity"]
        assert info["HostConfig"]["NetworkMode"] == "host"
        titles = [argv for _pid, _ppid, argv in processes(name)]
        assert not [a for a in titles if a and os.path.basename(a[0]) in ("ray", "raylet", "gcs_server")], titles
        assert not [a for a in titles if "ray" in " ".join(a).split("/")[-1].split()[:1]], titles


def test_each_node_runs_its_own_rank_command_from_the_render() -> None:
    for rank, name in enumerate(NODES):
        script = node(name).file(SERVE_SCRIPT)
        assert script.content_string == (RENDERED / "files" / name / "etc/hy3spark/serve.sh").read_text()
        assert script.mode == 0o755
        running = list(engines(name).values())
        assert len(running) == 1, running
        argv = running[0]
        assert argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--master-addr") + 1] == FABRIC_IP[HEAD]
        assert argv[argv.index("--master-port") + 1] == str(MASTER_PORT)
        assert argv[argv.index("--distributed-executor-backend") + 1] == "mp"
        assert ("--headless" in argv) is (name == WORKER)


def test_only_the_head_serves_the_api_and_the_rendezvous() -> None:
    assert connects(WORKER, FABRIC_IP[HEAD], API_PORT)
    assert connects(WORKER, FABRIC_IP[HEAD], MASTER_PORT)
    assert not connects(HEAD, FABRIC_IP[WORKER], API_PORT), "a headless node serves no API"
    assert not connects(HEAD, FABRIC_IP[WORKER], MASTER_PORT)


def test_models_completion_chat_and_the_key() -> None:
    status, body = api("/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [SERVED]
    status, body = api("/v1/completions", {"model": SERVED, "prompt": "Hello", "max_tokens": 8})
    assert status == 200 and body["choices"][0]["text"].strip()
    status, body = api("/v1/chat/completions",
                       {"model": SERVED, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
    assert status == 200 and body["choices"][0]["message"]["content"], body
    status, _ = api("/v1/models", key="")
    assert status == 401


def test_each_rank_ran_on_its_own_node_with_its_own_settings() -> None:
    status, body = api("/double/workers")
    assert status == 200, body
    ranks = body["workers"]
    assert sorted(r["hostname"] for r in ranks) == sorted(NODES)
    assert {r["hostname"]: r["vllm_host_ip"] for r in ranks} == FABRIC_IP
    # The transport gate read both nodes' logs: each node's ranks report the RDMA channels of its own env file.
    assert {r["hostname"]: r["nccl_transport"] for r in ranks if r.get("nccl_transport")}, ranks


def test_the_key_stays_on_the_head_and_off_every_command_line() -> None:
    assert API_KEY
    for name in NODES:
        assert API_KEY not in node(name).check_output("ps -eo args")
        assert API_KEY not in node(name).check_output(f"docker inspect {CONTAINER[name]}")
    assert API_KEY not in node(HEAD).check_output(f"cat {RUN_FILE}")
    assert node(HEAD).file("/etc/hy3spark-secrets/secrets.env").mode == 0o600
    assert not node(WORKER).file("/etc/hy3spark-secrets/secrets.env").exists, "a headless rank needs no secret"


def test_the_run_record_names_every_ranks_engine_and_the_idempotent_run_kept_them() -> None:
    record = run_record()
    assert list(engines(HEAD)) == [record["engine_pid"]]
    assert record["rank_pids"] == {WORKER: next(iter(engines(WORKER)))}
    assert "--nnodes" in record["argv"]
    assert record["transport"].startswith("NCCL transport"), record["transport"]


def test_status_reads_both_nodes_without_ray() -> None:
    result = playbook(str(REPO / "playbooks/status.yml"))
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"TASK \[Ask Ray for its nodes and GPUs on the head\][^\n]*\n(skipping: \[\S+\]\n)+", out), out
    assert "health: 200" in out, out
    for name in NODES:
        assert f"node: {name}" in out, out


# --- drift, as site.yml's first and last plays run it around the launcher (converge.yml) ---------------------------


def test_every_node_recorded_its_ranks_and_the_containers_it_runs() -> None:
    for name in NODES:
        record = node(name).file(DRIFT_RECORD)
        assert (record.mode, record.user) == (0o600, "root")
        assert API_KEY not in record.content_string
        state = json.loads(record.content_string)["state"]
        assert CONTAINER[name] in state["containers"], state["containers"]
        # Each node's engine processes are watched in its own container: the worker's --headless rank too.
        assert state["processes"][CONTAINER[name]], state["processes"]


def test_rerun_in_sync_skips_the_roles_and_checks_the_endpoint() -> None:
    before = {name: engines(name) for name in NODES}
    result = playbook(str(SCENARIO / "converge.yml"))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "Every node matches its last complete run" in flat(out), out
    assert recap(out) == dict.fromkeys(NODES, 0), out
    # The drift check and the endpoint check (/v1/models, one completion): a dozen tasks, never the roles.
    assert all(ok <= 12 for ok in recap(out, "ok").values()), out
    assert f"{SERVED} answered: " in out, out
    assert {name: engines(name) for name in NODES} == before


def test_forced_full_run_changes_and_restarts_nothing() -> None:
    before = {name: engines(name) for name in NODES}
    result = playbook(str(SCENARIO / "converge.yml"), "-e", "drift_full_run=true")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "drift_full_run is set: every role runs." in flat(out), out
    assert "leaving the engine alone: the same command is serving" in flat(out), out
    assert recap(out) == dict.fromkeys(NODES, 0), out
    assert {name: engines(name) for name in NODES} == before


# --- faults, each followed by a clean run that recovers --------------------------------------------------------------


def test_fault_worker_container_gone() -> None:
    with scenario.killed_on_start(node(WORKER), CONTAINER[WORKER]):
        code, out = converge()
        assert code != 0, out
        text = flat(out)
        assert "The engine's ranks did not start, so the head would wait for them in vain:" in text, out
        assert f"{WORKER} ({CONTAINER[WORKER]}):" in text and "is not running" in text, out
    code, out = converge()
    assert code == 0, out
    test_models_completion_chat_and_the_key()


def test_fault_worker_never_joins() -> None:
    with worker_engine_killed():
        code, out = converge()
        assert code != 0, out
        text = flat(out)
        # The head gave up waiting at the rendezvous (torch's message, as vLLM prints it), and names the node.
        assert "Timed out after" in text and "1/2 clients joined" in text, out
        assert f"{WORKER} did not join: its engine exited. Last lines of its /var/log/hy3spark/serve.log:" in text, out
    code, out = converge()
    assert code == 0, out
    test_models_completion_chat_and_the_key()


def test_fault_head_killed_then_recovers() -> None:
    with scenario.killed_on_start(node(HEAD), CONTAINER[HEAD]):
        code, out = converge()
        assert code != 0, out
        assert f"The head's container {CONTAINER[HEAD]} is not running (exited)" in flat(out), out
    code, out = converge()
    assert code == 0, out
    assert engines(WORKER), "the worker's ranks joined the new head"
    test_models_completion_chat_and_the_key()


def test_a_rank_that_dies_takes_the_engine_down_and_a_rerun_restarts_every_node() -> None:
    before = run_record()
    worker_pid = next(iter(engines(WORKER)))
    node(WORKER).check_output(f"docker exec {CONTAINER[WORKER]} kill -9 {worker_pid}")
    code, out = converge()
    assert code == 0, out
    # The drift check saw the worker's rank go (its processes in its own container), so the roles ran.
    assert re.search(f"Every role runs, because:.*{WORKER}: [^;]*processes {CONTAINER[WORKER]}\\b", flat(out)), out
    assert re.search(f"\\(re\\)starting the engine: (the engine is not running on {WORKER}|no engine is running)",
                     flat(out)), out
    after = run_record()
    assert after["engine_pid"] != before["engine_pid"]
    assert after["rank_pids"][WORKER] not in (None, worker_pid)
    test_models_completion_chat_and_the_key()
    again = playbook(str(SCENARIO / "converge.yml"))
    assert again.returncode == 0 and recap(again.stdout) == dict.fromkeys(NODES, 0), again.stdout


def test_teardown_stops_every_rank_and_leaves_nothing_of_ours() -> None:
    result = playbook(str(REPO / "playbooks/teardown.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    for name in NODES:
        assert node(name).check_output("docker ps -aq --filter label=io.hy3spark.cluster").strip() == ""
        assert node(name).file("/var/lib/hy3spark/hub").is_directory, "the model cache is kept"
    again = playbook(str(REPO / "playbooks/teardown.yml"))
    assert again.returncode == 0 and recap(again.stdout) == dict.fromkeys(NODES, 0), again.stdout
