"""Derive, from a validated spec, every value a deployment uses.

The result is plain data (dicts, lists, strings, ints). It is written into the Ansible inventory
(`group_vars/all/hy3spark.yml` and one `host_vars/<node>.yml` per node), and the same data feeds the Jinja
templates on both sides: `hy3spark render` here, the `template` module in the roles. So the preview and the
deployed files cannot drift: they are one template rendered from one set of variables.
"""

from __future__ import annotations

import json
from typing import Any

from typing_extensions import TypedDict

from hy3spark import __version__
from hy3spark.engines import SECRET_NAMES, Engine, engine_for, engine_front, engine_options
from hy3spark.ports import PortEntry, port_table
from hy3spark.spec import Loaded, Node, Spec, mpi_hosts

MANAGED = "Managed by hy3spark from the cluster spec; edit the spec and re-render instead of this file."

CONFIG_DIR = "/etc/hy3spark"
LOG_DIR = "/var/log/hy3spark"
STATE_DIR = "/var/lib/hy3spark"
SERVE_LOG = f"{LOG_DIR}/serve.log"
VLLM_CONFIG_ROOT = f"{CONFIG_DIR}/vllm"
# The serve script's first line at each engine start (templates/serve.sh.j2 prints it): everything logged after
# the last such line belongs to the running engine. The roles, `hy3spark logs` and status split the log on it.
ENGINE_START = "hy3spark: starting "
# The engine's own options file, for an engine that reads one (TensorRT-LLM's --extra_llm_api_options).
ENGINE_OPTIONS = f"{CONFIG_DIR}/engine-options.yml"
# hy3spark's API front, for an engine that checks no API key itself (TensorRT-LLM's serving role copies it to the
# head; the container sees it through the /etc/hy3spark mount).
API_FRONT = f"{CONFIG_DIR}/api-front.py"
# The cluster's Ray token (ray.auth: token): made on the head by the ray_node role, copied to every node, 0600, read
# by every Ray process through RAY_AUTH_TOKEN_PATH (the /etc/hy3spark mount). Never rendered.
RAY_TOKEN = f"{CONFIG_DIR}/ray-token"
# The engine's secrets (API key, Hub token): a 0600 file in a 0700 directory of its own, outside /etc/hy3spark,
# which every node container mounts. The serve script gets the file on stdin (`docker exec -i`, or a host unit's
# StandardInput=file:), so no file in a container holds them and no Ray process can read them from disk.
SECRETS_DIR = "/etc/hy3spark-secrets"
# Ray's two Prometheus servers (dashboard head, autoscaler monitor) bind every address and Ray cannot narrow them:
# with ray.metrics off, roles/ray_node puts a `sitecustomize` there (its files/sitecustomize.py) that binds them to
# 127.0.0.1, and the Ray container's command puts the directory first on PYTHONPATH (RAY_PYTHONPATH_ARGV).
RAY_PYTHON_DIR = f"{CONFIG_DIR}/ray-python"
# `sh -c SCRIPT ray start ...`: the image's own PYTHONPATH kept behind it ($0 is `ray`, "$@" the rest of the argv).
RAY_PYTHONPATH_ARGV = ["/bin/sh", "-c", f'PYTHONPATH="{RAY_PYTHON_DIR}${{PYTHONPATH:+:$PYTHONPATH}}" exec "$0" "$@"']
# The mpi launcher's files on every node: the Open MPI hostfile (mounted where OMPI_MCA_orte_default_hostfile points
# in the container), and the sshd's and mpirun's ssh configs, which its role writes with the cluster's key pair.
# Restarts (docs/restarts.md): each node's boot unit starts its container after the fabric address and Docker; on
# the head the supervisor restarts the engine when it is gone and a start can succeed. Its files live outside
# /etc/hy3spark, which every node container mounts: nothing in a container can change what the host runs.
UNIT_DIR = "/etc/systemd/system"
NODE_UNIT = "hy3spark-node.service"
SUPERVISOR_UNIT = "hy3spark-supervisor.service"
# A directory of its own: /usr/local/lib/hy3spark holds the network role's helpers too.
LIB_DIR = "/usr/local/lib/hy3spark/supervisor"
SUPERVISOR_CONFIG = f"{LIB_DIR}/supervisor.json"
SUPERVISOR_STATE = f"{STATE_DIR}/supervisor.json"
# Launchers whose readiness gate exists (roles/vllm_serve/files/launchers/<launcher>/ready.py): the supervisor needs
# one to know that a start can succeed. The others get the boot units only (docs/restarts.md says why).
SUPERVISED_LAUNCHERS = ("ray",)
# After a failed start the supervisor waits 10 s, then 30 s, then 60 s before each next one.
RESTART_BACKOFF_S = [10, 30, 60]

