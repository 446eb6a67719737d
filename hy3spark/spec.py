"""The cluster spec: one YAML file, merged over a profile, validated before anything runs.

A spec names a profile (`profile: hy3-295b-nvfp4-tp2`) and overrides only what differs. Errors name the field
path and, when the field is in the user's file, its line: `cluster.yml:14: workers[0].fabric_ip: ...`.
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from hy3spark import grammars, strict_yaml
from hy3spark.errors import SpecError

DEFAULT_SPEC_NAME = "default-cluster.yml"
# Shapes of real credentials, anywhere in a value (`--api_key=sk-...`, `Bearer hf_...`): Hugging Face and
# OpenAI-style tokens, GitHub, GitLab, Slack, NVIDIA API keys and AWS access key ids.
_SECRET_SHAPE = re.compile(r"(?<![A-Za-z0-9])(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{16,}|ghp_[A-Za-z0-9]{30,}|"
                           r"github_pat_[A-Za-z0-9_]{30,}|glpat-[A-Za-z0-9_-]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}|"
                           r"nvapi-[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16})")
# Keys people reach for when they paste a secret into YAML (a field, or a container.env variable such as
# VLLM_API_KEY or HF_HUB_TOKEN); extra="forbid" would reject a field anyway, but not say where the secret belongs.
_SECRET_KEY = re.compile(r"(?:.*[_-])?(?:token|api[_-]?key|apikey|password|passwd|secret|secret[_-]access[_-]key|"
                         r"private[_-]key|credentials?)", re.IGNORECASE)
# RDMA device names as ibdev2netdev prints them (rocep1s0f1, roceP2p1s0f1, mlx5_0): not socket interfaces.
_RDMA_NAME = re.compile(r"^(roce[pP]\w*|mlx\d+_\d+|ibp\w+)$")
_SHA = re.compile(r"^[0-9a-f]{40}$")


class SpecModel(BaseModel):
    # strict: no coercion, so `gpus: yes` and `port: "8888"` are refused rather than read as 1 and 8888. Addresses
    # are the exception (Lax below): YAML gives them as strings.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


Lax = Field(strict=False)


def _address_text(value: Any) -> Any:
    # Lax would also take a YAML boolean or integer as an address (`mgmt_ip: yes` is 0.0.0.1, `host: off` 0.0.0.0).
    if not isinstance(value, str):
        raise ValueError("must be an address written as text, such as 10.0.0.1")
    return value


Address = Annotated[ipaddress.IPv4Address, Lax, BeforeValidator(_address_text)]
# Upper bounds on counts and sizes: a value past them is a typo, and an int too big for a float crashes the planner.
_COUNT = 2**31 - 1
_BYTES = 2**60
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def _not_bool(value: Any) -> Any:
    # Literal[1, 2, 4] would take True as 1 even in strict mode.
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


def _fabric_address(value: Any) -> Any:
    if not isinstance(value, str):
        raise ValueError("must be an address with prefix written as text, such as 10.0.0.1/24")
    if ":" in value:
        raise ValueError("IPv6 fabric addresses are refused on purpose: the Ray, NCCL and vLLM settings hy3spark "
                         "renders are IPv4 only; give the port a private IPv4 address such as 10.0.0.1/24")
    return value


def _one_line(value: str) -> str:
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError("holds a newline or another control character; each argument is one line")
    return value


_CONFIG_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}")


def _json_value(value: Any, path: str = "") -> Any:
    """A JSON value made of strings, finite numbers, booleans, null, lists and mappings with string keys: what
    json.dumps turns into the --speculative-config argument unchanged."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"key {key!r}{path and ' in ' + path} must be a string")
            if not _CONFIG_KEY.fullmatch(key):
                raise ValueError(f"key {key!r}{path and ' in ' + path} is not a config field name (letters, digits, "
                                 "'_', '.', '-')")
            _json_value(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _json_value(item, f"{path}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path or 'the value'} is not a finite number")
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise ValueError(f"{path or 'the value'} is a {type(value).__name__}; only JSON values (strings, numbers, "
                         "booleans, null, lists, mappings) can be passed to the engine")
    return value


NodeName = Annotated[str, AfterValidator(grammars.node_name)]
Netdev = Annotated[str, AfterValidator(grammars.netdev)]
Ident = Annotated[str, AfterValidator(grammars.ident)]
Text = Annotated[str, AfterValidator(grammars.text)]
EarlyoomPattern = Annotated[str, AfterValidator(grammars.earlyoom_pattern)]


class Node(SpecModel):
    """One DGX Spark."""

    name: NodeName
    fabric_ip: Annotated[ipaddress.IPv4Interface, Lax, BeforeValidator(_fabric_address)] | None = Field(
        default=None, description="this node's OWN fabric address with prefix, 10.0.0.1/24; required with a fabric")
    ssh_host: Annotated[str, AfterValidator(grammars.ssh_host)] | None = Field(
        default=None, description="address Ansible connects to; default mgmt_ip, else fabric")
    ssh_user: Annotated[str, AfterValidator(grammars.posix_user)] = "ubuntu"
    mgmt_ip: Address | None = None
    gpus: Annotated[int, Field(ge=1, le=8)] = 1

    @property
    def connect_host(self) -> str:
        if self.ssh_host:
            return self.ssh_host
        if self.mgmt_ip:
            return str(self.mgmt_ip)
        if self.fabric_ip:
            return str(self.fabric_ip.ip)
        # A node with no address at all is the machine the controller runs on (the desktop): reached on loopback,
        # or with ansible_connection=local that the operator passes at run time (README, "The desktop").
        return "127.0.0.1"


class Fabric(SpecModel):
    """The cabled port between the nodes."""

    interfaces: Annotated[list[Netdev], Field(min_length=1)] = Field(
        description="netdevs of the cabled port; the address goes on the first"
    )
    hcas: list[Netdev] = Field(default_factory=list, description="RoCE HCAs of that port: both twins")
    mtu: Annotated[int, Field(ge=576, le=9216)] = 9000

    @field_validator("interfaces", "hcas")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("lists a device twice")
        return value


class Image(SpecModel):
    ref: Annotated[str, AfterValidator(grammars.image_ref)] = Field(
        description="name:tag of the engine image"
    )
    digest: Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")] | None = None
    worker_source: Literal["stream", "pull"] = Field(
        default="stream", description="stream: docker save | ssh worker docker load over the fabric; pull: registry"
    )


class ModelArch(SpecModel):
    """config.json numbers the capacity planner needs."""

    num_hidden_layers: Annotated[int, Field(ge=1, le=_COUNT)]
    num_key_value_heads: Annotated[int, Field(ge=1, le=_COUNT)]
    head_dim: Annotated[int, Field(ge=1, le=_COUNT)]
    num_attention_heads: Annotated[int, Field(ge=1, le=_COUNT)] | None = None
    mtp_layers: Annotated[int, Field(ge=0, le=_COUNT)] = 0
    sliding_window: Annotated[int, Field(ge=1, le=_COUNT)] | None = None
    sliding_window_layers: Annotated[int, Field(ge=0, le=_COUNT)] = 0
    max_context: Annotated[int, Field(ge=1, le=_COUNT)]
    dtype_bytes: Annotated[Literal[1, 2, 4], BeforeValidator(_not_bool)] = 2


class Model(SpecModel):
    repo: Annotated[str, AfterValidator(grammars.hf_repo)]
    revision: Annotated[str, Field(min_length=1), AfterValidator(grammars.git_revision)] = Field(
        description="40-character commit sha (or a tag)")
    cache_dir: Annotated[str, AfterValidator(grammars.abs_path)] = Field(
        description="Hugging Face hub cache on every node (HF_HUB_CACHE), same path everywhere")
    size_bytes: Annotated[int, Field(ge=1, le=_BYTES)]
    token_env: str | None = Field(default="HF_TOKEN", description="NAME of the env var holding the HF token")
    arch: ModelArch

    @property
    def repo_dir(self) -> str:
        org, name = self.repo.split("/", 1)
        return f"{self.cache_dir}/models--{org}--{name}"


# vLLM's internal listeners take VLLM_PORT and the ports above it (vllm/utils/network_utils.py: get_open_port scans
# upward from VLLM_PORT): the store first, then the broadcast queue; the rest is room for a port another process holds.
DEFAULT_VLLM_INTERNAL_PORT = 29510
VLLM_INTERNAL_PORTS = 8


class ServingBase(SpecModel):
    """What every engine serves with: the endpoint, the parallelism, the context, the key. An engine's own section
    (VllmServing, ...) adds its flags; `serving.engine` chooses the section, and its fields are checked there."""

    served_name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}$")]
    host: Address = ipaddress.IPv4Address("0.0.0.0")
    port: Annotated[int, Field(ge=1, le=65535)] = 8888
    tensor_parallel: Annotated[int, Field(ge=1, le=_COUNT)]
    pipeline_parallel: Annotated[int, Field(ge=1, le=_COUNT)] = 1
    max_model_len: Annotated[int, Field(ge=16, le=_COUNT)]
    max_num_seqs: Annotated[int, Field(ge=1, le=_COUNT)]
    api_key_env: str | None = Field(default=None, description="NAME of the env var holding the API key")
    open_endpoint: bool = Field(default=False, description="serve without an API key on a non-loopback address")
    verify_transport: bool | None = Field(default=None, description="NCCL transport gate; default on multi-node")
    health_timeout_s: Annotated[int, Field(ge=10, le=_COUNT)] = 1800


