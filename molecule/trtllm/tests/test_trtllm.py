"""trtllm scenario: TensorRT-LLM across the Spark pair under the mpi launcher, deployed by site.yml (converge), then
idempotence (changed=0) and check mode. These tests run in file order against the live nodes: the serving pair as
converge left it (both ranks, the endpoint, the SSH trust, the secrets), a re-run in sync, then the faults (each must
fail with a message from a named gate that names the node and why, and the next clean run must recover), then
teardown.

The faults re-run relaunch.yml (site.yml's drift check, the mpi launcher, serving and the record: the plays in
between neither see nor mend them, and take minutes); the last recovery is site.yml itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import scenario
from scenario import REPO, flat, node, playbook, recap

SCENARIO = Path(__file__).resolve().parent.parent
HEAD, WORKER = "mpi-head", "mpi-worker"
NODES = (HEAD, WORKER)
FABRIC_IP = {HEAD: "10.95.5.11", WORKER: "10.95.5.12"}
CONTAINER = {HEAD: "trtllm-head", WORKER: "trtllm-worker"}
API_PORT, ENGINE_PORT, MPI_PORT = 8355, 8356, 2233
API_KEY = os.environ.get("HY3SPARK_TRTLLM_API_KEY", "")
MODEL = "nvidia/Qwen3-235B-A22B-FP4"
HF_TOKEN = os.environ.get("HF_TOKEN", "")
RENDERED = SCENARIO / ".rendered"
RUN_FILE = "/var/lib/hy3spark/serve.json"
DRIFT_RECORD = "/var/lib/hy3spark/deployed.json"
MPI_DIR = "/etc/hy3spark/mpi"


def api(path: str, body: dict | None = None, key: str | None = API_KEY) -> tuple[int, dict]:
    return scenario.api(HEAD, path, body, key or "", port=API_PORT)


def ranks(name: str) -> dict[int, list[str]]:
    """The engine's processes in a node's container that carry `trtllm-serve <repo>` in their command line, without
    their children that share it: mpirun on the head, the rank's launcher on every other node."""
    found = {pid: (ppid, argv) for pid, ppid, argv in scenario.processes(name, CONTAINER[name])
             if any(os.path.basename(a) == "trtllm-serve" and argv[i + 1:i + 2] == [MODEL] for i, a in enumerate(argv))}
    return {pid: argv for pid, (ppid, argv) in found.items() if ppid not in found}


def run_record() -> dict:
    return json.loads(node(HEAD).check_output(f"cat {RUN_FILE}"))


def relaunch(*args: str) -> tuple[int, str]:
    result = playbook(str(SCENARIO / "relaunch.yml"), *args)
    return result.returncode, result.stdout + result.stderr


def serves() -> None:
    """The endpoint answers, and every node runs its rank."""
    status, body = api("/v1/completions", {"model": MODEL, "prompt": "two sparks", "max_tokens": 5})
    assert status == 200 and body["choices"][0]["text"].strip(), body
    assert all(ranks(name) for name in NODES)


# --- the serving pair, as converge and idempotence left it ----------------------------------------------------------


def test_restarts_off_deploys_no_unit_and_no_supervisor() -> None:
    """`restarts: off` in this scenario's spec: no boot unit on any node, no supervisor on the head."""
    for name in NODES:
        for unit in (scenario.NODE_UNIT, scenario.SUPERVISOR_UNIT):
            assert scenario.unit(name, unit)["UnitFileState"] == "", (name, unit)
            assert not node(name).file(f"/etc/systemd/system/{unit}").exists, (name, unit)


def test_mpirun_on_the_head_started_one_rank_on_each_node() -> None:
    head = ranks(HEAD)
    assert [argv[0] for argv in head.values()] == ["mpirun"], head
    rendered = (RENDERED / f"files/{HEAD}/etc/hy3spark/serve.sh").read_text().splitlines()[-1]
    assert rendered.startswith("exec mpirun ") and " --tp_size 2 " in rendered
    # trtllm-serve checks no key: it listens on loopback behind hy3spark's API front, which has the API port.
    assert rendered.endswith(f" --port {ENGINE_PORT} --host 127.0.0.1")
    listening = node(HEAD).check_output("ss -Hltnp").splitlines()
    assert any(f"127.0.0.1:{ENGINE_PORT} " in line and "python3" in line for line in listening), listening
    assert any(f"127.0.0.1:{API_PORT} " in line for line in listening), listening
    # The worker's rank came through its container's sshd (Open MPI's orted is its parent), not from a docker exec.
    worker = scenario.processes(WORKER, CONTAINER[WORKER])
    by_pid = {pid: (ppid, argv) for pid, ppid, argv in worker}
    (rank_pid,) = ranks(WORKER)
    parent = by_pid[by_pid[rank_pid][0]][1]
    assert os.path.basename(parent[0]) == "orted", parent
    sshd = [argv for _, _, argv in worker if argv[0].startswith("sshd")]
    assert sshd and all("2233" in " ".join(argv) for argv in sshd), sshd


