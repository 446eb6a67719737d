"""The engine double under vLLM's native launcher (no Ray), on this machine, without Docker: the head and a --headless
node are two `vllm serve` processes with different --node-rank on localhost, started from the command hy3spark
renders for examples/hy3-two-spark-native.yml (only the model path, addresses and ports changed). A few seconds."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hy3spark.engines.vllm import VllmEngine
from hy3spark.spec import load_spec

REPO = Path(__file__).resolve().parent.parent
DOUBLE = REPO / "tests" / "engine_double"
sys.path.insert(0, str(DOUBLE))
from make_model import make_model  # noqa: E402

HY3 = "kodelow/Hy3-NVFP4-W4A16"
TIMEOUT_S = "3"  # VLLM_DOUBLE_DISTRIBUTED_TIMEOUT_S: vLLM waits torch's 600 s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(length: int) -> int:
    """VLLM_PORT for a run: the first of `length` consecutive ports free on every address (vLLM probes with "")."""
    while True:
        first = free_port()
        try:
            for port in range(first, first + length):
                with socket.socket() as sock:
                    sock.bind(("", port))
        except (OSError, OverflowError):
            continue
        return first


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    cache = tmp_path_factory.mktemp("hub")
    return cache, make_model(cache, HY3, suffix=None)


def node_argv(index: int, revision: str, port: int, master_port: int, **changes: str) -> list[str]:
    """What hy3spark renders for node `index` of the native example, pointed at this machine."""
    argv = VllmEngine(load_spec(REPO / "examples" / "hy3-two-spark-native.yml").spec).node_argv(index)
    assert argv[:3] == ["vllm", "serve", HY3]
    values = {"--revision": revision, "--port": str(port), "--master-addr": "127.0.0.1",
              "--master-port": str(master_port), **changes}  # fmt: skip
    for flag, value in values.items():
        argv[argv.index(flag) + 1] = value
    return argv


class Node:
    def __init__(self, argv: list[str], cache: Path, log: Path, **env: str) -> None:
        self.log = log
        environ = {**os.environ, "PYTHONPATH": str(DOUBLE / "src"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
                   "VLLM_DOUBLE_DISTRIBUTED_TIMEOUT_S": TIMEOUT_S, "VLLM_DOUBLE_HEALTH_INTERVAL_S": "0.3",
                   "VLLM_DOUBLE_DEAD_GRACE_S": "1", **env}  # fmt: skip
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.cli.main", *argv[1:]],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environ,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float = 20) -> int:
        return self.proc.wait(timeout=timeout)

    def wait_for(self, pattern: str, timeout: float = 20) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.text(), re.M)
            if match:
                return match
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} not in {self.log}:\n{self.text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run(argv: list[str], cache: Path, tmp: Path, name: str, **env: str) -> tuple[int, str]:
    node = Node(argv, cache, tmp / f"{name}.log", **env)
    try:
        return node.wait(30), node.text()
    finally:
        node.stop()


def tree(pid: int) -> set[int]:
    """The process and all its descendants."""
    pids, found = {pid}, True
    while found:
        found = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            child, parent = int(stat.parent.name), int(fields[1])
            if parent in pids and child not in pids:
                pids.add(child)
                found = True
    return pids


def listening_ports(pid: int) -> set[int]:
    """TCP ports in LISTEN state whose socket belongs to the process tree of `pid`."""
    return {port for _address, port in listening(pid)}


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets in LISTEN state that belong to the process tree of `pid`."""
    inodes: set[str] = set()
    for member in tree(pid):
        try:
            for fd in Path(f"/proc/{member}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # the kernel prints each 32-bit word in host (little-endian) order
                packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, packed), int(port, 16)))
    return found


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read()
            return response.status, json.loads(body) if body else None
    except urllib.error.HTTPError as err:
        return err.code, None