MPI_HOSTFILE = f"{CONFIG_DIR}/openmpi-hostfile"
MPI_CONTAINER_HOSTFILE = "/etc/openmpi-hostfile"
MPI_DIR = f"{CONFIG_DIR}/mpi"
MPI_SSHD_CONFIG = f"{MPI_DIR}/sshd_config"
MPI_SSH_CONFIG = f"{MPI_DIR}/ssh_config"
# Made on the nodes by the mpi_node role, never rendered (no key leaves the node it was made on): each node's own
# host key, the head's client key (mpirun's), the head's pinned host keys of every node, every node's authorized key.
MPI_HOST_KEY = f"{MPI_DIR}/ssh_host_ed25519_key"
MPI_CLIENT_KEY = f"{MPI_DIR}/id_ed25519"
MPI_KNOWN_HOSTS = f"{MPI_DIR}/known_hosts"
MPI_AUTHORIZED_KEYS = f"{MPI_DIR}/authorized_keys"


# The context's shape. Every key a template, role or playbook reads (`hy3spark.x.y`, `hy3spark_node.x`) is declared
# here, and tests/test_context_keys.py fails on a read of an undeclared key and on a build_context() result that
# does not match these types. Values stay plain data (they are written into the inventory as YAML).
class Paths(TypedDict):
    config_dir: str
    log_dir: str
    state_dir: str
    node_env: str
    secrets_dir: str
    secrets_env: str
    serve_script: str
    serve_log: str
    vllm_config_root: str
    engine_options: str
    api_front: str


class Fabric(TypedDict):
    interfaces: list[str]
    interface: str
    hcas: list[str]
    mtu: int
    prefix: int
    subnet: str
    head_ip: str


class Image(TypedDict):
    ref: str
    digest: str | None
    worker_source: str


class Model(TypedDict):
    repo: str
    revision: str
    cache_dir: str
    repo_dir: str
    size_bytes: int | None
    token_env: str | None


class Front(TypedDict):
    """`hy3spark.serving.front`: hy3spark's API front before an engine that checks no key (None otherwise)."""
    argv: list[str]  # started in the background on the head before the engine
    key_env: str  # where it reads the key; the serve script unsets it before the engine starts
    engine_port: int  # the engine's own port on 127.0.0.1 behind it


class Serving(TypedDict):
    engine: str
    served_name: str
    host: str
    port: int
    # What clients use (the Pi config, bench, status from the controller): the bound address, or the head's
    # fabric address when the engine binds every address (with no fabric: its mgmt_ip or ssh_host, else loopback).
    base_url: str
    # What the head itself probes (readiness, the smoke completion, drift's health check): the bound address, or
    # loopback when the engine binds every address. No /v1 suffix: /health sits at the root.
    probe_url: str
    start_marker: str
    tensor_parallel: int
    pipeline_parallel: int
    max_model_len: int
    max_num_seqs: int
    api_key_env: str | None
    verify_transport: bool
    health_timeout_s: int
    argv: list[str]
    # The API front answers on host:port (so base_url and probe_url reach it, and readiness covers it), the engine
    # behind it on loopback.
    front: Front | None
    non_carry_over_env: list[str]


class EngineContext(TypedDict):
    """`hy3spark.engine`: what the roles need to know of the engine without knowing which it is."""
    name: str
    launcher: str
    process: dict[str, str]
    log_lines: dict[str, str]


