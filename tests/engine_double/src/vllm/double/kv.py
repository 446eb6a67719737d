"""The KV cache at startup: vLLM 0.23.0's RECORDED outcome for this configuration, and the fake GPU's memory.

The double computes no KV-cache arithmetic (so it cannot share a bug with ``hy3spark.capacity``, which tests compare
it with). ``kv_vectors.json`` is derived by ``tests/engine_double/make_kv_table.py`` from
``tests/fixtures/vllm-0.23.0/kv-cases.json``, what vLLM 0.23.0's own code computed: per case the configuration, the
per-rank available KV bytes, and what vLLM logged (``GPU KV cache size: N tokens``, ``Maximum concurrency for L
tokens per request: X.XXx``, its warnings) or raised. At startup the engine describes its configuration the way the
table does (:func:`engine_config`: the model shape from config.json, the parallelism and the resolved cache
settings), its workers measure their available bytes on their own fake GPUs (:func:`available_bytes`), and
:func:`lookup` finds the vector with the same configuration and the same bytes on every rank. Its lines are printed as
vLLM prints them, or its error is raised with vLLM's text. A configuration without a vector fails to start
(:class:`NoVector`): the double never invents numbers.

The fake GPU comes from the environment (vLLM_* variables are copied from the head to the workers, as vLLM does):

- ``VLLM_DOUBLE_GPU_MEMORY_GIB`` total memory per GPU (default 121.69, what vLLM reports on a DGX Spark / GB10);
- ``VLLM_DOUBLE_GPU_FREE_GIB`` free memory at startup (default: the total); below ``requested`` startup fails with
  vLLM's "Free memory on device ... on startup is less than desired GPU memory utilization" error;
- ``VLLM_DOUBLE_OVERHEAD_GIB`` activation + non-torch + CUDA-graph memory per rank. Default 3.0 with
  ``--enforce-eager`` and 4.0 without (CUDA graphs): the overheads of hy3spark's Hy3 and gpt-oss profiles, so that
  a synthetic model with the profile's checkpoint size lands on vLLM's profile vectors;
- ``VLLM_DOUBLE_NVML_MEMORY``: unset or ``unsupported``, NVML's memory query raises as on a real GB10 and
  ``vllm serve`` defaults max_num_batched_tokens to 2048; ``reported``, NVML reports the total (8192 for 121.69 GiB).

Available KV memory per rank: ``ceil(total * gpu_memory_utilization) - weights - overhead`` (vLLM's
request_memory and determine_available_memory, with a constant overhead instead of a profiling run), or
``--kv-cache-memory-bytes``, which skips profiling. Weights per rank are the checkpoint's ``total_size``
(model.safetensors.index.json) / (TP x PP), so a few-kilobyte synthetic model can carry a 181 GB index.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

GIB = 1 << 30
TABLE = "kv_vectors.json"
FIXTURE = "tests/fixtures/vllm-0.23.0/kv-cases.json"
# The id of the vector-less outcome VLLM_DOUBLE_KV_UNRECORDED=skip allows (:func:`unrecorded`).
UNRECORDED = "unrecorded"
# vLLM's CacheConfig default on CUDA when --block-size is not given.
DEFAULT_BLOCK_SIZE = 16
# The exception types vLLM raised in the recorded cases.
ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "NotImplementedError": NotImplementedError}


class NoVector(RuntimeError):
    """The table holds no vLLM outcome for this configuration: the double refuses to make one up."""


# --- the fake GPU ---------------------------------------------------------------------------------------------------


def env_gib(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else default


def gpu_total_bytes() -> int:
    return int(env_gib("VLLM_DOUBLE_GPU_MEMORY_GIB", 121.69) * GIB)


def gpu_free_bytes() -> int:
    raw = os.environ.get("VLLM_DOUBLE_GPU_FREE_GIB", "").strip()
    return int(float(raw) * GIB) if raw else gpu_total_bytes()


def overhead_bytes(enforce_eager: bool) -> int:
    return int(env_gib("VLLM_DOUBLE_OVERHEAD_GIB", 3.0 if enforce_eager else 4.0) * GIB)


def requested_bytes(total: int, utilization: float) -> int:
    return math.ceil(total * utilization)


def check_free_memory(utilization: float) -> None:
    """gpu_worker.init_device / utils.request_memory: refuse to start when free < requested."""
    total, free = gpu_total_bytes(), gpu_free_bytes()
    requested = requested_bytes(total, utilization)
    if free < requested:
        raise ValueError(
            f"Free memory on device cuda:0 ({free / GIB:.2f}/{total / GIB:.2f} GiB) on startup is less than desired "
            f"GPU memory utilization ({utilization}, {requested / GIB:.2f} GiB). Decrease GPU memory utilization or "
            "reduce GPU memory used by other processes."
        )


@dataclass(frozen=True)
class Memory:
    """What a worker needs to measure its available KV memory, sent from the engine to every rank."""

    gpu_memory_utilization: float
    weights_per_rank: int
    kv_cache_memory_bytes: int | None
    enforce_eager: bool


def available_bytes(memory: Memory) -> int:
    """This rank's KV cache memory (run on the rank's own node, with its own fake GPU)."""
    if memory.kv_cache_memory_bytes is not None:
        return memory.kv_cache_memory_bytes
    requested = requested_bytes(gpu_total_bytes(), memory.gpu_memory_utilization)
    return requested - memory.weights_per_rank - overhead_bytes(memory.enforce_eager)


def default_max_num_batched_tokens() -> int:
    """`vllm serve`'s default (EngineArgs.get_batch_defaults) on the fake GPU, as vLLM resolved it on the GB10."""
    defaults = table()["batch_defaults"]
    nvml = os.environ.get("VLLM_DOUBLE_NVML_MEMORY", "").strip() or "unsupported"
    if nvml == "unsupported":
        return int(defaults["nvml_not_supported"])
    if nvml == "reported" and gpu_total_bytes() == defaults["nvml_total_memory_bytes"]:
        return int(defaults["nvml_reported"])
    raise NoVector(
        f"the vLLM test double has no vLLM {table()['vllm_version']} batch default for VLLM_DOUBLE_NVML_MEMORY="
        f"{nvml} with a {gpu_total_bytes()}-byte GPU (recorded: 'unsupported', and 'reported' with "
        f"{defaults['nvml_total_memory_bytes']} bytes); pass --max-num-batched-tokens"
    )


