"""The Ray actor that stands in for one vLLM GPU worker (one TP x PP rank, one bundle of {"GPU": 1}).

The class is named like vLLM's (``RayWorkerWrapper``), so Ray forwards its output to the driver as
``(RayWorkerWrapper pid=N, ip=A.B.C.D) ...``, exactly where a real worker's lines appear. Each actor runs on the node
that holds its bundle, with that node's environment (the Ray container's env file), and:

- reports its IP the way vLLM's ``get_ip()`` does: ``VLLM_HOST_IP`` when set (the double falls back to Ray's node IP
  instead of vLLM's UDP probe of 8.8.8.8);
- applies the env vars the engine copies from the head (vllm/ray/ray_env.py rules), after which it records what it
  sees: a worker must keep its OWN ``VLLM_HOST_IP`` and, when ``ray_non_carry_over_env_vars.json`` lists them, its
  own NCCL/UCX/GLOO settings;
- checks that the model is on THIS node at the same path, every shard readable (a real worker loads the weights
  there); failures name the node's IP;
- measures its available KV cache memory on its own fake GPU (see kv.py); the engine matches every rank's against
  vLLM's recorded vectors;
- opens vLLM's internal ports where vLLM does (network.py): given the driver's ``distributed_init_method``, rank 0
  listens on every address at its port (torch's TCPStore) and the other ranks connect to it; the first rank of a
  TP group whose ranks span nodes binds the group's broadcast queue to ``VLLM_HOST_IP`` and a ``get_open_port()``
  port, and the group's ranks on other nodes connect to it. The sockets stay open until the worker goes away.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from vllm.double import kv, log, nccl, network
from vllm.double.model import snapshot_dir, verify_files

# What a worker reports back: its identity and the transport settings that must be per-node.
REPORTED_ENV_PREFIXES = ("VLLM_HOST_IP", "NCCL_", "GLOO_", "TP_SOCKET_", "UCX_", "MASTER_ADDR", "OMPI_MCA_btl_tcp")
# Secrets the driver may hold: a worker reports only WHICH of them reached it (never a value).
SECRET_ENV = ("VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def node_ip() -> str:
    host_ip = os.environ.get("VLLM_HOST_IP", "").strip()
    if host_ip:
        return host_ip
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def log_init_method(world_size: int, rank: int, local_rank: int, init_method: str) -> None:
    """init_distributed_environment's line, in the rank's process."""
    log.info(
        "parallel_state.py:1568",
        f"world_size={world_size} rank={rank} local_rank={local_rank} distributed_init_method={init_method} "
        "backend=nccl",
        tag=None,
    )


class RayWorkerWrapper:
    def __init__(self, rpc_rank: int) -> None:
        self.rpc_rank = rpc_rank
        self.rank = rpc_rank
        self.local_rank = 0
        self.world_size = 1
        self.tp = 1
        self.nodes = 1
        self.rank_nodes: list[str] = []
        self.init_method: str | None = None
        self.distributed_timeout = 600.0
        self.listeners: list[network.Listener] = []
        self.connections: list[socket.socket] = []

    # --- what vLLM's executor asks every worker -------------------------------------------------------------
    def get_node_ip(self) -> str:
        return node_ip()

    def get_node_and_gpu_ids(self) -> tuple[str, list[int]]:
        import ray

        context = ray.get_runtime_context()
        return context.get_node_id(), [int(x) for x in context.get_accelerator_ids().get("GPU", [])]

    def adjust_rank(self, mapping: dict[int, int]) -> None:
        self.rank = mapping.get(self.rpc_rank, self.rpc_rank)

    def update_environment_variables(self, per_rank: list[dict[str, str]]) -> None:
        os.environ.update(per_rank[self.rank])

    def init_worker(self, per_rank: list[dict[str, Any]]) -> None:
        kwargs = per_rank[self.rank]
        self.local_rank, self.world_size, self.tp = kwargs["local_rank"], kwargs["world_size"], kwargs["tp"]
        self.nodes = kwargs.get("nodes", 1)
        # The node of every rank (the TP groups' broadcast queues need it), the store's address and timeout: what
        # vLLM's executor hands its workers (distributed_init_method) and its parallel config holds.
        self.rank_nodes = kwargs.get("rank_nodes", [])
        self.init_method = kwargs.get("distributed_init_method")
        self.distributed_timeout = kwargs.get("distributed_timeout", self.distributed_timeout)
        pp_rank, tp_rank = divmod(self.rank, self.tp)
        log.info(
            "parallel_state.py:1208",
            f"rank {self.rank} in world size {self.world_size} is assigned as DP rank 0, PP rank {pp_rank}, "
            f"TP rank {tp_rank}, EP rank {tp_rank}",
            tag=None,
        )

    def init_device(self, gpu_memory_utilization: float) -> None:
        if self.init_method is not None:  # gpu_worker.py: init_worker_distributed_environment, then the memory check
            self._join_store(self.init_method)
        kv.check_free_memory(gpu_memory_utilization)
        # init_distributed_environment: the NCCL communicator over all ranks (NCCL_DEBUG=INFO shows its transport).
        nccl.emit(self.rank, self.world_size, self.nodes, node_ip())

    def _join_store(self, init_method: str) -> None:
        """init_process_group(init_method): rank 0 serves the TCPStore on every address, the others connect."""
        log_init_method(self.world_size, self.rank, self.local_rank, init_method)
        host, port = network.split_uri(init_method)
        if self.rank == 0:
            self.listeners.append(network.Listener(network.store_socket(port)))
        else:
            self.connections.append(network.connect(host, port, self.distributed_timeout))

    def _tp_group(self) -> list[int]:
        first = self.rank - self.rank % self.tp
        return list(range(first, first + self.tp))

    def _spans_nodes(self, ranks: list[int]) -> bool:
        return len({self.rank_nodes[r] for r in ranks}) > 1 if self.rank_nodes else False

    def open_broadcast_queue(self) -> str | None:
        """The TP group's MessageQueue (parallel_state.py GroupCoordinator.mq_broadcaster): its writer, the group's
        first rank, binds a port for the readers on other nodes (shm_broadcast.py). None when it opens none."""
        group = self._tp_group()
        if self.rank != group[0] or not self._spans_nodes(group):
            return None
        ip = node_ip()
        self.listeners.append(network.Listener(network.listening_socket(ip, network.get_open_port())))
        return network.tcp_uri(ip, self.listeners[-1].port)

    def connect_broadcast_queue(self, addresses: list[str | None]) -> None:
        """A reader on another node than its TP group's writer subscribes to the writer's address."""
        writer = self._tp_group()[0]
        address = addresses[writer]
        if address is not None and self.rank_nodes[self.rank] != self.rank_nodes[writer]:
            self.connections.append(network.connect_queue(address, self.distributed_timeout, self.rank))

    def close_listeners(self) -> None:
        for listener in self.listeners:
            listener.close()
        for conn in self.connections:
            conn.close()
        self.listeners, self.connections = [], []

    def load_model(self, model_tag: str, revision: str | None, load_delay_s: float) -> int:
        start = time.monotonic()
        where = f"node {node_ip()} ({socket.gethostname()})"
        try:
            path = snapshot_dir(model_tag, revision)
        except ValueError as err:
            raise ValueError(
                f"Model {model_tag!r} (revision {revision or 'main'}) is not in the Hugging Face cache on {where}; "
                f"HF_HUB_CACHE={os.environ.get('HF_HUB_CACHE', '(unset)')}. Every node must hold the model at the "
                f"same path.\n{err}"
            ) from None
        try:
            verify_files(path)
        except (FileNotFoundError, RuntimeError) as err:
            raise type(err)(f"Cannot load the model weights on {where}: {err}") from None
        if load_delay_s > 0:
            time.sleep(load_delay_s)
        self.model_path = str(path)
        return int(time.monotonic() - start)

    def log_model_loading(self, weights_per_rank: int, seconds: float) -> None:
        log.info(
            "gpu_model_runner.py:2653",
            f"Model loading took {weights_per_rank / kv.GIB:.2f} GiB memory and {seconds:.6f} seconds",
            tag=None,
        )

    def determine_available_memory(self, memory: kv.Memory) -> int:
        available = kv.available_bytes(memory)
        if memory.kv_cache_memory_bytes is not None:
            log.info(
                "gpu_worker.py:291",
                f"Reserved {available / kv.GIB:.2f} GiB for KV cache as specified by kv_cache_memory_bytes config and "
                "skipped memory profiling.",
                tag=None,
            )
        else:
            log.info("gpu_worker.py:298", f"Available KV cache memory: {available / kv.GIB:.2f} GiB", tag=None)
        return available

    # --- the double's own introspection ---------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        import ray

        env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(REPORTED_ENV_PREFIXES)}
        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "vllm_host_ip": os.environ.get("VLLM_HOST_IP"),
            "hostname": socket.gethostname(),
            "nccl_transport": nccl.transport(socket.gethostname(), node_ip()) if self.world_size > 1 else None,
            "model_path": getattr(self, "model_path", None),
            "listening": self.listening(),
            "env": env,
            "secret_env_names": [k for k in SECRET_ENV if k in os.environ],
        }

    def listening(self) -> list[str]:
        """The double's own introspection: host:port of every listener this rank holds open ("" is every address)."""
        return [f"{listener.host}:{listener.port}" for listener in self.listeners]

    def ping(self) -> bool:
        return True