class Mpi(TypedDict):
    """`hy3spark.mpi`: the mpi launcher's facts (None under any other launcher)."""
    port: int  # the sshd in every node's container
    hosts: list[str]  # the hostfile's addresses, in node order: fabric addresses only
    hostfile: str  # on the node
    container_hostfile: str  # where the container has it (OMPI_MCA_orte_default_hostfile)
    dir: str  # the launcher's SSH files on the node (0700), mounted into the container with /etc/hy3spark
    sshd_config: str
    ssh_config: str  # mpirun's, on the head
    host_key: str
    client_key: str  # on the head only
    known_hosts: str  # on the head only
    authorized_keys: str


class Ray(TypedDict):
    port: int
    version: str | None
    dashboard: str
    auth: str  # token (the cluster's token in token_file) or off
    token_file: str
    metrics: bool  # ray.metrics: the metrics export server on, and Ray's Prometheus servers as Ray binds them
    # Where roles/ray_node puts, with metrics off, the sitecustomize that binds Ray's Prometheus servers to loopback
    # (the Ray container's command puts it first on PYTHONPATH); with metrics on it removes it.
    python_dir: str
    address: str | None  # None with no fabric (the native launcher on one machine starts no Ray)


class Firewall(TypedDict):
    """`hy3spark.firewall`: hy3spark's nftables table on every node (roles/firewall), from the ports of each node."""
    enabled: bool
    table: str  # `inet <table>`: the only table the role writes, replaces or deletes
    api_allow: list[str]  # CIDRs that may reach the clients' ports; 0.0.0.0/0 and ::/0 mean any
    remove_on_teardown: bool
    interface: str | None  # the fabric interface; None with no fabric (one machine: nothing crosses a cable)
    peers: list[str]  # every node's fabric address: the only sources of the cluster-internal ports


class Restarts(TypedDict):
    """`hy3spark.restarts`: the boot units and the engine's supervisor (docs/restarts.md)."""
    enabled: bool
    # enabled, and the launcher has a readiness gate: the head runs the supervisor. Else only the boot units.
    supervised: bool
    max_failed_starts: int
    window_s: int
    node_unit: str  # on every node: its container at boot, after the fabric address and Docker
    supervisor_unit: str  # on the head
    unit_dir: str
    lib_dir: str  # the supervisor, engine.py and the launcher's gate, on the head's host
    config: str  # the supervisor's config (templates/supervisor.json.j2)
    state_file: str  # what it did last; `hy3spark status` reads it
    # What the gate requires free on every node before a start: the plan's per-rank request on GPU nodes, 0 where
    # the GPU is a double (container.gpus false).
    need_bytes: int
    backoff_s: list[int]


class Earlyoom(TypedDict):
    policy: str
    args: str


class Plan(TypedDict):
    requested_bytes: int
    kv_cache_tokens: int | None
    max_concurrency: float | None
    kv_cache_size_line: str | None
    max_concurrency_line: str | None
    overhead_source: str
    errors: list[str]
    warnings: list[str]


class Group(TypedDict):
    """`hy3spark` in group_vars/all: what every node shares."""
    version: str
    managed: str
    cluster: str
    profile: str | None
    spec_sha256: str
    spec_path: str | None
    paths: Paths
    head: str
    workers: list[str]
    node_order: list[str]
    node_count: int
    gpu_count: int
    fabric: Fabric | None  # None: one machine with no cabled port (the two-card desktop)
    image: Image
    model: Model
    serving: Serving
    engine: EngineContext
    # The engine's secrets: the variable the engine reads on the head -> the NAME of the variable that holds it
    # on the controller (or in the CLI's secrets file; the hy3spark_secret lookup reads it). Only set ones appear.
    secrets: dict[str, str]
    # The engine's own options file's content (hy3spark.paths.engine_options), for an engine that reads one.
    engine_options: dict[str, Any] | None
    mpi: Mpi | None
    ray: Ray
    firewall: Firewall
    restarts: Restarts
    earlyoom: Earlyoom
    plan: Plan
    pi_models: dict[str, Any]
    pi_settings: dict[str, Any]


class Container(TypedDict):
    name: str
    role: str
    image: str
    command: list[str]
    network_mode: str
    ipc_mode: str
    shm_size: str | None
    gpus: bool
    ulimits: list[str]
    volumes: list[str]
    env_file: str
    optional_devices: list[str]
    labels: dict[str, str]
    restart_policy: str
    # Docker's init (tini) as PID 1: it reaps what the command leaves behind (a tee after the engine dies), which
    # `ray start --block`, sshd or `sleep infinity` as PID 1 would leave as zombies.
    init: bool