def test_models_completion_and_streaming_chat_under_the_repository_name() -> None:
    status, body = api("/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [MODEL], body
    serves()
    code = ("import json, sys, urllib.request\n"
            "req = urllib.request.Request(sys.argv[1], data=json.dumps({'model': sys.argv[2], 'stream': True,"
            " 'max_tokens': 6, 'messages': [{'role': 'user', 'content': 'hello'}]}).encode(),"
            " headers={'Content-Type': 'application/json', 'Authorization': 'Bearer ' + sys.argv[3]})\n"
            "with urllib.request.urlopen(req, timeout=60) as r:\n"
            "    print(r.status); print(r.read().decode())\n")
    out = node(HEAD).check_output("python3 -c %s %s %s %s", code,
                                  f"http://127.0.0.1:{API_PORT}/v1/chat/completions", MODEL, API_KEY)
    status, _, text = out.partition("\n")
    chunks = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert status == "200" and len(chunks) > 2 and chunks[-1] == "[DONE]", out
    assert "".join(json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks[:-1]).strip(), out


def test_the_api_answers_401_without_the_key() -> None:
    assert API_KEY, "molecule.yml sets the key in the controller's environment"
    for path, body in (("/v1/models", None), ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})):
        assert api(path, body, key="")[0] == 401, path
        assert api(path, body, key="not-" + API_KEY)[0] == 401, path
    # As vLLM with --api-key: only /v1 needs the key. /health answers 200 with an empty body.
    code = ("import sys, urllib.request, urllib.error\n"
            "try:\n"
            "    print(urllib.request.urlopen(sys.argv[1], timeout=10).status)\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code)\n")
    assert node(HEAD).check_output("python3 -c %s %s", code, f"http://127.0.0.1:{API_PORT}/health").strip() == "200"


def test_sshd_listens_on_the_fabric_only_and_lets_in_the_cluster_key_alone() -> None:
    for name in NODES:
        listening = node(name).check_output("ss -Hltn sport = :%s", str(MPI_PORT)).split()
        assert f"{FABRIC_IP[name]}:{MPI_PORT}" in listening and f"0.0.0.0:{MPI_PORT}" not in listening, listening
        config = node(name).file(f"{MPI_DIR}/sshd_config").content_string
        assert config == (RENDERED / f"files/{name}{MPI_DIR}/sshd_config").read_text()
        assert node(name).file(MPI_DIR).mode == 0o700
        for path in (f"{MPI_DIR}/ssh_host_ed25519_key", f"{MPI_DIR}/authorized_keys"):
            assert node(name).file(path).mode == 0o600 and node(name).file(path).user == "root", path
    assert node(HEAD).file(f"{MPI_DIR}/id_ed25519").mode == 0o600
    assert not node(WORKER).file(f"{MPI_DIR}/id_ed25519").exists, "the client key stays on the head"
    # Every node's host key is pinned on the head by fabric address and port; nothing turns the check off.
    known = node(HEAD).file(f"{MPI_DIR}/known_hosts").content_string
    for name in NODES:
        host_key = node(name).file(f"{MPI_DIR}/ssh_host_ed25519_key.pub").content_string.split()[:2]
        assert f"[{FABRIC_IP[name]}]:{MPI_PORT} {' '.join(host_key)}" in known
    ssh_config = node(HEAD).file(f"{MPI_DIR}/ssh_config").content_string
    assert "StrictHostKeyChecking yes" in ssh_config and "StrictHostKeyChecking no" not in ssh_config
    assert ssh_config == (RENDERED / f"files/{HEAD}{MPI_DIR}/ssh_config").read_text()
    # A key the cluster did not make is refused: the worker's container has ssh but not the head's key.
    denied = node(WORKER).run(f"docker exec {CONTAINER[WORKER]} ssh -p {MPI_PORT} -o BatchMode=yes "
                              f"-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null {FABRIC_IP[HEAD]} true")
    assert denied.rc != 0 and "Permission denied" in denied.stderr, denied.stderr
    # The cluster key works from the head's container to the worker's, host key checked.
    ok = node(HEAD).run(f"docker exec {CONTAINER[HEAD]} ssh -F {MPI_DIR}/ssh_config {FABRIC_IP[WORKER]} hostname")
    assert ok.rc == 0, ok.stderr


