"""vLLM's multiprocessing executor without Ray, on one node or several (vllm/v1/executor/multiproc_executor.py,
vllm/entrypoints/cli/serve.py run_headless, vllm/distributed/parallel_state.py init_distributed_environment).

The head (``--node-rank 0``) and every ``--headless`` node start their share of the TP x PP ranks as local processes
(``VllmWorker-<rank>``, ``world_size / nnodes`` each; global rank = local_world_size x node_rank + local rank). Every
rank joins a rendezvous over TCP at ``--master-addr:--master-port`` (one node: the loopback and a free port), as
torch.distributed's TCPStore does for vLLM, and waits until all ``world_size`` ranks have joined:

- the head times out with torch's ``DistStoreError: Timed out after N seconds waiting for clients. J/W clients
  joined.`` (raised in rank 0), a headless node whose head never listens with ``DistNetworkError: The client socket
  has timed out after Nms while trying to connect to (addr, port).``; the wait is ``--distributed-timeout-seconds``,
  else torch's default for NCCL (600 s), which the double takes from ``VLLM_DOUBLE_DISTRIBUTED_TIMEOUT_S``;
- then each rank checks its fake GPU and loads the model on ITS node (worker.py), reports READY, and answers the
  head's calls (available KV memory, its report) over the same connection;
- a local rank that dies is vLLM's ``Worker proc VllmWorker-N died unexpectedly, shutting down executor.``; on the
  head the engine goes down with it, a headless node shuts down and returns (exit 0, as vLLM's run_headless does);
  the head also loses a remote rank when its connection closes (vLLM notices only at the next collective call);
- a worker exits when its parent dies (vLLM's death pipe); a headless node's ranks keep waiting when the head goes
  away, as vLLM's do (they block on the head's next broadcast): restart every node together.

The rendezvous is the double's own (newline-delimited JSON; the server runs in the head's executor process, torch's
in rank 0): no torch, no NCCL traffic. Like torch's TCPStore it listens on every address of the head, at
``--master-port`` (one node: ``get_open_port()``, as vLLM's executor picks it). With several nodes the head also
opens vLLM's cross-node queues (network.py): the executor's broadcast queue on ``VLLM_HOST_IP`` and a
``get_open_port()`` port (multiproc_executor.py ``rpc_broadcast_mq``; the other nodes' ranks connect once all joined)
and, in rank 0, the TP group's (worker.py).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from vllm import __version__
from vllm.double import kv, log, network
from vllm.double.network import DistNetworkError, DistStoreError
from vllm.double.worker import RayWorkerWrapper, log_init_method, node_ip

E = log.ENGINE
TORCH_NCCL_DEFAULT_TIMEOUT_S = 600.0  # torch.distributed's default_pg_nccl_timeout
WORKER_FAILED = (
    "WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause."
)


def distributed_timeout(args: Any) -> float:
    if args.distributed_timeout_seconds is not None:
        return float(args.distributed_timeout_seconds)
    raw = os.environ.get("VLLM_DOUBLE_DISTRIBUTED_TIMEOUT_S", "").strip()
    return float(raw) if raw else TORCH_NCCL_DEFAULT_TIMEOUT_S


@dataclass
class Layout:
    """Where the ranks are: vLLM's ParallelConfig for the mp executor."""

    world_size: int
    tp: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    timeout: float

    @property
    def local_world_size(self) -> int:
        return self.world_size // self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.local_world_size * self.node_rank + local_rank


@dataclass
class WorkerJob:
    layout: Layout
    local_rank: int
    model_tag: str
    revision: str | None
    gpu_memory_utilization: float
    weights_per_rank: int
    load_delay_s: float


# --- wire format ----------------------------------------------------------------------------------------------------


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


class Lines:
    """Newline-delimited JSON messages from a socket; ``None`` at EOF."""

    def __init__(self, sock: socket.socket) -> None:
        self.file = sock.makefile("rb")

    def read(self) -> dict[str, Any] | None:
        try:
            raw = self.file.readline()
        except OSError:
            return None
        return json.loads(raw) if raw else None


