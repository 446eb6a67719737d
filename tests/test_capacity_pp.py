"""Pipeline parallel in the planner, the two-card desktop's memory budget, and the remedy when vLLM would refuse.

The PP vectors of vLLM 0.23.0 (tests/fixtures/vllm-0.23.0/kv-cases.json: PP2, uneven PP3, the first failing rank, MTP
refused) are matched line for line by tests/test_capacity_vectors.py; this file checks the layer split itself against
them and against public logs, the per-stage weights, and what the plan tells a user to change, with numbers that are
re-planned to prove they are the tightest that work.

The desktop models' shapes are their config.json numbers; their weights are an AWQ checkpoint's bytes computed from the
same shapes (4-bit weights packed in int32, an int32 zero point per 8 columns and an fp16 scale per column, per group of
128 inputs; embedding and LM head in bf16). A spec uses the index's real total_size instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from hy3spark.capacity import (
    GIB,
    MTP_PP_ERROR,
    Budget,
    ModelShape,
    Plan,
    Remedy,
    ServeConfig,
    Severity,
    pipeline_parallel_refusal,
    plan,
    plan_from_available,
    pp_layer_partition,
    refuses_pipeline_parallel,
    stage_weight_bytes,
)

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "vllm-0.23.0" / "kv-cases.json"
CASES = {case["id"]: case for case in json.loads(FIXTURE.read_text())["cases"]}
# A 24 GB card as PyTorch reports it (an RTX 3090: "a total capacity of 23.68 GiB", wutong16/HyperDreamer#4).
CARD = int(23.68 * GIB)


def _awq_linear(inputs: int, outputs: int) -> int:
    return inputs * outputs // 2 + (inputs // 128) * (outputs // 8) * 4 + (inputs // 128) * outputs * 2


def _awq_model(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, max_context: int
) -> ModelShape:
    head_dim = 128
    per_layer = (
        _awq_linear(hidden, heads * head_dim)
        + 2 * _awq_linear(hidden, kv_heads * head_dim)
        + _awq_linear(heads * head_dim, hidden)
        + 2 * _awq_linear(hidden, intermediate)
        + _awq_linear(intermediate, hidden)
    )
    embedding = vocab * hidden * 2  # not tied: the LM head is as large
    return ModelShape(
        num_hidden_layers=layers,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        weight_bytes=layers * per_layer + 2 * embedding,
        embedding_bytes=embedding,
        lm_head_bytes=embedding,
        max_context=max_context,
    )


# Qwen/Qwen3-32B config.json: hidden 5120, intermediate 25600, 64 layers, 64 heads, 8 KV heads, head_dim 128,
# vocab 151936, max_position_embeddings 40960.
QWEN3_32B_AWQ = _awq_model(5120, 25600, 64, 64, 8, 151_936, 40_960)
# meta-llama/Llama-3.3-70B-Instruct: hidden 8192, intermediate 28672, 80 layers, 64 heads, 8 KV heads, vocab 128256.
LLAMA33_70B_AWQ = _awq_model(8192, 28672, 80, 64, 8, 128_256, 131_072)
# Qwen/Qwen2.5-72B-Instruct-AWQ: intermediate padded to 29696 for AWQ's groups, vocab 152064.
QWEN25_72B_AWQ = _awq_model(8192, 29696, 80, 64, 8, 152_064, 32_768)


def _desktop(
    shape: ModelShape,
    *,
    tp: int = 2,
    pp: int = 1,
    length: int = 32_768,
    kv: str = "auto",
    utilization: float = 0.90,
    free: int | tuple[int, ...] | None = None,
) -> Plan:
    """One machine, two 24 GB cards, vLLM's mp executor: TP 2 or PP 2; 2 GiB of overhead per card."""
    serve = ServeConfig(tensor_parallel=tp, pipeline_parallel=pp, max_model_len=length, max_num_seqs=4,
                        kv_cache_dtype=kv)  # fmt: skip
    budget = Budget(gpu_memory_utilization=utilization, total_memory_bytes=CARD, overhead_bytes=2 * GIB,
                    overhead_source="test", free_memory_bytes=free, unified_memory=False)  # fmt: skip
    return plan(shape, serve, budget)


