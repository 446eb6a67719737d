"""Predict vLLM's KV cache before the model loads.

A Hy3 load takes about ten minutes and vLLM only says at the end whether the configuration can serve, in two startup
lines: ``GPU KV cache size: N tokens`` and ``Maximum concurrency for L tokens per request: C.CCx``. This module
computes both from the model's shape and the serving knobs, the way vLLM 0.23 does (read from its source:
``vllm/v1/worker/utils.py`` ``request_memory``, ``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``,
``vllm/v1/kv_cache_interface.py`` ``FullAttentionSpec``/``SlidingWindowSpec``, ``vllm/v1/core/kv_cache_utils.py``
``get_kv_cache_groups``/``get_kv_cache_configs``/``get_max_concurrency_for_kv_cache_config``), and is tested against
every case of vLLM 0.23.0's own vectors (``tests/fixtures/vllm-0.23.0/kv-cases.json``):

- per rank: ``requested = ceil(total * gpu_memory_utilization)``; ``available = requested - weights - overhead``;
  ``num_blocks = available // page // group_size``, where ``page = block_size * kv_heads_per_rank * 2 * head_dim *
  kv_bytes`` and ``group_size`` is the number of layers in the rank's largest KV cache group; then the minimum over
  ranks;
- layers are grouped as vLLM's hybrid allocator does: one group when every layer has the same attention type;
  otherwise the layers of each type are split into groups of ``group_size`` layers (the smallest type's count, or the
  largest when it is under 1.5x the smallest), each type's layers dealt round-robin (``layers[i::num_groups]``).
  With ``--disable-hybrid-kv-cache-manager`` every layer is a full-attention layer (one group);
- a full-length request needs ``ceil(L / block_size)`` blocks in each full-attention group and
  ``ceil(min(window - 1 + max_num_batched_tokens, L) / block_size) + 1`` in each sliding-window group;
  concurrency = num_blocks / (sum over groups); tokens = int(concurrency * L);
- vLLM then checks each rank in order and raises on the FIRST that fails: ``No available memory for the cache
  blocks`` when its available memory is <= 0, else ``To serve at least one request ...`` when one full-length request
  needs more than it has, quoting that rank's estimated maximum model length (:attr:`Plan.vllm_error`);
- ``--max-model-len -1`` (auto-fit) starts from the model's own length and takes the longest that fits on every rank;
- with MTP speculative decoding (``ServeConfig.speculative_method``) and PP > 1, vLLM 0.23 refuses the configuration
  before any of this (:func:`pipeline_parallel_refusal`);
- PP stages get their hidden layers as vLLM's ``get_pp_indices`` splits them (:func:`pp_layer_partition`);
- when one full-length request does not fit, :attr:`Plan.remedy` says what does: the longest max_model_len that fits
  on every rank, and the smallest gpu_memory_utilization (two decimals) with which every rank holds one request.

Memory per GPU: ``Budget.total_memory_bytes`` is one GPU's total as vLLM sees it (torch's total). A DGX Spark has one
GB10 per node, whose memory the OS shares (``unified_memory``: free memory is the node's MemAvailable); a desktop's
discrete cards each have their own (``unified_memory=False``: free memory is each card's, which a display or another
process on the card lowers; ``free_memory_bytes`` may then be given per rank).

What is approximated, and why:

- ``overhead`` (activation peak + non-torch growth + CUDA-graph estimate) is the one empirical term: vLLM measures it
  by running the model. It comes from a profile default, ``--overhead``, or :func:`calibrate_overhead` on a real log.
- Weights: each PP stage holds its hidden layers' share of ``weight_bytes`` (the layers are taken as equal in size),
  the first stage also ``ModelShape.embedding_bytes`` and the last ``lm_head_bytes`` (both 0 unless given: then the
  split is even), each divided by TP (vLLM shards the vocabulary too); ``weights_per_rank_bytes`` overrides it.
- Sliding-window layers are taken as evenly interleaved with full ones (true of gpt-oss, which alternates); vLLM reads
  the real per-layer pattern. It only changes the result under PP, where it decides which stage gets which layers.
- MTP/draft layers are full-attention layers with the main layers' KV shape, on the last PP stage.
- ``max_num_batched_tokens`` (it only matters for sliding-window layers) is an input: vLLM's default depends on what
  NVML says about the GPU (:func:`vllm_default_max_num_batched_tokens`).
- A backend that changes the block size after the model loads is not modelled: ``block_size`` is what vLLM resolved.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

GIB = 1 << 30
# vLLM's default KV block size on CUDA (CacheConfig.block_size).
BLOCK_SIZE = 16
# What vLLM reports as total memory on a DGX Spark (GB10), seen in several public startup logs.
GB10_TOTAL_MEMORY_BYTES = int(121.69 * GIB)
# `vllm serve --max-model-len -1`: fit the length to the memory (vLLM's auto-fit).
AUTO_FIT_MAX_MODEL_LEN = -1
# vLLM's default max_num_batched_tokens for `vllm serve` on a GPU whose NVML reports >= 70 GiB; a GB10 gets 2048
# (see vllm_default_max_num_batched_tokens). It only matters for sliding-window layers, whose per-request blocks grow
# with the chunked-prefill chunk.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# vLLM 0.23.0's error texts (vllm/v1/core/kv_cache_utils.py, vllm/config/model.py), as its vectors recorded them.
NO_MEMORY_ERROR = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine "
    "(this flag also controls CPU memory reservation on the CPU backend, despite its name). See "
    "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)
TOO_SMALL_ERROR = (
    "To serve at least one request with the model's max seq len ({max_model_len}), ({needed} GiB KV cache is needed, "
    "which is larger than the available KV cache memory ({available} GiB). Based on the available memory, the "
    "estimated maximum model length is {estimate}. Try increasing `gpu_memory_utilization` (which also controls CPU "
    "memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See "
    "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)
MTP_PP_ERROR = (
    "Pipeline parallelism is not supported for this model. Supported models implement the `SupportsPP` interface."
)

_FP8_KV_DTYPES = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"})
_TWO_BYTE_KV_DTYPES = frozenset({"bfloat16", "float16"})


class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True)
class Problem:
    """Something that stops vLLM from starting (error) or from serving as configured (warning); says what to change."""

    severity: Severity
    code: str
    message: str


@dataclass(frozen=True)
class ModelShape:
    """The numbers from config.json (and the checkpoint index) that size the KV cache."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    weight_bytes: int
    dtype_bytes: int = 2
    # Draft (MTP) layers: full-attention layers with the main layers' KV shape, on the last PP stage.
    mtp_layers: int = 0
    sliding_window: int | None = None
    sliding_window_layers: int = 0
    # The model's own maximum length (max_position_embeddings): where --max-model-len -1 starts from.
    max_context: int | None = None
    # Parts of weight_bytes outside the hidden layers that PP puts on one stage: the input embedding on the first, the
    # LM head on the last (vocab_size x hidden_size x dtype bytes each; a tied head is a second copy under PP). 0: the
    # weights are taken as split evenly over the layers.
    embedding_bytes: int = 0
    lm_head_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("num_hidden_layers", "num_key_value_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.weight_bytes < 0 or self.mtp_layers < 0 or self.sliding_window_layers < 0:
            raise ValueError("ModelShape.weight_bytes, mtp_layers and sliding_window_layers must be >= 0")
        if self.sliding_window_layers > self.num_hidden_layers:
            raise ValueError(
                f"ModelShape.sliding_window_layers ({self.sliding_window_layers}) exceeds num_hidden_layers "
                f"({self.num_hidden_layers})"
            )
        if self.sliding_window_layers and not self.sliding_window:
            raise ValueError("ModelShape.sliding_window_layers > 0 needs sliding_window (the window in tokens)")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"ModelShape.max_context must be >= 1, got {self.max_context}")
        if self.embedding_bytes < 0 or self.lm_head_bytes < 0:
            raise ValueError("ModelShape.embedding_bytes and lm_head_bytes must be >= 0")
        if self.embedding_bytes + self.lm_head_bytes > self.weight_bytes:
            raise ValueError(
                f"ModelShape.embedding_bytes + lm_head_bytes ({self.embedding_bytes + self.lm_head_bytes}) exceed "
                f"weight_bytes ({self.weight_bytes})"
            )