def post(url: str, data: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(url, json.dumps(data).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as response:
        return response.status, json.loads(response.read())


@dataclass
class TwoNodes:
    head: Node
    other: Node
    port: int  # the API
    master_port: int
    vllm_port: int  # VLLM_PORT on both nodes, as hy3spark's node.env sets it


@pytest.fixture
def two_nodes(hub: tuple[Path, str], tmp_path: Path) -> Iterator[TwoNodes]:
    """The head and the --headless node, both serving."""
    cache, revision = hub
    port, master_port, vllm_port = free_port(), free_port(), free_ports(2)
    head = Node(node_argv(0, revision, port, master_port), cache, tmp_path / "head.log", VLLM_PORT=str(vllm_port))
    other = Node(node_argv(1, revision, port, master_port), cache, tmp_path / "node1.log", VLLM_PORT=str(vllm_port))
    try:
        head.wait_for(r"Application startup complete\.$")
        other.wait_for(r"\[gpu_worker\.py:\d+\] Available KV cache memory")
        yield TwoNodes(head, other, port, master_port, vllm_port)
    finally:
        head.stop()
        other.stop()


def test_two_nodes_serve_and_the_headless_node_opens_no_port(two_nodes: TwoNodes) -> None:
    head, other, port, master_port = two_nodes.head, two_nodes.other, two_nodes.port, two_nodes.master_port
    url = f"http://127.0.0.1:{port}"
    assert get(url + "/health") == (200, None)
    status, models = get(url + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["hy3"]
    status, body = post(url + "/v1/completions", {"model": "hy3", "prompt": "hello", "max_tokens": 5})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"].startswith(" hy3spark engine double says")

    # Each node runs its share of the ranks as its own processes: rank 0 on the head, rank 1 on the other node.
    status, workers = get(url + "/double/workers")
    ranks = {w["rank"]: w["pid"] for w in workers["workers"]}
    assert set(ranks) == {0, 1}

    # The head listens on the API port, the store on every address at the master port, and from VLLM_PORT upward on
    # its own address: the executor's broadcast queue, then rank 0's TP group queue (vLLM's get_open_port moves up
    # past the first). The headless node listens on nothing at all.
    ip, vllm_port = workers["workers"][0]["node_ip"], two_nodes.vllm_port
    assert listening(head.proc.pid) == {("0.0.0.0", port), ("0.0.0.0", master_port), (ip, vllm_port),
                                        (ip, vllm_port + 1)}  # fmt: skip
    assert [w["listening"] for w in sorted(workers["workers"], key=lambda w: w["rank"])] == [[f"{ip}:{vllm_port + 1}"],
                                                                                             []]  # fmt: skip
    assert re.search(rf"^\(Worker_TP0 pid=\d+\) INFO .*\[network_utils\.py:\d+\] Port {vllm_port} is already in use, "
                     rf"trying port {vllm_port + 1}$", head.text(), re.M)  # fmt: skip
    assert listening_ports(other.proc.pid) == set()
    assert ranks[0] in tree(head.proc.pid) - {head.proc.pid}
    assert ranks[1] in tree(other.proc.pid) - {other.proc.pid}

    # vLLM's lines: the headless banner (no API server lines there), the rank lines with the rendezvous address.
    headless = other.text()
    assert re.search(
        r"^INFO [\d-]+ [\d:]+ \[serve\.py:\d+\] Launching vLLM \(v0\.23\.0\+testdouble\) headless multiproc "
        rf"executor, with head node address 127\.0\.0\.1:{master_port} for torch\.distributed process group\.$",
        headless,
        re.M,
    )
    assert "APIServer" not in headless and "Starting vLLM server" not in headless
    assert re.search(rf"^\(Worker pid=\d+\) INFO .* world_size=2 rank=1 local_rank=0 distributed_init_method="
                     rf"tcp://127\.0\.0\.1:{master_port} backend=nccl$", headless, re.M)  # fmt: skip
    assert re.search(r"^\(Worker_TP1 pid=\d+\) INFO .*\] Available KV cache memory: 22\.24 GiB$", headless, re.M)
    log = head.text()
    assert re.search(r"^\(EngineCore pid=\d+\) INFO .*\] DP group leader: node_rank=0, node_rank_within_dp=0, "
                     r"master_addr=127\.0\.0\.1, .* world_size=2, local_world_size=1$", log, re.M)  # fmt: skip
    assert re.search(r"^\(Worker_TP0 pid=\d+\) INFO .*\] Available KV cache memory: 22\.24 GiB$", log, re.M)
    assert re.search(r"\] GPU KV cache size: 287,856 tokens$", log, re.M)
    assert re.search(rf"\] Starting vLLM server on http://0\.0\.0\.0:{port}$", log, re.M)


def test_a_rank_that_dies_on_the_headless_node_takes_the_engine_down(two_nodes: TwoNodes) -> None:
    head, other, port = two_nodes.head, two_nodes.other, two_nodes.port
    _, workers = get(f"http://127.0.0.1:{port}/double/workers")
    remote = next(w["pid"] for w in workers["workers"] if w["rank"] == 1)
    os.kill(remote, signal.SIGKILL)
    assert other.wait() == 0  # vLLM's run_headless returns once its monitor saw the death
    assert re.search(r"^ERROR .*\[multiproc_executor\.py:\d+\] Worker proc VllmWorker-1 died unexpectedly, shutting "
                     r"down executor\.$", other.text(), re.M)  # fmt: skip
    head.wait_for(r"EngineCore encountered a fatal error\.$")
    assert head.wait() == 1
    assert "EngineDeadError: EngineCore encountered an issue." in head.text()


def test_a_rank_that_dies_on_the_head_takes_the_engine_down(two_nodes: TwoNodes) -> None:
    head, other, port = two_nodes.head, two_nodes.other, two_nodes.port
    url = f"http://127.0.0.1:{port}"
    _, workers = get(url + "/double/workers")
    os.kill(next(w["pid"] for w in workers["workers"] if w["rank"] == 0), signal.SIGKILL)
    head.wait_for(r"\(EngineCore pid=\d+\) ERROR .* Worker proc VllmWorker-0 died unexpectedly, shutting down "
                  r"executor\.$")  # fmt: skip
    head.wait_for(r"EngineCore encountered a fatal error\.$")
    assert get(url + "/health")[0] == 503  # while the API server shuts down
    assert head.wait() == 1
    # vLLM's headless ranks block waiting for the head's next broadcast: the node stays up until it is stopped.
    time.sleep(0.5)
    assert other.proc.poll() is None


def test_a_missing_node_makes_the_head_time_out_with_torchs_message(hub: tuple[Path, str], tmp_path: Path) -> None:
    cache, revision = hub
    port, master_port = free_port(), free_port()
    started = time.monotonic()
    code, log = run(node_argv(0, revision, port, master_port), cache, tmp_path, "head")
    assert code == 1
    assert 3 <= time.monotonic() - started < 20
    assert re.search(r"^\(Worker pid=\d+\) ERROR .*\[multiproc_executor\.py:\d+\] torch\.distributed\.DistStoreError: "
                     r"Timed out after 4 seconds waiting for clients\. 1/2 clients joined\.$", log, re.M)  # fmt: skip
    assert re.search(r"^\(Worker pid=\d+\) ERROR .*\] WorkerProc failed to start\.$", log, re.M)
    assert re.search(r"^\(EngineCore pid=\d+\) ERROR .*\] Exception: WorkerProc initialization failed due to an "
                     r"exception in a background process\. See stack trace for root cause\.$", log, re.M)  # fmt: skip
    assert "RuntimeError: Engine core initialization failed. See root cause above." in log
    assert "Application startup complete" not in log

    # --distributed-timeout-seconds is vLLM's own knob, and wins over the double's default.
    code, log = run([*node_argv(0, revision, port, master_port), "--distributed-timeout-seconds", "1"], cache,
                    tmp_path, "head-flag")  # fmt: skip
    assert code == 1 and "DistStoreError: Timed out after 2 seconds waiting for clients. 1/2 clients joined." in log


def test_a_headless_node_without_its_head_times_out(hub: tuple[Path, str], tmp_path: Path) -> None:
    cache, revision = hub
    master_port = free_port()
    code, log = run(node_argv(1, revision, free_port(), master_port), cache, tmp_path, "node1")
    assert code == 1
    assert re.search(r"^\(Worker pid=\d+\) ERROR .*\] torch\.distributed\.DistNetworkError: The client socket has "
                     rf"timed out after 3000ms while trying to connect to \(127\.0\.0\.1, {master_port}\)\.$", log,
                     re.M)  # fmt: skip
    assert log.rstrip().endswith(
        "Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace "
        "for root cause."
    )


@pytest.mark.parametrize("index", [0, 1])
def test_a_world_size_that_does_not_divide_by_nnodes_is_refused(
    hub: tuple[Path, str], tmp_path: Path, index: int
) -> None:
    cache, revision = hub
    argv = node_argv(index, revision, free_port(), free_port(), **{"--nnodes": "3"})
    code, log = run(argv, cache, tmp_path, f"node{index}")
    assert code == 1
    assert log.rstrip().endswith("AssertionError: world_size=2 must be divisible by nnodes=3.")
    assert "Worker" not in log


def test_nnodes_with_the_ray_backend_is_refused(hub: tuple[Path, str], tmp_path: Path) -> None:
    cache, revision = hub
    argv = node_argv(0, revision, free_port(), free_port(), **{"--distributed-executor-backend": "ray"})
    code, log = run(argv, cache, tmp_path, "head")
    assert code == 1
    assert "Value error, nnodes > 1 can only be set when distributed executor backend is mp, uni or " in log


def test_one_node_several_gpus_runs_the_ranks_as_local_processes(hub: tuple[Path, str], tmp_path: Path) -> None:
    """The two-card desktop: `vllm serve -tp 2` with no Ray and no --nnodes, the default mp executor."""
    cache, revision = hub
    port = free_port()
    argv = node_argv(0, revision, port, 1)
    at = argv.index("--distributed-executor-backend")
    argv = [*argv[:at], *argv[at + 10:]]  # no launcher flags at all: vLLM picks mp
    assert "--nnodes" not in argv and "--master-port" not in argv
    vllm_port = free_ports(1)
    node = Node(argv, cache, tmp_path / "one.log", VLLM_DOUBLE_LOCAL_GPUS="2", VLLM_PORT=str(vllm_port))
    try:
        node.wait_for(r"Application startup complete\.$")
        _, workers = get(f"http://127.0.0.1:{port}/double/workers")
        assert sorted(w["rank"] for w in workers["workers"]) == [0, 1]
        assert {w["pid"] for w in workers["workers"]} <= tree(node.proc.pid) - {node.proc.pid}
        # vLLM's mp executor: the loopback and get_open_port() (VLLM_PORT), the store on every address; no queue.
        assert f"distributed_init_method=tcp://127.0.0.1:{vllm_port} backend=nccl" in node.text()
        assert listening(node.proc.pid) == {("0.0.0.0", port), ("0.0.0.0", vllm_port)}
    finally:
        node.stop()
    code, log = run(argv, cache, tmp_path, "one-gpu")  # VLLM_DOUBLE_LOCAL_GPUS=1
    assert code == 1 and "World size (2) is larger than the number of available GPUs (1) in this node." in log


def test_the_hy_v3_reasoning_parser_fails_at_startup_without_its_tokens(tmp_path: Path) -> None:
    """vLLM 0.23's bare-token parser and Hy3's `:opensource` tokenizer: ReasoningConfig builds the parser while the
    engine is configured, so `vllm serve` exits 1 before any engine starts (on the head and on a headless node)."""
    cache = tmp_path / "hub"
    revision = make_model(cache, HY3)  # Hy3's released tokenizer: <think:opensource> ...
    for index in (0, 1):
        code, log = run(node_argv(index, revision, free_port(), free_port()), cache, tmp_path, f"node{index}")
        assert code == 1
        assert log.rstrip().endswith(
            "RuntimeError: HYV3ReasoningParser reasoning parser could not locate think start/end tokens in the "
            "tokenizer!"
        )
        assert "Worker" not in log and "EngineCore" not in log