class NodeContext(TypedDict):
    """`hy3spark_node` in host_vars/<node>: what differs per node."""
    name: str
    role: str
    index: int
    fabric_ip: str | None
    fabric_cidr: str | None
    gpus: int
    mgmt_ip: str | None
    ssh_host: str
    ssh_user: str
    env: dict[str, str]
    container: Container
    # The container as `docker run` words (templates/docker-run.sh.j2 quotes each one).
    docker_run: list[str]
    # What the engine runs on this node (serve.sh execs it): the head's command, a native launcher's headless
    # command on the other nodes, nothing on a Ray worker (Ray places its ranks).
    serve_argv: list[str]
    # Every port hy3spark's processes listen on here, where each binds and who may reach it (hy3spark/ports.py).
    ports: list[PortEntry]


class Context(TypedDict):
    hy3spark: Group
    nodes: dict[str, NodeContext]


def node_env(spec: Spec, engine: Engine, node: Node) -> dict[str, str]:
    """The per-node env file: the settings every engine shares, laid out by the engine around its own."""
    common: dict[str, str] = {}
    if spec.fabric is not None and spec.head.fabric_ip is not None:
        iface = spec.fabric.interfaces[0]
        common = {
            "MASTER_ADDR": str(spec.head.fabric_ip.ip),
            "NCCL_SOCKET_IFNAME": iface,
            "GLOO_SOCKET_IFNAME": iface,
            "TP_SOCKET_IFNAME": iface,
            "UCX_NET_DEVICES": iface,
            "OMPI_MCA_btl_tcp_if_include": iface,
            "NCCL_IB_DISABLE": "0",
        }
    # With no fabric (one machine) nothing names an interface: the ranks meet over loopback and the PCIe link.
    common.update({
        "RAY_memory_monitor_refresh_ms": "0",
        "HF_HUB_CACHE": spec.model.cache_dir,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    })
    env = engine.node_env(node, common)
    if spec.fabric is not None and spec.fabric.hcas:
        # "=" makes NCCL match the names exactly; both twins of the cabled port give full bandwidth.
        env["NCCL_IB_HCA"] = "=" + ",".join(spec.fabric.hcas)
    if spec.verify_transport:
        env["NCCL_DEBUG"] = "INFO"
        env["NCCL_DEBUG_SUBSYS"] = "INIT,NET,GRAPH,ENV"
        if spec.serving.launcher != "mpi":  # no Ray runs under mpi; mpirun forwards every rank's lines as they are
            # Ray folds lines that differ only in words with digits ("[repeated 2x across cluster]"): the other
            # ranks' NCCL lines, host and transport included, would never reach the serve log the transport gate
            # reads.
            env["RAY_DEDUP_LOGS"] = "0"
    if spec.serving.launcher == "ray":
        env.update(ray_env(spec))
    env.update(spec.container.env)
    return env


def ray_env(spec: Spec) -> dict[str, str]:
    """Ray's own guards, for every Ray process in the node's container (ray start and all it starts, `ray status`,
    the engine's driver): the token file (never the token: this file is copied into `docker inspect`), metrics off
    unless asked for, and the two metrics servers Ray ports only take from the environment."""
    env = {"DASHBOARD_METRIC_PORT": str(spec.ray.dashboard_metrics_port),
           "AUTOSCALER_METRIC_PORT": str(spec.ray.autoscaler_metrics_port)}
    if not spec.ray.metrics:
        env["RAY_enable_metrics_collection"] = "0"
    if spec.ray.auth == "token":
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": RAY_TOKEN}
    else:
        env["RAY_AUTH_MODE"] = "disabled"
    return env


def _ip(node: Node) -> str:
    """A node's fabric address, where the rules require one (Ray, several nodes: _check_fabric_presence)."""
    if node.fabric_ip is None:
        raise ValueError(f"{node.name} has no fabric_ip")
    return str(node.fabric_ip.ip)