@dataclass(frozen=True)
class ServeConfig:
    """The vLLM serving knobs that size the KV cache."""

    tensor_parallel: int
    max_model_len: int  # AUTO_FIT_MAX_MODEL_LEN (-1): vLLM fits it to the memory, from ModelShape.max_context
    max_num_seqs: int
    pipeline_parallel: int = 1
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    block_size: int = BLOCK_SIZE
    # False: --disable-hybrid-kv-cache-manager (sliding-window layers keep full-length KV, all in one group).
    hybrid_kv_cache_manager: bool = True
    # --speculative-config's method ("mtp"); the draft layers themselves are ModelShape.mtp_layers.
    speculative_method: str | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 1 and self.max_model_len != AUTO_FIT_MAX_MODEL_LEN:
            raise ValueError(f"ServeConfig.max_model_len must be >= 1 or -1 (auto-fit), got {self.max_model_len}")
        known = {"auto"} | _FP8_KV_DTYPES | _TWO_BYTE_KV_DTYPES
        if self.kv_cache_dtype not in known:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {', '.join(sorted(known))}")


@dataclass(frozen=True)
class Budget:
    """Memory per GPU and where the non-KV part goes. One GPU per rank: a DGX Spark node has one (unified memory), a
    desktop may have several discrete cards (``unified_memory=False``), each with the same total."""

    gpu_memory_utilization: float
    # One GPU's total as vLLM sees it (torch.cuda.mem_get_info's total): GB10 121.69 GiB; a 24 GB card about 23.7.
    total_memory_bytes: int
    overhead_bytes: int
    # Where overhead_bytes came from, shown next to the plan: "profile default", "calibrated from <log>", "--overhead".
    overhead_source: str
    # Free memory at startup; vLLM refuses to start a rank whose GPU has less free than it requests. One value: the
    # lowest over the GPUs; a tuple: one per rank, in rank order. Unified memory: the node's MemAvailable; discrete
    # cards: the card's own free memory (nvidia-smi memory.free), which a display on the card lowers.
    free_memory_bytes: int | tuple[int, ...] | None = None
    weights_per_rank_bytes: int | None = None
    # True: the GPU shares the node's memory with the OS (GB10); False: discrete cards with memory of their own.
    unified_memory: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.total_memory_bytes < 1 or self.overhead_bytes < 0:
            raise ValueError("total_memory_bytes must be >= 1 and overhead_bytes >= 0")


@dataclass(frozen=True)
class KVGroup:
    """One vLLM KV cache group: layers of one attention type sharing a block table."""

    kind: str  # "full" or "sliding"
    layers: tuple[int, ...]  # indices into the model's attention layers (MTP layers follow the hidden layers)
    blocks_per_request: int  # blocks one max_model_len request needs in this group


@dataclass(frozen=True)
class RankRow:
    """One rank's memory budget. The budget fields are None when planned from a known available KV memory."""

    rank: int
    pp_rank: int
    tp_rank: int
    kv_layers: int
    total_bytes: int | None
    requested_bytes: int | None
    weights_bytes: int | None
    overhead_bytes: int | None
    kv_available_bytes: int
    num_blocks: int  # this rank's own blocks, before the minimum over ranks
    kv_needed_bytes: int  # KV memory one max_model_len request needs on this rank (vLLM's startup check)
    # Where one max_model_len request does not fit: the longest that does on this rank (vLLM's estimate).
    estimated_max_model_len: int | None = None


