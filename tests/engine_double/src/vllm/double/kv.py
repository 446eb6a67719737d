"""KV cache sizing with vLLM 0.23's arithmetic, from a FAKE GPU memory size.

Per rank (every TP x PP rank, each on its own fake GPU)::

    requested  = ceil(total * gpu_memory_utilization)          # vllm/v1/worker/utils.py request_memory
    available  = requested - weights_per_rank - overhead         # gpu_worker.determine_available_memory
               (or --kv-cache-memory-bytes, which skips profiling)
    page       = block_size * max(1, kv_heads // TP) * 2 * head_dim * kv_bytes
    num_blocks = available // page // layers_on_rank             # one KV cache group: full attention only
    num_blocks = min over ranks
    concurrency = num_blocks / ceil(max_model_len / block_size)  # "Maximum concurrency ... %.2fx"
    tokens      = int(concurrency * max_model_len)               # "GPU KV cache size: %s tokens"

The fake GPU comes from the environment (vLLM_* variables are copied from the head to the workers, as vLLM does):

- ``VLLM_DOUBLE_GPU_MEMORY_GIB`` total memory per GPU (default 121.69, what vLLM reports on a DGX Spark / GB10);
- ``VLLM_DOUBLE_GPU_FREE_GIB`` free memory at startup (default: the total); below ``requested`` startup fails with
  vLLM's "Free memory on device ... on startup is less than desired GPU memory utilization" error;
- ``VLLM_DOUBLE_OVERHEAD_GIB`` activation + non-torch + CUDA-graph memory (default 3.0, GB10 with --enforce-eager).

Weights per rank are the checkpoint's ``total_size`` (model.safetensors.index.json) / (TP x PP), so a few-kilobyte
synthetic model can carry a 181 GB index and produce Hy3's real numbers. MTP draft layers (``--speculative-config``
method ``mtp``: ``num_nextn_predict_layers``) are full decoder layers on the last PP stage. Sliding-window layers are
treated as full attention (a documented simplification).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
DEFAULT_BLOCK_SIZE = 16
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


def env_gib(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else default


def gpu_total_bytes() -> int:
    return int(env_gib("VLLM_DOUBLE_GPU_MEMORY_GIB", 121.69) * GIB)


def gpu_free_bytes() -> int:
    raw = os.environ.get("VLLM_DOUBLE_GPU_FREE_GIB", "").strip()
    return int(float(raw) * GIB) if raw else gpu_total_bytes()


def overhead_bytes() -> int:
    return int(env_gib("VLLM_DOUBLE_OVERHEAD_GIB", 3.0) * GIB)


def model_dtype_bytes(config: dict[str, Any], dtype_flag: str) -> int:
    if dtype_flag in ("float", "float32"):
        return 4
    if dtype_flag in ("half", "float16", "bfloat16"):
        return 2
    return 4 if str(config.get("torch_dtype") or config.get("dtype") or "bfloat16") == "float32" else 2


def draft_layers(config: dict[str, Any], speculative_config: dict[str, Any] | None) -> int:
    if not speculative_config:
        return 0
    method = str(speculative_config.get("method", ""))
    if method.endswith("mtp"):
        return int(config.get("num_nextn_predict_layers") or 1)
    return 0


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    draft_layers: int

    @classmethod
    def from_config(cls, config: dict[str, Any], dtype_flag: str, speculative: dict[str, Any] | None) -> Shape:
        text = config.get("text_config") or config
        heads = int(text.get("num_attention_heads") or 1)
        head_dim = text.get("head_dim") or int(text.get("hidden_size", 128 * heads)) // heads
        return cls(
            layers=int(text.get("num_hidden_layers") or 1),
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            dtype_bytes=model_dtype_bytes(text, dtype_flag),
            draft_layers=draft_layers(text, speculative),
        )


@dataclass(frozen=True)
class Sizing:
    """Everything a worker needs to size its share, sent from the engine to every rank."""

    shape: Shape
    tp: int
    pp: int
    kv_cache_dtype: str
    block_size: int
    gpu_memory_utilization: float
    max_model_len: int
    weight_bytes: int
    kv_cache_memory_bytes: int | None

    @property
    def kv_bytes(self) -> int:
        if self.kv_cache_dtype in FP8:
            return 1
        if self.kv_cache_dtype == "bfloat16":
            return 2
        return self.shape.dtype_bytes

    @property
    def page_bytes(self) -> int:
        heads = max(1, self.shape.kv_heads // self.tp)
        return self.block_size * heads * 2 * self.shape.head_dim * self.kv_bytes

    def stage_layers(self, pp_rank: int) -> int:
        """Layers on a PP stage: vLLM's get_pp_indices gives the remainder to the stages before the last."""
        per_stage = [self.shape.layers // self.pp] * self.pp
        for i in range(2, self.shape.layers % self.pp + 2):
            per_stage[-i] += 1
        layers = per_stage[pp_rank]
        return layers + (self.shape.draft_layers if pp_rank == self.pp - 1 else 0)

    @property
    def weights_per_rank(self) -> int:
        return self.weight_bytes // (self.tp * self.pp)

    @property
    def blocks_per_request(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)


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


def available_bytes(sizing: Sizing) -> int:
    """This rank's KV cache memory (run on the rank's own node, with its own fake GPU)."""
    if sizing.kv_cache_memory_bytes is not None:
        return sizing.kv_cache_memory_bytes
    requested = requested_bytes(gpu_total_bytes(), sizing.gpu_memory_utilization)
    return requested - sizing.weights_per_rank - overhead_bytes()


@dataclass(frozen=True)
class Capacity:
    num_blocks: int
    concurrency: float
    tokens: int


def capacity(sizing: Sizing, available_per_rank: list[int]) -> Capacity:
    """num_blocks as the minimum over ranks; raises vLLM's ValueErrors when the cache cannot hold one request."""
    rows = []
    for rank, available in enumerate(available_per_rank):
        layers = sizing.stage_layers(rank // sizing.tp)
        rows.append((available, layers, max(available // sizing.page_bytes // layers, 0)))
    if min(row[2] for row in rows) <= 0:
        raise ValueError(
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing "
            "the engine."
        )
    for available, layers, _blocks in rows:
        needed = layers * sizing.page_bytes * sizing.blocks_per_request
        if needed > available:
            estimated = available // (layers * sizing.page_bytes) * sizing.block_size
            raise ValueError(
                f"To serve at least one request with the model's max seq len ({sizing.max_model_len}), "
                f"({needed / GIB:.2f} GiB KV cache is needed, which is larger than the available KV cache memory "
                f"({available / GIB:.2f} GiB). Based on the available memory, the estimated maximum model length "
                f"is {estimated}. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
                "initializing the engine."
            )
    num_blocks = min(row[2] for row in rows)
    concurrency = num_blocks / sizing.blocks_per_request
    return Capacity(num_blocks=num_blocks, concurrency=concurrency, tokens=int(concurrency * sizing.max_model_len))
