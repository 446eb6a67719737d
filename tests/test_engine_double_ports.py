"""The engine double opens vLLM 0.23's internal ports where vLLM does, so a firewall test has something to fence.

vLLM takes them from get_open_port (vllm/utils/network_utils.py): VLLM_PORT and upward when it is set, a free port
otherwise. The torch.distributed store listens on every address of rank 0's node, a cross-node broadcast queue on
the node's own address. The double's modules run here, in this process, without Docker and without Ray (the workers
are the Ray actors' class, called directly); each test takes a second or two.
"""

from __future__ import annotations

import re
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

DOUBLE_SRC = Path(__file__).resolve().parent / "engine_double" / "src"
LOG_LINE = r"^INFO [\d-]+ [\d:]+ \[network_utils\.py:\d+\] "


@pytest.fixture
def double(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The double's `vllm` package from its source tree (no real vLLM is installed next to hy3spark)."""
    for name in ("VLLM_PORT", "VLLM_HOST_IP", "NCCL_DEBUG", "VLLM_DOUBLE_GPU_FREE_GIB", "VLLM_DOUBLE_GPU_MEMORY_GIB"):
        monkeypatch.delenv(name, raising=False)
    sys.path.insert(0, str(DOUBLE_SRC))
    try:
        from vllm.double import network

        yield network
    finally:
        sys.path.remove(str(DOUBLE_SRC))
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]