class VllmServing(ServingBase):
    """`vllm serve`, its ranks placed by Ray or by vLLM itself (hy3spark/engines/vllm.py)."""

    engine: Literal["vllm"] = Field(default="vllm", description="inference engine (see docs/engines.md)")
    launcher: Literal["ray", "native"] = Field(
        default="ray", description="ray: a Ray container on every node places the ranks (the recipe's way); native: "
                                   "vLLM's own executor, no Ray (one node: its mp executor; several: --nnodes, "
                                   "--node-rank, --master-addr, --headless on the other nodes)")
    master_port: Annotated[int, Field(ge=1024, le=65535)] | None = Field(
        default=None, description="native on several nodes: the head's rendezvous port (default 29501)")
    internal_port: Annotated[int, Field(ge=1024, le=65536 - VLLM_INTERNAL_PORTS)] = Field(
        default=DEFAULT_VLLM_INTERNAL_PORT,
        description=f"VLLM_PORT on every node: the first of vLLM's internal ports (its torch.distributed store, bound "
                    f"to all addresses, and its cross-node broadcast queue, on the fabric address). vLLM takes the "
                    f"first free port from here upward; hy3spark reserves and fences this one and the next "
                    f"{VLLM_INTERNAL_PORTS - 1} (the cluster's fabric addresses only)")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"] = "auto"
    gpu_memory_utilization: Annotated[FiniteFloat, Field(gt=0, le=1)] = 0.9
    speculative_config: Annotated[dict[str, Any], AfterValidator(_json_value)] | None = None
    tool_call_parser: Ident | None = None
    reasoning_parser: Ident | None = None
    enable_auto_tool_choice: bool = False
    trust_remote_code: bool = False
    enforce_eager: bool = False
    # Always rendered: vLLM's default depends on what NVML says of the GPU's memory (8192, or 2048 when the query
    # fails, as GB10's is reported to), which changes the KV-cache lines of sliding-window models.
    max_num_batched_tokens: Annotated[int, Field(ge=16, le=_COUNT)] = Field(
        default=8192, description="tokens per scheduler step (chunked prefill); rendered explicitly")
    # Checked against vLLM's real option table by a rule (_check_extra_args): the engine knows its flags.
    extra_args: list[Annotated[str, AfterValidator(_one_line)]] = Field(default_factory=list)
    overhead_gib: Annotated[FiniteFloat, Field(ge=0, le=1024)] = Field(
        default=3.0, description="activation + non-torch memory per rank (planner); calibrate from a real log"
    )


class TrtllmKvCache(SpecModel):
    """TensorRT-LLM's kv_cache_config (the extra LLM API options file): the keys a Spark deployment sets."""

    dtype: Literal["auto", "fp8"] = "auto"
    free_gpu_memory_fraction: Annotated[FiniteFloat, Field(gt=0, le=1)] = Field(
        default=0.9, description="share of the memory left after the weights that the KV cache takes")
    enable_block_reuse: bool | None = None
    max_tokens: Annotated[int, Field(ge=1, le=_COUNT)] | None = None


class TrtllmCudaGraph(SpecModel):
    """TensorRT-LLM's cuda_graph_config; `cuda_graph_config: null` turns CUDA graphs off."""

    enable_padding: bool = True
    max_batch_size: Annotated[int, Field(ge=1, le=_COUNT)] | None = None
    batch_sizes: list[Annotated[int, Field(ge=1, le=_COUNT)]] | None = None


DEFAULT_MPI_PORT = 2233  # the sshd inside every node's container that mpirun reaches (NVIDIA's two-Spark playbook)


class TrtllmServing(ServingBase):
    """`trtllm-serve` under `mpirun` (hy3spark/engines/trtllm.py). The shared fields keep their names and are
    rendered as trtllm-serve's flags: tensor_parallel is --tp_size, pipeline_parallel --pp_size, max_num_seqs
    --max_batch_size, max_model_len --max_seq_len."""

    engine: Literal["trtllm"] = Field(description="inference engine (see docs/engines.md)")
    # trtllm-serve has no served-name flag: it reports the model under the name it was given, the repo id.
    served_name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,127}$")] = Field(
        description="the name clients use: model.repo, as trtllm-serve reports it (filled in when omitted)")
    launcher: Literal["mpi"] = Field(
        default="mpi", description="mpi: one container per node with an sshd on mpi_port; the head's mpirun starts "
                                   "one rank per node over the hostfile of fabric addresses")
    mpi_port: Annotated[int, Field(ge=1, le=65535)] = Field(
        default=DEFAULT_MPI_PORT, description="the port of the sshd in every node's container that mpirun reaches")
    # trtllm-serve checks no API key (NVIDIA/TensorRT-LLM#9950): with serving.api_key_env set, hy3spark's API front
    # answers on serving.port and checks the key, and trtllm-serve listens on 127.0.0.1 on this port behind it.
    engine_port: Annotated[int, Field(ge=1024, le=65535)] | None = Field(
        default=None, description="with serving.api_key_env: trtllm-serve's own port on 127.0.0.1, behind the API "
                                  "front on serving.port (default serving.port + 1)")
    backend: Literal["pytorch"] = "pytorch"
    max_num_tokens: Annotated[int, Field(ge=16, le=_COUNT)] = Field(
        default=8192, description="batched input tokens per scheduler step (--max_num_tokens)")
    # The extra LLM API options file (--extra_llm_api_options): its keys override trtllm-serve's flags, so only
    # these fields write it.
    print_iter_log: bool = False
    kv_cache_config: TrtllmKvCache = TrtllmKvCache()
    cuda_graph_config: TrtllmCudaGraph | None = TrtllmCudaGraph()
    # Checked against trtllm-serve's option table by a rule (_check_extra_args): the engine knows its flags.
    extra_args: list[Annotated[str, AfterValidator(_one_line)]] = Field(default_factory=list)


# Every engine's serving section, by the value of `serving.engine` (the default: vllm). Adding an engine adds its
# section here (docs/engines.md has the whole checklist).
SERVING_SECTIONS: dict[str, type[ServingBase]] = {"vllm": VllmServing, "trtllm": TrtllmServing}
DEFAULT_ENGINE = "vllm"


def _engine_of(value: Any) -> Any:
    if isinstance(value, dict):
        tag = value.get("engine", DEFAULT_ENGINE)
        return tag if isinstance(tag, str) else repr(tag)  # engine: null or 5 is an unknown engine, named as such
    return getattr(value, "engine", None)


# The serving section, keyed on `engine`: engine-specific fields sit under the engine they belong to.
Serving = Annotated[
    Union[  # noqa: UP007 (a tagged union, one member per engine)
        Annotated[VllmServing, Tag("vllm")],
        Annotated[TrtllmServing, Tag("trtllm")],
    ],
    Discriminator(_engine_of),
]