def _ray_argv(spec: Spec, node: Node, head: bool) -> list[str]:
    ray = spec.ray
    argv = ["ray", "start"]
    if head:
        argv += ["--head", "--port", str(ray.port), "--ray-client-server-port", str(ray.client_server_port)]
        if ray.dashboard == "off":
            argv += ["--include-dashboard=false"]
        else:
            argv += ["--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--dashboard-port",
                     str(ray.dashboard_port)]
    else:
        argv += ["--address", f"{_ip(spec.head)}:{ray.port}"]
    argv += [
        "--node-ip-address", _ip(node),
        "--num-gpus", str(node.gpus),
        "--node-manager-port", str(ray.node_manager_port),
        "--object-manager-port", str(ray.object_manager_port),
        "--min-worker-port", str(ray.min_worker_port),
        "--max-worker-port", str(ray.max_worker_port),
        "--dashboard-agent-listen-port", str(ray.dashboard_agent_listen_port),
        "--dashboard-agent-grpc-port", str(ray.dashboard_agent_grpc_port),
        "--runtime-env-agent-port", str(ray.runtime_env_agent_port),
        "--metrics-export-port", str(ray.metrics_export_port),
        "--disable-usage-stats",
    ]
    if ray.object_store_memory_bytes:
        argv += ["--object-store-memory", str(ray.object_store_memory_bytes)]
    return [*([] if ray.metrics else RAY_PYTHONPATH_ARGV), *argv, "--block"]


# The native launcher's node container holds the engine's namespace (host network and IPC, GPUs, mounts) until the
# serving role execs the engine in it, as the Ray container does with Ray; it runs nothing else.
HOLD_ARGV = ["sleep", "infinity"]


def _mpi_argv(port: int) -> list[str]:
    """The mpi launcher's node container: its sshd in the foreground on the MPI port (mpirun's way into the node),
    which holds the container as `sleep infinity` does the native launcher's. sshd refuses to start without its
    privilege separation directory, which the image does not have."""
    return ["/bin/sh", "-c", f"mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e -p {port} -f {MPI_SSHD_CONFIG}"]


def _command(spec: Spec, node: Node, head: bool) -> list[str]:
    launcher = spec.serving.launcher
    if launcher == "ray":
        return _ray_argv(spec, node, head)
    if launcher == "mpi":
        return _mpi_argv(spec.serving.mpi_port)
    return list(HOLD_ARGV)


def _container_for(spec: Spec, node: Node, head: bool) -> Container:
    """A node container described as data: under Ray it runs the node's Ray (the ray_head/ray_worker roles), under
    the native launcher it holds the node for the engine."""
    role = "head" if head else "worker"
    mounts = [
        f"{spec.model.cache_dir}:{spec.model.cache_dir}",
        f"{CONFIG_DIR}:{CONFIG_DIR}:ro",
        f"{LOG_DIR}:{LOG_DIR}",
    ]
    if spec.serving.launcher == "mpi":
        mounts.append(f"{MPI_HOSTFILE}:{MPI_CONTAINER_HOSTFILE}:ro")
    return {
        "name": f"{spec.container.name_prefix}-{role}",
        "role": role,
        "image": spec.image.ref,
        "command": _command(spec, node, head),
        "network_mode": "host",
        "ipc_mode": "host",
        "shm_size": spec.container.shm_size,
        "gpus": spec.container.gpus,
        "ulimits": ["memlock:-1:-1", "stack:67108864:67108864"],
        "volumes": mounts,
        # Non-secret settings only: docker copies an env file into `docker inspect`. Secrets live in a separate
        # 0600 file outside every mount (SECRETS_DIR) that only the serve script reads, from its stdin.
        "env_file": f"{CONFIG_DIR}/node.env",
        "optional_devices": ["/dev/infiniband"],
        "labels": {"io.hy3spark.cluster": spec.name, "io.hy3spark.role": role},
        "restart_policy": "no",
        "init": True,
    }