@dataclass(frozen=True)
class VllmError:
    """The exception vLLM raises for this configuration, with its message as vLLM formats it."""

    type: str  # "ValueError" (the KV cache check), "NotImplementedError" (a refused configuration)
    message: str
    rank: int | None = None  # the first rank that failed the check (vLLM stops there)
    estimated_max_model_len: int | None = None


@dataclass(frozen=True)
class Remedy:
    """What to change so that every rank holds one full-length request, without which vLLM refuses to start."""

    # The rank vLLM names: the first that fails its check (vLLM stops there), in rank order (pp-major).
    rank: int
    # Set max_model_len to at most this: the longest that fits on every rank; None when not even one token does.
    max_model_len: int | None
    max_model_len_rank: int  # the rank that decides it (the fewest tokens)
    # Raise gpu_memory_utilization to at least this (two decimals, as vLLM takes it): the smallest with which every
    # rank fits. None when the plan has no memory budget (planned from a known KV memory) or no value up to 1.0, or up
    # to what the GPUs have free, is enough (gpu_memory_utilization_needed says how much would be).
    gpu_memory_utilization: float | None
    gpu_memory_utilization_rank: int | None  # the rank that needs the most
    gpu_memory_utilization_needed: float | None = None  # unrounded fraction of total the neediest rank would ask


@dataclass(frozen=True)
class Plan:
    rows: tuple[RankRow, ...]
    groups: tuple[KVGroup, ...]
    kv_heads_per_rank: int
    page_bytes: int  # bytes of one block of one layer
    num_blocks: int  # min over ranks: what every rank allocates
    blocks_per_request: int
    max_model_len: int  # the length vLLM serves (after auto-fit)
    max_concurrency: float
    kv_cache_tokens: int
    overhead_source: str | None
    problems: tuple[Problem, ...]
    vllm_error: VllmError | None = None
    auto_fit_from: int | None = None  # with --max-model-len -1: the model's length that auto-fit started from
    # With concurrency < 1 (vLLM refuses to start): the rank vLLM names and the two knobs, with numbers.
    remedy: Remedy | None = None

    @property
    def kv_cache_size_line(self) -> str:
        """The startup line exactly as vLLM logs it (``"GPU KV cache size: %s tokens"`` with ``f"{n:,}"``)."""
        return f"GPU KV cache size: {self.kv_cache_tokens:,} tokens"

    @property
    def max_concurrency_line(self) -> str:
        """The startup line exactly as vLLM logs it (``"Maximum concurrency for %s tokens per request: %.2fx"``)."""
        return f"Maximum concurrency for {self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x"

    @property
    def ok(self) -> bool:
        return not any(p.severity is Severity.ERROR for p in self.problems)


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


def _vllm_gib(value: int) -> str:
    """vLLM's format_gib: GiB rounded to two decimals, printed as a float (``3.0``, ``6.75``)."""
    return str(round(value / GIB, 2))


def vllm_default_max_num_batched_tokens(nvml_total_memory_bytes: int | None) -> int:
    """`vllm serve`'s max_num_batched_tokens when none is given (EngineArgs.get_batch_defaults, OPENAI_API_SERVER):
    8192 on a GPU whose NVML reports at least 70 GiB (an A100 excepted), else 2048.

    None: NVML cannot report the memory. That is a DGX Spark: its GB10's memory query raises NVMLError_NotSupported,
    which vLLM takes as 0 GiB, so `vllm serve` on a Spark defaults to 2048.
    """
    if nvml_total_memory_bytes is not None and nvml_total_memory_bytes >= 70 * GIB:
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    return 2048


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes per KV element: 1 for fp8 caches, else the named dtype, and the model's dtype for "auto"."""
    if kv_cache_dtype in _FP8_KV_DTYPES:
        return 1
    if kv_cache_dtype in _TWO_BYTE_KV_DTYPES:
        return 2
    return model_dtype_bytes