class Ray(SpecModel):
    port: Annotated[int, Field(ge=1, le=65535)] = 6379
    object_store_memory_bytes: Annotated[int, Field(ge=78643200, le=_BYTES)] | None = None
    version: Annotated[str, AfterValidator(grammars.version)] | None = Field(
        default=None, description="pin: every node's Ray must report this version")
    dashboard: Literal["off", "localhost"] = Field(
        default="off", description="Ray's dashboard/Jobs API runs code for anyone who reaches it (ShadowRay)"
    )
    node_manager_port: Annotated[int, Field(ge=1, le=65535)] = 6380
    object_manager_port: Annotated[int, Field(ge=1, le=65535)] = 6381
    min_worker_port: Annotated[int, Field(ge=1024, le=65535)] = 20000
    max_worker_port: Annotated[int, Field(ge=1024, le=65535)] = 20999
    # Every other port Ray opens, pinned so the firewall can name it (Ray picks a random one for several otherwise).
    client_server_port: Annotated[int, Field(ge=1, le=65535)] = 10001
    dashboard_port: Annotated[int, Field(ge=1, le=65535)] = 8265
    dashboard_agent_listen_port: Annotated[int, Field(ge=1, le=65535)] = 52365
    dashboard_agent_grpc_port: Annotated[int, Field(ge=1, le=65535)] = 52366
    runtime_env_agent_port: Annotated[int, Field(ge=1, le=65535)] = 52368
    metrics_export_port: Annotated[int, Field(ge=1, le=65535)] = 52367
    dashboard_metrics_port: Annotated[int, Field(ge=1, le=65535)] = Field(
        default=44227, description="the dashboard head process's Prometheus server (Ray's DASHBOARD_METRIC_PORT)")
    autoscaler_metrics_port: Annotated[int, Field(ge=1, le=65535)] = Field(
        default=44217, description="the autoscaler monitor's Prometheus server (Ray's AUTOSCALER_METRIC_PORT)")
    metrics: bool = Field(default=False, description="Ray's metrics export (metrics_export_port); off by default")
    auth: Literal["token", "off"] = Field(
        default="token", description="token: every Ray process needs the cluster's token (Ray 2.52 and later); off "
                                     "accepts the ShadowRay risk: anyone reaching a Ray port runs code")

    @model_validator(mode="after")
    def _ports(self) -> Ray:
        if self.min_worker_port >= self.max_worker_port:
            raise ValueError("min_worker_port must be below max_worker_port")
        return self


class Container(SpecModel):
    """How the Ray head/worker containers run (the recipe's docker run flags)."""

    name_prefix: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,47}$")] = "hy3spark"
    shm_size: Annotated[str, Field(pattern=r"^\d+[bkmg]$")] | None = Field(
        default=None, description="only for a private IPC namespace; with the host's IPC (the default) it is unused"
    )
    gpus: bool = Field(default=True, description="request all GPUs (--gpus all); false only for test nodes")
    env: dict[Annotated[str, AfterValidator(grammars.env_name)], Annotated[str, AfterValidator(grammars.env_value)]] = (
        Field(default_factory=dict, description="extra non-secret env for every container"))