# --- the worker process (one rank) ----------------------------------------------------------------------------------


class _Prefixed:
    """vLLM's decorate_logs: every line a worker writes starts with ``(Worker_TP1 pid=N) ``."""

    def __init__(self, stream: Any, name: str) -> None:
        self.stream, self.name, self.fresh = stream, name, True

    def write(self, text: str) -> int:
        prefix = f"({self.name} pid={os.getpid()}) "
        out = []
        for part in text.splitlines(keepends=True):
            out.append((prefix if self.fresh else "") + part)
            self.fresh = part.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def _decorate(name: str) -> None:
    sys.stdout = _Prefixed(sys.__stdout__, name)
    sys.stderr = _Prefixed(sys.__stderr__, name)


def _process_name(rank: int, layout: Layout) -> str:
    pp_size = layout.world_size // layout.tp
    name = "Worker"
    if pp_size > 1:
        name += f"_PP{rank // layout.tp}"
    if layout.tp > 1:
        name += f"_TP{rank % layout.tp}"
    return name


def _rendezvous(job: WorkerJob, rank: int) -> tuple[socket.socket, Lines, str | None]:
    """init_process_group(tcp://master): join, then wait until every rank has joined (or the store times out). Also
    returns the address of the executor's broadcast queue (None on one node)."""
    layout = job.layout
    sock = network.connect(layout.master_addr, layout.master_port, layout.timeout)
    lines = Lines(sock)
    send(sock, {"op": "join", "rank": rank, "world_size": layout.world_size, "node_rank": layout.node_rank,
                "host": socket.gethostname(), "ip": node_ip(), "pid": os.getpid()})  # fmt: skip
    answer = lines.read()
    if answer is None:
        raise DistNetworkError("failed to recv, got 0 bytes")
    if answer["op"] == "timeout":
        raise DistStoreError(
            f"Timed out after {answer['elapsed']} seconds waiting for clients. {answer['joined']}/"
            f"{layout.world_size} clients joined."
        )
    if answer["op"] == "reject":
        raise RuntimeError(f"hy3spark TEST DOUBLE: the head at {layout.master_addr}:{layout.master_port} refused "
                           f"rank {rank}: {answer['reason']}")  # fmt: skip
    return sock, lines, answer.get("queue")