def test_hostfile_options_and_env_are_the_render_byte_for_byte() -> None:
    for name in NODES:
        hostfile = node(name).file("/etc/hy3spark/openmpi-hostfile").content_string
        assert hostfile == (RENDERED / f"files/{name}/etc/hy3spark/openmpi-hostfile").read_text()
        assert [line.split()[0] for line in hostfile.splitlines() if line and not line.startswith("#")] == [
            FABRIC_IP[HEAD], FABRIC_IP[WORKER]]
        inside = node(name).check_output(f"docker exec {CONTAINER[name]} cat /etc/openmpi-hostfile")
        assert inside == hostfile.rstrip("\n")
        env = node(name).file("/etc/hy3spark/node.env").content_string
        assert env == (RENDERED / f"files/{name}/etc/hy3spark/node.env").read_text()
        for line in ("UCX_NET_DEVICES=eth1", "NCCL_SOCKET_IFNAME=eth1", "OMPI_MCA_btl_tcp_if_include=eth1",
                     "OMPI_MCA_orte_default_hostfile=/etc/openmpi-hostfile", "OMPI_MCA_rmaps_ppr_n_pernode=1",
                     "NCCL_IB_HCA==rocep1s0f1,roceP2p1s0f1"):
            assert line in env.splitlines(), line
    options = node(HEAD).file("/etc/hy3spark/engine-options.yml").content_string
    assert options == (RENDERED / f"files/{HEAD}/etc/hy3spark/engine-options.yml").read_text()


def test_no_secret_on_a_command_line_in_docker_inspect_a_record_or_the_output() -> None:
    assert HF_TOKEN and API_KEY, "molecule.yml sets HF_TOKEN and the API key in the controller's environment"
    secrets = node(HEAD).file("/etc/hy3spark-secrets/secrets.env")
    assert secrets.mode == 0o600 and HF_TOKEN in secrets.content_string and API_KEY in secrets.content_string
    private = node(HEAD).file(f"{MPI_DIR}/id_ed25519").content_string.splitlines()[1]
    for name in NODES:
        for secret in (HF_TOKEN, API_KEY):
            assert secret not in node(name).check_output("ps -eo args")
            assert secret not in node(name).check_output(f"docker inspect {CONTAINER[name]}")
        for path in (RUN_FILE, DRIFT_RECORD):
            if node(name).file(path).exists:
                text = node(name).check_output(f"cat {path}")
                assert HF_TOKEN not in text and API_KEY not in text and private not in text, path
    # The key reaches the front only: mpirun and every rank start without it (the serve script unsets it).
    for name in NODES:
        for pid, _ppid, argv in scenario.processes(name, CONTAINER[name]):
            if any("trtllm" in a for a in argv):
                environ = node(name).run(f"docker exec {CONTAINER[name]} cat /proc/{pid}/environ").stdout
                assert API_KEY not in environ, (name, argv)
    # mpirun passes the token's NAME to the ranks; its value reaches rank 1 only through MPI's own wire.
    assert "-x HF_TOKEN " in (RENDERED / f"files/{HEAD}/etc/hy3spark/serve.sh").read_text()
    # A full run's output (what ansible-runner would keep as artifacts) holds neither.
    code, out = relaunch("-e", "drift_full_run=true", "-v")
    assert code == 0, out
    assert HF_TOKEN not in out and API_KEY not in out and private not in out
    assert "PRIVATE KEY" not in out


def test_run_record_names_the_engine_its_version_and_the_kv_cache_line() -> None:
    record = run_record()
    assert node(HEAD).file(RUN_FILE).mode == 0o600
    assert record["engine"] == "trtllm" and record["launcher"] == "mpi"
    assert record["engine_version"] == "1.2.0rc6+testdouble"  # what the double's tensorrt_llm reports
    assert record["served_name"] == MODEL and record["mpi_hosts"] == [FABRIC_IP[HEAD], FABRIC_IP[WORKER]]
    assert re.fullmatch(r"Allocated [\d.]+ GiB for max tokens in paged KV cache \([\d,]+\)", record["kv_cache_line"])
    assert record["transport"].startswith("NCCL transport gate: PASS (NET/IB"), record["transport"]


def test_rerun_in_sync_changes_and_restarts_nothing() -> None:
    before = {name: ranks(name) for name in NODES}
    result = playbook(str(SCENARIO / "converge.yml"))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "Every node matches its last complete run" in flat(out), out
    assert recap(out) == dict.fromkeys(NODES, 0), out
    assert f"{MODEL} answered: " in out, out
    assert {name: ranks(name) for name in NODES} == before


# --- faults, each named by a gate, each followed by a clean run that recovers ----------------------------------------


def test_fault_worker_container_gone() -> None:
    with scenario.killed_on_start(node(WORKER), CONTAINER[WORKER]):
        code, out = relaunch()
        assert code != 0, out
        text = flat(out)
        # The container is killed as it starts: either its sshd never listened (the first check), or it died right
        # after and mpirun's ssh found nobody there (the second). Both name the node, its container and why.
        assert (f"The mpi launcher cannot reach {WORKER}: {WORKER}: container {CONTAINER[WORKER]} is exited" in text
                or f"{WORKER} ({FABRIC_IP[WORKER]}:2233; container {CONTAINER[WORKER]}: exited, exit code 137): ssh: "
                   "connect to host" in text), out
        assert "The engine was not started" in text or "Nothing was started on any node" in text, out
    code, out = relaunch()
    assert code == 0, out
    assert "(re)starting the engine: " in flat(out), out
    serves()


