"""Glue between the cluster spec and the capacity planner: `hy3spark plan` and the vllm_serve pre-launch gate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hy3spark import capacity
from hy3spark.errors import Hy3SparkError
from hy3spark.spec import Loaded

GIB = capacity.GIB


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


def plan_for(loaded: Loaded, overhead: Overhead, free_gib: float | None = None) -> capacity.Plan:
    spec = loaded.spec
    arch, s = spec.model.arch, spec.serving
    shape = capacity.ModelShape(
        num_hidden_layers=arch.num_hidden_layers,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        weight_bytes=spec.model.size_bytes,
        dtype_bytes=arch.dtype_bytes,
        mtp_layers=arch.mtp_layers if s.speculative_config else 0,
        sliding_window=arch.sliding_window,
        sliding_window_layers=arch.sliding_window_layers,
    )
    serve = capacity.ServeConfig(
        tensor_parallel=s.tensor_parallel,
        pipeline_parallel=s.pipeline_parallel,
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs,
        kv_cache_dtype=s.kv_cache_dtype,
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