def free_run(length: int) -> int:
    """The first of `length` consecutive ports that are free on every address right now."""
    while True:
        with socket.socket() as sock:
            sock.bind(("", 0))
            first = int(sock.getsockname()[1])
        if first + length <= 65535 and all(bindable(port) for port in range(first, first + length)):
            return first


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def listeners() -> set[tuple[str, int]]:
    """(address, port) of every IPv4 TCP socket in LISTEN state in this network namespace (/proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A":
            address, port = fields[1].split(":")
            found.add((socket.inet_ntoa(bytes.fromhex(address)[::-1]), int(port, 16)))
    return found


# --- get_open_port ---------------------------------------------------------------------------------------------------


def test_without_vllm_port_a_free_port_is_picked_and_left_free(double: Any) -> None:
    ports = {double.get_open_port() for _ in range(5)}
    assert all(1024 <= port <= 65535 for port in ports)
    assert all(bindable(port) for port in ports)  # the probe socket is closed again


def test_a_free_vllm_port_is_returned_as_it_is(
    double: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    first = free_run(1)
    monkeypatch.setenv("VLLM_PORT", str(first))
    assert double.get_open_port() == first
    assert double.get_open_port() == first  # nothing held it in between
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("held_on", ["", "127.0.0.1"])
def test_a_taken_vllm_port_moves_up_to_the_next_free_one(
    double: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], held_on: str
) -> None:
    """A port held on every address or on one address only (a broadcast queue's) is taken: the probe binds all."""
    first = free_run(3)
    monkeypatch.setenv("VLLM_PORT", str(first))
    with socket.socket() as one, socket.socket() as two:
        one.bind((held_on, first))
        one.listen()
        two.bind((held_on, first + 1))  # bound without listening is taken too
        assert double.get_open_port() == first + 2
    assert re.findall(LOG_LINE + r"(.*)$", capsys.readouterr().out, re.M) == [
        f"Port {first} is already in use, trying port {first + 1}",
        f"Port {first + 1} is already in use, trying port {first + 2}",
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("29510x", "VLLM_PORT '29510x' must be a valid integer"),
        ("", "VLLM_PORT '' must be a valid integer"),
        ("tcp://10.96.0.12:29510", "VLLM_PORT 'tcp://10.96.0.12:29510' appears to be a URI. This may be caused by a "
                                   "Kubernetes service discovery issue,check the warning in: "
                                   "https://docs.vllm.ai/en/stable/serving/env_vars.html"),
    ],
)  # fmt: skip
def test_an_invalid_vllm_port_raises_vllms_error(
    double: Any, monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv("VLLM_PORT", value)
    with pytest.raises(ValueError) as raised:
        double.get_open_port()
    assert str(raised.value) == message


# --- the listeners -------------------------------------------------------------------------------------------------


def workers(world_size: int, tp: int, rank_nodes: list[str], init_method: str, timeout: float = 5) -> list[Any]:
    """Ray workers as the Ray executor initialises them (the actor class, called here instead of through Ray)."""
    from vllm.double.worker import RayWorkerWrapper

    ranks = [RayWorkerWrapper(rank) for rank in range(world_size)]
    per_rank = [{"local_rank": 0, "world_size": world_size, "tp": tp, "nodes": len(set(rank_nodes)),
                 "rank_nodes": rank_nodes, "distributed_init_method": init_method, "distributed_timeout": timeout}
                for _ in ranks]  # fmt: skip
    for rank in ranks:
        rank.init_worker(per_rank)
    return ranks


def in_parallel(calls: list[Any]) -> list[Any]:
    """Ray calls every rank at once; so does this."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    if errors:
        raise errors[0]
    return results


def test_two_nodes_open_the_store_on_every_address_and_the_queue_on_the_node_address(
    double: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """TP 2 over two nodes, VLLM_PORT set: what ray_executor.py and shm_broadcast.py open, in that order."""
    first = free_run(3)
    monkeypatch.setenv("VLLM_PORT", str(first))
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")  # both "nodes" are this machine
    init_method = double.tcp_uri("127.0.0.1", double.get_open_port())  # the driver's
    ranks = workers(2, 2, ["node-a", "node-b"], init_method)
    try:
        in_parallel([lambda rank=rank: rank.init_device(0.9) for rank in ranks])
        assert ("0.0.0.0", first) in listeners()
        addresses = in_parallel([rank.open_broadcast_queue for rank in ranks])
        assert addresses == [f"tcp://127.0.0.1:{first + 1}", None]  # the store holds VLLM_PORT: one up
        in_parallel([lambda rank=rank: rank.connect_broadcast_queue(addresses) for rank in ranks])
        assert {("0.0.0.0", first), ("127.0.0.1", first + 1)} <= listeners()
        assert [rank.listening() for rank in ranks] == [[f"0.0.0.0:{first}", f"127.0.0.1:{first + 1}"], []]
        assert len(ranks[1].connections) == 2  # to the store and to the queue
        log = capsys.readouterr().out
        for rank in (0, 1):
            line = f"world_size=2 rank={rank} local_rank=0 distributed_init_method=tcp://127.0.0.1:{first} backend=nccl"
            assert re.search(r"^INFO .*\[parallel_state\.py:\d+\] " + re.escape(line) + "$", log, re.M)
        assert re.search(LOG_LINE + rf"Port {first} is already in use, trying port {first + 1}$", log, re.M)
    finally:
        for rank in ranks:
            rank.close_listeners()
    # Closed (the ports may still be in TIME_WAIT from the connections: vLLM's probe would move past them too).
    assert not {("0.0.0.0", first), ("127.0.0.1", first + 1)} & listeners()


def test_one_node_opens_the_store_only(double: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    first = free_run(2)
    monkeypatch.setenv("VLLM_PORT", str(first))
    ranks = workers(2, 2, ["node-a", "node-a"], f"tcp://127.0.0.1:{first}")
    try:
        in_parallel([lambda rank=rank: rank.init_device(0.9) for rank in ranks])
        assert in_parallel([rank.open_broadcast_queue for rank in ranks]) == [None, None]
        assert [rank.listening() for rank in ranks] == [[f"0.0.0.0:{first}"], []]
    finally:
        for rank in ranks:
            rank.close_listeners()


def test_a_rank_whose_store_never_answers_fails_with_torchs_message(double: Any) -> None:
    port = free_run(1)
    (lonely,) = [w for w in workers(2, 2, ["node-a", "node-b"], f"tcp://127.0.0.1:{port}", timeout=1) if w.rank == 1]
    with pytest.raises(double.DistNetworkError) as raised:
        lonely.init_device(0.9)
    assert str(raised.value) == (
        f"The client socket has timed out after 1000ms while trying to connect to (127.0.0.1, {port})."
    )
    assert type(raised.value).__module__ == "torch.distributed"


def test_a_taken_store_port_fails_with_torchs_message(double: Any) -> None:
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        (rank0,) = [w for w in workers(1, 1, ["node-a"], f"tcp://127.0.0.1:{port}") if w.rank == 0]
        with pytest.raises(double.DistNetworkError, match=rf"failed to listen on any local network address\. port: "
                                                          rf"{port}, .*name: EADDRINUSE"):  # fmt: skip
            rank0.init_device(0.9)


def test_the_uni_executor_serves_the_store_until_shutdown(double: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """uniproc_executor.py: tcp://<get_ip()>:<get_open_port()>; its one rank's store listens on every address."""
    from vllm.double.serve import LocalExecutor

    first = free_run(1)
    monkeypatch.setenv("VLLM_PORT", str(first))
    executor = LocalExecutor(1, 1, 5)
    try:
        executor.init_device(0.9)
        assert ("0.0.0.0", first) in listeners()
    finally:
        executor.shutdown()
    # Nothing listens there any more, and the next engine's store binds it again (with SO_REUSEADDR, as libuv does:
    # the closed store's connections may still sit in TIME_WAIT on that port, which a bare bind() would refuse).
    assert ("0.0.0.0", first) not in listeners()
    double.listening_socket("", first).close()