def docker_run_argv(container: Container) -> list[str]:
    """The `docker run` equivalent of a container definition, for people who think in docker run."""
    args = ["docker", "run", "-d", "--name", container["name"], "--network", container["network_mode"],
            "--ipc", container["ipc_mode"]]
    if container["init"]:
        args.append("--init")
    if container["gpus"]:
        args += ["--gpus", "all"]
    if container["shm_size"]:
        args += ["--shm-size", container["shm_size"]]
    for ulimit in container["ulimits"]:
        name, soft, hard = ulimit.split(":")
        args += ["--ulimit", f"{name}={soft}" if soft == hard else f"{name}={soft}:{hard}"]
    for dev in container["optional_devices"]:
        args += ["--device", dev]
    args += ["--env-file", container["env_file"]]
    for vol in container["volumes"]:
        args += ["-v", vol]
    for key, value in container["labels"].items():
        args += ["--label", f"{key}={value}"]
    return [*args, container["image"], *container["command"]]


def _pi_models(spec: Spec, base_url: str) -> dict[str, Any]:
    pi = spec.pi
    model: dict[str, Any] = {
        "id": spec.serving.served_name,
        "name": pi.model_label,
        "reasoning": pi.reasoning,
        "input": ["text"],
        "contextWindow": spec.serving.max_model_len,
        "maxTokens": pi.max_tokens,
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
    }
    compat: dict[str, Any] = {}
    if pi.thinking_level_map:
        compat["thinkingLevelMap"] = pi.thinking_level_map
    if pi.reasoning_kwarg:
        compat["chatTemplateKwargs"] = {pi.reasoning_kwarg: "{thinkingLevel}"}
    if compat:
        model["compat"] = compat
    return {
        "providers": {
            pi.provider: {
                "name": pi.provider_name,
                "baseUrl": base_url,
                "api": "openai-completions",
                # Pi resolves an env var NAME here; the key itself never lands in this file.
                "apiKey": spec.serving.api_key_env or "none",
                "models": [model],
            }
        }
    }


def _endpoint(spec: Spec, when_unbound: str) -> str:
    """http://HOST:PORT of the engine: its bound address, or `when_unbound` when it binds every address."""
    host = when_unbound if spec.serving.host.is_unspecified else str(spec.serving.host)
    return f"http://{host}:{spec.serving.port}"


def client_url(spec: Spec) -> str:
    """The OpenAI base URL clients use: the bound address, or the head's fabric address when it binds them all
    (with no fabric: the head's mgmt_ip or ssh_host, else loopback: the desktop the client runs on)."""
    head = spec.head
    if head.fabric_ip is not None:
        reach = str(head.fabric_ip.ip)
    else:
        reach = str(head.mgmt_ip) if head.mgmt_ip else head.ssh_host or "127.0.0.1"
    return _endpoint(spec, reach) + "/v1"


def probe_url(spec: Spec) -> str:
    """The engine's root URL as the head itself reaches it: the bound address, or loopback when it binds them all."""
    return _endpoint(spec, "127.0.0.1")


