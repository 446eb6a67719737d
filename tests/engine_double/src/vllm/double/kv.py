"""KV cache sizing with vLLM 0.23's arithmetic, from a FAKE GPU memory size.

Per rank (every TP x PP rank, each on its own fake GPU)::

    requested  = ceil(total * gpu_memory_utilization)          # vllm/v1/worker/utils.py request_memory
    available  = requested - weights_per_rank - overhead         # gpu_worker.determine_available_memory
               (or --kv-cache-memory-bytes, which skips profiling)
    page       = block_size * max(1, kv_heads // TP) * 2 * head_dim * kv_bytes
    num_blocks = available // page // group_size                 # group_size: layers of the rank's largest group
    num_blocks = min over ranks
    concurrency = num_blocks / sum over groups of blocks_per_request   # "Maximum concurrency ... %.2fx"
    tokens      = int(concurrency * max_model_len)               # "GPU KV cache size: %s tokens"

Layers are grouped as vLLM's hybrid KV cache manager does: one group when every layer is full attention; with
sliding-window layers (config.json ``layer_types``, e.g. gpt-oss) each type is split into groups of equal size, dealt
round-robin. A request needs ``ceil(L / block)`` blocks in a full group and ``ceil(min(window - 1 +
max_num_batched_tokens, L) / block) + 1`` in a sliding one.

The fake GPU comes from the environment (vLLM_* variables are copied from the head to the workers, as vLLM does):

- ``VLLM_DOUBLE_GPU_MEMORY_GIB`` total memory per GPU (default 121.69, what vLLM reports on a DGX Spark / GB10);
- ``VLLM_DOUBLE_GPU_FREE_GIB`` free memory at startup (default: the total); below ``requested`` startup fails with
  vLLM's "Free memory on device ... on startup is less than desired GPU memory utilization" error;
- ``VLLM_DOUBLE_OVERHEAD_GIB`` activation + non-torch + CUDA-graph memory (default 3.0, GB10 with --enforce-eager).

Weights per rank are the checkpoint's ``total_size`` (model.safetensors.index.json) / (TP x PP), so a few-kilobyte
synthetic model can carry a 181 GB index and produce Hy3's real numbers. MTP draft layers (``--speculative-config``
method ``mtp``: ``num_nextn_predict_layers``) are full decoder layers on the last PP stage.
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
    sliding: tuple[bool, ...] = ()  # per hidden layer: a sliding-window layer (empty: all full attention)
    sliding_window: int | None = None

    @property
    def kinds(self) -> list[str]:
        """Attention type of every KV layer: hidden layers, then the draft layers (full attention)."""
        hidden = ["sliding" if (self.sliding and self.sliding[i]) else "full" for i in range(self.layers)]
        return hidden + ["full"] * self.draft_layers

    @classmethod
    def from_config(cls, config: dict[str, Any], dtype_flag: str, speculative: dict[str, Any] | None) -> Shape:
        text = config.get("text_config") or config
        heads = int(text.get("num_attention_heads") or 1)
        head_dim = text.get("head_dim") or int(text.get("hidden_size", 128 * heads)) // heads
        layers = int(text.get("num_hidden_layers") or 1)
        window = text.get("sliding_window")
        types = text.get("layer_types") or []
        sliding = tuple(str(t) == "sliding_attention" for t in types[:layers]) if window and types else ()
        return cls(
            layers=layers,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            dtype_bytes=model_dtype_bytes(text, dtype_flag),
            draft_layers=draft_layers(text, speculative),
            sliding=sliding if any(sliding) else (),
            sliding_window=int(window) if window and any(sliding) else None,
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
    max_num_batched_tokens: int = 8192

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

    def stage(self, pp_rank: int) -> set[int]:
        """KV layer indices on a PP stage: vLLM's get_pp_indices gives the remainder to the stages before the last;
        the draft layers sit on the last stage."""
        per_stage = [self.shape.layers // self.pp] * self.pp
        for i in range(2, self.shape.layers % self.pp + 2):
            per_stage[-i] += 1
        start = sum(per_stage[:pp_rank])
        layers = set(range(start, start + per_stage[pp_rank]))
        if pp_rank == self.pp - 1:
            layers |= set(range(self.shape.layers, self.shape.layers + self.shape.draft_layers))
        return layers

    @property
    def groups(self) -> list[tuple[str, tuple[int, ...]]]:
        """vLLM's KV cache groups for layers of one page size (_get_kv_cache_groups_uniform_page_size)."""
        by_kind: dict[str, list[int]] = {}
        for index, kind in enumerate(self.shape.kinds):
            by_kind.setdefault(kind, []).append(index)
        if len(by_kind) == 1:
            kind, layers = next(iter(by_kind.items()))
            return [(kind, tuple(layers))]
        smallest = min(len(layers) for layers in by_kind.values())
        largest = max(len(layers) for layers in by_kind.values())
        group_size = largest if largest < smallest * 1.5 else smallest
        groups = []
        for kind, layers in by_kind.items():
            count = math.ceil(len(layers) / group_size)
            groups += [(kind, tuple(layers[i::count])) for i in range(count)]
        return groups

    def group_size(self, pp_rank: int) -> int:
        stage = self.stage(pp_rank)
        return max(len(stage.intersection(layers)) for _kind, layers in self.groups)

    def request_blocks(self, length: int) -> int:
        """Blocks one request of `length` tokens needs, summed over the groups."""
        total = 0
        for kind, _layers in self.groups:
            if kind == "full":
                total += math.ceil(length / self.block_size)
            else:
                assert self.shape.sliding_window is not None
                tokens = min(self.shape.sliding_window - 1 + self.max_num_batched_tokens, length)
                total += math.ceil(tokens / self.block_size) + 1
        return total

    @property
    def weights_per_rank(self) -> int:
        return self.weight_bytes // (self.tp * self.pp)

    @property
    def blocks_per_request(self) -> int:
        return self.request_blocks(self.max_model_len)

    def longest_within(self, blocks: int) -> int:
        """The longest request (<= max_model_len) that fits in `blocks` blocks: vLLM's estimated max model length."""
        if self.request_blocks(1) > blocks:
            return 0
        low, high, best = 1, self.max_model_len, 1
        while low <= high:
            mid = (low + high) // 2
            if self.request_blocks(mid) <= blocks:
                best, low = mid, mid + 1
            else:
                high = mid - 1
        return best


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
        group_size = sizing.group_size(rank // sizing.tp)
        rows.append((available, group_size, max(available // sizing.page_bytes // group_size, 0)))
    if min(row[2] for row in rows) <= 0:
        raise ValueError(
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing "
            "the engine."
        )
    for available, group_size, blocks in rows:
        needed = group_size * sizing.page_bytes * sizing.blocks_per_request
        if needed > available:
            raise ValueError(
                f"To serve at least one request with the model's max seq len ({sizing.max_model_len}), "
                f"({needed / GIB:.2f} GiB KV cache is needed, which is larger than the available KV cache memory "
                f"({available / GIB:.2f} GiB). Based on the available memory, the estimated maximum model length "
                f"is {sizing.longest_within(blocks)}. Try increasing `gpu_memory_utilization` or decreasing "
                "`max_model_len` when initializing the engine."
            )
    num_blocks = min(row[2] for row in rows)
    concurrency = num_blocks / sizing.blocks_per_request
    return Capacity(num_blocks=num_blocks, concurrency=concurrency, tokens=int(concurrency * sizing.max_model_len))
