"""`vllm serve` from the spec, in the recipe's flag order."""

from __future__ import annotations

import json

from hy3spark.spec import Node, Spec, master_port

# vLLM's startup lines that say what the KV cache holds (vllm/v1/core/kv_cache_utils.py); the roles, `status` and
# the run record read them from the serve log.
KV_CACHE_LINE = r"GPU KV cache size: ([\d,]+) tokens"
CONCURRENCY_LINE = r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x"


class VllmEngine:
    name = "vllm"
    # serving.launcher: `ray` (vLLM's Ray executor: every node runs a Ray container, the head's `vllm serve` places
    # the ranks on them) or `native` (vLLM's own executor: `vllm serve` on every node, the others --headless).
    launchers = ("ray", "native")

    def __init__(self, spec: Spec) -> None:
        self.spec = spec

    @property
    def launcher(self) -> str:
        return self.spec.serving.launcher

    def node_env(self, node: Node, common: dict[str, str]) -> dict[str, str]:
        """The node's env file: VLLM_HOST_IP is the node's OWN fabric address (the field's commonest mistake),
        VLLM_CONFIG_ROOT holds ray_non_carry_over_env_vars.json (the vllm_serve role writes it), VLLM_PORT pins
        vLLM's internal ports to serving.internal_port and up (the range the port table and the firewall name)."""
        from hy3spark.context import VLLM_CONFIG_ROOT  # the context imports the engines

        own = {"VLLM_CONFIG_ROOT": VLLM_CONFIG_ROOT, "VLLM_PORT": str(self.spec.serving.internal_port)}
        if node.fabric_ip is None:  # one machine, no fabric: the ranks meet on loopback, vLLM's own default
            return {**common, **own}
        return {"VLLM_HOST_IP": str(node.fabric_ip.ip), **common, **own}

    @staticmethod
    def check_extra_args(args: list[str]) -> list[tuple[int, str]]:
        """(index, problem) for each word of serving.extra_args vLLM's own parser would not take as an option the
        spec lets through (hy3spark/engines/vllm_args.py: the real option table, aliases and abbreviations)."""
        from hy3spark.engines import vllm_args

        return vllm_args.check(args)

    def process(self) -> dict[str, str]:
        """How the engine's process is recognised in /proc: an argv word named `exe` followed by `arg`."""
        return {"exe": "vllm", "arg": "serve"}

    def log_lines(self) -> dict[str, str]:
        return {"kv_cache": KV_CACHE_LINE, "concurrency": CONCURRENCY_LINE}

    # vLLM reads the API key from VLLM_API_KEY and huggingface_hub the token from HF_TOKEN.
    secret_names = ("VLLM_API_KEY", "HF_TOKEN")

    def secret_env(self) -> dict[str, str]:
        """Its secrets on the head -> the NAME of the controller's variable holding each; only the set ones."""
        wanted = dict(zip(self.secret_names, (self.spec.serving.api_key_env, self.spec.model.token_env), strict=True))
        return {var: source for var, source in wanted.items() if source}

    def node_argv(self, index: int) -> list[str]:
        """What node `index` (0: the head) runs: under Ray only the head runs `vllm serve` (an empty list for the
        others); under the native launcher every node runs it, the others with their --node-rank and --headless."""
        if index == 0:
            return self.serve_argv()
        if self.launcher == "ray":
            return []
        argv = self.serve_argv()
        at = argv.index("--node-rank")
        return [*argv[:at], "--node-rank", str(index), "--headless", *argv[at + 2:]]

    def _launch_args(self) -> list[str]:
        """How the ranks are placed, always explicit: an image default can switch the executor and silently ignore
        the other nodes."""
        if self.launcher == "ray":
            return ["--distributed-executor-backend", "ray"]
        argv = ["--distributed-executor-backend", "mp"]
        port = master_port(self.spec)
        if port is not None:
            # Several nodes: the spec rules require the fabric there (_check_fabric_presence).
            assert self.spec.head.fabric_ip is not None
            argv += ["--nnodes", str(len(self.spec.nodes)), "--node-rank", "0",
                     "--master-addr", str(self.spec.head.fabric_ip.ip), "--master-port", str(port)]
        return argv

    def serve_argv(self) -> list[str]:
        """The head's `vllm serve`."""
        s, m = self.spec.serving, self.spec.model
        # The repo id plus a pinned --revision, resolved from the local cache (HF_HUB_OFFLINE=1, HF_HUB_CACHE in the
        # node env): the same string works on every node because model_sync puts the same tree at the same path.
        argv = ["vllm", "serve", m.repo, "--revision", m.revision, "--served-model-name", s.served_name]
        if not s.host.is_unspecified:
            argv += ["--host", str(s.host)]
        argv += ["--port", str(s.port), "--tensor-parallel-size", str(s.tensor_parallel)]
        if s.pipeline_parallel > 1:
            argv += ["--pipeline-parallel-size", str(s.pipeline_parallel)]
        argv += self._launch_args()
        argv += ["--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
                 "--max-num-batched-tokens", str(s.max_num_batched_tokens)]
        if s.kv_cache_dtype != "auto":
            argv += ["--kv-cache-dtype", s.kv_cache_dtype]
        argv += ["--gpu-memory-utilization", f"{s.gpu_memory_utilization:.2f}"]
        if s.speculative_config:
            argv += ["--speculative-config", json.dumps(s.speculative_config, separators=(",", ":"))]
        if s.tool_call_parser:
            argv += ["--tool-call-parser", s.tool_call_parser]
        if s.reasoning_parser:
            argv += ["--reasoning-parser", s.reasoning_parser]
        if s.enable_auto_tool_choice:
            argv.append("--enable-auto-tool-choice")
        if s.trust_remote_code:
            argv.append("--trust-remote-code")
        if s.enforce_eager:
            argv.append("--enforce-eager")
        return [*argv, *s.extra_args]