def worker_main(job: WorkerJob, ready_pipe: Any, death_pipe: Any, inherited: list[Any]) -> None:
    layout = job.layout
    rank = layout.global_rank(job.local_rank)
    for conn in inherited:  # the parent's pipe ends, copied by fork: a death pipe reads EOF only once all are closed
        conn.close()

    def parent_gone() -> None:
        with contextlib.suppress(EOFError):
            death_pipe.recv()
        os._exit(0)  # the executor process is gone: vLLM's worker exits too

    threading.Thread(target=parent_gone, daemon=True).start()
    _decorate("Worker")
    try:
        init_method = network.tcp_uri(layout.master_addr, layout.master_port)
        log_init_method(layout.world_size, rank, job.local_rank, init_method)
        sock, lines, queue = _rendezvous(job, rank)
        _decorate(_process_name(rank, layout))
        worker = NativeWorker(rank)
        rank_nodes = [str(r // layout.local_world_size) for r in range(layout.world_size)]
        worker.init_worker([{"local_rank": job.local_rank, "world_size": layout.world_size, "tp": layout.tp,
                             "nodes": layout.nnodes, "rank_nodes": rank_nodes,
                             "distributed_timeout": layout.timeout}] * (rank + 1))  # fmt: skip
        if queue is not None and layout.node_rank > 0:  # the head's ranks read it through shared memory in vLLM
            worker.connections.append(network.connect_queue(queue, layout.timeout, rank))
        gpus = int(float(os.environ.get("VLLM_DOUBLE_LOCAL_GPUS", "").strip() or 1))
        if job.local_rank >= gpus:
            raise RuntimeError(
                "CUDA error: invalid device ordinal\nCUDA kernel errors might be asynchronously reported at some "
                "other API call, so the stacktrace below might be incorrect."
            )
        worker.init_device(job.gpu_memory_utilization)
        started = time.monotonic()
        worker.load_model(job.model_tag, job.revision, job.load_delay_s)
        worker.log_model_loading(job.weights_per_rank, time.monotonic() - started)
    except Exception as exc:
        log.exception("multiproc_executor.py:888", "WorkerProc failed to start.", exc, tag=None)
        ready_pipe.send({"status": "FAILED", "rank": rank})
        sys.stdout.flush()
        os._exit(1)
    send(sock, {"op": "ready", "rank": rank})
    ready_pipe.send({"status": "READY", "rank": rank})
    while True:  # the busy loop: the head's calls, until it goes away
        call = lines.read()
        if call is None:
            threading.Event().wait()  # vLLM's ranks block waiting for the head's next broadcast
        try:
            value = getattr(worker, call["method"])(*call["args"])
            send(sock, {"op": "reply", "ok": True, "value": value})
        except Exception as exc:
            text = "".join(traceback.format_exception(exc))
            send(sock, {"op": "reply", "ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": text})


class NativeWorker(RayWorkerWrapper):
    """One rank in its own process (no Ray actor): what the head asks it over the rendezvous connection."""

    def determine_available_memory(self, memory: Any) -> int:  # type: ignore[override]
        return super().determine_available_memory(kv.Memory(**memory) if isinstance(memory, dict) else memory)

    def report(self) -> dict[str, Any]:
        from vllm.double import nccl
        from vllm.double.worker import REPORTED_ENV_PREFIXES, SECRET_ENV

        env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(REPORTED_ENV_PREFIXES)}
        return {
            "rank": self.rank,
            "node_ip": node_ip(),
            "vllm_host_ip": os.environ.get("VLLM_HOST_IP"),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "nccl_transport": nccl.transport(socket.gethostname(), node_ip()) if self.world_size > 1 else None,
            "model_path": getattr(self, "model_path", None),
            "listening": self.listening(),
            "env": env,
            "secret_env_names": [k for k in SECRET_ENV if k in os.environ],
        }


# --- the executor on every node ------------------------------------------------------------------------------------


@dataclass
class _Local:
    rank: int
    proc: Any
    ready: Any
    death_writer: Any


class Rendezvous:
    """The head's store: accepts the ranks, answers them all once ``world_size`` joined (or the timeout passed), with
    the address of the executor's broadcast queue when there is one."""

    def __init__(self, layout: Layout, queue: str | None) -> None:
        self.layout = layout
        self.queue = queue
        self.server = network.store_socket(layout.master_port)
        self.port = self.server.getsockname()[1]
        self.ranks: dict[int, tuple[socket.socket, Lines, dict[str, Any]]] = {}
        self.lock = threading.Lock()
        self.all_joined = threading.Event()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._join, args=(conn,), daemon=True).start()

    def _join(self, conn: socket.socket) -> None:
        lines = Lines(conn)
        hello = lines.read()
        if hello is None or hello.get("op") != "join":
            conn.close()
            return
        rank, world = hello["rank"], hello["world_size"]
        with self.lock:
            reason = None
            if world != self.layout.world_size:
                reason = f"its world size {world} is not the head's {self.layout.world_size} (same flags on every node)"
            elif rank in self.ranks or not 0 <= rank < world or self.all_joined.is_set():
                reason = f"rank {rank} has already joined (is an older run of that node still up?)"
            if reason:
                send(conn, {"op": "reject", "reason": reason})
                conn.close()
                return
            self.ranks[rank] = (conn, lines, hello)
            if len(self.ranks) == self.layout.world_size:
                for other, _lines, _hello in self.ranks.values():
                    send(other, {"op": "start", "queue": self.queue})
                self.all_joined.set()

    def wait(self) -> bool:
        if self.all_joined.wait(self.layout.timeout):
            return True
        with self.lock:
            if self.all_joined.is_set():
                return True
            self.closed = True
            # torch counts whole seconds and fails once more than the timeout has passed
            answer = {"op": "timeout", "joined": len(self.ranks), "elapsed": int(self.layout.timeout) + 1}
            for conn, _lines, _hello in self.ranks.values():
                send(conn, answer)
        return False

    def close(self) -> None:
        self.closed = True
        self.server.close()
        for conn, _lines, _hello in self.ranks.values():
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