# --- the layer split: vLLM's get_pp_indices ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "stages", "partition"),
    [
        (80, 2, (40, 40)), (80, 3, (27, 27, 26)), (80, 1, (80,)), (36, 2, (18, 18)),
        # Public vLLM logs: "Hidden layers were unevenly partitioned: [31,30]" (DeepSeek-V3, 61 layers, PP2) and
        # 21/22/21 for a 64-layer Qwen over PP3.
        (61, 2, (31, 30)), (64, 3, (21, 22, 21)),
        # The remainder goes to the stages before the last, counting back from the second-to-last.
        (10, 4, (2, 3, 3, 2)), (11, 4, (3, 3, 3, 2)), (5, 4, (1, 1, 2, 1)), (4, 4, (1, 1, 1, 1)),
    ],
)  # fmt: skip
def test_pp_layer_partition_is_vllms(layers: int, stages: int, partition: tuple[int, ...]) -> None:
    assert pp_layer_partition(layers, stages) == partition
    assert sum(partition) == layers


def test_pp_layer_partition_equals_every_pp_vector_of_vllm() -> None:
    checked = 0
    for case in CASES.values():
        inputs = case["inputs"]
        if inputs["pipeline_parallel"] == 1 or "ranks" not in inputs:
            continue
        tp, layers = inputs["tensor_parallel"], inputs["model"]["num_hidden_layers"]
        partition = pp_layer_partition(layers, inputs["pipeline_parallel"])
        starts = [sum(partition[:stage]) for stage in range(len(partition))]
        for rank in inputs["ranks"]:
            stage = rank["rank"] // tp
            assert rank["hidden_layers"] == [starts[stage], starts[stage] + partition[stage]], case["id"]
        for line in case["vllm"].get("layer_split_log", []):
            assert f"unevenly partitioned: [{','.join(map(str, partition))}]" in line
        checked += 1
    assert checked == 5  # hy3 PP2, both uneven PP3 cases, gpt-oss PP2 with and without an extra layer


def test_pp_beyond_the_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel 5 must be between 1 and the model's 4 layers"):
        pp_layer_partition(4, 5)


def test_the_least_memory_does_not_decide_the_fewest_blocks_do() -> None:
    """Uneven PP3 (vector hy3-tp1-pp3-uneven-len100001): rank 2 has the least memory (29 GiB) but 26 layers, so it
    holds more blocks than rank 0 (30 GiB for 27 layers); rank 0's 36,408 blocks are what every rank allocates."""
    case = CASES["hy3-tp1-pp3-uneven-len100001"]
    shape = ModelShape(num_hidden_layers=80, num_key_value_heads=8, head_dim=128, weight_bytes=0)
    serve = ServeConfig(tensor_parallel=1, pipeline_parallel=3, max_model_len=100_001, max_num_seqs=6,
                        kv_cache_dtype="fp8")  # fmt: skip
    result = plan_from_available(shape, serve, case["inputs"]["available_kv_bytes_per_rank"])
    assert [row.kv_layers for row in result.rows] == [27, 27, 26]
    assert [row.num_blocks for row in result.rows] == [36_408, 37_622, 36_548]
    assert result.num_blocks == 36_408 == case["vllm"]["num_blocks"]
    assert [result.kv_cache_size_line, result.max_concurrency_line] == case["vllm"]["lines"]


# --- weights per stage ------------------------------------------------------------------------------------------