@contextlib.contextmanager
def new_connections_dropped(name: str, port: int) -> Iterator[None]:
    """While in the block, the node drops every new TCP connection to `port` (as a firewall in the way would); the
    ones already open (the running job's) go on."""
    rule = f"INPUT -p tcp --dport {port} -m conntrack --ctstate NEW -j DROP"
    node(name).check_output(f"iptables -I {rule}")
    try:
        yield
    finally:
        node(name).run(f"iptables -D {rule}")


def test_fault_worker_mpi_sshd_unreachable() -> None:
    before = {name: ranks(name) for name in NODES}
    with new_connections_dropped(WORKER, MPI_PORT):
        code, out = relaunch("-e", "drift_full_run=true")
        assert code != 0, out
        text = flat(out)
        assert f"mpirun on {HEAD} cannot reach every node of /etc/openmpi-hostfile: {WORKER} " \
               f"({FABRIC_IP[WORKER]}:2233; container {CONTAINER[WORKER]}: running): ssh: connect to host " \
               f"{FABRIC_IP[WORKER]} port 2233: Connection timed out" in text, out
        # Nothing was stopped: the serving engine and its ranks stay up while the gate fails.
        assert {name: ranks(name) for name in NODES} == before
        serves()
    code, out = relaunch("-e", "drift_full_run=true")
    assert code == 0, out
    assert "leaving the engine alone: the same command is serving" in flat(out), out
    assert {name: ranks(name) for name in NODES} == before


def test_fault_hostfile_lists_an_unreachable_address() -> None:
    stray = "10.95.5.99"
    code, out = relaunch("-e", json.dumps({"mpi_node_hosts": [FABRIC_IP[HEAD], stray]}))
    assert code != 0, out
    text = flat(out)
    assert f"no node of the cluster ({stray}:2233, not the fabric address of any node: {FABRIC_IP[HEAD]} {HEAD}, " \
           f"{FABRIC_IP[WORKER]} {WORKER}): ssh: connect to host {stray} port 2233:" in text, out
    assert "The engine was not started" in text, out
    code, out = relaunch()
    assert code == 0, out
    serves()
    assert "10.95.5.99" not in node(HEAD).file("/etc/hy3spark/openmpi-hostfile").content_string


def test_fault_rank_1_dies_at_start_then_site_recovers() -> None:
    die = "/run/trtllm-double/die-at-start"
    node(WORKER).check_output(f"docker exec {CONTAINER[WORKER]} sh -c 'mkdir -p {os.path.dirname(die)} && touch {die}'")
    try:
        (mpirun,) = ranks(HEAD)
        node(HEAD).check_output(f"docker exec {CONTAINER[HEAD]} kill {mpirun}")
        code, out = relaunch()
        assert code != 0, out
        text = flat(out)
        assert f"The engine exited in {CONTAINER[HEAD]} on {HEAD}." in text, out
        assert f"rank 1 on {WORKER} dies at start" in text, out
        assert f"rank 1 on {WORKER} ({FABRIC_IP[WORKER]})" in text, out
        assert not ranks(WORKER), "the rank that died took the job down on every node"
    finally:
        node(WORKER).run(f"docker exec {CONTAINER[WORKER]} rm -f {die}")
    # site.yml itself: the drift check names what the failed run left (no engine on either node), the roles run.
    result = playbook(str(SCENARIO / "converge.yml"))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert re.search(rf"Every role runs, because:.*{HEAD}: [^;]*processes {CONTAINER[HEAD]}\b", flat(out)), out
    serves()


def test_teardown_leaves_nothing_of_ours_and_keeps_the_model() -> None:
    result = playbook(str(REPO / "playbooks/teardown.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    for name in NODES:
        assert node(name).check_output("docker ps -aq --filter label=io.hy3spark.cluster").strip() == ""
        assert not node(name).check_output("ss -Hltn sport = :%s", str(MPI_PORT)).strip()
        assert node(name).file("/var/lib/hy3spark/hub").is_directory, "the model cache is kept"
    assert node(HEAD).run(f"python3 -c 'import urllib.request; urllib.request.urlopen(\"http://127.0.0.1:{API_PORT}"
                          "/health\", timeout=3)'").rc != 0
    again = playbook(str(REPO / "playbooks/teardown.yml"))
    assert again.returncode == 0 and recap(again.stdout) == dict.fromkeys(NODES, 0), again.stdout