class NativeExecutor:
    """MultiprocExecutor: the head's (rendezvous server, calls to every rank) or a headless node's (its ranks only)."""

    def __init__(self, layout: Layout, job: dict[str, Any]) -> None:
        self.layout = layout
        self.locals: list[_Local] = []
        self.reports: list[dict[str, Any]] = []
        self.failed: str | None = None
        self.shutting_down = False
        self.head = layout.node_rank == 0
        self.store: Rendezvous | None = None
        self.queue: network.Listener | None = None
        if self.head:
            if layout.nnodes == 1:  # vLLM: get_distributed_init_method(get_loopback_ip(), get_open_port())
                layout.master_addr, layout.master_port = "127.0.0.1", network.get_open_port(E)
            ip = node_ip()
            log.info(
                "multiproc_executor.py:140",
                f"DP group leader: node_rank={layout.node_rank}, node_rank_within_dp=0, master_addr="
                f"{layout.master_addr}, mq_connect_ip={ip} (local), world_size={layout.world_size}, "
                f"local_world_size={layout.local_world_size}",
                E,
            )
            queue = None
            try:
                if layout.nnodes > 1:  # the broadcast queue to the other nodes' ranks, before any worker starts
                    self.queue = network.Listener(network.listening_socket(ip, network.get_open_port(E)))
                    queue = network.tcp_uri(ip, self.queue.port)
                self.store = Rendezvous(layout, queue)
            except BaseException:
                self.shutdown()
                raise
        context = multiprocessing.get_context("fork")
        inherited: list[Any] = []  # the parent's pipe ends every later fork copies (vLLM's inherited_fds)
        for local_rank in range(layout.local_world_size):
            rank = layout.global_rank(local_rank)
            ready_reader, ready_writer = context.Pipe(duplex=False)
            death_reader, death_writer = context.Pipe(duplex=False)
            proc = context.Process(
                target=worker_main,
                kwargs={"job": WorkerJob(layout=layout, local_rank=local_rank, **job), "ready_pipe": ready_writer,
                        "death_pipe": death_reader, "inherited": [*inherited, ready_reader, death_writer]},
                name=f"VllmWorker-{rank}",
                daemon=True,
            )
            proc.start()
            ready_writer.close()
            death_reader.close()
            inherited += [ready_reader, death_writer]
            self.locals.append(_Local(rank, proc, ready_reader, death_writer))
        try:
            self._wait_for_ready()
            if self.head and layout.nnodes > 1:  # the TP groups' queues, opened while the ranks initialise in vLLM
                self.call("connect_broadcast_queue", self.call("open_broadcast_queue"))
        except BaseException:
            self.shutdown()
            raise

    def _wait_for_ready(self) -> None:
        if self.store is not None and not self.store.wait():
            pass  # rank 0 raises torch's DistStoreError itself: it comes back as a FAILED worker below
        pending = {local.ready for local in self.locals}
        while pending:
            for pipe in multiprocessing.connection.wait(list(pending)):
                pending.discard(pipe)
                try:
                    status = pipe.recv()["status"]  # type: ignore[union-attr]
                except EOFError:
                    status = "DIED"
                if status != "READY":
                    raise Exception(WORKER_FAILED)
        if self.store is None:
            return
        for rank, (_conn, lines, hello) in sorted(self.store.ranks.items()):
            if rank < self.layout.local_world_size:
                if lines.read() is None:
                    raise Exception(WORKER_FAILED)
                continue
            message = lines.read()
            if message is None or message.get("op") != "ready":
                log.error(
                    "multiproc_executor.py:0",
                    f"hy3spark TEST DOUBLE: rank {rank} on node rank {hello['node_rank']} ({hello['host']}, "
                    f"{hello['ip']}) failed to start: see that node's log",
                    E,
                )
                raise Exception(WORKER_FAILED)

    # --- the head's calls ---------------------------------------------------------------------------------------
    def call(self, method: str, *args: Any) -> list[Any]:
        if self.failed:
            raise RuntimeError("Executor failed.")
        assert self.store is not None, "collective_rpc should not be called on follower node"
        wire = [asdict(a) if hasattr(a, "__dataclass_fields__") else a for a in args]
        ranks = sorted(self.store.ranks.items())
        for _rank, (conn, _lines, _hello) in ranks:
            send(conn, {"op": "call", "method": method, "args": wire})
        results = []
        for rank, (_conn, lines, _hello) in ranks:
            reply = lines.read()
            if reply is None:
                raise RuntimeError(f"hy3spark TEST DOUBLE: rank {rank} went away during {method}")
            if not reply["ok"]:
                raise RuntimeError(
                    f"Worker failed with error '{reply['error']}', please check the stack trace above for the root "
                    "cause"
                )
            results.append(reply["value"])
        return results

    def collect_reports(self) -> list[dict[str, Any]]:
        self.reports = self.call("report")
        for report in self.reports:
            log.info(
                "multiproc_executor.py:0",
                f"hy3spark TEST DOUBLE: rank {report['rank']} on {report['hostname']} ({report['node_ip']}, pid "
                f"{report['pid']}) model={report['model_path']}",
                E,
            )
        return self.reports

    # --- liveness -----------------------------------------------------------------------------------------------
    def start_monitor(self, inline: bool = False) -> None:
        """vLLM's MultiprocWorkerMonitor: a local rank's death (its sentinel), and on the head a remote rank's
        connection closing."""

        def watch_local() -> None:
            sentinels = {local.proc.sentinel: local for local in self.locals}
            died = multiprocessing.connection.wait(list(sentinels))
            if self.shutting_down:
                return
            name = sentinels[died[0]].proc.name  # type: ignore[index]
            self._fail(f"Worker proc {name} died unexpectedly, shutting down executor.", "multiproc_executor.py:285")

        def watch_remote(rank: int, conn: socket.socket, hello: dict[str, Any]) -> None:
            try:
                while conn.recv(1, socket.MSG_PEEK):
                    time.sleep(0.2)
            except OSError:
                pass
            if not self.shutting_down:
                self._fail(
                    f"hy3spark TEST DOUBLE: rank {rank} on node rank {hello['node_rank']} ({hello['host']}, "
                    f"{hello['ip']}) closed its connection to the head: its process or its node is gone",
                    "multiproc_executor.py:0",
                )

        if self.store is not None:
            for rank, (conn, _lines, hello) in self.store.ranks.items():
                if rank >= self.layout.local_world_size:  # the local ranks' deaths show in their sentinels
                    threading.Thread(target=watch_remote, args=(rank, conn, hello), daemon=True).start()
        if inline:
            watch_local()
        else:
            threading.Thread(target=watch_local, daemon=True, name="MultiprocWorkerMonitor").start()

    def _fail(self, message: str, where: str) -> None:
        if self.failed is None:
            self.failed = message
            log.error(where, message, E if self.head else None)
            self.shutdown()

    def alive(self, timeout: float = 10.0) -> tuple[bool, str | None]:
        return (True, self.failed) if self.failed else (False, None)

    def shutdown(self) -> None:
        if self.shutting_down:
            return
        self.shutting_down = True
        for local in self.locals:
            local.death_writer.close()
        for local in self.locals:
            local.proc.join(timeout=2)
            if local.proc.is_alive():
                local.proc.kill()
        if self.store is not None:
            self.store.close()
        if self.queue is not None:
            self.queue.close()


def headless_banner(layout: Layout) -> None:
    log.info(
        "serve.py:212",
        f"Launching vLLM (v{__version__}) headless multiproc executor, with head node address "
        f"{layout.master_addr}:{layout.master_port} for torch.distributed process group.",
        tag=None,
    )
