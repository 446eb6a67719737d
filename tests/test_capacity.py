"""The KV-cache planner against vLLM's published numbers, the whole memory budget, and every problem it reports."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hy3spark.capacity import (
    GB10_TOTAL_MEMORY_BYTES,
    GIB,
    Budget,
    ModelShape,
    ServeConfig,
    Severity,
    calibrate_overhead,
    kv_dtype_bytes,
    parse_kv_lines,
    plan,
    plan_from_available,
    vllm_default_max_num_batched_tokens,
)


def _within(predicted: float, published: float, tolerance: float = 0.02) -> bool:
    return abs(predicted - published) / published <= tolerance


# --- the three published cases in shared/CAPACITY.md, planned from the logged "Available KV cache memory" --------


def test_published_48_layers_fp8_tp1_from_10_55_gib() -> None:
    # vllm-project/vllm#25350: "Available KV cache memory: 10.55 GiB", "GPU KV cache size: 230,528 tokens",
    # "Maximum concurrency for 100,000 tokens per request: 2.31x".
    shape = ModelShape(num_hidden_layers=48, num_key_value_heads=4, head_dim=128, weight_bytes=0)
    serve = ServeConfig(tensor_parallel=1, max_model_len=100_000, max_num_seqs=1, kv_cache_dtype="fp8")
    result = plan_from_available(shape, serve, int(10.55 * GIB))
    # 10.55 GiB / (16 x 4 x 2 x 128 x 1 B x 48 layers) = 14,404 blocks; the log's 14,408 is within its 2-decimal
    # rounding of the GiB figure (10.5527 GiB).
    assert result.num_blocks == 14_404
    assert result.kv_cache_size_line == "GPU KV cache size: 230,464 tokens"
    assert result.max_concurrency_line == "Maximum concurrency for 100,000 tokens per request: 2.30x"
    assert _within(result.kv_cache_tokens, 230_528)
    assert _within(result.max_concurrency, 2.31)
    assert result.problems == ()


def test_published_qwen3_coder_480b_needs_62_gib_and_fits_205728() -> None:
    # vllm-project/recipes PR #12 (62 layers x 8 KV heads x 128, bf16 KV, TP1): "62.00 GiB KV cache is needed" for
    # 262,144 tokens; from 48.66 GiB available "the estimated maximum model length is 205728".
    shape = ModelShape(num_hidden_layers=62, num_key_value_heads=8, head_dim=128, weight_bytes=0)
    serve = ServeConfig(tensor_parallel=1, max_model_len=262_144, max_num_seqs=1)
    result = plan_from_available(shape, serve, int(48.66 * GIB))
    # 262,144 / 16 = 16,384 blocks x 65,536 B x 62 layers = 66,571,993,088 B = 62.00 GiB.
    assert result.rows[0].kv_needed_bytes == 16_384 * 65_536 * 62
    assert f"{result.rows[0].kv_needed_bytes / GIB:.2f}" == "62.00"
    (problem,) = result.problems
    assert problem.severity is Severity.ERROR
    assert problem.code == "max-model-len"
    assert "needs 62.00 GiB of KV cache on rank 0 but only 48.66 GiB is available" in problem.message
    assert "the estimated maximum model length is 205728" in problem.message
    assert not result.ok


def test_published_qwen3_235b_tp4_one_kv_head_per_rank() -> None:
    # vllm-project/vllm#21348 (94 layers, 4 KV heads, TP4, bf16 KV): "Available KV cache memory: 8.11 GiB",
    # "GPU KV cache size: 178,880 tokens". The logged GiB is one worker's while vLLM's blocks are the minimum over
    # four, so a plan fed 8.11 GiB lands about 1% high. Any max_model_len that is a multiple of 16 gives
    # tokens = blocks x 16 here; the length is not needed.
    shape = ModelShape(num_hidden_layers=94, num_key_value_heads=4, head_dim=128, weight_bytes=0)
    serve = ServeConfig(tensor_parallel=4, max_model_len=40_960, max_num_seqs=1)
    result = plan_from_available(shape, serve, int(8.11 * GIB))
    assert result.kv_heads_per_rank == 1
    assert len(result.rows) == 4
    assert result.kv_cache_tokens == 180_928
    assert _within(result.kv_cache_tokens, 178_880)


# --- the whole path: total x utilization - weights - overhead ---------------------------------------------------


def _hy3(**serve: int | str) -> tuple[ModelShape, ServeConfig]:
    shape = ModelShape(
        num_hidden_layers=80, num_key_value_heads=8, head_dim=128, weight_bytes=181_000_000_000, mtp_layers=1
    )
    knobs: dict[str, int | str] = {
        "tensor_parallel": 2,
        "max_model_len": 131_072,
        "max_num_seqs": 6,
        "kv_cache_dtype": "fp8_e4m3",
    }
    return shape, ServeConfig(**{**knobs, **serve})  # type: ignore[arg-type]


def _spark_budget(**overrides: object) -> Budget:
    values: dict[str, object] = {
        "gpu_memory_utilization": 0.90,
        "total_memory_bytes": GB10_TOTAL_MEMORY_BYTES,
        "overhead_bytes": 3 * GIB,
        "overhead_source": "profile default",
    }
    return Budget(**{**values, **overrides})  # type: ignore[arg-type]


def test_hy3_on_two_sparks() -> None:
    shape, serve = _hy3()
    result = plan(shape, serve, _spark_budget())
    # By hand, per rank (both ranks alike, TP2 x PP1):
    #   total      = 121.69 GiB                         = 130,663,642,562 B
    #   requested  = ceil(0.90 x total)                 = 117,597,278,306 B (109.52 GiB)
    #   weights    = 181 GB / 2                         =  90,500,000,000 B ( 84.28 GiB)
    #   overhead   = 3 GiB                              =   3,221,225,472 B
    #   available  = requested - weights - overhead     =  23,876,052,834 B ( 22.24 GiB)
    #   page       = 16 x (8 / 2 KV heads) x 2 x 128 x 1 B (fp8) = 16,384 B per layer; 80 layers + 1 MTP = 81
    #   num_blocks = 23,876,052,834 // 16,384 // 81     = 17,991
    #   per request: 131,072 / 16 = 8,192 blocks -> 17,991 / 8,192 = 2.196 -> "2.20x"
    #   tokens     = int(2.196... x 131,072)            = 287,856 (= 17,991 x 16)
    # Cross-check: 81 layers x 4 heads x 2 x 128 x 1 B = 82,944 B per token; 22.24 GiB / 82,944 B = 287,860 tokens.
    row = result.rows[0]
    assert (row.total_bytes, row.requested_bytes) == (130_663_642_562, 117_597_278_306)
    assert (row.weights_bytes, row.overhead_bytes) == (90_500_000_000, 3 * GIB)
    assert row.kv_available_bytes == 23_876_052_834
    assert row.kv_layers == 81
    assert replace(result.rows[1], rank=0, tp_rank=0) == row
    assert result.page_bytes == 16_384
    assert result.num_blocks == 17_991
    assert result.blocks_per_request == 8_192
    assert result.kv_cache_size_line == "GPU KV cache size: 287,856 tokens"
    assert result.max_concurrency_line == "Maximum concurrency for 131,072 tokens per request: 2.20x"
    assert result.overhead_source == "profile default"
    # 2.20 full-length requests against max_num_seqs 6: a warning, not an error.
    (problem,) = result.problems
    assert (problem.severity, problem.code) == (Severity.WARNING, "concurrency")
    assert "only 2.20 requests of 131,072 tokens fit in the KV cache, fewer than max_num_seqs 6" in problem.message
    # 17,991 // 6 = 2,998 blocks per request -> 47,968 tokens (2,998 x 16).
    assert "lower max_num_seqs to 2, max_model_len to 47,968 (fits 6 full-length requests)" in problem.message
    assert result.ok
    print("\nHy3 two-Spark plan:", result.kv_cache_size_line, "|", result.max_concurrency_line)


def test_hy3_with_two_sequences_has_no_problem() -> None:
    shape, serve = _hy3(max_num_seqs=2)
    assert plan(shape, serve, _spark_budget()).problems == ()


def test_weights_per_rank_override_replaces_the_even_split() -> None:
    shape, serve = _hy3()
    result = plan(shape, serve, _spark_budget(weights_per_rank_bytes=95 * GIB))
    assert result.rows[0].weights_bytes == 95 * GIB
    assert result.rows[0].kv_available_bytes == 117_597_278_306 - 95 * GIB - 3 * GIB


# --- problems: severity and what to change ------------------------------------------------------------------------


def test_free_memory_below_requested_fails_the_startup_check() -> None:
    shape, serve = _hy3()
    result = plan(shape, serve, _spark_budget(free_memory_bytes=int(105 * GIB)))
    problem = result.problems[0]
    assert (problem.severity, problem.code) == (Severity.ERROR, "startup-memory")
    assert (
        "vLLM will refuse to start: free memory 105.00 GiB is less than the 109.52 GiB it requests" in problem.message
    )
    # floor(105 / 121.69 x 100) / 100 = 0.86, and ceil(121.69 GiB x 0.86) = 104.65 GiB fits in 105.
    assert "lower gpu_memory_utilization to 0.86" in problem.message
    assert math.ceil(GB10_TOTAL_MEMORY_BYTES * 0.86) <= 105 * GIB
    assert not result.ok


def test_free_memory_at_or_above_requested_passes_the_startup_check() -> None:
    shape, serve = _hy3(max_num_seqs=2)
    assert plan(shape, serve, _spark_budget(free_memory_bytes=117_597_278_306)).problems == ()


def test_tp_that_does_not_divide_the_kv_heads_is_an_error() -> None:
    shape, serve = _hy3(tensor_parallel=3, max_num_seqs=1)
    (problem,) = [p for p in plan(shape, serve, _spark_budget()).problems if p.code == "tp-kv-heads"]
    assert problem.severity is Severity.ERROR
    assert problem.message == (
        "tensor_parallel 3 does not divide the model's 8 KV heads (nor do they divide it), so vLLM cannot shard "
        "them; use a tensor_parallel of 1, 2, 4, 8 (or a multiple of 8)"
    )


def test_tp_above_the_kv_heads_replicates_them() -> None:
    # 16 ranks over 8 KV heads: vLLM keeps one head per rank (replicated), which is legal.
    shape, serve = _hy3(tensor_parallel=16, max_num_seqs=1)
    result = plan(shape, serve, _spark_budget())
    assert result.kv_heads_per_rank == 1
    assert all(p.code != "tp-kv-heads" for p in result.problems)


def test_weights_larger_than_the_budget_leave_no_kv_memory() -> None:
    shape, serve = _hy3(tensor_parallel=1)
    (problem,) = plan(shape, serve, _spark_budget()).problems
    assert (problem.severity, problem.code) == (Severity.ERROR, "no-kv-memory")
    # 109.52 - 168.57 - 3.00 = -62.05 GiB.
    assert problem.message.startswith(
        "rank 0 has -62.05 GiB left for the KV cache (requested 109.52 GiB - weights 168.57 GiB - overhead 3.00 GiB)"
    )
    assert "No available memory for the cache blocks" in problem.message


def test_no_kv_memory_from_a_known_available_value() -> None:
    shape, serve = _hy3()
    (problem,) = plan_from_available(shape, serve, 0).problems
    assert problem.code == "no-kv-memory"
    assert problem.message.startswith("rank 0 has 0.00 GiB left for the KV cache, so vLLM will stop")


def test_concurrency_below_one_says_what_max_model_len_fits() -> None:
    shape, serve = _hy3(max_model_len=262_144)
    result = plan(shape, serve, _spark_budget(overhead_bytes=int(12.5 * GIB)))
    (problem,) = result.problems
    assert (problem.severity, problem.code) == (Severity.ERROR, "max-model-len")
    # 23,876,052,834 B - 9.5 GiB more overhead = 13,675,505,506 B // 16,384 // 81 = 10,304 blocks, fewer than the
    # 262,144 / 16 = 16,384 one request needs; 10,304 x 16 = 164,864 tokens fit.
    assert result.num_blocks == 10_304
    assert "the estimated maximum model length is 164864: set max_model_len to at most 164864" in problem.message
    # fp8 is already on, so the hint does not suggest it again.
    assert "fp8" not in problem.message


def test_kv_that_fits_not_even_one_token_says_so() -> None:
    shape, serve = _hy3()
    (problem,) = plan_from_available(shape, serve, 1_000_000).problems
    assert problem.code == "max-model-len"
    assert "not even a one-token request fits" in problem.message


# --- hybrid models, PP, dtypes ------------------------------------------------------------------------------------


def _gpt_oss() -> ModelShape:
    return ModelShape(
        num_hidden_layers=36,
        num_key_value_heads=8,
        head_dim=64,
        weight_bytes=65_300_000_000,
        sliding_window=128,
        sliding_window_layers=18,
    )


def test_gpt_oss_hybrid_groups_and_sliding_window_blocks() -> None:
    serve = ServeConfig(tensor_parallel=1, max_model_len=131_072, max_num_seqs=8)
    result = plan(_gpt_oss(), serve, _spark_budget(gpu_memory_utilization=0.80, overhead_bytes=4 * GIB))
    # 18 sliding + 18 full: two groups of 18 layers; the pool is split 18 ways, each block serves one layer per group.
    assert [(g.kind, len(g.layers)) for g in result.groups] == [("sliding", 18), ("full", 18)]
    # Sliding: ceil(min(128 - 1 + 8192, 131072) / 16) + 1 = 521; full: 131072 / 16 = 8192.
    assert [g.blocks_per_request for g in result.groups] == [521, 8_192]
    assert result.blocks_per_request == 8_713
    # page = 16 x 8 x 2 x 64 x 2 B = 32,768 B;
    # available = ceil(0.80 x 130,663,642,562) - 65,300,000,000 - 4 GiB = 34,935,946,754 B;
    # num_blocks = 34,935,946,754 // 32,768 // 18 = 59,231; concurrency 59,231 / 8,713 = 6.80;
    # tokens = int(6.798 x 131,072) = 891,027 (vLLM before PR #42206 logged 59,231 // 2 groups x 16 = 473,840).
    assert result.page_bytes == 32_768
    assert result.rows[0].kv_available_bytes == 34_935_946_754
    assert result.num_blocks == 59_231
    assert result.kv_cache_size_line == "GPU KV cache size: 891,027 tokens"
    assert result.max_concurrency_line == "Maximum concurrency for 131,072 tokens per request: 6.80x"


def test_hybrid_grouping_follows_vllm_for_unequal_counts() -> None:
    serve = ServeConfig(tensor_parallel=1, max_model_len=4_096, max_num_seqs=1)
    # gpt-oss-20b + a one-layer drafter: 12 sliding + 13 full -> group size 13 (13 < 1.5 x 12), one group each.
    drafted = ModelShape(24, 8, 64, 0, mtp_layers=1, sliding_window=128, sliding_window_layers=12)
    assert [(g.kind, len(g.layers)) for g in plan_from_available(drafted, serve, GIB).groups] == [
        ("sliding", 12),
        ("full", 13),
    ]
    # 20 sliding + 10 full -> group size 10: two sliding groups dealt round-robin and one full group.
    two_to_one = ModelShape(30, 8, 64, 0, sliding_window=512, sliding_window_layers=20)
    groups = plan_from_available(two_to_one, serve, GIB).groups
    assert [(g.kind, len(g.layers)) for g in groups] == [("sliding", 10), ("sliding", 10), ("full", 10)]
    assert groups[0].layers[:3] == (0, 3, 6)


def test_hybrid_under_pp_assumes_evenly_interleaved_sliding_layers() -> None:
    # An approximation (see the module docstring): vLLM reads each layer's type; here sliding layers alternate,
    # so each PP stage of gpt-oss gets 9 sliding + 9 full and projects to groups of 9 layers.
    serve = ServeConfig(tensor_parallel=1, pipeline_parallel=2, max_model_len=131_072, max_num_seqs=1)
    result = plan_from_available(_gpt_oss(), serve, 10 * GIB)
    assert [row.kv_layers for row in result.rows] == [18, 18]
    assert result.num_blocks == 10 * GIB // 32_768 // 9


def test_pp_splits_layers_like_vllm_and_the_fullest_stage_limits() -> None:
    # get_pp_indices: 94 layers over 4 stages -> 23 each, the remainder to the stages before the last: 23, 24, 24, 23.
    shape = ModelShape(num_hidden_layers=94, num_key_value_heads=4, head_dim=128, weight_bytes=0, mtp_layers=1)
    serve = ServeConfig(tensor_parallel=1, pipeline_parallel=4, max_model_len=32_768, max_num_seqs=1)
    result = plan_from_available(shape, serve, 8 * GIB)
    # The MTP layer sits on the last stage (an approximation, see the module docstring).
    assert [row.kv_layers for row in result.rows] == [23, 24, 24, 24]
    page = 16 * 4 * 2 * 128 * 2
    assert result.num_blocks == 8 * GIB // page // 24
    assert result.rows[0].num_blocks == 8 * GIB // page // 23


def test_per_rank_available_memory_takes_the_minimum() -> None:
    shape, serve = _hy3()
    result = plan_from_available(shape, serve, [20 * GIB, 19 * GIB])
    assert result.num_blocks == 19 * GIB // 16_384 // 81
    with pytest.raises(ValueError, match="got 1 available-memory values for 2 ranks"):
        plan_from_available(shape, serve, [20 * GIB])


@pytest.mark.parametrize(
    ("kv_cache_dtype", "expected"),
    [("auto", 2), ("bfloat16", 2), ("float16", 2), ("fp8", 1), ("fp8_e4m3", 1), ("fp8_e5m2", 1)],
)
def test_kv_dtype_bytes(kv_cache_dtype: str, expected: int) -> None:
    assert kv_dtype_bytes(kv_cache_dtype, 2) == expected


def test_unknown_kv_dtype_and_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is not one of"):
        ServeConfig(tensor_parallel=1, max_model_len=1024, max_num_seqs=1, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="needs sliding_window"):
        ModelShape(36, 8, 64, 0, sliding_window_layers=18)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        _spark_budget(gpu_memory_utilization=1.5)


# --- reading real startup logs --------------------------------------------------------------------------------------

# SYNTHETIC: no real Hy3 startup log is at hand. Each line below uses the exact format string vLLM logs it with
# (vllm/v1/worker/gpu_worker.py: DEBUG "Initial free memory: %s GiB; Requested memory: %f (util), %s GiB" and INFO
# "Available KV cache memory: %s GiB"; vllm/v1/worker/gpu_model_runner.py: "Model loading took %s GiB memory and
# %.6f seconds"; vllm/v1/core/kv_cache_utils.py: "GPU KV cache size: %s tokens" and "Maximum concurrency for %s
# tokens per request: %.2fx"; vllm/entrypoints/utils.py: "non-default args: %s") and vLLM's process prefixes:
# "(EngineCore_DP0 pid=N)" for the engine's own worker, "(RayWorkerWrapper pid=N, ip=A)" for a Ray worker.
_HEAD = "(EngineCore_DP0 pid=412) {level} 11-30 10:{t} [{src}] {msg}"
_WORKER = "(RayWorkerWrapper pid=233, ip=10.0.0.2) {level} 11-30 10:{t} [{src}] {msg}"
_SYNTHETIC_LOG = "\n".join(
    [
        "(APIServer pid=301) INFO 11-30 10:00:02 [utils.py:253] non-default args: {'model_tag': '/models/hy3', "
        "'port': 8888, 'max_model_len': 131072, 'gpu_memory_utilization': 0.9, 'kv_cache_dtype': 'fp8_e4m3'}",
        _HEAD.format(
            level="DEBUG",
            t="01:10",
            src="gpu_worker.py:346",
            msg="Initial free memory: 117.85 GiB; Requested memory: 0.900000 (util), 109.52 GiB",
        ),
        _WORKER.format(
            level="DEBUG",
            t="01:11",
            src="gpu_worker.py:346",
            msg="Initial free memory: 116.9 GiB; Requested memory: 0.900000 (util), 109.52 GiB",
        ),
        _HEAD.format(
            level="INFO",
            t="11:40",
            src="gpu_model_runner.py:3120",
            msg="Model loading took 84.29 GiB memory and 612.402211 seconds",
        ),
        _WORKER.format(
            level="INFO",
            t="11:41",
            src="gpu_model_runner.py:3120",
            msg="Model loading took 84.29 GiB memory and 615.113052 seconds",
        ),
        _HEAD.format(level="INFO", t="12:02", src="gpu_worker.py:360", msg="Available KV cache memory: 22.23 GiB"),
        _WORKER.format(level="INFO", t="12:03", src="gpu_worker.py:360", msg="Available KV cache memory: 22.21 GiB"),
        _HEAD.format(level="INFO", t="12:04", src="kv_cache_utils.py:1300", msg="GPU KV cache size: 287,568 tokens"),
        _HEAD.format(
            level="INFO",
            t="12:04",
            src="kv_cache_utils.py:1301",
            msg="Maximum concurrency for 131,072 tokens per request: 2.19x",
        ),
    ]
)


def test_calibrate_overhead_from_a_synthetic_two_rank_log() -> None:
    overhead, ranks = calibrate_overhead(_SYNTHETIC_LOG)
    by_process = {rank.process: rank for rank in ranks}
    head = by_process["EngineCore_DP0 pid=412"]
    worker = by_process["RayWorkerWrapper pid=233, ip=10.0.0.2"]
    # 109.52 - 84.29 - 22.23 = 3.00 GiB on the head; 109.52 - 84.29 - 22.21 = 3.02 GiB on the worker.
    assert head.overhead_bytes / GIB == pytest.approx(3.00, abs=1e-6)
    assert worker.overhead_bytes / GIB == pytest.approx(3.02, abs=1e-6)
    # The largest is the one to plan with: every rank must fit.
    assert overhead == worker.overhead_bytes
    assert head.requested_bytes == int(109.52 * GIB)


def test_calibrate_without_the_debug_line_uses_total_and_the_logged_utilization() -> None:
    log = "\n".join(line for line in _SYNTHETIC_LOG.splitlines() if "Requested memory" not in line)
    with pytest.raises(ValueError, match=r"no 'Requested memory: <util> \(util\), <N> GiB' line .* pass total_memory"):
        calibrate_overhead(log)
    overhead, ranks = calibrate_overhead(log, total_memory_bytes=GB10_TOTAL_MEMORY_BYTES)
    # gpu_memory_utilization 0.9 comes from the "non-default args" line: requested = ceil(0.9 x 121.69 GiB).
    assert {rank.requested_bytes for rank in ranks} == {117_597_278_306}
    assert overhead == 117_597_278_306 - int(84.29 * GIB) - int(22.21 * GIB)


def test_calibrate_names_the_missing_line() -> None:
    no_available = "\n".join(line for line in _SYNTHETIC_LOG.splitlines() if "Available KV" not in line)
    with pytest.raises(ValueError, match="no 'Available KV cache memory: <N> GiB' line"):
        calibrate_overhead(no_available)
    no_weights = "\n".join(line for line in _SYNTHETIC_LOG.splitlines() if "Model loading" not in line)
    with pytest.raises(ValueError, match="no 'Model loading took <N> GiB memory' line for process 'EngineCore_DP0"):
        calibrate_overhead(no_weights)


def test_parse_kv_lines() -> None:
    lines = parse_kv_lines(_SYNTHETIC_LOG)
    assert (lines.kv_cache_tokens, lines.max_model_len, lines.max_concurrency) == (287_568, 131_072, 2.19)
    empty = parse_kv_lines("INFO nothing here")
    assert (empty.kv_cache_tokens, empty.max_model_len, empty.max_concurrency) == (None, None, None)


def test_parse_kv_lines_reads_the_one_line_form() -> None:
    # Some vLLM builds log both on one line: "GPU KV cache size: N tokens, Maximum concurrency for L tokens ...".
    lines = parse_kv_lines(
        "INFO GPU KV cache size: 1,553,140 tokens, Maximum concurrency for 1,000,000 tokens per request: 1.55x"
    )
    assert (lines.kv_cache_tokens, lines.max_model_len, lines.max_concurrency) == (1_553_140, 1_000_000, 1.55)


def test_calibrate_reads_ray_coloured_worker_tags() -> None:
    """Ray forwards worker output to the driver with the process tag in colour: ESC[36m(RayWorkerWrapper ...)ESC[0m."""
    coloured = "\n".join(
        f"\x1b[36m{line[:line.index(')') + 1]}\x1b[0m{line[line.index(')') + 1:]}" if line.startswith("(RayWorker")
        else line
        for line in _SYNTHETIC_LOG.splitlines()
    )
    assert "\x1b[36m(RayWorkerWrapper" in coloured
    assert calibrate_overhead(coloured) == calibrate_overhead(_SYNTHETIC_LOG)


def test_auto_fit_needs_the_model_length_and_keeps_it_when_it_fits() -> None:
    shape, serve = _hy3(max_model_len=-1, max_num_seqs=1)
    with pytest.raises(ValueError, match=r"max_model_len -1 \(auto-fit\) needs ModelShape.max_context"):
        plan_from_available(shape, serve, 20 * GIB)
    # 20 GiB // 16,384 B // 81 layers = 16,181 blocks: 258,896 tokens fit, so a 131,072-token model keeps its length.
    result = plan_from_available(replace(shape, max_context=131_072), serve, 20 * GIB)
    assert (result.auto_fit_from, result.max_model_len) == (131_072, 131_072)
    # A 262,144-token model is cut to the whole pool: 16,181 x 16 tokens.
    result = plan_from_available(replace(shape, max_context=262_144), serve, 20 * GIB)
    assert (result.auto_fit_from, result.max_model_len) == (262_144, 16_181 * 16)
    assert result.max_concurrency_line == "Maximum concurrency for 258,896 tokens per request: 1.00x"
    # Unequal ranks: the length must fit on every one, so the smaller rank decides (10 GiB: 8,090 blocks).
    result = plan_from_available(replace(shape, max_context=262_144), serve, [20 * GIB, 10 * GIB])
    assert result.max_model_len == 8_090 * 16
    assert result.vllm_error is None


def test_serve_config_rejects_lengths_other_than_auto_fit_and_bad_block_sizes() -> None:
    with pytest.raises(ValueError, match=r"max_model_len must be >= 1 or -1 \(auto-fit\), got 0"):
        ServeConfig(tensor_parallel=1, max_model_len=0, max_num_seqs=1)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        ServeConfig(tensor_parallel=1, max_model_len=1024, max_num_seqs=1, block_size=0)


# --- edges a user can reach: odd sizes, the smallest block, bounds of the knobs --------------------------------


def test_sliding_window_blocks_with_a_batch_size_that_is_not_a_power_of_two() -> None:
    # --max-num-batched-tokens 1000: ceil(min(128 - 1 + 1000, 131072) / 16) + 1 = ceil(1127 / 16) + 1 = 72 blocks
    # per sliding group (SlidingWindowSpec.max_memory_usage_bytes), beside 131072 / 16 = 8192 for the full group.
    serve = ServeConfig(tensor_parallel=1, max_model_len=131_072, max_num_seqs=1, max_num_batched_tokens=1_000)
    result = plan_from_available(_gpt_oss(), serve, 10 * GIB)
    assert [(g.kind, g.blocks_per_request) for g in result.groups] == [("sliding", 72), ("full", 8_192)]
    assert result.blocks_per_request == 8_264
    # 10 GiB // 32,768 B // 18 layers = 18,204 blocks; 18,204 / 8,264 = 2.2028x; int(2.2028 x 131,072) = 288,726.
    assert result.num_blocks == 18_204
    assert result.kv_cache_size_line == "GPU KV cache size: 288,726 tokens"
    assert result.max_concurrency_line == "Maximum concurrency for 131,072 tokens per request: 2.20x"


def test_block_size_1_with_one_block_fits_a_one_token_request() -> None:
    # --block-size 1, one layer with one KV head of head_dim 1 (bf16): a page is 1 x 1 x 2 x 1 x 2 = 4 B. With 4 B
    # available the rank has one block: a one-token request fits, a 1,024-token one does not, and vLLM's estimate is 1.
    shape = ModelShape(num_hidden_layers=1, num_key_value_heads=1, head_dim=1, weight_bytes=0)
    serve = ServeConfig(tensor_parallel=1, max_model_len=1_024, max_num_seqs=1, block_size=1)
    result = plan_from_available(shape, serve, 4)
    assert (result.page_bytes, result.num_blocks) == (4, 1)
    assert result.vllm_error is not None
    assert (result.vllm_error.rank, result.vllm_error.estimated_max_model_len) == (0, 1)
    assert "Based on the available memory, the estimated maximum model length is 1." in result.vllm_error.message
    (problem,) = result.problems
    assert "the estimated maximum model length is 1: set max_model_len to at most 1, or" in problem.message


def test_tp_that_does_not_divide_an_odd_number_of_kv_heads_lists_them_all() -> None:
    shape = ModelShape(num_hidden_layers=4, num_key_value_heads=3, head_dim=128, weight_bytes=0)
    serve = ServeConfig(tensor_parallel=2, max_model_len=1_024, max_num_seqs=1)
    (problem,) = [p for p in plan_from_available(shape, serve, GIB).problems if p.code == "tp-kv-heads"]
    assert problem.message.endswith("use a tensor_parallel of 1, 3 (or a multiple of 3)")


@pytest.mark.parametrize("utilization", [0, 0.0, -0.1, 1.01])
def test_gpu_memory_utilization_outside_0_to_1_is_rejected(utilization: float) -> None:
    with pytest.raises(ValueError, match=rf"gpu_memory_utilization must be in \(0, 1\], got {utilization}"):
        _spark_budget(gpu_memory_utilization=utilization)


def test_gpu_memory_utilization_of_1_is_accepted() -> None:
    assert _spark_budget(gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_when_only_rank_0_fails_the_problem_names_rank_0_and_its_memory() -> None:
    shape, serve = _hy3(max_num_seqs=1)
    (problem,) = plan_from_available(shape, serve, [0, 20 * GIB]).problems
    assert problem.message.startswith("rank 0 has 0.00 GiB left for the KV cache, so vLLM will stop")
    # 1 GiB // 16,384 B // 81 layers = 809 blocks = 12,944 tokens; a 131,072-token request needs 10.12 GiB.
    (problem,) = plan_from_available(shape, serve, [GIB, 20 * GIB]).problems
    assert problem.message.startswith(
        "one 131,072-token request needs 10.12 GiB of KV cache on rank 0 but only 1.00 GiB is available"
    )
    assert "the estimated maximum model length is 12944: set max_model_len to at most 12944" in problem.message


@pytest.mark.parametrize(
    ("nvml_total_memory_bytes", "expected"),
    [(None, 2048), (0, 2048), (48 * GIB, 2048), (70 * GIB - 1, 2048), (70 * GIB, 8192), (80 * GIB, 8192)],
)
def test_vllm_serve_batches_8192_tokens_only_on_a_gpu_nvml_reports_at_70_gib_or_more(
    nvml_total_memory_bytes: int | None, expected: int
) -> None:
    assert vllm_default_max_num_batched_tokens(nvml_total_memory_bytes) == expected


def test_calibrate_says_which_of_total_and_utilization_to_pass() -> None:
    no_requested = [line for line in _SYNTHETIC_LOG.splitlines() if "Requested memory" not in line]
    bare = "\n".join(line for line in no_requested if "non-default args" not in line)
    with pytest.raises(ValueError) as both:
        calibrate_overhead(bare)
    assert str(both.value).endswith(
        "cannot be computed instead: pass total_memory_bytes and pass gpu_memory_utilization (the log has no "
        "'non-default args: {...gpu_memory_utilization...}' line)"
    )
    with pytest.raises(ValueError) as utilization:
        calibrate_overhead(bare, total_memory_bytes=GB10_TOTAL_MEMORY_BYTES)
    assert str(utilization.value).endswith("cannot be computed instead: pass gpu_memory_utilization (the log has no "
                                           "'non-default args: {...gpu_memory_utilization...}' line)")
    with pytest.raises(ValueError) as total:
        calibrate_overhead(bare, gpu_memory_utilization=0.9)
    assert str(total.value).endswith("cannot be computed instead: pass total_memory_bytes")
    # Both given: requested = ceil(0.9 x 121.69 GiB), as from the logged utilization.
    overhead, _ranks = calibrate_overhead(bare, total_memory_bytes=GB10_TOTAL_MEMORY_BYTES, gpu_memory_utilization=0.9)
    assert overhead == 117_597_278_306 - int(84.29 * GIB) - int(22.21 * GIB)


def test_calibrate_explains_a_run_that_set_kv_cache_memory_bytes() -> None:
    # vllm/v1/worker/gpu_worker.py logs this instead of "Available KV cache memory" when --kv-cache-memory-bytes is set.
    reserved = "\n".join(
        line.replace("Available KV cache memory: 22.23 GiB", "Reserved 22.23 GiB for KV cache as specified by "
                     "kv_cache_memory_bytes config and skipped memory profiling.")
        for line in _SYNTHETIC_LOG.splitlines() if "Available KV cache memory: 22.21" not in line
    )
    with pytest.raises(ValueError) as error:
        calibrate_overhead(reserved)
    assert str(error.value) == (
        "the log has no 'Available KV cache memory: <N> GiB' line (this run set --kv-cache-memory-bytes, which skips "
        "the profiling that measures the overhead)"
    )
    with pytest.raises(ValueError) as cut:
        calibrate_overhead("INFO nothing here")
    assert str(cut.value).endswith("(vLLM logs it at INFO after profiling; was the log cut short or did startup fail "
                                   "earlier?)")


def test_the_suggested_utilization_is_one_vllm_accepts_at_a_rounding_boundary() -> None:
    # 100 GB total, 34 GB free: 34/100 is exactly 0.34, but vLLM requests ceil(100 GB x 0.34) = 34,000,000,001 B
    # (0.34 is not exact in binary), one byte more than is free; 0.33 is the largest utilization that starts.
    shape, serve = _hy3(max_num_seqs=1)
    budget = _spark_budget(total_memory_bytes=100_000_000_000, free_memory_bytes=34_000_000_000)
    assert math.ceil(100_000_000_000 * 0.34) > 34_000_000_000
    problem = plan(shape, serve, budget).problems[0]
    assert problem.code == "startup-memory"
    assert "lower gpu_memory_utilization to 0.33 (which also shrinks the KV cache)" in problem.message


def test_free_memory_under_one_percent_only_says_to_free_memory() -> None:
    shape, serve = _hy3(max_num_seqs=1)
    problem = plan(shape, serve, _spark_budget(free_memory_bytes=GIB // 2)).problems[0]
    assert problem.message.endswith(
        "free memory 0.50 GiB is less than the 109.52 GiB it requests (gpu_memory_utilization 0.9 x 121.69 GiB "
        "total); free memory on the nodes (stop other containers and processes, drop the page cache)"
    )


def test_a_rank_with_negative_kv_memory_has_no_length_estimate() -> None:
    # Like vLLM's vector llama405b-no-kv-memory: a rank with no memory left raises before any estimate.
    shape, serve = _hy3(tensor_parallel=2, max_num_seqs=1)
    result = plan(shape, serve, _spark_budget(weights_per_rank_bytes=110 * GIB))
    assert [row.kv_available_bytes < 0 for row in result.rows] == [True, True]
    assert [row.estimated_max_model_len for row in result.rows] == [None, None]
    assert result.vllm_error is not None
    assert (result.vllm_error.rank, result.vllm_error.estimated_max_model_len) == (0, None)


def test_hybrid_grouping_at_exactly_1_5x_uses_the_smaller_count() -> None:
    # vLLM takes the larger count as the group size only when it is under 1.5x the smaller: 18 sliding + 12 full is
    # exactly 1.5x, so groups of 12: two sliding groups of 9 (dealt round-robin) and one full group of 12, and the
    # pool is split 12 ways (1 GiB // 32,768 B // 12 = 2,730 blocks).
    shape = ModelShape(30, 8, 64, 0, sliding_window=512, sliding_window_layers=18)
    serve = ServeConfig(tensor_parallel=1, max_model_len=4_096, max_num_seqs=1)
    result = plan_from_available(shape, serve, GIB)
    assert [(g.kind, len(g.layers)) for g in result.groups] == [("sliding", 9), ("sliding", 9), ("full", 12)]
    assert result.num_blocks == 2_730


def test_concurrency_warning_for_a_bf16_cache_suggests_fp8() -> None:
    # bf16 KV: 32,768 B pages, 8,995 blocks, 1.10 requests of 131,072 tokens; 8,995 // 3 = 2,998 blocks per request.
    shape, serve = _hy3(max_num_seqs=3, kv_cache_dtype="auto")
    (problem,) = plan(shape, serve, _spark_budget()).problems
    assert problem.message == (
        "only 1.10 requests of 131,072 tokens fit in the KV cache, fewer than max_num_seqs 3: with long prompts the "
        "rest wait or are preempted; lower max_num_seqs to 1, max_model_len to 47,968 (fits 3 full-length "
        "requests), or raise gpu_memory_utilization (if the nodes have the memory free), use kv_cache_dtype fp8 "
        "(half the bytes per token), spread the model over more ranks"
    )


def test_concurrency_warning_without_a_length_that_fits_every_sequence() -> None:
    # 17,991 blocks over 20,000 sequences is not one block each: no max_model_len to suggest.
    shape, serve = _hy3(max_num_seqs=20_000)
    (problem,) = plan(shape, serve, _spark_budget()).problems
    assert problem.message.endswith(
        "fewer than max_num_seqs 20000: with long prompts the rest wait or are preempted; lower max_num_seqs to 2, "
        "or raise gpu_memory_utilization (if the nodes have the memory free), spread the model over more ranks"
    )


def test_calibrate_reads_the_last_start_of_a_restarted_engine() -> None:
    # A log that holds a failed first start (10.00 GiB available on the head) and then the restarted engine's lines.
    first_start = _HEAD.format(
        level="INFO", t="00:30", src="gpu_worker.py:360", msg="Available KV cache memory: 10.00 GiB"
    )
    overhead, ranks = calibrate_overhead(first_start + "\n" + _SYNTHETIC_LOG)
    assert {rank.process: rank.kv_available_bytes for rank in ranks} == {
        "EngineCore_DP0 pid=412": int(22.23 * GIB),
        "RayWorkerWrapper pid=233, ip=10.0.0.2": int(22.21 * GIB),
    }
    assert (overhead, ranks) == calibrate_overhead(_SYNTHETIC_LOG)


def test_calibrate_reads_the_utilization_from_the_cuda_graph_profiling_note() -> None:
    # Without the DEBUG line and the "non-default args" line, the utilization comes from the note vLLM logs at INFO
    # after profiling CUDA graphs (gpu_model_runner.profile_cudagraph_memory).
    note = _HEAD.format(
        level="INFO",
        t="12:01",
        src="gpu_model_runner.py:4420",
        msg="CUDA graph memory profiling is enabled (default since v0.21.0). The current "
        "--gpu-memory-utilization=0.9000 is equivalent to --gpu-memory-utilization=0.8870 without CUDA graph memory "
        "profiling. To maintain the same effective KV cache size as before, increase --gpu-memory-utilization to "
        "0.9130. To disable, set VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.",
    )
    log = "\n".join(
        line for line in _SYNTHETIC_LOG.splitlines() if "Requested memory" not in line and "non-default" not in line
    )
    overhead, ranks = calibrate_overhead(log + "\n" + note, total_memory_bytes=GB10_TOTAL_MEMORY_BYTES)
    assert {rank.requested_bytes for rank in ranks} == {117_597_278_306}
    assert overhead == 117_597_278_306 - int(84.29 * GIB) - int(22.21 * GIB)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_hidden_layers": 0}, "ModelShape.num_hidden_layers must be >= 1, got 0"),
        ({"num_key_value_heads": 0}, "ModelShape.num_key_value_heads must be >= 1, got 0"),
        ({"head_dim": 0}, "ModelShape.head_dim must be >= 1, got 0"),
        ({"dtype_bytes": 0}, "ModelShape.dtype_bytes must be >= 1, got 0"),
        ({"weight_bytes": -1}, "ModelShape.weight_bytes, mtp_layers and sliding_window_layers must be >= 0"),
        ({"mtp_layers": -1}, "ModelShape.weight_bytes, mtp_layers and sliding_window_layers must be >= 0"),
        ({"sliding_window_layers": -1}, "ModelShape.weight_bytes, mtp_layers and sliding_window_layers must be >= 0"),
        (
            {"sliding_window": 128, "sliding_window_layers": 5},
            r"ModelShape.sliding_window_layers \(5\) exceeds num_hidden_layers \(4\)",
        ),
        ({"max_context": 0}, "ModelShape.max_context must be >= 1, got 0"),
    ],
)
def test_model_shapes_vllm_cannot_have_are_rejected(fields: dict[str, int], message: str) -> None:
    values = {"num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 1, "weight_bytes": 0, **fields}
    with pytest.raises(ValueError, match=message):
        ModelShape(**values)


def test_the_smallest_model_shape_is_accepted() -> None:
    shape = ModelShape(1, 1, 1, 0, dtype_bytes=1, sliding_window=1, sliding_window_layers=1, max_context=1)
    assert (shape.num_hidden_layers, shape.sliding_window_layers, shape.max_context) == (1, 1, 1)


@pytest.mark.parametrize(
    "field", ["tensor_parallel", "pipeline_parallel", "max_num_seqs", "max_num_batched_tokens", "block_size"]
)
def test_serve_knobs_below_1_are_rejected(field: str) -> None:
    values = {"tensor_parallel": 1, "max_model_len": 1_024, "max_num_seqs": 1, field: 0}
    with pytest.raises(ValueError, match=f"ServeConfig.{field} must be >= 1, got 0"):
        ServeConfig(**values)  # type: ignore[arg-type]


def test_budget_rejects_no_total_memory_and_negative_overhead() -> None:
    for overrides in ({"total_memory_bytes": 0}, {"overhead_bytes": -1}):
        with pytest.raises(ValueError, match="total_memory_bytes must be >= 1 and overhead_bytes >= 0"):
            _spark_budget(**overrides)
    assert _spark_budget(total_memory_bytes=1, overhead_bytes=0).overhead_bytes == 0


def test_exactly_the_kv_memory_one_request_needs_is_enough() -> None:
    # vLLM refuses only when the request needs more than is available: 81 layers x 16,384 B x 8,192 blocks.
    shape, serve = _hy3(max_num_seqs=1)
    needed = 81 * 16_384 * 8_192
    result = plan_from_available(shape, serve, needed)
    assert (result.vllm_error, result.problems) == (None, ())
    assert result.rows[0].estimated_max_model_len is None
    assert result.max_concurrency_line == "Maximum concurrency for 131,072 tokens per request: 1.00x"
    # One byte less is one block less: 8,191 blocks hold 131,056 tokens.
    short = plan_from_available(shape, serve, needed - 1)
    assert short.vllm_error is not None
    assert (short.vllm_error.rank, short.vllm_error.estimated_max_model_len) == (0, 131_056)
    assert [row.estimated_max_model_len for row in short.rows] == [131_056, 131_056]


def test_parse_kv_lines_reads_the_last_start() -> None:
    first_start = (
        "INFO GPU KV cache size: 100,000 tokens\n"
        "INFO Maximum concurrency for 65,536 tokens per request: 1.53x\n"
    )
    lines = parse_kv_lines(first_start + _SYNTHETIC_LOG)
    assert (lines.kv_cache_tokens, lines.max_model_len, lines.max_concurrency) == (287_568, 131_072, 2.19)


def test_the_suggested_utilization_is_the_largest_that_fits() -> None:
    # 86.95 GB free of 100 GB: 0.86 fits (86 GB) and 0.87 does not (87 GB), so 0.86, not a rounded 0.8695.
    shape, serve = _hy3(max_num_seqs=1)
    budget = _spark_budget(total_memory_bytes=100_000_000_000, free_memory_bytes=86_950_000_000)
    problem = plan(shape, serve, budget).problems[0]
    assert "lower gpu_memory_utilization to 0.86 (which also shrinks the KV cache)" in problem.message


def test_one_byte_of_kv_memory_fails_the_length_check_not_the_no_memory_check() -> None:
    # vLLM raises "No available memory" only for <= 0 bytes; 1 byte fails the one-request check with an estimate of 0.
    shape, serve = _hy3(max_num_seqs=1)
    result = plan_from_available(shape, serve, 1)
    assert result.vllm_error is not None
    assert result.vllm_error.message.startswith("To serve at least one request with the model's max seq len (131072)")
    assert (result.vllm_error.rank, result.vllm_error.estimated_max_model_len) == (0, 0)
    (problem,) = result.problems
    assert problem.code == "max-model-len"
    assert "not even a one-token request fits on rank 0" in problem.message


def test_pp_gives_a_remainder_of_one_layer_to_the_first_stage() -> None:
    # get_pp_indices: 61 layers over 2 stages -> 30 each, the remainder to the stage before the last: 31, 30.
    shape = ModelShape(num_hidden_layers=61, num_key_value_heads=8, head_dim=128, weight_bytes=0)
    serve = ServeConfig(tensor_parallel=1, pipeline_parallel=2, max_model_len=32_768, max_num_seqs=1)
    result = plan_from_available(shape, serve, 8 * GIB)
    assert [row.kv_layers for row in result.rows] == [31, 30]
    # page = 16 x 8 x 2 x 128 x 2 B = 65,536 B: 8 GiB // 65,536 // 31 = 4,228 blocks on the fuller stage.
    assert [row.num_blocks for row in result.rows] == [4_228, 4_369]
    assert result.num_blocks == 4_228


def test_sliding_window_blocks_count_the_window_minus_one_token() -> None:
    # SlidingWindowSpec: min(window - 1 + max_num_batched_tokens, max_model_len) tokens; with a 4,097-token batch
    # that is 127 + 4,097 = 4,224 = 264 whole blocks, + 1 for a window that need not start on a block boundary.
    serve = ServeConfig(tensor_parallel=1, max_model_len=131_072, max_num_seqs=1, max_num_batched_tokens=4_097)
    result = plan_from_available(_gpt_oss(), serve, 10 * GIB)
    assert [(g.kind, g.blocks_per_request) for g in result.groups] == [("sliding", 265), ("full", 8_192)]
    assert result.kv_cache_size_line == "GPU KV cache size: 282,137 tokens"


@pytest.mark.parametrize(
    ("kv_cache_dtype", "expected"),
    [("auto", 4), ("bfloat16", 2), ("float16", 2), ("fp8", 1), ("fp8_e4m3", 1), ("fp8_e5m2", 1), ("fp8_inc", 1)],
)
def test_kv_dtype_bytes_of_a_float32_model(kv_cache_dtype: str, expected: int) -> None:
    # "auto" keeps the model's dtype; a named KV dtype sets its own size whatever the model's.
    assert kv_dtype_bytes(kv_cache_dtype, 4) == expected


def test_the_shortest_max_model_len_is_accepted() -> None:
    assert ServeConfig(tensor_parallel=1, max_model_len=1, max_num_seqs=1).max_model_len == 1


def test_a_rank_that_fits_no_token_is_the_one_named_even_after_one_that_fits_one() -> None:
    # --block-size 1, a 4-byte page: rank 0 has one block (a one-token request fits), rank 1 has 3 bytes, no block.
    # vLLM stops at rank 0, but no length fits every rank, so there is no length to suggest.
    shape = ModelShape(num_hidden_layers=1, num_key_value_heads=1, head_dim=1, weight_bytes=0)
    serve = ServeConfig(tensor_parallel=2, max_model_len=1_024, max_num_seqs=1, block_size=1)
    result = plan_from_available(shape, serve, [4, 3])
    assert [row.estimated_max_model_len for row in result.rows] == [1, 0]
    assert result.vllm_error is not None and result.vllm_error.rank == 0
    (problem,) = result.problems
    assert "(concurrency 0.00x < 1); not even a one-token request fits on rank 1: raise" in problem.message