def pp_layer_partition(num_hidden_layers: int, pp_size: int) -> tuple[int, ...]:
    """Hidden layers per PP stage, as vLLM 0.23's ``vllm.distributed.utils.get_pp_indices`` splits them when
    VLLM_PP_LAYER_PARTITION is unset: ``num_hidden_layers // pp_size`` each, and the remainder one layer each to the
    stages before the last, counting back from the second-to-last (the last also holds the LM head). 80 over 3 is
    (27, 27, 26), 64 over 3 (21, 22, 21), 10 over 4 (2, 3, 3, 2); vLLM logs "Hidden layers were unevenly
    partitioned: [27,27,26]"."""
    if not 1 <= pp_size <= num_hidden_layers:
        raise ValueError(f"pipeline_parallel {pp_size} must be between 1 and the model's {num_hidden_layers} layers")
    partition = [num_hidden_layers // pp_size] * pp_size
    for i in range(2, num_hidden_layers % pp_size + 2):
        partition[-i] += 1
    return tuple(partition)


def _pp_stage_layers(num_hidden_layers: int, pp_size: int) -> list[range]:
    stages, start = [], 0
    for count in pp_layer_partition(num_hidden_layers, pp_size):
        stages.append(range(start, start + count))
        start += count
    return stages


def stage_weight_bytes(shape: ModelShape, serve: ServeConfig) -> tuple[int, ...]:
    """Weights on each rank of each PP stage (one value per stage): the stage's share of the layer weights (the draft
    layers count as layers of the last stage), plus the embedding on the first stage and the LM head on the last,
    divided by TP. With PP 1, or with no embedding/LM head given and an even split: ``weight_bytes // (TP * PP)``."""
    tp, pp = serve.tensor_parallel, serve.pipeline_parallel
    partition = list(pp_layer_partition(shape.num_hidden_layers, pp))
    partition[-1] += shape.mtp_layers
    layer_bytes = shape.weight_bytes - shape.embedding_bytes - shape.lm_head_bytes
    layers = shape.num_hidden_layers + shape.mtp_layers
    stages = []
    for stage, count in enumerate(partition):
        on_stage = layer_bytes * count // layers
        if stage == 0:
            on_stage += shape.embedding_bytes
        if stage == pp - 1:
            on_stage += shape.lm_head_bytes
        stages.append(on_stage // tp)
    return tuple(stages)


def refuses_pipeline_parallel(speculative_method: str | None) -> bool:
    """Whether vLLM 0.23 refuses ``--pipeline-parallel-size`` > 1 with this ``--speculative-config`` method.

    The rule (vLLM 0.23.0, ``create_engine_config`` -> ``SpeculativeConfig`` -> the draft model config's
    ``verify_with_parallel_config``): with PP > 1 a draft model whose architecture does not implement ``SupportsPP``
    raises ``NotImplementedError: Pipeline parallelism is not supported for this model``, before anything loads.
    MTP drafters are draft models without it (Hy3's, vector hy3-tp2-pp2-mtp-rejected; DeepSeek's and Qwen3.5's by
    public reports), so every MTP method (``mtp`` or a ``*_mtp`` name) is refused; ngram/suffix have no draft model,
    and EAGLE or draft-model methods are not judged here.
    """
    return speculative_method is not None and (speculative_method == "mtp" or speculative_method.endswith("_mtp"))


def pipeline_parallel_refusal(speculative_method: str | None, pipeline_parallel: int) -> Problem | None:
    """The error vLLM 0.23 raises for MTP speculative decoding with pipeline_parallel > 1 (see
    :func:`refuses_pipeline_parallel`), as a Problem with code ``mtp-pp``; None when vLLM accepts the pair."""
    if pipeline_parallel <= 1 or not refuses_pipeline_parallel(speculative_method):
        return None
    return Problem(
        Severity.ERROR,
        "mtp-pp",
        f"vLLM 0.23 refuses MTP speculative decoding with pipeline_parallel {pipeline_parallel} ({MTP_PP_ERROR}); "
        "use pipeline_parallel 1 and spread the model with tensor_parallel, or drop speculative_config",
    )


def _layer_kinds(shape: ModelShape, hybrid: bool) -> list[str]:
    sliding, total = shape.sliding_window_layers, shape.num_hidden_layers
    # Even interleaving: layer i is sliding when i*S mod N < S, which for gpt-oss (18 of 36) alternates starting
    # with a sliding layer, as its config.json layer_types do. Without the hybrid manager vLLM gives sliding layers
    # a full-length cache, so for the KV cache they are full layers.
    kinds = ["sliding" if hybrid and (i * sliding) % total < sliding else "full" for i in range(total)]
    return kinds + ["full"] * shape.mtp_layers


def _kv_cache_groups(kinds: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """vLLM's get_kv_cache_groups for layers that share one page size (same KV heads, head_dim and dtype)."""
    same_type: dict[str, list[int]] = defaultdict(list)
    for index, kind in enumerate(kinds):
        same_type[kind].append(index)
    if len(same_type) == 1:
        kind, layers = next(iter(same_type.items()))
        return [(kind, tuple(layers))]
    # _get_kv_cache_groups_uniform_page_size: groups of equal size, the n:1 pattern's "1" as the size unless the
    # counts are close (gpt-oss + a drafter: 12 sliding + 13 full become two groups of 13).
    min_layers = min(len(layers) for layers in same_type.values())
    max_layers = max(len(layers) for layers in same_type.values())
    group_size = max_layers if max_layers < min_layers * 1.5 else min_layers
    groups = []
    for kind, layers in same_type.items():
        num_groups = math.ceil(len(layers) / group_size)
        groups.extend((kind, tuple(layers[i::num_groups])) for i in range(num_groups))
    return groups


def _blocks_per_request(kind: str, length: int, shape: ModelShape, serve: ServeConfig) -> int:
    if kind == "full":
        return math.ceil(length / serve.block_size)
    assert shape.sliding_window is not None
    # SlidingWindowSpec.max_memory_usage_bytes: the last window-1 tokens plus one prefill chunk, never more than the
    # request, and +1 block because the window need not start on a block boundary.
    tokens = min(shape.sliding_window - 1 + serve.max_num_batched_tokens, length)
    return math.ceil(tokens / serve.block_size) + 1


def _request_blocks(kinds: Sequence[str], length: int, shape: ModelShape, serve: ServeConfig) -> int:
    return sum(_blocks_per_request(kind, length, shape, serve) for kind in kinds)


def _longest_len_within(
    blocks_budget: int, kinds: Sequence[str], upper: int, shape: ModelShape, serve: ServeConfig
) -> int:
    """Largest length <= upper whose request fits in blocks_budget blocks (vLLM's binary search); 0 if none.

    vLLM searches for the longest length whose KV memory fits the rank's available memory; with
    ``num_blocks = available // (page * group_size)`` that is the same as fitting in num_blocks blocks.
    """
    if _request_blocks(kinds, 1, shape, serve) > blocks_budget:
        return 0
    low, high, best = 1, upper, 1
    while low <= high:
        mid = (low + high) // 2
        if _request_blocks(kinds, mid, shape, serve) <= blocks_budget:
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best


def _kv_memory_hint(serve: ServeConfig, utilization: str | None = None) -> str:
    hints = [utilization or "raise gpu_memory_utilization (if the nodes have the memory free)"]
    if serve.kv_cache_dtype not in _FP8_KV_DTYPES:
        hints.append("use kv_cache_dtype fp8 (half the bytes per token)")
    hints.append("spread the model over more ranks")
    return ", ".join(hints)


def _tp_problem(shape: ModelShape, serve: ServeConfig) -> Problem | None:
    heads, tp = shape.num_key_value_heads, serve.tensor_parallel
    # vLLM's QKVParallelLinear shards KV heads when TP divides them and replicates them when they divide TP;
    # anything else fails its divide() assertion at load time.
    if heads % tp == 0 or tp % heads == 0:
        return None
    divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
    return Problem(
        Severity.ERROR,
        "tp-kv-heads",
        f"tensor_parallel {tp} does not divide the model's {heads} KV heads (nor do they divide it), so vLLM cannot "
        f"shard them; use a tensor_parallel of {divisors} (or a multiple of {heads})",
    )


def _free_per_rank(budget: Budget, ranks: int) -> list[int] | None:
    free = budget.free_memory_bytes
    if free is None:
        return None
    if isinstance(free, int):
        return [free] * ranks
    if len(free) != ranks:
        raise ValueError(f"got {len(free)} free-memory values for {ranks} ranks (TP x PP)")
    return list(free)


def _startup_problem(budget: Budget, requested: int, free: Sequence[int] | None) -> Problem | None:
    short = [(rank, value) for rank, value in enumerate(free or []) if value < requested]
    if not short:
        return None
    # The GPU with the least free memory decides; vLLM checks each rank's own GPU.
    rank, least = min(short, key=lambda item: item[1])
    # Largest two-decimal utilization whose ceil(total * util) still fits in the free memory.
    suggested = math.floor(least / budget.total_memory_bytes * 100) / 100
    while suggested > 0 and math.ceil(budget.total_memory_bytes * suggested) > least:
        suggested = round(suggested - 0.01, 2)
    if budget.unified_memory:
        fix = "free memory on the nodes (stop other containers and processes, drop the page cache)"
    else:
        fix = "free memory on the card (a display server or another process on it: nvidia-smi lists them)"
    if suggested > 0:
        fix = f"lower gpu_memory_utilization to {suggested:.2f} (which also shrinks the KV cache) or {fix}"
    where = "" if isinstance(budget.free_memory_bytes, int) else f" on rank {rank}'s GPU"
    return Problem(
        Severity.ERROR,
        "startup-memory",
        f"vLLM will refuse to start: free memory{where} {_gib(least)} is less than the {_gib(requested)} it "
        f"requests (gpu_memory_utilization {budget.gpu_memory_utilization} x {_gib(budget.total_memory_bytes)} "
        f"total); {fix}",
    )


def _first_failing_rank(rows: Sequence[RankRow], length: int) -> VllmError | None:
    """vLLM's admission check (_check_enough_kv_cache_memory), rank by rank in order; it raises on the first failure."""
    for row in rows:
        if row.kv_available_bytes <= 0:
            return VllmError("ValueError", NO_MEMORY_ERROR, rank=row.rank)
        if row.kv_needed_bytes > row.kv_available_bytes:
            assert row.estimated_max_model_len is not None
            message = TOO_SMALL_ERROR.format(
                max_model_len=length,
                needed=_vllm_gib(row.kv_needed_bytes),
                available=_vllm_gib(row.kv_available_bytes),
                estimate=row.estimated_max_model_len,
            )
            return VllmError("ValueError", message, row.rank, row.estimated_max_model_len)
    return None


def _least_utilization(total: int, required: int) -> float:
    """The smallest two-decimal gpu_memory_utilization u with ceil(total * u) >= required (vLLM's requested memory)."""
    utilization = max(math.ceil(required / total * 100) / 100, 0.01)
    while utilization > 0.01 and math.ceil(total * round(utilization - 0.01, 2)) >= required:
        utilization = round(utilization - 0.01, 2)
    while math.ceil(total * utilization) < required:
        utilization = round(utilization + 0.01, 2)
    return utilization


def _remedy(
    rows: Sequence[RankRow],
    kinds: Sequence[str],
    length: int,
    error: VllmError,
    shape: ModelShape,
    serve: ServeConfig,
    free: Sequence[int] | None,
) -> tuple[Remedy, str | None]:
    """The longest max_model_len and the smallest gpu_memory_utilization with which every rank holds one request, and
    the utilization advice as a phrase (None without a budget)."""
    fits = [_longest_len_within(row.num_blocks, kinds, length, shape, serve) for row in rows]
    length_rank = min(range(len(rows)), key=lambda rank: fits[rank])
    utilization = utilization_rank = needed = None
    phrase = None
    budgets = [(row.total_bytes, row.weights_bytes, row.overhead_bytes) for row in rows]
    if all(None not in budget for budget in budgets):
        # Each rank needs requested >= weights + overhead + the KV memory of one request (vLLM's admission check).
        required = [
            (row.kv_needed_bytes + (row.weights_bytes or 0) + (row.overhead_bytes or 0), row.total_bytes or 1)
            for row in rows
        ]
        least = [_least_utilization(total, need) for need, total in required]
        utilization_rank = max(range(len(rows)), key=lambda rank: least[rank])
        need, total = required[utilization_rank]
        needed = need / total
        utilization = least[utilization_rank]
        short = [rank for rank in range(len(rows)) if free and math.ceil(required[rank][1] * utilization) > free[rank]]
        if utilization > 1:
            phrase = (
                f"no gpu_memory_utilization is enough (rank {utilization_rank} would need {needed:.2f} of its "
                f"GPU's {_gib(total)})"
            )
            utilization = None
        elif short and free:
            asked = math.ceil(required[short[0]][1] * utilization)
            phrase = (
                f"gpu_memory_utilization {utilization:.2f} would do it (rank {utilization_rank} needs it), but it "
                f"requests {_gib(asked)} and rank {short[0]}'s GPU has only {_gib(free[short[0]])} free"
            )
            utilization = None
        else:
            asked = math.ceil(total * utilization)
            phrase = (
                f"raise gpu_memory_utilization to at least {utilization:.2f} (rank {utilization_rank} needs it: "
                f"{_gib(asked)} of {_gib(total)}, if the GPU has that much free)"
            )
    remedy = Remedy(
        rank=error.rank or 0,
        max_model_len=fits[length_rank] or None,
        max_model_len_rank=length_rank,
        gpu_memory_utilization=utilization,
        gpu_memory_utilization_rank=utilization_rank,
        gpu_memory_utilization_needed=needed,
    )
    return remedy, phrase


def _stage(row: RankRow, serve: ServeConfig) -> str:
    if serve.pipeline_parallel == 1:
        return ""
    return f" (PP stage {row.pp_rank} of {serve.pipeline_parallel}, {row.kv_layers} KV layers)"


def _capacity_problems(
    rows: Sequence[RankRow],
    kinds: Sequence[str],
    num_blocks: int,
    concurrency: float,
    length: int,
    error: VllmError | None,
    remedy: tuple[Remedy, str | None] | None,
    shape: ModelShape,
    serve: ServeConfig,
) -> list[Problem]:
    if error is not None and remedy is not None:
        fix, utilization = remedy
        row = rows[fix.rank]
        hint = _kv_memory_hint(serve, utilization)
        if error.message == NO_MEMORY_ERROR:
            if row.requested_bytes is None:
                spent = ""
            else:
                spent = (
                    f" (requested {_gib(row.requested_bytes)} - weights {_gib(row.weights_bytes or 0)}"
                    f" - overhead {_gib(row.overhead_bytes or 0)})"
                )
            return [
                Problem(
                    Severity.ERROR,
                    "no-kv-memory",
                    f"rank {row.rank}{_stage(row, serve)} has {_gib(row.kv_available_bytes)} left for the KV "
                    f"cache{spent}, so vLLM will stop with 'No available memory for the cache blocks'; {hint}, or use "
                    "a smaller checkpoint",
                )
            ]
        # vLLM quotes the first failing rank's estimate; a later rank may fit less, and the length to set is the
        # one that fits on every rank.
        fits = fix.max_model_len
        if not fits:
            estimate = f"not even a one-token request fits on rank {fix.max_model_len_rank}: "
        elif fits == error.estimated_max_model_len:
            estimate = f"the estimated maximum model length is {fits}: set max_model_len to at most {fits}, or "
        else:
            estimate = (
                f"the estimated maximum model length is {error.estimated_max_model_len} (vLLM stops at the first "
                f"rank that fails), but rank {fix.max_model_len_rank} fits only {fits}: set max_model_len to at "
                f"most {fits}, or "
            )
        return [
            Problem(
                Severity.ERROR,
                "max-model-len",
                f"one {length:,}-token request needs {_gib(row.kv_needed_bytes)} of KV cache on rank {row.rank} but "
                f"only {_gib(row.kv_available_bytes)} is available{_stage(row, serve)}, so vLLM will refuse to start "
                f"(concurrency {concurrency:.2f}x < 1); {estimate}{hint}",
            )
        ]
    if concurrency < serve.max_num_seqs:
        fits = _longest_len_within(num_blocks // serve.max_num_seqs, kinds, length, shape, serve)
        shorter = f", max_model_len to {fits:,} (fits {serve.max_num_seqs} full-length requests)" if fits else ""
        return [
            Problem(
                Severity.WARNING,
                "concurrency",
                f"only {concurrency:.2f} requests of {length:,} tokens fit in the KV cache, fewer than "
                f"max_num_seqs {serve.max_num_seqs}: with long prompts the rest wait or are preempted; lower "
                f"max_num_seqs to {math.floor(concurrency)}{shorter}, or {_kv_memory_hint(serve)}",
            )
        ]
    return []


def _plan(
    shape: ModelShape,
    serve: ServeConfig,
    available: Sequence[int],
    budget_rows: Sequence[tuple[int, ...]] | None,
    overhead_source: str | None,
    early_problems: Sequence[Problem],
    free: Sequence[int] | None = None,
) -> Plan:
    tp, pp = serve.tensor_parallel, serve.pipeline_parallel
    kv_heads = max(1, shape.num_key_value_heads // tp)
    page = serve.block_size * kv_heads * 2 * shape.head_dim * kv_dtype_bytes(serve.kv_cache_dtype, shape.dtype_bytes)
    layer_groups = _kv_cache_groups(_layer_kinds(shape, serve.hybrid_kv_cache_manager))
    kinds = [kind for kind, _layers in layer_groups]
    stages = [set(stage) for stage in _pp_stage_layers(shape.num_hidden_layers, pp)]
    stages[-1].update(range(shape.num_hidden_layers, shape.num_hidden_layers + shape.mtp_layers))
    # vLLM projects the global groups onto each stage's layers; the pool is split into as many tensors as the
    # largest projected group has layers.
    group_sizes = [max(len(stage.intersection(layers)) for _kind, layers in layer_groups) for stage in stages]
    rank_blocks = [max(available[rank] // page // group_sizes[rank // tp], 0) for rank in range(tp * pp)]

    length, auto_fit_from = serve.max_model_len, None
    if length == AUTO_FIT_MAX_MODEL_LEN:
        if shape.max_context is None:
            raise ValueError("max_model_len -1 (auto-fit) needs ModelShape.max_context, the model's own length")
        # vLLM's auto-fit: the longest length up to the model's own that fits on every rank.
        auto_fit_from = shape.max_context
        fits = min(_longest_len_within(blocks, kinds, auto_fit_from, shape, serve) for blocks in rank_blocks)
        length = fits or auto_fit_from  # nothing fits: the admission check below reports it
    groups = tuple(
        KVGroup(kind, layers, _blocks_per_request(kind, length, shape, serve)) for kind, layers in layer_groups
    )
    blocks_per_request = sum(group.blocks_per_request for group in groups)

    rows = []
    for rank, blocks in enumerate(rank_blocks):
        pp_rank, tp_rank = divmod(rank, tp)
        total, requested, weights, overhead = budget_rows[rank] if budget_rows else (None, None, None, None)
        needed = group_sizes[pp_rank] * page * blocks_per_request
        rows.append(
            RankRow(
                rank=rank,
                pp_rank=pp_rank,
                tp_rank=tp_rank,
                kv_layers=len(stages[pp_rank]),
                total_bytes=total,
                requested_bytes=requested,
                weights_bytes=weights,
                overhead_bytes=overhead,
                kv_available_bytes=available[rank],
                num_blocks=blocks,
                kv_needed_bytes=needed,
                estimated_max_model_len=(
                    _longest_len_within(blocks, kinds, length, shape, serve) if 0 < available[rank] < needed else None
                ),
            )
        )
    num_blocks = min(rank_blocks)
    concurrency = num_blocks / blocks_per_request
    problems = [*early_problems]
    if (tp_problem := _tp_problem(shape, serve)) is not None:
        problems.append(tp_problem)
    remedy = None
    if (refusal := pipeline_parallel_refusal(serve.speculative_method, pp)) is not None:
        # create_engine_config refuses it (the MTP drafter does not implement SupportsPP): no KV check runs.
        vllm_error: VllmError | None = VllmError("NotImplementedError", MTP_PP_ERROR)
        problems.append(refusal)
    else:
        vllm_error = _first_failing_rank(rows, length)
        if vllm_error is not None:
            remedy = _remedy(rows, kinds, length, vllm_error, shape, serve, free)
        problems.extend(
            _capacity_problems(rows, kinds, num_blocks, concurrency, length, vllm_error, remedy, shape, serve)
        )
    return Plan(
        rows=tuple(rows),
        groups=groups,
        kv_heads_per_rank=kv_heads,
        page_bytes=page,
        num_blocks=num_blocks,
        blocks_per_request=blocks_per_request,
        max_model_len=length,
        max_concurrency=concurrency,
        kv_cache_tokens=int(concurrency * length),
        overhead_source=overhead_source,
        problems=tuple(problems),
        vllm_error=vllm_error,
        auto_fit_from=auto_fit_from,
        remedy=remedy[0] if remedy else None,
    )


def plan(shape: ModelShape, serve: ServeConfig, budget: Budget) -> Plan:
    """Predict the KV cache from the whole memory budget, per rank: total x utilization - the weights of the rank's PP
    stage (:func:`stage_weight_bytes`, or ``budget.weights_per_rank_bytes``) - overhead."""
    tp, ranks = serve.tensor_parallel, serve.tensor_parallel * serve.pipeline_parallel
    requested = math.ceil(budget.total_memory_bytes * budget.gpu_memory_utilization)
    if budget.weights_per_rank_bytes is None:
        weights = [stage_weight_bytes(shape, serve)[rank // tp] for rank in range(ranks)]
    else:
        weights = [budget.weights_per_rank_bytes] * ranks
    free = _free_per_rank(budget, ranks)
    early = [problem] if (problem := _startup_problem(budget, requested, free)) else []
    return _plan(
        shape,
        serve,
        [requested - weight - budget.overhead_bytes for weight in weights],
        [(budget.total_memory_bytes, requested, weight, budget.overhead_bytes) for weight in weights],
        budget.overhead_source,
        early,
        free,
    )


def plan_from_available(shape: ModelShape, serve: ServeConfig, kv_available_bytes: int | Sequence[int]) -> Plan:
    """Predict the KV cache from a known "Available KV cache memory" (one value for every rank, or one per rank in
    rank order, pp-major), skipping the requested/weights/overhead arithmetic."""
    ranks = serve.tensor_parallel * serve.pipeline_parallel
    if isinstance(kv_available_bytes, int):
        available = [kv_available_bytes] * ranks
    else:
        available = list(kv_available_bytes)
        if len(available) != ranks:
            raise ValueError(f"got {len(available)} available-memory values for {ranks} ranks (TP x PP)")
    return _plan(shape, serve, available, None, None, [])


# --- reading real vLLM startup logs ----------------------------------------------------------------------------

# vLLM prefixes each process's lines with "(EngineCore_DP0 pid=412) " or, for Ray workers,
# "(RayWorkerWrapper pid=233, ip=192.168.100.11) "; a single-process run has no prefix.
_PROCESS_TAG = re.compile(r"^\((?P<tag>[^)]*)\)")
# Ray colours the "(RayWorkerWrapper pid=..., ip=...)" tag it puts before each forwarded worker line.
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# gpu_model_runner: "Model loading took %s GiB memory and %.6f seconds" (format_gib); older: "%.4f GiB and".
_WEIGHTS_LINE = re.compile(r"Model loading took (?P<gib>[\d.]+) GiB(?: memory)? and")
# gpu_worker.determine_available_memory: "Available KV cache memory: %s GiB" (older "%.2f GiB").
_AVAILABLE_LINE = re.compile(r"Available KV cache memory: (?P<gib>-?[\d.]+) GiB")
# gpu_worker, DEBUG only: "Initial free memory: %s GiB; Requested memory: %f (util), %s GiB".
_REQUESTED_LINE = re.compile(r"Requested memory: (?P<util>[\d.]+) \(util\), (?P<gib>[\d.]+) ?GiB")
# Where the utilization shows at INFO: the "non-default args: {...}" line and the CUDA-graph profiling note.
_UTILIZATION = (
    re.compile(r"'gpu_memory_utilization': (?P<util>[\d.]+)"),
    re.compile(r"--gpu-memory-utilization=(?P<util>[\d.]+) is equivalent"),
)
_KV_SIZE_LINE = re.compile(r"GPU KV cache size: (?P<tokens>[\d,]+) tokens")
_CONCURRENCY_LINE = re.compile(
    r"Maximum concurrency for (?P<length>[\d,]+) tokens per request: (?P<concurrency>[\d.]+)x"
)


@dataclass(frozen=True)
class RankCalibration:
    """One process's numbers from a startup log, and the overhead they imply."""

    process: str  # the log's process tag, e.g. "RayWorkerWrapper pid=233, ip=192.168.100.11"; "" without one
    requested_bytes: int
    weights_bytes: int
    kv_available_bytes: int
    overhead_bytes: int


@dataclass(frozen=True)
class KvLines:
    """The two capacity lines vLLM logged; None where the log lacks them."""

    kv_cache_tokens: int | None
    max_model_len: int | None
    max_concurrency: float | None


def _by_process(pattern: re.Pattern[str], log_text: str) -> dict[str, re.Match[str]]:
    found: dict[str, re.Match[str]] = {}
    for line in _ANSI.sub("", log_text).splitlines():
        if match := pattern.search(line):
            tag = _PROCESS_TAG.match(line)
            # The last occurrence wins: a restarted engine logs again further down.
            found[tag["tag"] if tag else ""] = match
    return found


def _requested_from_total(log_text: str, total_memory_bytes: int | None, gpu_memory_utilization: float | None) -> int:
    utilization = gpu_memory_utilization
    if utilization is None:
        for pattern in _UTILIZATION:
            if match := pattern.search(log_text):
                utilization = float(match["util"])
                break
    if total_memory_bytes is None or utilization is None:
        raise ValueError(
            "the log has no 'Requested memory: <util> (util), <N> GiB' line (vLLM logs it only at DEBUG: start it "
            "with VLLM_LOGGING_LEVEL=DEBUG), and requested memory cannot be computed instead: "
            + ("pass total_memory_bytes" if total_memory_bytes is None else "")
            + (" and " if total_memory_bytes is None and utilization is None else "")
            + (
                "pass gpu_memory_utilization (the log has no 'non-default args: {...gpu_memory_utilization...}' line)"
                if utilization is None
                else ""
            )
        )
    return math.ceil(total_memory_bytes * utilization)


def calibrate_overhead(
    log_text: str, *, total_memory_bytes: int | None = None, gpu_memory_utilization: float | None = None
) -> tuple[int, tuple[RankCalibration, ...]]:
    """Overhead per rank from a real vLLM startup log: requested - "Model loading took X GiB" - "Available KV cache
    memory: Y GiB", for each process that logged both; the largest (the one to plan with) and the per-process rows.

    Requested memory comes from vLLM's DEBUG line ``Requested memory: <util> (util), <N> GiB``; without it, from
    ``ceil(total_memory_bytes * utilization)``, the utilization read from the log or given. The log's numbers have two
    decimals, so the overhead is good to about 0.01 GiB.
    """
    weights = _by_process(_WEIGHTS_LINE, log_text)
    available = _by_process(_AVAILABLE_LINE, log_text)
    requested = _by_process(_REQUESTED_LINE, log_text)
    if not available:
        skipped = "kv_cache_memory_bytes config and skipped memory profiling" in log_text
        raise ValueError(
            "the log has no 'Available KV cache memory: <N> GiB' line"
            + (
                " (this run set --kv-cache-memory-bytes, which skips the profiling that measures the overhead)"
                if skipped
                else " (vLLM logs it at INFO after profiling; was the log cut short or did startup fail earlier?)"
            )
        )
    rows = []
    for process, available_match in available.items():
        weights_match = weights.get(process) or (weights.get("") if len(weights) == 1 else None)
        if weights_match is None:
            where = f" for process '{process}'" if process else ""
            raise ValueError(f"the log has no 'Model loading took <N> GiB memory' line{where}")
        requested_match = requested.get(process) or (requested.get("") if len(requested) == 1 else None)
        if requested_match is not None:
            requested_bytes = int(float(requested_match["gib"]) * GIB)
        else:
            requested_bytes = _requested_from_total(log_text, total_memory_bytes, gpu_memory_utilization)
        weights_bytes = int(float(weights_match["gib"]) * GIB)
        kv_bytes = int(float(available_match["gib"]) * GIB)
        rows.append(
            RankCalibration(
                process=process,
                requested_bytes=requested_bytes,
                weights_bytes=weights_bytes,
                kv_available_bytes=kv_bytes,
                overhead_bytes=requested_bytes - weights_bytes - kv_bytes,
            )
        )
    return max(row.overhead_bytes for row in rows), tuple(rows)


def parse_kv_lines(log_text: str) -> KvLines:
    """The logged ``GPU KV cache size`` and ``Maximum concurrency`` numbers (the last of each), to set beside a plan."""
    sizes = _KV_SIZE_LINE.findall(log_text)
    concurrency = list(_CONCURRENCY_LINE.finditer(log_text))
    return KvLines(
        kv_cache_tokens=int(sizes[-1].replace(",", "")) if sizes else None,
        max_model_len=int(concurrency[-1]["length"].replace(",", "")) if concurrency else None,
        max_concurrency=float(concurrency[-1]["concurrency"]) if concurrency else None,
    )
