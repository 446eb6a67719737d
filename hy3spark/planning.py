"""Glue between the cluster spec and the capacity planner: `hy3spark plan` and the vllm_serve pre-launch gate."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hy3spark import capacity
from hy3spark.errors import Hy3SparkError
from hy3spark.spec import Loaded, Spec, VllmServing

GIB = capacity.GIB
# max_num_batched_tokens is a spec field, always rendered (serving.max_num_batched_tokens): vLLM's own default
# depends on what NVML reports of the GPU's memory, and a GB10 raises NVMLError_NotSupported there (2048 instead of
# 8192: vLLM 0.23.0's vectors gptoss120b-profile-gb10-nvml-unsupported and hy3-profile-gb10-nvml-unsupported), so
# the planner plans the value the engine is given.
# The serving.extra_args with a value that change the KV cache (vLLM resolves them when they are absent).
_VALUED_KV_FLAGS = ("--block-size",)


def plannable(spec: Spec) -> bool:
    """The planner models vLLM's memory profile from vLLM's own serving fields (gpu_memory_utilization,
    kv_cache_dtype, max_num_batched_tokens, speculative_config); it predicts nothing for another engine."""
    return isinstance(spec.serving, VllmServing)


def not_planned(spec: Spec) -> str:
    return (f"not planned: hy3spark's capacity planner models vLLM only, and serving.engine is {spec.serving.engine}; "
            "the engine's own KV cache line in the serve log is the measure")


@dataclass(frozen=True)
class Overhead:
    bytes: int
    source: str


def overhead_for(loaded: Loaded, calibrate: Path | None, override_gib: float | None) -> Overhead:
    spec = loaded.spec
    if calibrate is not None:
        try:
            text = calibrate.read_text(errors="replace")
        except OSError as exc:
            raise Hy3SparkError(f"--calibrate {calibrate}: {exc.strerror}") from None
        try:
            value, _rows = capacity.calibrate_overhead(
                text,
                total_memory_bytes=int(spec.hardware.total_memory_gib * GIB),
                gpu_memory_utilization=spec.serving.gpu_memory_utilization,
            )
        except ValueError as exc:
            raise Hy3SparkError(f"--calibrate {calibrate}: {exc}") from None
        return Overhead(value, f"calibrated from {calibrate}")
    if override_gib is not None:
        return Overhead(int(override_gib * GIB), "--overhead")
    user_set = "overhead_gib" in (loaded.raw.get("serving") or {})
    where = "the spec's serving.overhead_gib" if user_set else f"profile {spec.profile} default"
    return Overhead(int(spec.serving.overhead_gib * GIB), where)


def _human_readable_int(flag: str, value: str) -> int:
    """vLLM's human_readable_int: '2048', '2k' (2000), '2K' (2048)."""
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", value.strip())
    if not match:
        raise Hy3SparkError(f"serving.extra_args: {flag} {value!r} is not a whole number")
    number, suffix = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    return int(number) * scale


def kv_extra_args(extra_args: list[str]) -> dict[str, int | bool]:
    """The serving.extra_args that change the KV cache, read as vLLM's parser reads them: underscores in a flag name
    are dashes, ``--flag value`` or ``--flag=value``, the last one given wins. Absent flags are absent."""
    found: dict[str, int | bool] = {}
    for index, arg in enumerate(extra_args):
        if not arg.startswith("--"):
            continue
        name, has_value, value = arg.partition("=")
        name = name.replace("_", "-")
        if name in ("--disable-hybrid-kv-cache-manager", "--no-disable-hybrid-kv-cache-manager"):
            found["disable_hybrid_kv_cache_manager"] = name == "--disable-hybrid-kv-cache-manager"
        elif name in _VALUED_KV_FLAGS:
            if not has_value:
                if index + 1 >= len(extra_args):
                    raise Hy3SparkError(f"serving.extra_args: {name} needs a value")
                value = extra_args[index + 1]
            found[name[2:].replace("-", "_")] = _human_readable_int(name, value)
    return found


def plan_for(loaded: Loaded, overhead: Overhead, free_gib: float | None = None) -> capacity.Plan:
    spec = loaded.spec
    arch, s = spec.model.arch, spec.serving
    extra = kv_extra_args(s.extra_args)
    speculative = s.speculative_config or {}
    shape = capacity.ModelShape(
        num_hidden_layers=arch.num_hidden_layers,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        weight_bytes=spec.model.size_bytes,
        dtype_bytes=arch.dtype_bytes,
        mtp_layers=arch.mtp_layers if s.speculative_config else 0,
        sliding_window=arch.sliding_window,
        sliding_window_layers=arch.sliding_window_layers,
        max_context=arch.max_context,
    )
    serve = capacity.ServeConfig(
        tensor_parallel=s.tensor_parallel,
        pipeline_parallel=s.pipeline_parallel,
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs,
        kv_cache_dtype=s.kv_cache_dtype,
        max_num_batched_tokens=s.max_num_batched_tokens,
        block_size=extra.get("block_size") or capacity.BLOCK_SIZE,
        hybrid_kv_cache_manager=not extra.get("disable_hybrid_kv_cache_manager", False),
        speculative_method=str(speculative["method"]) if "method" in speculative else None,
    )
    budget = capacity.Budget(
        gpu_memory_utilization=s.gpu_memory_utilization,
        total_memory_bytes=int(spec.hardware.total_memory_gib * GIB),
        overhead_bytes=overhead.bytes,
        overhead_source=overhead.source,
        free_memory_bytes=int(free_gib * GIB) if free_gib is not None else None,
    )
    return capacity.plan(shape, serve, budget)


def rank_nodes(loaded: Loaded) -> list[str]:
    """Which node each rank lands on: Ray fills each node's GPUs in spec order."""
    names: list[str] = []
    for node in loaded.spec.nodes:
        names.extend([node.name] * node.gpus)
    return names
