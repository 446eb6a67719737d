"""vLLM's Ray executor, reduced to what hy3spark depends on (vllm/v1/executor/ray_utils.py, ray_executor.py,
vllm/ray/ray_env.py).

- connect to the running Ray cluster (``ray.init(address="auto")``; vLLM passes no address, which also finds it);
- a placement group of TP x PP bundles ``{"GPU": 1.0}``, the first pinned to the driver's node with
  ``node:<VLLM_HOST_IP>: 0.001``, strategy PACK (one GPU per DGX Spark, so the bundles spread one per node);
- while it cannot be placed: vLLM's "Waiting for creating a placement group of specs for N seconds" lines, then its
  ValueError after the timeout (vLLM: 1800 s; the double: ``VLLM_DOUBLE_PG_TIMEOUT_S``, default 20);
- one ``RayWorkerWrapper`` actor per bundle (num_gpus=1); the unique-IP check ("Every node should have a unique IP
  address ... If you set `VLLM_HOST_IP` environment variable, make sure it is unique for each node.");
- env vars copied from the driver to the workers: vLLM's registered names, names with the prefixes VLLM_, LMCACHE_,
  NCCL_, UCX_, HF_, HUGGING_FACE_, plus PYTHONHASHSEED, HF_TOKEN; minus the worker-specific ones (VLLM_HOST_IP,
  VLLM_HOST_PORT, LOCAL_RANK, CUDA_VISIBLE_DEVICES) and the names listed in
  ``$VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json``;
- the torch.distributed store (ray_executor.py ``_init_workers_ray``): ``tcp://<driver IP>:<get_open_port()>`` (the
  loopback when every worker is on one node) handed to every worker; rank 0 listens there on every address, the
  others connect (worker.py). Then each TP group whose ranks span nodes opens its broadcast queue on its writer's
  node: the executor asks the writers for their addresses and hands them to the readers (vLLM broadcasts the
  handle over the process group).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from typing import Any

from vllm.double import log, network
from vllm.double.worker import RayWorkerWrapper, node_ip

E = log.ENGINE
WORKER_SPECIFIC_ENV_VARS = {"VLLM_HOST_IP", "VLLM_HOST_PORT", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"}
ADDITIONAL_ENV_VARS = {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"}
DEFAULT_ENV_VAR_PREFIXES = {"VLLM_", "LMCACHE_", "NCCL_", "UCX_", "HF_", "HUGGING_FACE_"}
DEFAULT_EXTRA_ENV_VARS = {"PYTHONHASHSEED"}


def config_root() -> str:
    return os.environ.get("VLLM_CONFIG_ROOT") or os.path.join(
        os.environ.get("XDG_CONFIG_HOME", os.path.expanduser("~/.config")), "vllm"
    )


def non_carry_over() -> tuple[str, set[str]]:
    path = os.path.join(config_root(), "ray_non_carry_over_env_vars.json")
    try:
        if os.path.exists(path):
            with open(path) as handle:
                return path, set(json.load(handle))
    except json.JSONDecodeError:
        log.warning("ray_env.py:31", f"Failed to parse {path}. Using an empty set for non-carry-over env vars.", E)
    return path, set()


def env_vars_to_copy() -> set[str]:
    path, blocked = non_carry_over()
    extra_prefixes = {p.strip() for p in os.environ.get("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "").split(",")}
    prefixes = DEFAULT_ENV_VAR_PREFIXES | {p for p in extra_prefixes if p}
    extra = {v.strip() for v in os.environ.get("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY", "").split(",") if v.strip()}
    result = {name for name in os.environ if any(name.startswith(p) for p in prefixes)}
    result |= DEFAULT_EXTRA_ENV_VARS | extra | ADDITIONAL_ENV_VARS
    result -= WORKER_SPECIFIC_ENV_VARS | blocked
    log.info("ray_env.py:104", f"Env var prefixes to copy: {sorted(prefixes)}", E)
    log.info(
        "ray_env.py:105",
        f"Copying the following environment variables to workers: {sorted(v for v in result if v in os.environ)}",
        E,
    )
    if blocked:
        log.info("ray_env.py:110", f"RAY_NON_CARRY_OVER_ENV_VARS from config: {blocked}", E)
    log.info("ray_env.py:114", f"To exclude env vars from copying, add them to {path}", E)
    return result


def pg_timeout() -> float:
    raw = os.environ.get("VLLM_DOUBLE_PG_TIMEOUT_S", "").strip()
    return float(raw) if raw else 20.0


def wait_until_pg_ready(ray: Any, pg: Any) -> None:
    timeout = pg_timeout()
    specs = pg.bundle_specs
    start = time.time()
    ready_ref = pg.ready()
    # vLLM waits 10 s, then doubles; scaled down with a short timeout so at least one line shows before the error.
    interval = min(10.0, max(timeout / 2, 0.5))
    while time.time() - start < timeout:
        ready, _ = ray.wait([ready_ref], timeout=interval)
        if ready:
            break
        interval *= 2
        log.info(
            "ray_utils.py:277",
            f"Waiting for creating a placement group of specs for {int(time.time() - start)} seconds. specs={specs}. "
            "Check `ray status` and `ray list nodes` to see if you have enough resources, and make sure the IP "
            "addresses used by ray cluster are the same as VLLM_HOST_IP environment variable specified in each node "
            "if you are running on a multi-node.",
            E,
        )
    try:
        ray.get(ready_ref, timeout=0)
    except ray.exceptions.GetTimeoutError:
        shown = int(timeout) if float(timeout).is_integer() else timeout
        total_gpu = sum(spec.get("GPU", 0) for spec in specs)
        if total_gpu > 1:
            raise ValueError(
                f"Cannot provide a placement group requiring {total_gpu} GPUs (placement_group_specs={specs}) within "
                f"{shown} seconds.\nTensor parallel size may exceed available GPUs in your cluster. Check resources "
                "with `ray status` and `ray list nodes`.\nIf running on K8s with limited GPUs, consider reducing "
                "--tensor-parallel-size to match available GPU resources."
            ) from None
        raise ValueError(
            f"Cannot provide a placement group of placement_group_specs={specs} within {shown} seconds. See "
            "`ray status` and `ray list nodes` to make sure the cluster has enough resources."
        ) from None


class RayExecutor:
    def __init__(self, world_size: int, tp: int, distributed_timeout: float) -> None:
        self.world_size = world_size
        self.tp = tp
        self.distributed_timeout = distributed_timeout
        self.workers: list[Any] = []
        self.pg: Any = None
        self.reports: list[dict[str, Any]] = []

    def initialize_cluster(self) -> None:
        import ray
        from ray.util import placement_group_table

        # Ray's own "Connecting to existing Ray cluster at address: ..." line comes from here.
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=True)
        log.info("ray_utils.py:398", "No current placement group found. Creating a new placement group.", E)
        if self.world_size > ray.cluster_resources().get("GPU", 0):
            log.warning(
                "ray_utils.py:404",
                "The number of required GPUs exceeds the total number of available GPUs in the placement group.",
                E,
            )
        specs: list[dict[str, float]] = [{"GPU": 1.0} for _ in range(self.world_size)]
        current_ip = node_ip()
        current_node_id = ray.get_runtime_context().get_node_id()
        resources = _available_resources_per_node(ray).get(current_node_id, {})
        if resources.get("GPU", 0) < 1:
            raise ValueError(
                f"Current node has no GPU available. current_node_resource={resources}. vLLM engine cannot start "
                f"without GPU. Make sure you have at least 1 GPU available in a node "
                f"current_node_id={current_node_id!r} current_ip={current_ip!r}."
            )
        specs[0][f"node:{current_ip}"] = 0.001
        self.pg = ray.util.placement_group(specs, strategy="PACK")
        wait_until_pg_ready(ray, self.pg)

        table = placement_group_table(self.pg)
        per_node: dict[str, list[dict[str, float]]] = defaultdict(list)
        for index, node_id in table["bundles_to_node_id"].items():
            per_node[node_id].append(table["bundles"][index])
        if current_node_id not in per_node:
            raise RuntimeError(
                f"driver node id {current_node_id} is not included in a placement group {self.pg.id}. Node id -> "
                f"bundles {dict(per_node)}. You don't have enough GPUs available in a current node. Check `ray status` "
                "and `ray list nodes` to see if you have available GPUs in a node `{driver_node_id}` before starting "
                "an vLLM engine."
            )
        for node_id, bundles in per_node.items():
            if len(bundles) < self.tp:
                log.warning(
                    "ray_utils.py:226",
                    f"tensor_parallel_size={self.tp} is bigger than a reserved number of GPUs ({len(bundles)} GPUs) "
                    f"in a node {node_id}. Tensor parallel workers can be spread out to 2+ nodes which can degrade the "
                    "performance unless you have fast interconnect across nodes, like Infiniband. To resolve this "
                    f"issue, make sure you have more than {self.tp} GPUs available at each node.",
                    E,
                )

    def init_workers(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = ray.remote(num_cpus=0, num_gpus=1)(RayWorkerWrapper)
        created = []
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_capture_child_tasks=True, placement_group_bundle_index=rank
            )
            created.append(actor_class.options(scheduling_strategy=strategy).remote(rpc_rank=rank))
        worker_ips = ray.get([w.get_node_ip.remote() for w in created])
        driver_ip = node_ip()
        counts: dict[str, int] = defaultdict(int)
        for ip in worker_ips:
            counts[ip] += 1
        # vLLM's order: the driver's node first, then nodes with fewer workers, then by IP.
        order = sorted(
            range(len(created)),
            key=lambda i: (0 if worker_ips[i] == driver_ip else 1, counts[worker_ips[i]], worker_ips[i]),
        )
        self.workers = [created[i] for i in order]
        mapping = {created_rank: adjusted for adjusted, created_rank in enumerate(order)}
        ray.get([w.adjust_rank.remote(mapping) for w in created])

        node_and_gpus = ray.get([w.get_node_and_gpu_ids.remote() for w in self.workers])
        node_workers: dict[str, list[int]] = defaultdict(list)
        for rank, (node_id, _gpus) in enumerate(node_and_gpus):
            node_workers[node_id].append(rank)
        all_ips = {*worker_ips, driver_ip}
        if len(node_workers) != len(all_ips):
            raise RuntimeError(
                f"Every node should have a unique IP address. Got {len(node_workers)} nodes with node ids "
                f"{list(node_workers.keys())} and {len(all_ips)} unique IP addresses {all_ips}. Please check your "
                "network configuration. If you set `VLLM_HOST_IP` environment variable, make sure it is unique for "
                "each node."
            )
        names = env_vars_to_copy()
        node_gpus: dict[str, list[int]] = defaultdict(list)
        for node_id, gpus in node_and_gpus:
            node_gpus[node_id].extend(gpus)
        copied = {name: os.environ[name] for name in names if name in os.environ}
        per_rank_env = [
            {"CUDA_VISIBLE_DEVICES": ",".join(map(str, sorted(node_gpus[node_id]))), **copied}
            for node_id, _gpus in node_and_gpus
        ]
        self.call("update_environment_variables", per_rank_env)
        # One node: the loopback is enough (vLLM's comment: a node's other addresses may not reach itself). The port
        # comes from this process's VLLM_PORT, as in vLLM's driver.
        store_ip = "127.0.0.1" if len(node_workers) == 1 else driver_ip
        init_method = network.tcp_uri(store_ip, network.get_open_port(E))
        rank_nodes = [node_id for node_id, _gpus in node_and_gpus]
        kwargs = [
            {
                "local_rank": node_workers[node_id].index(rank),
                "world_size": self.world_size,
                "tp": self.tp,
                "nodes": len(node_workers),
                "rank_nodes": rank_nodes,
                "distributed_init_method": init_method,
                "distributed_timeout": self.distributed_timeout,
            }
            for rank, (node_id, _gpus) in enumerate(node_and_gpus)
        ]
        self.call("init_worker", kwargs)

    def init_device(self, gpu_memory_utilization: float) -> None:
        """Every rank's init_device (the store joins there), then the TP groups' broadcast queues across nodes."""
        self.call("init_device", gpu_memory_utilization)
        addresses = self.call("open_broadcast_queue")
        self.call("connect_broadcast_queue", addresses)

    def call(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def collect_reports(self) -> list[dict[str, Any]]:
        self.reports = self.call("report")
        for report in self.reports:
            env = report["env"]
            shown = {k: env[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA") if k in env}
            log.info(
                "ray_executor.py:0",
                f"hy3spark TEST DOUBLE: rank {report['rank']} on {report['hostname']} (Ray node {report['node_ip']}) "
                f"sees VLLM_HOST_IP={report['vllm_host_ip']} {shown} model={report['model_path']}",
                E,
            )
        return self.reports

    def alive(self, timeout: float = 10.0) -> tuple[bool, str | None]:
        """(fatal, problem): problem is None when every worker answers. A dead actor or node is fatal at once; a
        ping that only timed out is not (a loaded machine), the caller decides after several."""
        import ray

        try:
            ray.get([w.ping.remote() for w in self.workers], timeout=timeout)
        except ray.exceptions.GetTimeoutError as err:
            return False, f"ray.exceptions.GetTimeoutError: {err}"
        except Exception as err:  # ActorDiedError, ActorUnavailableError, RayTaskError
            return True, f"{type(err).__module__}.{type(err).__name__}: {err}"
        return False, None

    def shutdown(self) -> None:
        import ray

        log.info(
            "ray_executor.py:128",
            "Shutting down Ray distributed executor. If you see error log from logging.cc regarding SIGTERM received, "
            "please ignore because this is the expected termination process in Ray.",
            E,
        )
        try:
            for worker in self.workers:
                ray.kill(worker)
            if self.pg is not None:
                ray.util.remove_placement_group(self.pg)
            ray.shutdown()
        except Exception:  # the cluster may already be gone
            pass


def _available_resources_per_node(ray: Any) -> dict[str, dict[str, float]]:
    try:
        from ray._private.state import available_resources_per_node

        return available_resources_per_node()
    except ImportError:
        from ray._private.state import state

        return state._available_resources_per_node()