def test_stage_weights_without_embedding_sizes_are_the_even_split() -> None:
    shape = ModelShape(num_hidden_layers=80, num_key_value_heads=8, head_dim=128, weight_bytes=181_000_000_001)
    for tp, pp in [(1, 1), (2, 1), (2, 2), (1, 4), (4, 2)]:
        serve = ServeConfig(tensor_parallel=tp, pipeline_parallel=pp, max_model_len=1024, max_num_seqs=1)
        assert stage_weight_bytes(shape, serve) == (181_000_000_001 // (tp * pp),) * pp


def test_stage_weights_put_the_embedding_first_and_the_head_last() -> None:
    """Qwen3-32B-AWQ over PP3 (21/22/21 layers): 16,212,295,680 B of layers (253,317,120 B each) and a 1,555,824,640 B
    embedding and LM head. The middle stage has a layer more but no vocabulary, so it is the lightest."""
    serve = ServeConfig(tensor_parallel=1, pipeline_parallel=3, max_model_len=1024, max_num_seqs=1)
    layer = 253_317_120
    assert QWEN3_32B_AWQ.weight_bytes == 64 * layer + 2 * 1_555_824_640 == 19_323_944_960
    assert stage_weight_bytes(QWEN3_32B_AWQ, serve) == (
        21 * layer + 1_555_824_640,
        22 * layer,
        21 * layer + 1_555_824_640,
    )
    # TP divides every stage's share; PP 1 holds everything.
    two = ServeConfig(tensor_parallel=2, pipeline_parallel=1, max_model_len=1024, max_num_seqs=1)
    assert stage_weight_bytes(QWEN3_32B_AWQ, two) == (19_323_944_960 // 2,)


def test_draft_layers_weigh_on_the_last_stage() -> None:
    shape = ModelShape(num_hidden_layers=3, num_key_value_heads=1, head_dim=1, weight_bytes=400, mtp_layers=1)
    serve = ServeConfig(tensor_parallel=1, pipeline_parallel=3, max_model_len=16, max_num_seqs=1)
    assert stage_weight_bytes(shape, serve) == (100, 100, 200)


def test_embedding_and_head_larger_than_the_weights_are_refused() -> None:
    with pytest.raises(ValueError, match=r"embedding_bytes \+ lm_head_bytes \(12\) exceed weight_bytes \(10\)"):
        ModelShape(num_hidden_layers=1, num_key_value_heads=1, head_dim=1, weight_bytes=10, embedding_bytes=6,
                   lm_head_bytes=6)  # fmt: skip


# --- the two-card desktop -----------------------------------------------------------------------------------------


def test_qwen3_32b_awq_on_two_24_gb_cards_tp2_and_pp2_hold_the_same() -> None:
    """Per card: requested ceil(0.90 x 23.68 GiB) = 21.31 GiB; weights 19,323,944,960 / 2 = 9.00 GiB on either split
    (PP2: 32 layers + the embedding, 32 layers + the LM head); 10.31 GiB left for the KV cache. A token costs the same
    on a card either way: TP2 64 layers x 4 KV heads, PP2 32 layers x 8 KV heads (x 128 x 2 x 2 B = 128 KiB)."""
    tp2, pp2 = _desktop(QWEN3_32B_AWQ, tp=2), _desktop(QWEN3_32B_AWQ, tp=1, pp=2)
    for result in (tp2, pp2):
        assert [row.weights_bytes for row in result.rows] == [9_661_972_480, 9_661_972_480]
        assert [row.kv_available_bytes for row in result.rows] == [11_074_129_625, 11_074_129_625]
        assert result.kv_cache_size_line == "GPU KV cache size: 84,480 tokens"
        assert result.max_concurrency_line == "Maximum concurrency for 32,768 tokens per request: 2.58x"
        assert [p.code for p in result.problems] == ["concurrency"]  # below max_num_seqs 4: a warning
        assert result.remedy is None
    assert (tp2.kv_heads_per_rank, tp2.page_bytes, [r.kv_layers for r in tp2.rows]) == (4, 32_768, [64, 64])
    assert (pp2.kv_heads_per_rank, pp2.page_bytes, [r.kv_layers for r in pp2.rows]) == (8, 65_536, [32, 32])
    assert [(r.pp_rank, r.tp_rank) for r in pp2.rows] == [(0, 0), (1, 0)]
    # An fp8 cache halves the bytes per token: twice the blocks.
    assert _desktop(QWEN3_32B_AWQ, kv="fp8").max_concurrency_line.endswith(": 5.16x")


def test_llama_70b_awq_on_two_cards_names_the_rank_and_both_knobs() -> None:
    """37.03 GiB of weights leave 0.79 GiB of KV cache per card at 0.90: 325 blocks = 5,200 tokens, not one 32,768-token
    request. One needs 5.00 GiB per card: 18.52 + 2 + 5.00 GiB is 1.08 of a card, so only max_model_len helps."""
    result = _desktop(LLAMA33_70B_AWQ, tp=2)
    assert result.max_concurrency_line == "Maximum concurrency for 32,768 tokens per request: 0.16x"
    assert result.remedy == Remedy(
        rank=0,
        max_model_len=5_200,
        max_model_len_rank=0,
        gpu_memory_utilization=None,
        gpu_memory_utilization_rank=0,
        gpu_memory_utilization_needed=pytest.approx(1.0776, abs=1e-4),
    )
    (problem,) = result.problems
    assert problem.severity is Severity.ERROR and problem.code == "max-model-len"
    assert (
        "one 32,768-token request needs 5.00 GiB of KV cache on rank 0 but only 0.79 GiB is available, so vLLM will "
        "refuse to start (concurrency 0.16x < 1); the estimated maximum model length is 5200: set max_model_len to "
        "at most 5200, or no gpu_memory_utilization is enough (rank 0 would need 1.08 of its GPU's 23.68 GiB), use "
        "kv_cache_dtype fp8" in problem.message
    )


def test_llama_70b_awq_with_an_fp8_cache_can_also_raise_the_utilization() -> None:
    """With fp8 one request needs 2.50 GiB: 18.52 + 2 + 2.50 = 23.02 GiB, 0.972 of the card, so 0.98 (0.97 is short)."""
    result = _desktop(LLAMA33_70B_AWQ, tp=1, pp=2, kv="fp8")
    assert result.remedy is not None
    assert (result.remedy.max_model_len, result.remedy.gpu_memory_utilization) == (10_416, 0.98)
    (problem,) = result.problems
    assert "(PP stage 0 of 2, 40 KV layers)" in problem.message
    assert (
        "set max_model_len to at most 10416, or raise gpu_memory_utilization to at least 0.98 (rank 0 needs it: "
        "23.21 GiB of 23.68 GiB, if the GPU has that much free)" in problem.message
    )


def test_a_card_driving_the_display_blocks_the_utilization_remedy() -> None:
    """Card 0 drives the desktop: 22.50 GiB free. 0.98 would request 23.21 GiB, more than that."""
    result = _desktop(LLAMA33_70B_AWQ, kv="fp8", free=(int(22.5 * GIB), int(23.4 * GIB)))
    assert result.remedy is not None
    assert (result.remedy.gpu_memory_utilization, result.remedy.gpu_memory_utilization_needed) == (
        None,
        pytest.approx(0.972, abs=1e-3),
    )
    assert (
        "gpu_memory_utilization 0.98 would do it (rank 0 needs it), but it requests 23.21 GiB and rank 0's GPU has "
        "only 22.50 GiB free" in result.problems[-1].message
    )


def test_qwen25_72b_awq_leaves_no_kv_memory_on_24_gb_cards() -> None:
    """38.73 GiB of weights: 19.37 GiB per card plus 2 GiB of overhead is more than the 21.31 GiB requested."""
    result = _desktop(QWEN25_72B_AWQ, tp=1, pp=2)
    assert result.vllm_error is not None and result.vllm_error.rank == 0
    assert result.remedy is not None
    assert (result.remedy.max_model_len, result.remedy.gpu_memory_utilization) == (None, None)
    (problem,) = result.problems
    assert problem.code == "no-kv-memory"
    assert problem.message.startswith(
        "rank 0 (PP stage 0 of 2, 40 KV layers) has -0.06 GiB left for the KV cache (requested 21.31 GiB - weights "
        "19.37 GiB - overhead 2.00 GiB), so vLLM will stop with 'No available memory for the cache blocks'; no "
        "gpu_memory_utilization is enough (rank 0 would need 1.11 of its GPU's 23.68 GiB)"
    )


def test_a_card_with_less_free_memory_than_requested_is_named() -> None:
    result = _desktop(QWEN3_32B_AWQ, free=(int(23.0 * GIB), int(21.0 * GIB)))
    startup = [p for p in result.problems if p.code == "startup-memory"]
    assert startup == [
        dataclasses.replace(
            startup[0],
            message="vLLM will refuse to start: free memory on rank 1's GPU 21.00 GiB is less than the 21.31 GiB it "
            "requests (gpu_memory_utilization 0.9 x 23.68 GiB total); lower gpu_memory_utilization to 0.88 (which "
            "also shrinks the KV cache) or free memory on the card (a display server or another process on it: "
            "nvidia-smi lists them)",
        )
    ]
    with pytest.raises(ValueError, match="got 1 free-memory values for 2 ranks"):
        _desktop(QWEN3_32B_AWQ, free=(GIB,))


# --- the remedy is the tightest that works -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "tp", "pp", "kv", "length"),
    [
        (LLAMA33_70B_AWQ, 2, 1, "auto", 32_768), (LLAMA33_70B_AWQ, 1, 2, "fp8", 32_768),
        (LLAMA33_70B_AWQ, 2, 1, "fp8", 32_768), (QWEN3_32B_AWQ, 1, 2, "auto", 131_072),
        (QWEN3_32B_AWQ, 2, 1, "auto", 98_304), (QWEN3_32B_AWQ, 1, 3, "auto", 262_144),
    ],
)  # fmt: skip
def test_the_remedy_numbers_are_exactly_enough(shape: ModelShape, tp: int, pp: int, kv: str, length: int) -> None:
    """Whatever the split, the suggested max_model_len starts vLLM and one token more does not; the same for the
    suggested utilization and 0.01 less (where one up to 1.0 is enough)."""
    result = _desktop(shape, tp=tp, pp=pp, length=length, kv=kv)
    if pp == 3:  # three cards on the same budget: uneven stages (21/22/21) and uneven weights
        assert [r.kv_layers for r in result.rows] == [21, 22, 21]
        assert result.rows[1].weights_bytes < result.rows[0].weights_bytes == result.rows[2].weights_bytes
    remedy = result.remedy
    assert remedy is not None and remedy.max_model_len is not None
    assert _desktop(shape, tp=tp, pp=pp, length=remedy.max_model_len, kv=kv).vllm_error is None
    assert _desktop(shape, tp=tp, pp=pp, length=remedy.max_model_len + 1, kv=kv).vllm_error is not None
    if remedy.gpu_memory_utilization is not None:
        fits = _desktop(shape, tp=tp, pp=pp, length=length, kv=kv, utilization=remedy.gpu_memory_utilization)
        assert fits.vllm_error is None and fits.max_concurrency >= 1
        short = round(remedy.gpu_memory_utilization - 0.01, 2)
        assert _desktop(shape, tp=tp, pp=pp, length=length, kv=kv, utilization=short).vllm_error is not None
    else:
        assert remedy.gpu_memory_utilization_needed is not None and remedy.gpu_memory_utilization_needed > 1


def test_the_remedy_names_vllms_rank_and_the_one_that_decides_each_knob() -> None:
    """Vector hy3-tp1-pp3-first-failing-rank: vLLM names rank 1 (58,240 tokens), rank 2 fits only 40,320. Planned
    from a known KV memory there is no budget, so no utilization to suggest."""
    case = CASES["hy3-tp1-pp3-first-failing-rank"]
    shape = ModelShape(num_hidden_layers=80, num_key_value_heads=8, head_dim=128, weight_bytes=0)
    serve = ServeConfig(tensor_parallel=1, pipeline_parallel=3, max_model_len=131_072, max_num_seqs=6,
                        kv_cache_dtype="fp8")  # fmt: skip
    result = plan_from_available(shape, serve, case["inputs"]["available_kv_bytes_per_rank"])
    assert result.vllm_error is not None
    assert result.vllm_error.message == case["vllm"]["error"]["message"]
    assert result.remedy == Remedy(
        rank=1,
        max_model_len=40_320,
        max_model_len_rank=2,
        gpu_memory_utilization=None,
        gpu_memory_utilization_rank=None,
    )
    assert [r["estimated_max_model_len"] for r in case["vllm"]["all_ranks_fit"] if not r["fits"]] == [58_240, 40_320]
    (problem,) = result.problems
    assert "on rank 1 but only 3.00 GiB is available (PP stage 1 of 3, 27 KV layers)" in problem.message


def test_a_later_rank_with_no_memory_means_no_length_fits() -> None:
    """vLLM stops at rank 0 (too small for 1,024 tokens), but rank 1 has nothing: no max_model_len can help."""
    shape = ModelShape(num_hidden_layers=2, num_key_value_heads=1, head_dim=1, weight_bytes=0)
    serve = ServeConfig(tensor_parallel=1, pipeline_parallel=2, max_model_len=1_024, max_num_seqs=1, block_size=1)
    result = plan_from_available(shape, serve, [40, 0])
    assert result.vllm_error is not None and result.vllm_error.rank == 0
    assert result.remedy is not None
    assert (result.remedy.rank, result.remedy.max_model_len, result.remedy.max_model_len_rank) == (0, None, 1)
    assert "not even a one-token request fits on rank 1" in result.problems[0].message


# --- MTP with pipeline parallel -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "pp", "refused"),
    [
        ("mtp", 2, True), ("mtp", 3, True), ("deepseek_mtp", 2, True), ("qwen3_next_mtp", 4, True),
        ("mtp", 1, False), (None, 2, False), ("ngram", 2, False), ("suffix", 2, False), ("eagle3", 2, False),
    ],
)  # fmt: skip
def test_mtp_with_pipeline_parallel_is_refused_as_vllm_does(method: str | None, pp: int, refused: bool) -> None:
    problem = pipeline_parallel_refusal(method, pp)
    assert (problem is not None) == refused
    assert refuses_pipeline_parallel(method) == (method is not None and method.endswith("mtp"))
    if problem is not None:
        assert (problem.severity, problem.code) == (Severity.ERROR, "mtp-pp")
        assert f"pipeline_parallel {pp}" in problem.message
        assert MTP_PP_ERROR in problem.message


def test_the_refusal_is_vllms_own_message() -> None:
    config_error = CASES["hy3-tp2-pp2-mtp-rejected"]["vllm"]["config_error"]
    assert config_error == f"NotImplementedError: {MTP_PP_ERROR}"
    # The planner's plan carries it before any KV arithmetic, with no remedy: no knob but the split fixes it.
    shape = ModelShape(num_hidden_layers=80, num_key_value_heads=8, head_dim=128, weight_bytes=0, mtp_layers=1)
    serve = ServeConfig(tensor_parallel=2, pipeline_parallel=2, max_model_len=131_072, max_num_seqs=6,
                        kv_cache_dtype="fp8_e4m3", speculative_method="mtp")  # fmt: skip
    result = plan_from_available(shape, serve, 60 * GIB)
    assert (result.remedy, [p.code for p in result.problems]) == (None, ["mtp-pp"])
    assert math.isclose(result.max_concurrency, result.num_blocks / result.blocks_per_request)