# --- the configuration, described as the table describes it ---------------------------------------------------------


def pp_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """vllm.distributed.utils.get_pp_indices: the remainder goes to the stages before the last."""
    per_stage = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        per_stage[-i] += 1
    starts = [sum(per_stage[:stage]) for stage in range(pp)]
    return [range(start, start + count) for start, count in zip(starts, per_stage, strict=True)]


def model_dtype(config: dict[str, Any], dtype_flag: str) -> str:
    """ModelConfig's dtype: --dtype, else config.json's torch_dtype (bfloat16 when absent)."""
    named = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32", "float32": "float32"}
    if dtype_flag in named:
        return named[dtype_flag]
    return str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")


def draft_layers(config: dict[str, Any], speculative_config: dict[str, Any] | None) -> int:
    """MTP speculative decoding (`--speculative-config` method ``mtp``) adds the checkpoint's MTP layers."""
    if not speculative_config or not str(speculative_config.get("method", "")).endswith("mtp"):
        return 0
    return int(config.get("num_nextn_predict_layers") or 1)


def engine_config(model_config: dict[str, Any], args: argparse.Namespace, max_len: int) -> dict[str, Any]:
    """This engine's configuration in the table's terms (the keys of a vector's ``config``).

    ``max_len`` is what the config checks resolved (the model's own length when --max-model-len is absent or -1).
    """
    text = model_config.get("text_config") or model_config
    heads = int(text.get("num_attention_heads") or 1)
    layers = int(text.get("num_hidden_layers") or 1)
    window = text.get("sliding_window")
    types = [str(kind) for kind in (text.get("layer_types") or [])[:layers]] if window else []
    sliding = [kind == "sliding_attention" for kind in types] + [False] * (layers - len(types))
    extra = draft_layers(text, args.speculative_config)
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    stages = []
    for stage, hidden in enumerate(pp_layer_ranges(layers, pp)):
        count = sum(sliding[i] for i in hidden)
        full = len(hidden) - count + (extra if stage == pp - 1 else 0)
        stages.append({"full": full, "sliding": count})
    auto_fit = args.max_model_len == -1
    return {
        "architecture": str((model_config.get("architectures") or ["UnknownForCausalLM"])[0]),
        "num_hidden_layers": layers,
        "num_key_value_heads": int(text.get("num_key_value_heads") or heads),
        "head_dim": int(text.get("head_dim") or int(text.get("hidden_size", 128 * heads)) // heads),
        "model_dtype": model_dtype(text, args.dtype),
        "sliding_window": int(window) if any(sliding) else None,
        "sliding_layers": sum(sliding),
        "extra_full_layers": extra,
        "speculative_method": (args.speculative_config or {}).get("method"),
        "tensor_parallel": tp,
        "pipeline_parallel": pp,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_model_len": -1 if auto_fit else max_len,
        "stages": stages,
        "block_size": args.block_size or DEFAULT_BLOCK_SIZE,
        "max_num_batched_tokens": args.max_num_batched_tokens or default_max_num_batched_tokens(),
        "hybrid_kv_cache_manager": not args.disable_hybrid_kv_cache_manager,
        "auto_fit_from": max_len if auto_fit else None,
    }


# --- the table ------------------------------------------------------------------------------------------------------


@cache
def table() -> dict[str, Any]:
    return json.loads(resources.files("vllm.double").joinpath(TABLE).read_text())


def _matches(vector: dict[str, Any], config: dict[str, Any]) -> bool:
    # A key vLLM never resolved (it refused the flags first) is absent from the vector's config.
    return all(config.get(key) == value for key, value in vector["config"].items())


def _describe(config: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in config.items())


@dataclass(frozen=True)
class Vector:
    """One recorded vLLM outcome."""

    id: str
    log: tuple[tuple[str, str], ...]  # (level, message) as vLLM logged them, in order
    num_blocks: int | None
    max_model_len: int | None  # what vLLM serves (after auto-fit)
    error: dict[str, Any] | None  # type, message, rank: raised at the first failing rank

    def raise_error(self) -> None:
        if self.error is not None:
            raise ERRORS[self.error["type"]](self.error["message"])


def check_config(config: dict[str, Any]) -> None:
    """create_engine_config: raise vLLM's recorded error for a configuration it refused (no KV check runs)."""
    for vector in table()["vectors"]:
        if "config_error" in vector and _matches(vector, config):
            error = vector["config_error"]
            raise ERRORS[error["type"]](error["message"])


def lookup(config: dict[str, Any], available: list[int]) -> Vector:
    """The vector for this configuration and these per-rank available bytes (rank order, pp-major)."""
    same_config = [v for v in table()["vectors"] if "config_error" not in v and _matches(v, config)]
    for vector in same_config:
        if vector["available_kv_bytes_per_rank"] == available:
            return Vector(
                id=vector["id"],
                log=tuple((level, message) for level, message in vector["log"]),
                num_blocks=vector.get("num_blocks"),
                max_model_len=vector.get("max_model_len"),
                error=vector.get("error"),
            )
    version = table()["vllm_version"]
    if same_config:
        recorded = "; ".join(f"{v['id']}: {v['available_kv_bytes_per_rank']}" for v in same_config)
        hint = (
            f" (vectors with this configuration have other available KV bytes per rank: {recorded}; the fake GPU "
            "is set by VLLM_DOUBLE_GPU_MEMORY_GIB, VLLM_DOUBLE_OVERHEAD_GIB, the index's total_size, "
            "--gpu-memory-utilization or --kv-cache-memory-bytes)"
        )
    else:
        hint = ""
    raise NoVector(
        f"the vLLM test double has no vLLM {version} KV vector for {_describe(config)} with available KV bytes per "
        f"rank {available}{hint}: add a case to {FIXTURE} (made by running vLLM {version}) and regenerate "
        "src/vllm/double/kv_vectors.json with tests/engine_double/make_kv_table.py"
    )


def unrecorded(missing: NoVector) -> Vector:
    """With ``VLLM_DOUBLE_KV_UNRECORDED=skip`` (double-only), a configuration vLLM recorded nothing for starts with NO
    KV cache lines instead of failing: the double still invents no numbers (no ``GPU KV cache size`` or ``Maximum
    concurrency`` line, no block count), it says so in one warning, and the engine serves. For tests of what does
    not depend on the KV outcome (a model shape or split without a vector, such as the two-card desktop's Qwen3-32B
    under TP 2 and PP 2); anything else, unset, fails to start with :class:`NoVector`."""
    if os.environ.get("VLLM_DOUBLE_KV_UNRECORDED", "").strip() != "skip":
        raise missing
    warning = (
        f"hy3spark TEST DOUBLE: {missing}. VLLM_DOUBLE_KV_UNRECORDED=skip: starting WITHOUT vLLM's KV cache "
        "lines (this run's KV cache size and concurrency are unknown, not vLLM's)"
    )
    return Vector(id=UNRECORDED, log=(("WARNING", warning),), num_blocks=None, max_model_len=None, error=None)