def build_context(loaded: Loaded) -> Context:
    """Everything group-wide (`hy3spark`) and per node (`nodes[name]` -> host var `hy3spark_node`)."""
    spec = loaded.spec
    engine = engine_for(spec)
    head_ip = str(spec.head.fabric_ip.ip) if spec.head.fabric_ip else None
    base_url = client_url(spec)
    nodes: dict[str, NodeContext] = {}
    for i, node in enumerate(spec.nodes):
        head = i == 0
        container = _container_for(spec, node, head)
        nodes[node.name] = {
            "name": node.name,
            "role": "head" if head else "worker",
            "index": i,
            "fabric_ip": str(node.fabric_ip.ip) if node.fabric_ip else None,
            "fabric_cidr": str(node.fabric_ip) if node.fabric_ip else None,
            "gpus": node.gpus,
            "mgmt_ip": str(node.mgmt_ip) if node.mgmt_ip else None,
            "ssh_host": node.connect_host,
            "ssh_user": node.ssh_user,
            "env": node_env(spec, engine, node),
            "container": container,
            "docker_run": docker_run_argv(container),
            "serve_argv": engine.node_argv(i),
            "ports": port_table(spec, node, head),
        }
    serve_argv = engine.serve_argv()
    plan = plan_summary(loaded)
    group = {
        "version": __version__,
        "managed": MANAGED,
        "cluster": spec.name,
        "profile": spec.profile,
        "spec_sha256": loaded.sha256,
        # preflight re-hashes this file on the controller: an inventory rendered from an older spec is stale.
        "spec_path": loaded.path,
        "paths": {
            "config_dir": CONFIG_DIR,
            "log_dir": LOG_DIR,
            "state_dir": STATE_DIR,
            "node_env": f"{CONFIG_DIR}/node.env",
            "secrets_dir": SECRETS_DIR,
            "secrets_env": f"{SECRETS_DIR}/secrets.env",
            "serve_script": f"{CONFIG_DIR}/serve.sh",
            "serve_log": SERVE_LOG,
            "vllm_config_root": VLLM_CONFIG_ROOT,
            "engine_options": ENGINE_OPTIONS,
            "api_front": API_FRONT,
        },
        "head": spec.head.name,
        "workers": [w.name for w in spec.workers],
        "node_order": [n.name for n in spec.nodes],
        "node_count": len(spec.nodes),
        "gpu_count": spec.gpu_count,
        "fabric": _fabric(spec),
        "image": {
            "ref": spec.image.ref,
            "digest": spec.image.digest,
            "worker_source": spec.image.worker_source,
        },
        "model": {
            "repo": spec.model.repo,
            "revision": spec.model.revision,
            "cache_dir": spec.model.cache_dir,
            "repo_dir": spec.model.repo_dir,
            "size_bytes": spec.model.size_bytes,
            "token_env": spec.model.token_env,
        },
        "serving": {
            "engine": spec.serving.engine,
            "served_name": spec.serving.served_name,
            "host": str(spec.serving.host),
            "port": spec.serving.port,
            "base_url": base_url,
            "probe_url": probe_url(spec),
            "start_marker": ENGINE_START,
            "tensor_parallel": spec.serving.tensor_parallel,
            "pipeline_parallel": spec.serving.pipeline_parallel,
            "max_model_len": spec.serving.max_model_len,
            "max_num_seqs": spec.serving.max_num_seqs,
            "api_key_env": spec.serving.api_key_env,
            "verify_transport": spec.verify_transport,
            "health_timeout_s": spec.serving.health_timeout_s,
            "argv": serve_argv,
            "front": engine_front(engine),
            # Workers keep their own NCCL/UCX/GLOO settings: vLLM's Ray executor would copy the head's otherwise.
            # The secrets the serve script exports stay on the head too: vLLM copies VLLM_* and HF_TOKEN into the
            # workers' Ray runtime env, which Ray keeps in its GCS and shows in its dashboard.
            "non_carry_over_env": sorted({k for k in nodes[spec.head.name]["env"] if _per_node_env(k)} | SECRET_NAMES),
        },
        "engine": {
            "name": engine.name,
            "launcher": engine.launcher,
            "process": engine.process(),
            "log_lines": engine.log_lines(),
        },
        "secrets": engine.secret_env(),
        "engine_options": engine_options(engine),
        "mpi": _mpi(spec),
        "ray": {
            "port": spec.ray.port,
            "version": spec.ray.version,
            "dashboard": spec.ray.dashboard,
            "address": f"{head_ip}:{spec.ray.port}" if head_ip else None,
            "auth": spec.ray.auth,
            "token_file": RAY_TOKEN,
            "metrics": spec.ray.metrics,
            "python_dir": RAY_PYTHON_DIR,
        },
        "firewall": {
            "enabled": spec.firewall.enabled,
            "table": "hy3spark",
            "api_allow": list(spec.firewall.api_allow),
            "remove_on_teardown": spec.firewall.remove_on_teardown,
            "interface": spec.fabric.interfaces[0] if spec.fabric is not None else None,
            "peers": [str(n.fabric_ip.ip) for n in spec.nodes if n.fabric_ip is not None],
        },
        "restarts": {
            "enabled": spec.restarts.enabled,
            "supervised": spec.restarts.enabled and spec.serving.launcher in SUPERVISED_LAUNCHERS,
            "max_failed_starts": spec.restarts.max_failed_starts,
            "window_s": spec.restarts.window_minutes * 60,
            "node_unit": NODE_UNIT,
            "supervisor_unit": SUPERVISOR_UNIT,
            "unit_dir": UNIT_DIR,
            "lib_dir": LIB_DIR,
            "config": SUPERVISOR_CONFIG,
            "state_file": SUPERVISOR_STATE,
            "need_bytes": plan["requested_bytes"] if spec.container.gpus else 0,
            "backoff_s": list(RESTART_BACKOFF_S),
        },
        "earlyoom": {
            "policy": spec.earlyoom.policy,
            "args": earlyoom_args(spec),
        },
        # The capacity planner's verdict, for vllm_serve's pre-launch gate and the run record's comparison.
        "plan": plan,
        "pi_models": _pi_models(spec, base_url),
        "pi_settings": {
            "defaultProvider": spec.pi.provider,
            "defaultModel": spec.serving.served_name,
            "defaultThinkingLevel": "high" if spec.pi.reasoning else "off",
        },
    }
    return {"hy3spark": group, "nodes": nodes}


