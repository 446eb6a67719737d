"""TensorRT-LLM's `trtllm-serve`, launched by Open MPI across the nodes (NVIDIA's "Run on two Sparks" playbook).

One container per node holds the node: an sshd on serving.mpi_port (the launcher's way in) and nothing else. On the
head, `mpirun` reads the hostfile of fabric addresses (one slot per node) and starts one rank on every node through
those sshds; `trtllm-llmapi-launch` makes rank 0 the `trtllm-serve` that answers the API and the others its workers.
The engine's own options (kv_cache_config, cuda_graph_config, ...) go in the extra LLM API options file
(--extra_llm_api_options), which hy3spark renders from the spec like every other file.
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from typing import Any

from hy3spark.spec import Node, Spec, TrtllmServing, engine_port

TABLE = "trtllm_flags.json"
# TensorRT-LLM's KV cache manager, once the cache is allocated (the number is the tokens it holds):
# "[TensorRT-LLM][INFO] [MemUsageChange] Allocated 52.31 GiB for max tokens in paged KV cache (1071232)."
# It prints no concurrency line as vLLM does. No log of the pinned image is recorded yet: the TensorRT-LLM double
# (tests/trtllm_double/) is where this pattern gets checked against real lines.
KV_CACHE_LINE = r"Allocated [\d.]+ GiB for max tokens in paged KV cache \(([\d,]+)\)"

# Options whose value a spec field sets: the rendered command already gives them, and a second one would silently
# win (or, in the options file, override the flag).
OWNED = {
    "model": "model.repo",
    "revision": "model.revision",
    "host": "serving.host",
    "port": "serving.port (serving.engine_port behind the API front)",
    "backend": "serving.backend",
    "tensor_parallel_size": "serving.tensor_parallel",
    "pipeline_parallel_size": "serving.pipeline_parallel",
    "max_batch_size": "serving.max_num_seqs",
    "max_num_tokens": "serving.max_num_tokens",
    "max_seq_len": "serving.max_model_len",
    "extra_llm_api_options": "serving.kv_cache_config, serving.cuda_graph_config and serving.print_iter_log",
    "free_gpu_memory_fraction": "serving.kv_cache_config.free_gpu_memory_fraction",
}
# Options that decide how many ranks run where: the mpi launcher owns them (one rank per node, TP x PP ranks).
LAUNCHER = {"gpus_per_node", "context_parallel_size"}
# Options that would make trtllm-serve do something other than serve the spec.
OTHER = {
    "help": "prints the help and exits, so trtllm-serve would never serve",
    "server_role": "is for disaggregated serving, which hy3spark does not deploy",
    "metadata_server_config_file": "is for disaggregated serving, which hy3spark does not deploy",
    "disagg_cluster_uri": "is for disaggregated serving, which hy3spark does not deploy",
}
# trtllm-serve takes no secret as an option today (no --api_key, so hy3spark's API front checks the key; the hub
# token comes from HF_TOKEN in the environment). An option named like one, in a table regenerated from a newer
# release, is refused all the same.
_SECRET_DEST = re.compile(r"(?:^|_)(?:api_key|key|token|password|secret)(?:$|_)")


@cache
def table() -> dict[str, Any]:
    return json.loads((resources.files("hy3spark.engines") / TABLE).read_text())


@cache
def _options() -> dict[str, dict[str, Any]]:
    return {spelling: option for option in table()["options"] for spelling in option["strings"]}


def check(args: list[str]) -> list[tuple[int, str]]:
    """(index, problem) for each word of serving.extra_args trtllm-serve would not take as an option the spec leaves
    open. Read as click reads it: `--flag value` or `--flag=value`, no abbreviations, no positional (MODEL is the
    spec's)."""
    where = f"trtllm-serve option in the table of {table()['trtllm_image']}"
    problems: list[tuple[int, str]] = []
    i = 0
    while i < len(args):
        word = args[i]
        name, has_value, _ = word.partition("=")
        option = _options().get(name) if word.startswith("-") else None
        if option is None:
            if word.startswith("-"):
                problems.append((i, f"{name!r} is not a {where} (hy3spark/engines/{TABLE})"))
                # Its value, if it has one, is no second problem: click stops at the unknown option.
                has_next_value = not has_value and i + 1 < len(args) and not args[i + 1].startswith("-")
                i += 2 if has_next_value else 1
            else:
                problems.append((i, f"{word!r} is a second model argument: trtllm-serve takes one, model.repo"))
                i += 1
            continue
        dest = option["dest"]
        if dest in OWNED:
            problems.append((i, f"{name!r}: it is set from {OWNED[dest]}, and a second value here would silently win; "
                                f"set {OWNED[dest]} instead"))
        elif dest in LAUNCHER:
            problems.append((i, f"{name!r}: the mpi launcher decides how many ranks run where (one per node, "
                                "tensor_parallel x pipeline_parallel in all); remove it"))
        elif dest in OTHER:
            problems.append((i, f"{name!r} {OTHER[dest]}"))
        elif _SECRET_DEST.search(dest):
            problems.append((i, f"{name!r}: it would put a secret on the process command line (`ps`, `docker "
                                "inspect`, the logs); secrets reach the engine from the environment"))
        elif not option["takes_value"] and has_value:
            problems.append((i, f"{name!r} is a flag and takes no value"))
        if option["takes_value"] and not has_value:
            if i + 1 >= len(args):
                problems.append((i, f"{name!r} needs a value"))
            i += 1  # its value
        i += 1
    return problems


# Where hy3spark's API front reads the key (serving.api_key_env's value) on the head: the secrets file carries it, the
# serve script hands it to the front and unsets it before the engine starts. Not VLLM_API_KEY: no engine reads this
# one (were a TensorRT-LLM release to read a VLLM_-like name, the key would not turn on a second check unseen), it
# sits in the HY3SPARK_ names the spec already keeps for the operator's own secrets, and being in secret_names it
# stays out of container.env, of the spec and of every rank.
FRONT_KEY = "HY3SPARK_API_KEY"


class TrtllmEngine:
    name = "trtllm"
    launchers = ("mpi",)
    # trtllm-serve reads no API key (NVIDIA/TensorRT-LLM#9950): hy3spark's API front checks it, from FRONT_KEY;
    # huggingface_hub reads the token from HF_TOKEN.
    secret_names = (FRONT_KEY, "HF_TOKEN")

    def __init__(self, spec: Spec) -> None:
        assert isinstance(spec.serving, TrtllmServing)
        self.spec = spec
        self.serving: TrtllmServing = spec.serving

    @property
    def launcher(self) -> str:
        return self.serving.launcher

    def node_env(self, node: Node, common: dict[str, str]) -> dict[str, str]:
        """The shared fabric settings (NCCL_SOCKET_IFNAME, UCX_NET_DEVICES, OMPI_MCA_btl_tcp_if_include: the fabric
        netdev) and Open MPI's own: the hostfile where the container has it, one rank per node, and mpirun as root
        (the release image runs as root), its daemons started from the head alone."""
        from hy3spark.context import MPI_CONTAINER_HOSTFILE  # the context imports the engines

        env = {k: v for k, v in common.items() if not k.startswith("RAY_")}  # no Ray runs under mpi
        env.update({
            "OMPI_MCA_orte_default_hostfile": MPI_CONTAINER_HOSTFILE,
            "OMPI_MCA_rmaps_ppr_n_pernode": "1",
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        })
        if "OMPI_MCA_btl_tcp_if_include" in common:  # across nodes (one machine has no fabric and no remote daemon)
            env.update({
                # mpirun on the head starts every node's daemon itself: only the head holds the cluster's client key
                # (roles/mpi_node), so no daemon may start another's (Open MPI's tree spawn would, past two nodes).
                "OMPI_MCA_plm_rsh_no_tree_spawn": "1",
                # Open MPI's control channel (mpirun <-> orted) on the fabric too, like its data
                # (btl_tcp_if_include): by default it offers and listens on every interface, management's included.
                "OMPI_MCA_oob_tcp_if_include": common["OMPI_MCA_btl_tcp_if_include"],
            })
        return env

    @staticmethod
    def check_extra_args(args: list[str]) -> list[tuple[int, str]]:
        return check(args)

    def process(self) -> dict[str, str]:
        """The engine is recognised by `trtllm-serve <repo>` in a command line: mpirun's, the launch wrapper's and
        trtllm-serve's own."""
        return {"exe": "trtllm-serve", "arg": self.spec.model.repo}

    def log_lines(self) -> dict[str, str]:
        return {"kv_cache": KV_CACHE_LINE}

    def secret_env(self) -> dict[str, str]:
        """Its secrets on the head -> the NAME of the controller's variable holding each; only the set ones."""
        wanted = {FRONT_KEY: self.serving.api_key_env, "HF_TOKEN": self.spec.model.token_env}
        return {name: source for name, source in wanted.items() if source}

    def front(self) -> dict[str, Any] | None:
        """hy3spark's API front, when serving.api_key_env is set: the serve script starts `argv` in the background
        before the launcher, with the key in `key_env` (from the secrets file), and unsets that before mpirun. The
        front answers on serving.host:serving.port, trtllm-serve on 127.0.0.1:`engine_port`."""
        from hy3spark.context import API_FRONT  # the context imports the engines

        port = engine_port(self.spec)
        if port is None:
            return None
        s = self.serving
        return {"argv": ["python3", API_FRONT, "--listen", f"{s.host}:{s.port}", "--upstream", f"127.0.0.1:{port}",
                         "--key-env", FRONT_KEY],
                "key_env": FRONT_KEY, "engine_port": port}

    def options(self) -> dict[str, Any]:
        """The extra LLM API options file (--extra_llm_api_options): its keys override trtllm-serve's flags, so it
        holds only what the spec's own fields set; keys sorted, unset keys left to TensorRT-LLM."""
        s = self.serving
        kv = s.kv_cache_config.model_dump(exclude_none=True)
        graphs = None if s.cuda_graph_config is None else s.cuda_graph_config.model_dump(exclude_none=True)
        return {"cuda_graph_config": graphs, "kv_cache_config": dict(sorted(kv.items())),
                "print_iter_log": s.print_iter_log}

    def node_argv(self, index: int) -> list[str]:
        """The head runs mpirun; the other nodes run nothing themselves: mpirun starts their rank through the
        sshd in their container."""
        return self.serve_argv() if index == 0 else []

    def _mpirun(self) -> list[str]:
        from hy3spark.context import MPI_SSH_CONFIG, node_env  # the context imports the engines

        # mpirun reaches the other containers' sshd on the MPI port with the cluster's own client config.
        argv = ["mpirun", "--mca", "plm_rsh_args", f"-p {self.serving.mpi_port} -F {MPI_SSH_CONFIG}"]
        # -x passes a variable by NAME, its value taken from mpirun's own environment: the head container's env file
        # (every value there is the same on every node: the fabric netdev, the cache path) and the secrets the serve
        # script read from its 0600 file. A rank started over SSH would otherwise have neither. Open MPI's own
        # OMPI_* settings configure mpirun and reach the ranks by themselves. The API front's key is no rank's: the
        # serve script unsets it before mpirun.
        names = [k for k in node_env(self.spec, self, self.spec.head) if not k.startswith("OMPI_")]
        for name in [*names, *(k for k in self.secret_env() if k != FRONT_KEY)]:
            argv += ["-x", name]
        return argv

    def serve_argv(self) -> list[str]:
        """The head's `mpirun ... trtllm-llmapi-launch trtllm-serve <repo> ...`, in NVIDIA's flag order."""
        from hy3spark.context import ENGINE_OPTIONS  # the context imports the engines

        s, m = self.serving, self.spec.model
        # Behind the API front (serving.api_key_env set) trtllm-serve answers on loopback only, on its own port.
        behind = engine_port(self.spec)
        host, port = (str(s.host), s.port) if behind is None else ("127.0.0.1", behind)
        argv = ["trtllm-llmapi-launch", "trtllm-serve", m.repo, "--revision", m.revision,
                "--tp_size", str(s.tensor_parallel)]
        if s.pipeline_parallel > 1:
            argv += ["--pp_size", str(s.pipeline_parallel)]
        argv += ["--backend", s.backend, "--max_num_tokens", str(s.max_num_tokens),
                 "--max_batch_size", str(s.max_num_seqs), "--max_seq_len", str(s.max_model_len),
                 "--extra_llm_api_options", ENGINE_OPTIONS,
                 # Always given: trtllm-serve's own default host is localhost.
                 "--port", str(port), "--host", host]
        return [*self._mpirun(), *argv, *s.extra_args]