def _network(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return str(ipaddress.ip_network(value, strict=True))
        except ValueError as exc:
            raise ValueError(f"{value!r} is not a network in CIDR form (10.0.0.0/24, 192.0.2.7/32 or ::/0): {exc}") \
                from None
    raise ValueError("a network in CIDR form, as a string (10.0.0.0/24)")


class Firewall(SpecModel):
    """hy3spark's own nftables table on every node (roles/firewall): the cluster-internal ports (Ray, MPI, the
    rendezvous) admit only the cluster's fabric addresses on the fabric interface, the API port only `api_allow`.
    SSH and every other rule on the node are left as they are."""

    enabled: bool = Field(default=True, description="false (or `firewall: off`) leaves the nodes without it; every "
                                                    "render and run warns")
    api_allow: Annotated[list[Annotated[str, BeforeValidator(_network)]], Field(min_length=1)] = Field(
        default_factory=lambda: ["0.0.0.0/0", "::/0"],
        description="networks that may reach serving.port (the API key is still required); default any")
    remove_on_teardown: bool = Field(default=False, description="teardown removes the table too (kept by default: "
                                                                "a torn-down node stays closed)")


def _switch(value: Any) -> Any:
    """`firewall: off`, `restarts: off` (or false/on/true) are the short forms of `{enabled: ...}`."""
    if value is False or value == "off":
        return {"enabled": False}
    if value is True or value == "on":
        return {"enabled": True}
    return value


class Earlyoom(SpecModel):
    policy: Literal["protect", "stop", "leave"] = "protect"
    mem_percent: Annotated[int, Field(ge=1, le=50)] = 4
    swap_percent: Annotated[int, Field(ge=1, le=100)] = 100
    avoid: list[EarlyoomPattern] = Field(
        default_factory=lambda: ["vllm", "VLLM", "ray", "raylet", "gcs_server", "python3", "python", "trtllm-serve",
                                 "mpirun", "dockerd", "containerd", "sshd", "systemd"]
    )
    prefer: list[EarlyoomPattern] = Field(default_factory=lambda: ["chrome", "chromium", "firefox", "code"])


class Restarts(SpecModel):
    """The engine comes back by itself (docs/restarts.md): each node's container starts at boot (a systemd unit per
    node, after the fabric address and Docker), and a supervisor on the head restarts an engine that exited once Ray
    shows every node and GPU, every node has the memory the plan needs and no previous engine's process is left.
    After `max_failed_starts` starts that never became healthy within `window_minutes` it gives up, leaving the node
    as it is, and `hy3spark status` says why."""

    enabled: bool = Field(default=True, description="false (or `restarts: off`) deploys no boot units and no "
                                                    "supervisor: nothing comes back without an Ansible run")
    max_failed_starts: Annotated[int, Field(ge=1, le=100)] = Field(
        default=3, description="failed starts (never healthy within serving.health_timeout_s) before giving up")
    window_minutes: Annotated[int, Field(ge=1, le=10080)] = Field(
        default=15, description="the window the failed starts are counted in")


class Hardware(SpecModel):
    total_memory_gib: Annotated[FiniteFloat, Field(gt=0, le=4096)] = Field(
        default=121.69, description="what the engine sees as GPU total per node (GB10: 121.69 GiB)"
    )


class Pi(SpecModel):
    provider: Ident = "hy3-local"
    provider_name: Text = "Hy3 Local"
    model_label: Text = "Hy3"
    reasoning: bool = True
    max_tokens: Annotated[int, Field(ge=1, le=_COUNT)] = 32768
    thinking_level_map: dict[Ident, Ident] = Field(default_factory=dict)
    reasoning_kwarg: Ident | None = None


class Spec(SpecModel):
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]
    profile: str | None = None
    head: Node
    workers: list[Node] = Field(default_factory=list)
    # None: one machine with no cabled port (the two-card desktop); the ranks meet inside it.
    fabric: Fabric | None = None
    image: Image
    model: Model
    serving: Serving
    ray: Ray = Ray()
    container: Container = Container()
    earlyoom: Earlyoom = Earlyoom()
    firewall: Annotated[Firewall, BeforeValidator(_switch)] = Firewall()
    restarts: Annotated[Restarts, BeforeValidator(_switch)] = Restarts()
    hardware: Hardware = Hardware()
    pi: Pi = Pi()

    @model_validator(mode="before")
    @classmethod
    def _loopback_on_one_machine(cls, data: Any) -> Any:
        """The native launcher on one machine (the desktop the operator sits at) binds loopback unless told."""
        if isinstance(data, dict) and not data.get("workers"):
            serving = data.get("serving")
            if isinstance(serving, dict) and serving.get("launcher") == "native" and "host" not in serving:
                data = {**data, "serving": {**serving, "host": "127.0.0.1"}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _served_as_the_repo(cls, data: Any) -> Any:
        """trtllm-serve reports the model under the repo id it was given: that is the name clients use."""
        if isinstance(data, dict) and isinstance(data.get("serving"), dict) and isinstance(data.get("model"), dict):
            serving, repo = data["serving"], data["model"].get("repo")
            if serving.get("engine") == "trtllm" and "served_name" not in serving and isinstance(repo, str):
                data = {**data, "serving": {**serving, "served_name": repo}}
        return data

    @property
    def nodes(self) -> list[Node]:
        return [self.head, *self.workers]

    @property
    def gpu_count(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def multi_node(self) -> bool:
        return bool(self.workers)

    @property
    def verify_transport(self) -> bool:
        if self.serving.verify_transport is None:
            return self.multi_node
        return self.serving.verify_transport


# ---------------------------------------------------------------------------------------------------------------
# Cross-field rules: the field's known mistakes. Each returns (path, message); the path is a tuple like pydantic's.
# ---------------------------------------------------------------------------------------------------------------
Problem = tuple[tuple[str | int, ...], str]


def _node_path(index: int) -> tuple[str | int, ...]:
    return ("head",) if index == 0 else ("workers", index - 1)


def _address_key(value: str) -> str:
    """The same address however it is written: an IP in canonical form, a host name in lower case without the
    trailing dot of a fully qualified name."""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return value.lower().rstrip(".")


def _check_nodes(spec: Spec) -> list[Problem]:
    problems: list[Problem] = []
    # (kind, value) -> the node and field that gave it first. Names are one namespace; every address a node answers
    # on is another: fabric_ip, mgmt_ip (its own LAN address even when ssh_host is set) and ssh_host (what Ansible
    # connects to). A node may give its own address twice (ssh_host equal to its mgmt_ip); two nodes never share one.
    seen: dict[tuple[str, str], tuple[int, str]] = {}
    head_net = spec.head.fabric_ip.network if spec.head.fabric_ip else None
    used = {n.fabric_ip.ip for n in spec.nodes if n.fabric_ip}
    free = (ip for ip in (head_net.hosts() if head_net else ()) if ip not in used)  # one per duplicate, none twice
    for i, node in enumerate(spec.nodes):
        path = _node_path(i)
        keys = [("name", node.name)]
        if node.fabric_ip is not None:
            keys.append(("fabric_ip", str(node.fabric_ip.ip)))
        if node.mgmt_ip is not None:
            keys.append(("mgmt_ip", str(node.mgmt_ip)))
        if node.ssh_host:
            keys.append(("ssh_host", node.ssh_host))
        for key, value in keys:
            kind = "name" if key == "name" else "address"
            first, first_key = seen.setdefault((kind, _address_key(value) if kind == "address" else value), (i, key))
            if first == i:
                continue
            fix = f"each node needs its own {key if key == first_key else kind}"
            if key == "fabric_ip" and head_net is not None:
                spare = next(free, None)
                fix += f", for example {spare}/{head_net.prefixlen}" if spare else f"; {head_net} has no free address"
            if key == first_key == "fabric_ip" and first == 0:
                msg = f"{value} is the head's address; {fix}"
            else:
                msg = f"{value!r} is already used by {format_path((*_node_path(first), first_key))}; {fix}"
            problems.append(((*path, key), msg))
        if node.fabric_ip is not None and head_net is not None:  # a missing one: _check_fabric_presence
            if i > 0 and node.fabric_ip.ip not in head_net:
                problems.append(((*path, "fabric_ip"), f"{node.fabric_ip} is not in the head's fabric subnet "
                                                       f"{head_net}; all fabric addresses must share one subnet"))
            elif i > 0 and node.fabric_ip.network != head_net:
                problems.append(((*path, "fabric_ip"), f"prefix /{node.fabric_ip.network.prefixlen} differs from the "
                                                       f"head's /{head_net.prefixlen}; use one prefix on every node"))
            ip = node.fabric_ip.ip
            if ip.is_link_local or ip.is_loopback or ip.is_multicast or ip.is_unspecified:
                problems.append(((*path, "fabric_ip"), f"{ip} is not usable as a fabric address (link-local, "
                                                       "loopback or multicast); give the port a static private "
                                                       "address such as 10.0.0.1/24"))
            elif node.fabric_ip.network.prefixlen < 31 and ip in (node.fabric_ip.network.network_address,
                                                                  node.fabric_ip.network.broadcast_address):
                # A /31 has no network or broadcast address: both are hosts on a point-to-point link (RFC 3021).
                problems.append(((*path, "fabric_ip"), f"{ip} is the network or broadcast address of "
                                                       f"{node.fabric_ip.network}"))
        if node.mgmt_ip is not None and head_net is not None and node.mgmt_ip in head_net:
            problems.append(((*path, "mgmt_ip"), f"{node.mgmt_ip} is inside the fabric subnet {head_net}; the "
                                                 "management network must be a different subnet"))
        if i > 0 and node.ssh_user != spec.head.ssh_user:
            problems.append(((*path, "ssh_user"), f"{node.ssh_user!r} differs from head.ssh_user "
                                                  f"{spec.head.ssh_user!r}; the head streams the image and model to "
                                                  "workers as its own user, so use one user on every node"))
    return problems


def _check_fabric_presence(spec: Spec) -> list[Problem]:
    """The fabric is optional only on one machine, and only under a launcher that does not need its address."""
    problems: list[Problem] = []
    if spec.fabric is None and spec.multi_node:
        problems.append((("fabric",), "is required with workers: the ranks on different nodes meet over the cabled "
                                      "port; name its netdev(s) in fabric.interfaces"))
    for i, node in enumerate(spec.nodes):
        if node.fabric_ip is not None:
            if spec.fabric is None and not spec.multi_node:
                problems.append(((*_node_path(i), "fabric_ip"), "there is no fabric section to put this address "
                                                                "on; add fabric (its interfaces) or remove fabric_ip"))
            continue
        if spec.multi_node:
            problems.append(((*_node_path(i), "fabric_ip"), "is required with workers: the ranks meet over the "
                                                            "fabric, so every node needs its own address on it, "
                                                            "such as 10.0.0.1/24"))
        elif spec.fabric is not None:
            problems.append(((*_node_path(i), "fabric_ip"), "is required when fabric is set: the netplan file puts "
                                                            "this node's own address (such as 10.0.0.1/24) on "
                                                            "fabric.interfaces; or remove fabric on a single "
                                                            "machine"))
    if spec.fabric is None and not spec.multi_node and spec.serving.launcher == "ray":
        problems.append((("serving", "launcher"), f"{spec.serving.launcher} needs a fabric: Ray starts on the "
                                                  "node's fabric address (ray start --node-ip-address); with no "
                                                  "fabric set serving.launcher: native (one machine: vLLM's mp "
                                                  "executor, no Ray)"))
    return problems


def _check_fabric(spec: Spec) -> list[Problem]:
    problems: list[Problem] = []
    if spec.fabric is None:
        return problems
    for i, name in enumerate(spec.fabric.interfaces):
        if name in spec.fabric.hcas or _RDMA_NAME.match(name):
            problems.append((("fabric", "interfaces", i),
                             f"{name!r} is an RDMA device (HCA) name, not the network interface that carries the "
                             "address; put it under fabric.hcas and name the netdev here (`ibdev2netdev` shows the "
                             "pairing, for example rocep1s0f1 port 1 ==> enp1s0f1np1)"))
    for i, name in enumerate(spec.fabric.hcas):
        if not _RDMA_NAME.match(name):
            problems.append((("fabric", "hcas", i),
                             f"{name!r} does not look like an RDMA device name (rocep1s0f1, roceP2p1s0f1, mlx5_0); "
                             "list the HCAs that `ibdev2netdev` maps to the cabled port"))
    return problems


def _check_serving(spec: Spec) -> list[Problem]:
    problems: list[Problem] = []
    s, arch = spec.serving, spec.model.arch
    ranks = s.tensor_parallel * s.pipeline_parallel
    if ranks != spec.gpu_count:
        flags = " (trtllm-serve's --tp_size x --pp_size)" if isinstance(s, TrtllmServing) else ""
        problems.append((("serving", "tensor_parallel"),
                         f"tensor_parallel x pipeline_parallel{flags} = {s.tensor_parallel} x {s.pipeline_parallel} = "
                         f"{ranks}, but the cluster has {spec.gpu_count} GPU(s) ({len(spec.nodes)} node(s)); "
                         "make the product equal the GPU count"))
    if arch.num_key_value_heads % s.tensor_parallel:
        divisors = [d for d in range(1, arch.num_key_value_heads + 1) if arch.num_key_value_heads % d == 0]
        problems.append((("serving", "tensor_parallel"),
                         f"{s.tensor_parallel} does not divide the model's {arch.num_key_value_heads} KV heads; use "
                         f"one of {divisors} (and pipeline_parallel for the rest)"))
    if s.pipeline_parallel > arch.num_hidden_layers:
        problems.append((("serving", "pipeline_parallel"),
                         f"{s.pipeline_parallel} stages for {arch.num_hidden_layers} layers"))
    if s.max_model_len > arch.max_context:
        problems.append((("serving", "max_model_len"),
                         f"{s.max_model_len} is above the model's context of {arch.max_context} tokens; use at most "
                         f"{arch.max_context}"))
    core = {spec.ray.port, spec.ray.node_manager_port, spec.ray.object_manager_port}
    # Every single port Ray opens but the two with a message of their own below.
    reserved = {port for _, key, port in ray_ports(spec, head=True)
                if key not in {"client_server_port", "dashboard_port"}}
    ray = s.launcher == "ray"  # the native launcher starts no Ray: its ports are free then
    if ray and (s.port in reserved or spec.ray.min_worker_port <= s.port <= spec.ray.max_worker_port):
        problems.append((("serving", "port"), f"{s.port} collides with a Ray port; pick another serving.port"))
    elif s.port == SSH_PORT:
        problems.append((("serving", "port"), f"{s.port} is SSH's port, which Ansible reaches the nodes on; pick "
                                              "another serving.port"))
    elif ray and s.port == spec.ray.client_server_port:
        problems.append((("serving", "port"), f"{s.port} is Ray's client server port on the head "
                                              "(ray.client_server_port); pick another serving.port"))
    elif ray and s.port == spec.ray.dashboard_port and spec.ray.dashboard != "off":
        problems.append((("serving", "port"), f"{s.port} is Ray's dashboard port, and ray.dashboard is "
                                              f"{spec.ray.dashboard}; pick another serving.port"))
    if len(core) != 3 and s.launcher == "ray":
        problems.append((("ray", "port"), "ray.port, ray.node_manager_port and ray.object_manager_port must differ"))
    # Every engine's endpoint checks the key when api_key_env is set: vLLM itself (--api-key), trtllm-serve through
    # hy3spark's API front (engine_port).
    if s.api_key_env is None and not s.host.is_loopback and not s.open_endpoint:
        problems.append((("serving", "api_key_env"),
                         f"the endpoint listens on {s.host}:{s.port} with no API key; set serving.api_key_env to the "
                         "name of an environment variable holding the key, bind serving.host to 127.0.0.1, or set "
                         "serving.open_endpoint: true to serve without a key on purpose"))
    if isinstance(s, VllmServing) and s.speculative_config is not None and "method" not in s.speculative_config:
        problems.append((("serving", "speculative_config"), "needs a 'method' (for example mtp)"))
    return problems


def _check_secret_refs(spec: Spec) -> list[Problem]:
    problems: list[Problem] = []
    for path, value, example in ((("model", "token_env"), spec.model.token_env, "HF_TOKEN"),
                                 (("serving", "api_key_env"), spec.serving.api_key_env, "VLLM_API_KEY")):
        if value is None:
            continue
        if _looks_secret(value):
            problems.append((path, "looks like a secret written inline; secrets never go in the spec: put the value "
                                   f"in an environment variable and write its NAME here (for example {example})"))
        elif not grammars.ENV_REF.fullmatch(value):
            problems.append((path, f"{value!r} is not an environment variable name (for example {example})"))
        elif value not in SECRET_VARS[path] and not value.startswith(SECRET_VAR_PREFIX):
            named = ", ".join(sorted(SECRET_VARS[path]))
            problems.append((path, f"{value} is not a name a spec may read a secret from: a copied spec could "
                                   "otherwise copy any of the controller's secrets to the nodes. Use one of "
                                   f"{named}, or a name that starts with {SECRET_VAR_PREFIX} (for example "
                                   f'export {SECRET_VAR_PREFIX}{example}="${value}" and write '
                                   f"{SECRET_VAR_PREFIX}{example} here)"))
    return problems


# The controller variables a spec may name as its secrets' sources (model.token_env, serving.api_key_env): the names
# the hub client and the engines read themselves, and the operator's own HY3SPARK_* names. Any other name is refused,
# so a copied spec cannot point hy3spark at AWS_SECRET_ACCESS_KEY and send that to the nodes (and to the hub).
SECRET_VAR_PREFIX = "HY3SPARK_"
SECRET_VARS: dict[tuple[str, ...], frozenset[str]] = {
    ("model", "token_env"): frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"}),
    ("serving", "api_key_env"): frozenset({"VLLM_API_KEY"}),
}


def _looks_secret(value: str) -> bool:
    return bool(_SECRET_SHAPE.search(value))


# Variables hy3spark derives for every node (hy3spark/context.py's node env): container.env may not set them, or a
# copied spec could point a worker at the head's address (VLLM_HOST_IP) or NCCL at another port.
OWNED_ENV = {"VLLM_HOST_IP", "VLLM_CONFIG_ROOT", "MASTER_ADDR", "UCX_NET_DEVICES", "HF_HUB_CACHE", "HF_HUB_OFFLINE",
             "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"}
OWNED_ENV_PREFIXES = ("NCCL_IB_", "OMPI_MCA_")
OWNED_ENV_SUFFIXES = ("_SOCKET_IFNAME",)
# Set when the transport gate is on: it reads NCCL's INFO lines from the serve log.
TRANSPORT_ENV = {"NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "RAY_DEDUP_LOGS"}
# Ray's settings that guard it: token auth (RAY_AUTH_TOKEN would put the token in `docker inspect`), metrics, and the
# ports its metrics servers take from the environment.
RAY_OWNED_ENV = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_enable_metrics_collection",
                 "DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT"}
SSH_PORT = 22
# trtllm-serve has no --api_key (an open feature request upstream): with serving.api_key_env set, hy3spark's API front
# checks the key in front of it (engine_port).
TRTLLM_NO_KEY = "NVIDIA/TensorRT-LLM#9950"


def _check_env(spec: Spec) -> list[Problem]:
    from hy3spark.engines import SECRET_NAMES  # the engines import this module

    problems: list[Problem] = []
    for key in spec.container.env:
        path = ("container", "env", key)
        if key in SECRET_NAMES:
            problems.append((path, f"{key} is where the engine reads a secret; secrets never go in the spec: "
                                   "export it on the controller and name the variable in serving.api_key_env or "
                                   "model.token_env"))
        elif key in RAY_OWNED_ENV:
            problems.append((path, f"{key} is set by hy3spark from the ray section (ray.auth, ray.metrics and the "
                                   "ray.*_metrics_port fields); container.env may not override it: a copied spec "
                                   "could otherwise turn off Ray's token check"))
        elif key == "VLLM_PORT":
            problems.append((path, "VLLM_PORT is set by hy3spark from serving.internal_port, the range the firewall "
                                   "fences for vLLM's internal ports; set serving.internal_port instead"))
        elif key in OWNED_ENV or key.startswith(OWNED_ENV_PREFIXES) or key.endswith(OWNED_ENV_SUFFIXES):
            problems.append((path, f"{key} is derived per node by hy3spark (from fabric, model.cache_dir and the "
                                   "node's own address); container.env may not override it"))
        elif key in TRANSPORT_ENV and spec.verify_transport:
            problems.append((path, f"{key} is set by the NCCL transport gate (serving.verify_transport); container.env "
                                   "may not override it while the gate is on"))
    return problems


def _check_extra_args(spec: Spec) -> list[Problem]:
    from hy3spark.engines import ENGINES  # the engines import this module

    return [(("serving", "extra_args", i), message)
            for i, message in ENGINES[spec.serving.engine].check_extra_args(list(spec.serving.extra_args))]


# Titles the engine and Ray processes have, as earlyoom sees them (comm, cut to 15 characters).
# The interpreter appears as the name it was started by (python3, or python3.12 in an image that calls it so), and
# PyTorch renames the main thread of every process that imports it to pt_main_thread, which is what `ps` then shows.
_PROTECTED_TITLES = ("vllm", "VLLM", "VLLM::EngineCor", "VLLM::Worker", "ray", "raylet", "gcs_server", "ray::IDLE",
                     "ray::RayWorkerW", "python3", "python", *(f"python3.{minor}" for minor in range(8, 16)),
                     "pt_main_thread")


def _check_earlyoom(spec: Spec) -> list[Problem]:
    from hy3spark.engines import ENGINES

    titles = (*_PROTECTED_TITLES, ENGINES[spec.serving.engine](spec).process()["exe"])
    problems: list[Problem] = []
    for i, pattern in enumerate(spec.earlyoom.prefer):
        # As rendered: --prefer ^(a|b)$ is a full match of one of the patterns.
        hit = [t for t in titles if re.fullmatch(f"(?:{pattern})", t)]
        if hit:
            problems.append((("earlyoom", "prefer", i), f"{pattern!r} matches {', '.join(dict.fromkeys(hit))}: "
                                                        "earlyoom would kill the engine or Ray first; prefer only "
                                                        "processes that are not the inference stack"))
    return problems


DEFAULT_MASTER_PORT = 29501  # vLLM's own default for --master-port


def ray_ports(spec: Spec, head: bool) -> list[tuple[str, str, int]]:
    """(what, ray field, port) of every single port Ray opens on a head or worker node (the worker range aside)."""
    ray = spec.ray
    ports: list[tuple[str, str, int]] = []
    if head:
        ports += [("Ray GCS", "port", ray.port),
                  ("Ray client server", "client_server_port", ray.client_server_port),
                  ("Ray dashboard head's metrics", "dashboard_metrics_port", ray.dashboard_metrics_port),
                  ("Ray autoscaler monitor's metrics", "autoscaler_metrics_port", ray.autoscaler_metrics_port)]
        if ray.dashboard != "off":
            ports.append(("Ray dashboard", "dashboard_port", ray.dashboard_port))
    ports += [("Ray node manager (raylet)", "node_manager_port", ray.node_manager_port),
              ("Ray object manager", "object_manager_port", ray.object_manager_port),
              ("Ray dashboard agent (HTTP)", "dashboard_agent_listen_port", ray.dashboard_agent_listen_port),
              ("Ray dashboard agent (gRPC)", "dashboard_agent_grpc_port", ray.dashboard_agent_grpc_port),
              ("Ray runtime-env agent", "runtime_env_agent_port", ray.runtime_env_agent_port)]
    if ray.metrics:
        ports.append(("Ray metrics export", "metrics_export_port", ray.metrics_export_port))
    return ports



def _check_ray_ports(spec: Spec) -> list[Problem]:
    """Every port Ray opens is distinct, outside its own worker range and off SSH's port: the firewall and the
    render's port table name each one, and two processes cannot bind one port."""
    if spec.serving.launcher != "ray":
        return []
    ray = spec.ray
    core = {"port", "node_manager_port", "object_manager_port"}  # _check_serving has their message
    problems: list[Problem] = []
    seen: dict[int, str] = {}
    for _, key, port in ray_ports(spec, head=True):
        other = seen.setdefault(port, key)
        if other != key and not {key, other} <= core:
            problems.append((("ray", key), f"{port} is also ray.{other}; every port Ray opens must differ: pick "
                                           f"another ray.{key}"))
        elif ray.min_worker_port <= port <= ray.max_worker_port:
            problems.append((("ray", key), f"{port} is inside Ray's worker port range ({ray.min_worker_port}-"
                                           f"{ray.max_worker_port}, ray.min_worker_port to ray.max_worker_port); "
                                           f"pick a ray.{key} outside it, or move the range"))
        elif port == SSH_PORT:
            problems.append((("ray", key), f"{port} is SSH's port, which Ansible reaches the nodes on; pick "
                                           f"another ray.{key}"))
    return problems


def vllm_internal_ports(spec: Spec) -> tuple[int, int] | None:
    """(first, last) of the range vLLM's internal listeners take from VLLM_PORT upward; None for another engine."""
    s = spec.serving
    if not isinstance(s, VllmServing):
        return None
    return s.internal_port, s.internal_port + VLLM_INTERNAL_PORTS - 1


def _check_vllm_ports(spec: Spec) -> list[Problem]:
    """vLLM's internal range (serving.internal_port) holds no other port of ours: the engine would move up past a
    taken port, out of the range the firewall names."""
    span = vllm_internal_ports(spec)
    if span is None:
        return []
    first, last = span
    s = spec.serving
    taken: list[tuple[str, int]] = [("SSH's port", SSH_PORT), ("serving.port", s.port)]
    rendezvous = master_port(spec)
    if rendezvous is not None:
        taken.append(("serving.master_port", rendezvous))
    if s.launcher == "ray":
        taken += [(f"ray.{key}", port) for _, key, port in ray_ports(spec, head=True)]
    where = f"{first}-{last} (VLLM_PORT and the {VLLM_INTERNAL_PORTS - 1} ports above it, vLLM's internal range)"
    for what, port in taken:
        if first <= port <= last:
            return [(("serving", "internal_port"), f"{where} holds {what} ({port}); move one of them")]
    if s.launcher == "ray" and first <= spec.ray.max_worker_port and spec.ray.min_worker_port <= last:
        return [(("serving", "internal_port"), f"{where} overlaps Ray's worker ports ({spec.ray.min_worker_port}"
                                               f"-{spec.ray.max_worker_port}); move one of them")]
    return []


def master_port(spec: Spec) -> int | None:
    """The native launcher's rendezvous port on the head; None when the launcher is Ray or there is one node."""
    s = spec.serving
    if not isinstance(s, VllmServing) or s.launcher != "native" or not spec.multi_node:
        return None
    return s.master_port or DEFAULT_MASTER_PORT


def engine_port(spec: Spec) -> int | None:
    """trtllm-serve's own port on 127.0.0.1 when hy3spark's API front answers on serving.port and checks the key
    (serving.api_key_env set; trtllm-serve checks none itself); None when the engine answers on serving.port."""
    s = spec.serving
    if not isinstance(s, TrtllmServing) or s.api_key_env is None:
        return None
    return s.engine_port or s.port + 1


def mpi_hosts(spec: Spec) -> list[str]:
    """The Open MPI hostfile's addresses, in node order: each node's fabric address, never its management address or
    ssh_host (the ranks' traffic belongs on the cabled port). One node without a fabric is `localhost`: mpirun
    starts that rank itself, over no SSH and no network."""
    return [str(n.fabric_ip.ip) if n.fabric_ip is not None else "localhost" for n in spec.nodes]


def _check_mpi(spec: Spec) -> list[Problem]:
    s = spec.serving
    assert isinstance(s, TrtllmServing)
    problems: list[Problem] = []
    if "ray" in spec.model_fields_set:
        problems.append((("ray",), "the mpi launcher starts no Ray: the ray section has no effect under "
                                   "serving.launcher: mpi; remove it"))
    if s.mpi_port == SSH_PORT:
        problems.append((("serving", "mpi_port"), f"{s.mpi_port} is SSH's port on the node, which Ansible reaches "
                                                  "the nodes on; the container's sshd shares the host's network, so "
                                                  f"pick another serving.mpi_port (NVIDIA's is {DEFAULT_MPI_PORT})"))
    elif s.mpi_port == s.port:
        problems.append((("serving", "mpi_port"), f"{s.mpi_port} collides with serving.port, where trtllm-serve's API "
                                                  "listens; pick another serving.mpi_port"))
    problems += _check_engine_port(spec)
    for i, node in enumerate(spec.nodes):
        if node.gpus != 1:
            problems.append(((*_node_path(i), "gpus"), f"{node.gpus}: the mpi launcher starts one rank per node "
                                                       "(slots=1 in the hostfile, OMPI_MCA_rmaps_ppr_n_pernode=1), "
                                                       "so every node must have 1 GPU"))
    if s.served_name != spec.model.repo:
        problems.append((("serving", "served_name"), f"{s.served_name!r}: trtllm-serve has no served-name flag and "
                                                     f"reports the model as {spec.model.repo!r} (model.repo); remove "
                                                     "served_name (it defaults to model.repo)"))
    return problems


def _check_engine_port(spec: Spec) -> list[Problem]:
    """trtllm-serve's port behind the API front: on the head's loopback, in the host's network beside the front
    (serving.port) and the container's sshd (mpi_port). No Ray runs under mpi (_check_mpi refuses a ray section), so
    Ray's ports are free; the field's lower bound keeps it off SSH's port."""
    s = spec.serving
    assert isinstance(s, TrtllmServing)
    if s.api_key_env is None:
        if s.engine_port is None:
            return []
        return [(("serving", "engine_port"), "only the API front, which runs when serving.api_key_env is set, moves "
                                             "trtllm-serve to another port; remove engine_port (without a key "
                                             "trtllm-serve listens on serving.port itself)")]
    port = engine_port(spec)
    assert port is not None
    if s.engine_port is None:  # the default, serving.port + 1: the user wrote serving.port
        taken = "no port" if port > 65535 else "serving.mpi_port" if port == s.mpi_port else None
        if taken is None:
            return []
        return [(("serving", "port"), f"trtllm-serve listens behind the API front on serving.port + 1 by default, and "
                                      f"{port} is {taken}; set serving.engine_port to a free port")]
    if port == s.port:
        return [(("serving", "engine_port"), f"{port} is serving.port, where the API front answers; pick another "
                                             "serving.engine_port for trtllm-serve behind it")]
    if port == s.mpi_port:
        return [(("serving", "engine_port"), f"{port} is serving.mpi_port, where the mpi launcher's sshd listens; "
                                             "pick another serving.engine_port")]
    return []


def _check_launcher(spec: Spec) -> list[Problem]:
    s = spec.serving
    if isinstance(s, TrtllmServing):
        return _check_mpi(spec)
    problems: list[Problem] = []
    if s.launcher == "ray":
        if s.master_port is not None:
            problems.append((("serving", "master_port"), "only the native launcher has a master port; set "
                                                         "serving.launcher: native, or remove master_port"))
        return problems
    if "ray" in spec.model_fields_set:
        problems.append((("ray",), "the native launcher starts no Ray: the ray section has no effect under "
                                   "serving.launcher: native; remove it (or set serving.launcher: ray)"))
    if not spec.multi_node:
        if s.master_port is not None:
            problems.append((("serving", "master_port"), "one node needs no rendezvous: the master port is for "
                                                         "native on several nodes; remove it"))
        return problems
    ranks, nodes = s.tensor_parallel * s.pipeline_parallel, len(spec.nodes)
    if ranks % nodes:
        problems.append((("serving", "tensor_parallel"),
                         f"the world size tensor_parallel x pipeline_parallel = {ranks} does not divide by the "
                         f"{nodes} nodes; vLLM's native multi-node runs the same number of ranks on every node"))
    port = master_port(spec)
    if port == s.port:  # below 1024 (SSH's 22) the field's own bound refuses it
        problems.append((("serving", "master_port"), f"{port} collides with serving.port; pick another "
                                                     "serving.master_port"))
    return problems


_RULES = (_check_secret_refs, _check_nodes, _check_fabric_presence, _check_fabric, _check_serving, _check_env,
          _check_extra_args, _check_earlyoom, _check_launcher, _check_ray_ports,
          _check_vllm_ports)


# ---------------------------------------------------------------------------------------------------------------
# Loading: YAML with line numbers, profile merge, pydantic, then the rules above.
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Loaded:
    spec: Spec
    source: str
    sha256: str
    warnings: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)  # the user's own fields, before the profile merge
    path: str | None = None  # absolute path of the spec file; None for the embedded default


def _compose_lines(text: str, source: str) -> tuple[Any, dict[tuple[str | int, ...], int]]:
    """The data and the line of every field path, through the strict loader (hy3spark/strict_yaml.py)."""
    try:
        return strict_yaml.load(text)
    except strict_yaml.StrictYAMLError as exc:
        where = source if exc.line is None else f"{source}:{exc.line}"
        field = "" if exc.path is None else f"{format_path(exc.path) or '(top level)'}: "
        raise SpecError(source, [f"{where}: {field}{exc.message}"]) from None


def format_path(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # A key that is not one printable word (a newline in a container.env name) is quoted, so a message
            # stays one line.
            out += ("." if out else "") + (part if part.isprintable() and " " not in part else repr(part))
    return out


def profiles_dir() -> Path:
    return Path(str(resources.files("hy3spark") / "profiles"))


def available_profiles() -> list[str]:
    return sorted(p.stem for p in profiles_dir().glob("*.yml"))


def _profile_data(name: str) -> dict[str, Any]:
    # By name only: a name is looked up among the packaged files, never joined into a path (`../x`, `/tmp/p`).
    if name not in available_profiles():
        raise KeyError(name)
    data, _ = _compose_lines((profiles_dir() / f"{name}.yml").read_text(), f"profile {name}")
    return data


def load_profile(name: str) -> dict[str, Any]:
    data = _profile_data(name)
    data.pop("description", None)
    return data


def profile_description(name: str) -> str:
    return str(_profile_data(name).get("description", ""))


def _unknown_profile(profile: Any) -> str:
    available = f"available: {', '.join(available_profiles())}"
    if not isinstance(profile, str):
        return f"must be the name of a packaged profile; {available}"
    if any(mark in profile for mark in ("/", "\\", "~")) or profile.startswith(".") or profile.endswith(".yml"):
        return f"{profile!r} looks like a path; a profile is chosen by name, never by path: {available}"
    return f"unknown profile {profile!r}; {available}"


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` wins; mappings merge key by key, anything else (lists included) is replaced whole."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _find_inline_secrets(data: Any, path: tuple[str | int, ...] = ()) -> list[Problem]:
    from hy3spark.engines import SECRET_NAMES  # the engines import this module

    problems: list[Problem] = []
    if isinstance(data, dict):
        for key, value in data.items():
            p = (*path, str(key))
            if _looks_secret(str(key)):  # named by the mapping it is in: the path would echo it
                problems.append((path, "a key looks like a secret written inline; secrets never go in the spec: put "
                                       "it in an environment variable and reference the variable's NAME"))
            elif str(key) in SECRET_NAMES or _SECRET_KEY.fullmatch(str(key)):
                problems.append((p, "secrets are never written in the spec; export the secret as an environment "
                                    "variable and reference its NAME (model.token_env: HF_TOKEN, "
                                    "serving.api_key_env: VLLM_API_KEY)"))
            else:
                problems.extend(_find_inline_secrets(value, p))
    elif isinstance(data, list):
        for i, item in enumerate(data):
            problems.extend(_find_inline_secrets(item, (*path, i)))
    elif isinstance(data, str) and _looks_secret(data):
        problems.append((path, "looks like a secret written inline; secrets never go in the spec: put it in an "
                               "environment variable and reference the variable's NAME"))
    return problems


def _find_jinja(data: Any, path: tuple[str | int, ...] = ()) -> list[Problem]:
    """Values land in the Ansible inventory, and Ansible templates every string it reads there: a `{{` in the spec
    would be previewed as written but deployed as something else."""
    if isinstance(data, dict):
        return [p for key, value in data.items() for p in _find_jinja(value, (*path, str(key)))]
    if isinstance(data, list):
        return [p for i, item in enumerate(data) for p in _find_jinja(item, (*path, i))]
    if isinstance(data, str) and any(mark in data for mark in ("{{", "{%", "{#")):
        return [(path, "contains Jinja syntax ({{, {% or {#), which Ansible would evaluate when it reads the "
                       "inventory, so the deployed value would differ from the preview; write the value literally")]
    return []


_SCALAR = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|true|false|yes|no|on|off", re.IGNORECASE)


def _pydantic_problem(err: dict[str, Any]) -> Problem:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "constrained-"))))
    # The serving union puts the engine's tag into the path (serving.vllm.port): the user wrote serving.port.
    engine = None
    if loc[:1] == ("serving",) and len(loc) > 1 and loc[1] in SERVING_SECTIONS:
        engine, loc = str(loc[1]), ("serving", *loc[2:])
    if loc[-1:] == ("[key]",):  # a mapping key's own grammar (container.env.NAME)
        loc = loc[:-1]
    kind, msg, given = err["type"], err["msg"], err.get("input")
    # Strict types: say why a YAML value that looks right is refused.
    if isinstance(given, bool) and kind in ("int_type", "float_type", "literal_error", "value_error"):
        return loc, f"{given}: {msg.removeprefix('Value error, ')} (YAML reads yes/no/on/off/true/false as booleans)"
    if isinstance(given, str) and kind in ("int_type", "float_type", "bool_type") and (
            _SCALAR.fullmatch(given.strip())):
        return loc, f"{given!r}: {msg}, not a quoted string; write the value without quotes"
    if isinstance(given, str) and _looks_secret(given):
        given = "<a secret-shaped value>"  # never echoed
    if kind == "union_tag_invalid":
        engine = given.get("engine") if isinstance(given, dict) else given
        return (*loc, "engine"), (f"{engine!r} is not an engine hy3spark knows; use one of: "
                                  f"{', '.join(sorted(SERVING_SECTIONS))}")
    if kind == "union_tag_not_found" or (kind == "model_attributes_type" and loc == ("serving",)):
        return loc, "must be a mapping of the serving fields (engine:, served_name:, tensor_parallel:, ...)"
    if kind == "extra_forbidden" and engine is not None and len(loc) == 2:
        # A field of another engine's section (kv_cache_dtype under trtllm): say whose it is.
        owners = sorted(name for name, section in SERVING_SECTIONS.items()
                        if name != engine and loc[1] in section.model_fields)
        if owners:
            return loc, (f"a {' and '.join(owners)} field; serving.engine is {engine}, whose section has no "
                         f"{loc[1]} (docs/engines.md): remove it, or set serving.engine: {owners[0]}")
    if kind == "extra_forbidden":
        return loc, "unknown field; check the spelling (see README 'The cluster spec' for every field)"
    if kind == "literal_error" and engine is not None and loc == ("serving", "launcher"):
        from hy3spark.engines import ENGINES  # the engines import this module

        by_engine = "; ".join(f"{e}: {', '.join(ENGINES[e].launchers)}" for e in sorted(ENGINES))
        return loc, (f"{given!r} is not a launcher of {engine}, which runs under "
                     f"{' or '.join(ENGINES[engine].launchers)} (the launchers by engine: {by_engine})")
    if kind == "missing":
        return loc, "is required"
    msg = msg.removeprefix("Value error, ")
    if isinstance(given, (str, int, float)) and not isinstance(given, bool):
        # A grammar's message reads on from the value: 'eth 1' is not a network device name.
        joint = " " if kind == "value_error" and msg.startswith(("is ", "must ", "holds ", "uses ")) else ": "
        return loc, f"{given!r}{joint}{msg}"
    return loc, msg


def load_spec(path: Path | None = None) -> Loaded:
    """Read, merge and validate a spec; `None` means the embedded default. Raises SpecError with every problem."""
    if path is None:
        source = f"<embedded {DEFAULT_SPEC_NAME}>"
        raw = (resources.files("hy3spark") / DEFAULT_SPEC_NAME).read_bytes()
    else:
        source = str(path)
        try:
            with Path(path).open("rb") as fh:  # no more than the limit is read: the size is checked before parsing
                raw = fh.read(strict_yaml.MAX_BYTES + 1)
                size = os.fstat(fh.fileno()).st_size if len(raw) > strict_yaml.MAX_BYTES else 0
        except OSError as exc:
            raise SpecError(source, [f"{source}: cannot read the spec: {exc.strerror}"]) from None
        if len(raw) > strict_yaml.MAX_BYTES:
            raise SpecError(source, [f"{source}: {strict_yaml.too_big_message(size or None)}"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(source, [f"{source}: the spec is not UTF-8 text (byte {exc.start})"]) from None
    loaded = parse_spec(text, source, sha256=hashlib.sha256(raw).hexdigest())
    loaded.path = None if path is None else str(Path(path).resolve())
    return loaded


def parse_spec(text: str, source: str, sha256: str | None = None) -> Loaded:
    """Validate spec text; `sha256` is of the file's bytes (what a staleness check hashes), else of the text."""
    data, lines = _compose_lines(text, source)
    if not isinstance(data, dict):
        raise SpecError(source, [f"{source}:1: the spec must be a YAML mapping (name:, profile:, head:, ...)"])

    def where(path: tuple[str | int, ...]) -> str:
        for cut in range(len(path), 0, -1):
            if path[:cut] in lines:
                return f"{source}:{lines[path[:cut]]}: "
        origin = f" (value from profile {data.get('profile')})" if data.get("profile") else ""
        return f"{source}{origin}: "

    def render(problems: list[Problem]) -> list[str]:
        return [f"{where(p)}{format_path(p) or '(top level)'}: {m}" for p, m in problems]

    secret_problems = _find_inline_secrets(data)
    if secret_problems:
        raise SpecError(source, render(secret_problems))

    jinja_problems = _find_jinja(data)
    if jinja_problems:
        raise SpecError(source, render(jinja_problems))

    merged = data
    profile = data.get("profile")
    if profile is not None:
        if not isinstance(profile, str) or profile not in available_profiles():
            raise SpecError(source, render([(("profile",), _unknown_profile(profile))]))
        merged = deep_merge(load_profile(profile), data)
    try:
        spec = Spec.model_validate(merged)
    except ValidationError as exc:
        raise SpecError(source, render([_pydantic_problem(e) for e in exc.errors()])) from None

    problems: list[Problem] = []
    for rule in _RULES:
        problems.extend(rule(spec))
    if problems:
        raise SpecError(source, render(problems))

    warnings = []
    if not _SHA.match(spec.model.revision):
        warnings.append(f"{where(('model', 'revision'))}model.revision: {spec.model.revision!r} is not a commit sha; "
                        "a branch or tag can move under you: pin the 40-character sha the hub shows")
    if spec.multi_node and spec.fabric is not None and len(spec.fabric.hcas) == 1:
        warnings.append(f"{where(('fabric', 'hcas'))}fabric.hcas: only one RoCE device listed; a cabled Spark port has "
                        "two twins (e.g. rocep1s0f1,roceP2p1s0f1) and NCCL runs at about half speed on one")
    if spec.multi_node and spec.fabric is not None and spec.fabric.mtu < 9000:
        warnings.append(f"{where(('fabric', 'mtu'))}fabric.mtu: {spec.fabric.mtu} is below 9000; RoCE throughput "
                        "drops with standard frames")
    if spec.serving.open_endpoint and not spec.serving.host.is_loopback:
        warnings.append(f"{where(('serving', 'open_endpoint'))}serving.open_endpoint: the endpoint on "
                        f"{spec.serving.host}:{spec.serving.port} answers anyone who can reach it, without a key")
    if not spec.firewall.enabled:
        warnings.append(f"{where(('firewall',))}firewall: off: no node gets hy3spark's nftables table, so every port "
                        "Ray and the engine bind to all addresses answers whoever reaches the node (see the README's "
                        "security section)")
    if spec.serving.launcher == "ray" and spec.ray.auth == "off":
        warnings.append(f"{where(('ray', 'auth'))}ray.auth: off: Ray runs without its token check; anyone who "
                        "reaches a Ray port can run code on the nodes (ShadowRay)")
    digest = sha256 or hashlib.sha256(text.encode()).hexdigest()
    return Loaded(spec=spec, source=source, sha256=digest, warnings=warnings, raw=data)