def _mpi(spec: Spec) -> Mpi | None:
    if spec.serving.launcher != "mpi":
        return None
    return {
        "port": spec.serving.mpi_port,
        "hosts": mpi_hosts(spec),
        "hostfile": MPI_HOSTFILE,
        "container_hostfile": MPI_CONTAINER_HOSTFILE,
        "dir": MPI_DIR,
        "sshd_config": MPI_SSHD_CONFIG,
        "ssh_config": MPI_SSH_CONFIG,
        "host_key": MPI_HOST_KEY,
        "client_key": MPI_CLIENT_KEY,
        "known_hosts": MPI_KNOWN_HOSTS,
        "authorized_keys": MPI_AUTHORIZED_KEYS,
    }


def _fabric(spec: Spec) -> Fabric | None:
    if spec.fabric is None or spec.head.fabric_ip is None:
        return None
    return {
        "interfaces": list(spec.fabric.interfaces),
        "interface": spec.fabric.interfaces[0],
        "hcas": list(spec.fabric.hcas),
        "mtu": spec.fabric.mtu,
        "prefix": spec.head.fabric_ip.network.prefixlen,
        "subnet": str(spec.head.fabric_ip.network),
        "head_ip": str(spec.head.fabric_ip.ip),
    }


def plan_summary(loaded: Loaded) -> Plan:
    from hy3spark import planning

    if not planning.plannable(loaded.spec):
        return {"requested_bytes": 0, "kv_cache_tokens": None, "max_concurrency": None, "kv_cache_size_line": None,
                "max_concurrency_line": None, "overhead_source": "not planned", "errors": [],
                "warnings": [planning.not_planned(loaded.spec)]}
    overhead = planning.overhead_for(loaded, None, None)
    plan = planning.plan_for(loaded, overhead)
    return {
        "requested_bytes": max(r.requested_bytes or 0 for r in plan.rows),
        "kv_cache_tokens": plan.kv_cache_tokens,
        "max_concurrency": round(plan.max_concurrency, 2),
        "kv_cache_size_line": plan.kv_cache_size_line,
        "max_concurrency_line": plan.max_concurrency_line,
        "overhead_source": overhead.source,
        "errors": [p.message for p in plan.problems if p.severity == "error"],
        "warnings": [p.message for p in plan.problems if p.severity == "warning"],
    }


def _per_node_env(name: str) -> bool:
    return name.startswith(("NCCL_", "GLOO_", "UCX_", "TP_", "OMPI_")) or name in {"VLLM_HOST_IP"}


def earlyoom_args(spec: Spec) -> str:
    """EARLYOOM_ARGS for the protect policy: inference processes are avoided, never preferred."""
    eo = spec.earlyoom
    # No spaces inside a pattern: systemd splits $EARLYOOM_ARGS at whitespace (it does drop quotes, but unquoted
    # patterns need no quoting rules at all).
    # --avoid matches by prefix: engines retitle their processes (vLLM's VLLM::EngineCore, Ray's ray::IDLE and
    # ray::RayWorkerWrapper), and earlyoom sees that title, cut to 15 characters. --prefer stays exact.
    avoid = "^(" + "|".join(eo.avoid) + ")"
    prefer = "^(" + "|".join(eo.prefer) + ")$"
    return f"-r 3600 -m {eo.mem_percent} -s {eo.swap_percent} --avoid {avoid} --prefer {prefer}"


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False) + "\n"
