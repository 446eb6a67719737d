"""`trtllm-llmapi-launch CMD...`: run by every MPI rank, as TensorRT-LLM's launcher script is.

Rank 0 (SLURM_PROCID, OMPI_COMM_WORLD_RANK, PMI_RANK or PMI_ID; 0 without any) starts CMD in the background with
every MPI variable removed from its environment (OMPI_, PMIX_, PMI_, SLURM_, MPI_, UCX_, ...), exports
TLLM_SPAWN_PROXY_PROCESS=1 and TLLM_SPAWN_PROXY_PROCESS_IPC_ADDR (the first free port from 10012 on 127.0.0.1)
for it, and runs the "mgmn leader node": the MPI process that CMD's LLM drives the ranks through. Every other rank
runs the "mgmn worker node" loop. Both print the script's stderr lines (mpi_rank, tllm_mpi_size, ...).

Real MPI (mpi4py over Open MPI) throughout: the ranks first meet in a barrier (TRTLLM_DOUBLE_JOIN_TIMEOUT_S,
default 60: a rank that cannot reach the others says so and aborts the job), then every step is a broadcast from
rank 0 and a gather of every rank's answer (the model load, each generation's shards with an all-reduce of their
sizes, and a heartbeat every TRTLLM_DOUBLE_HEARTBEAT_S, default 1). A rank that hears nothing from rank 0 for
TRTLLM_DOUBLE_PEER_TIMEOUT_S (default 10) exits 1, as does rank 0 when a step is not answered in that time,
taking CMD down. mpirun itself ends the job when any rank dies (its default), and rank 0 stops CMD on SIGTERM.
When CMD exits, rank 0 stops the workers and exits with CMD's status.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any

from . import engine, log, wire

MPI_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "MPI_", "UCX_", "I_MPI_", "HYDRA_", "KMP_", "MPICH_", "MV2_",
                "CRAY_")
MESSAGE = 1 << 16  # bytes of one broadcast / one rank's answer


def _seconds(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def mpi_rank() -> int:
    for name in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMI_ID"):
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    return 0


def mpi_world_size() -> int:
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    return 1


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class StepTimeout(Exception):
    pass


def _pack(message: dict[str, Any]) -> bytearray:
    data = json.dumps(message).encode()
    if len(data) + 4 > MESSAGE:
        raise ValueError(f"message of {len(data)} bytes exceeds the double's {MESSAGE}")
    buf = bytearray(MESSAGE)
    buf[:4] = len(data).to_bytes(4, "big")
    buf[4:4 + len(data)] = data
    return buf


def _unpack(buf: bytes | bytearray | memoryview) -> dict[str, Any]:
    size = int.from_bytes(buf[:4], "big")
    return json.loads(bytes(buf[4:4 + size]))


class Ranks:
    """COMM_WORLD with every collective bounded in time (a dead peer must not hang a rank forever)."""

    def __init__(self) -> None:
        from mpi4py import MPI  # MPI_Init happens here

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()

    def wait(self, request: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                raise StepTimeout(f"{what} did not complete in {timeout:g} s")
            time.sleep(0.002)

    def barrier(self, timeout: float) -> None:
        self.wait(self.comm.Ibarrier(), timeout, "the MPI barrier of all ranks")

    def broadcast(self, message: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        buf = _pack(message) if message is not None else bytearray(MESSAGE)
        self.wait(self.comm.Ibcast([buf, self.MPI.BYTE], root=0), timeout, "a broadcast from rank 0")
        return _unpack(buf)

    def gather(self, answer: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        send = _pack(answer)
        recv = bytearray(MESSAGE * self.world) if self.rank == 0 else None
        target = [recv, self.MPI.BYTE] if recv is not None else None
        self.wait(self.comm.Igather([send, self.MPI.BYTE], target, root=0), timeout, "the gather on rank 0")
        if recv is None:
            return []
        view = memoryview(recv)
        return [_unpack(view[i * MESSAGE:(i + 1) * MESSAGE]) for i in range(self.world)]

    def allreduce(self, value: int, timeout: float) -> int:
        # Both buffers must outlive the request: a temporary would be freed while MPI still reads it.
        mine, out = array.array("q", [value]), array.array("q", [0])
        request = self.comm.Iallreduce([mine, self.MPI.INT64_T], [out, self.MPI.INT64_T], op=self.MPI.SUM)
        self.wait(request, timeout, "the all-reduce of every rank")
        return out[0]


def answer(ranks: Ranks, message: dict[str, Any], nodes: int) -> dict[str, Any]:
    """What any rank (0 included) answers to a step of rank 0."""
    op = message["op"]
    if op == "load":
        return engine.load(ranks.rank, ranks.world, nodes, message["spec"])
    if op == "generate":
        words = engine.shard(message["seed"], message["count"], ranks.rank, ranks.world)
        return {"rank": ranks.rank, "words": {str(i): w for i, w in words.items()}}
    return {"rank": ranks.rank, "host": socket.gethostname()}


def worker(ranks: Ranks, timeout: float) -> int:
    host = socket.gethostname()
    nodes = 1
    while True:
        try:
            message = ranks.broadcast(None, timeout)
            if message["op"] == "stop":
                return 0
            if message["op"] == "join":
                nodes = message["nodes"]
            reply = answer(ranks, message, nodes)
            ranks.gather(reply, timeout)
            if message["op"] == "generate":
                ranks.allreduce(len(reply["words"]), timeout)
        except StepTimeout as err:
            log.log("E", f"rank {ranks.rank} on {host} lost rank 0: {err}; aborting", rank=ranks.rank)
            ranks.comm.Abort(1)
            return 1


class Leader:
    def __init__(self, ranks: Ranks, command: list[str], timeout: float, heartbeat: float) -> None:
        self.ranks, self.command, self.timeout, self.heartbeat = ranks, command, timeout, heartbeat
        self.child: subprocess.Popen[bytes] | None = None
        self.nodes, self.hosts = 1, [socket.gethostname()]

    def step(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        self.ranks.broadcast(message, self.timeout)
        replies = self.ranks.gather(answer(self.ranks, message, self.nodes), self.timeout)
        if message["op"] == "generate":
            total = self.ranks.allreduce(len(replies[0]["words"]), self.timeout)
            if total != message["count"]:
                raise RuntimeError(f"the ranks produced {total} of {message['count']} tokens")
        return replies

    def join(self) -> None:
        hosts = [r["host"] for r in self.step({"op": "join", "nodes": 0})]
        self.hosts, self.nodes = hosts, len(set(hosts))
        self.step({"op": "join", "nodes": self.nodes})

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "init":
            replies = self.step({"op": "load", "spec": request["spec"]})
            errors = [r["error"] for r in replies if "error" in r]
            return {"ok": not errors, "errors": errors, "world_size": self.ranks.world, "ranks": replies}
        if op == "generate":
            replies = self.step({"op": "generate", "seed": request["seed"], "count": request["count"]})
            words = {int(i): w for r in replies for i, w in r["words"].items()}
            return {"ok": True, "words": [words[i] for i in range(request["count"])]}
        return {"ok": False, "errors": [f"unknown request {op!r}"]}

    def stop_child(self, signum: int) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)
            try:
                self.child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()

    def run(self) -> int:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port = 10012
        while True:
            try:
                listener.bind(("127.0.0.1", port))
                break
            except OSError:
                port += 1
        listener.listen(8)
        addr = f"tcp://127.0.0.1:{port}"
        say(f"TLLM_SPAWN_PROXY_PROCESS_IPC_ADDR: {addr}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_PREFIXES)}
        env.update(TLLM_SPAWN_PROXY_PROCESS="1", TLLM_SPAWN_PROXY_PROCESS_IPC_ADDR=addr)
        say(f"rank0 run {' '.join(self.command)} in background")

        def on_signal(signum: int, _frame: Any) -> None:
            self.stop_child(signal.SIGTERM)
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.child = subprocess.Popen(self.command, env=env)
        say(f"rank0 run mgmn leader node with mpi_world_size: {self.ranks.world} ...")
        say(f"rank0 host: {socket.gethostname()}")
        try:
            self.join()
            log.log("I", f"MPI session of {self.ranks.world} rank(s) on {self.nodes} node(s): "
                         f"{', '.join(self.hosts)}", rank=0)
            return self.serve(listener)
        except StepTimeout as err:
            others = ", ".join(f"rank {i} on {h}" for i, h in enumerate(self.hosts) if i)
            log.log("E", f"{err}: {others or 'another rank'} did not answer; stopping the server", rank=0)
            self.stop_child(signal.SIGTERM)
            self.ranks.comm.Abort(1)
            return 1

    def serve(self, listener: socket.socket) -> int:
        readers: dict[socket.socket, wire.Reader] = {}
        next_beat = time.monotonic() + self.heartbeat
        assert self.child is not None
        while True:
            code = self.child.poll()
            if code is not None:
                self.ranks.broadcast({"op": "stop"}, self.timeout)
                return code
            ready, _, _ = select.select([listener, *readers], [], [], max(0.0, next_beat - time.monotonic()))
            for sock in ready:
                if sock is listener:
                    conn, _ = listener.accept()
                    readers[conn] = wire.Reader(conn)
                    continue
                messages = readers[sock].messages()
                if messages is None:
                    del readers[sock]
                    sock.close()
                    continue
                for request in messages:
                    if request.get("op") != "watch":
                        wire.send(sock, self.handle(request))
            if time.monotonic() >= next_beat:
                self.step({"op": "heartbeat"})
                next_beat = time.monotonic() + self.heartbeat


def main(argv: list[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    rank, world = mpi_rank(), mpi_world_size()
    say(f"mpi_rank: {rank}")
    say(f"tllm_mpi_size: {world}")
    if not command and rank == 0:
        say("trtllm-llmapi-launch: no command to run")
        return 2
    timeout = _seconds("TRTLLM_DOUBLE_PEER_TIMEOUT_S", 10)
    if rank != 0:
        say(f"rank{rank} run mgmn worker node with mpi_world_size: {world} ...")
    ranks = Ranks()
    try:
        ranks.barrier(_seconds("TRTLLM_DOUBLE_JOIN_TIMEOUT_S", 60))
    except StepTimeout as err:
        log.log("E", f"rank {ranks.rank} on {socket.gethostname()} could not join the other "
                     f"{ranks.world - 1} rank(s): {err}", rank=ranks.rank)
        ranks.comm.Abort(1)
        return 1
    leader = Leader(ranks, command, timeout, _seconds("TRTLLM_DOUBLE_HEARTBEAT_S", 1)) if ranks.rank == 0 else None
    try:
        code = leader.run() if leader is not None else worker(ranks, timeout)
    except Exception:  # as in the engine: an error on any rank ends the whole job, never a hang in MPI_Finalize
        traceback.print_exc()
        if leader is not None:
            leader.stop_child(signal.SIGTERM)
        ranks.comm.Abort(1)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Every rank reaches here only after the stop step (all alive): finalize, or mpirun calls the exit improper.
    # The failure paths above abort the job instead.
    ranks.MPI.Finalize()
    return code


if __name__ == "__main__":
    sys.exit(main())
