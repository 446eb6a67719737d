"""The capacity planner against vLLM 0.23.0's own KV-cache vectors: every case of kv-cases.json.

The vectors were made by running vLLM 0.23.0's code (tests/fixtures/vllm-0.23.0/README.md): per-rank num_blocks before
the minimum, the minimum, blocks per request, concurrency, tokens, the two startup lines as vLLM logged them, and the
errors it raised (type, message, estimated maximum model length, the first failing rank). Each case's inputs (model
shape, resolved serve settings, per-rank available KV bytes) go into `capacity.plan_from_available`, and every
recorded output is compared. The profile cases are also planned from the example specs they came from, through
`planning.plan_for`, as `hy3spark plan` does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from hy3spark import planning
from hy3spark.capacity import (
    AUTO_FIT_MAX_MODEL_LEN,
    ModelShape,
    ServeConfig,
    Severity,
    VllmError,
    plan_from_available,
    vllm_default_max_num_batched_tokens,
)
from hy3spark.engines.vllm import VllmEngine
from hy3spark.spec import load_spec, parse_spec

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "vllm-0.23.0" / "kv-cases.json"
# The copy's sha256, as tests/fixtures/vllm-0.23.0/README.md records it.
FIXTURE_SHA256 = "aa3a138ef50ef4c5c3cb788bc24993b6b9d8f1fd556c917e2abbf918e09f8947"
DATA = json.loads(FIXTURE.read_text())
CASES: dict[str, dict[str, Any]] = {case["id"]: case for case in DATA["cases"]}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def planner_inputs(case: dict[str, Any]) -> tuple[ModelShape, ServeConfig]:
    """The case's inputs in the planner's terms: what vLLM was given and what its config resolved."""
    inputs = case["inputs"]
    model = inputs["model"]
    resolved = inputs.get("resolved_vllm_config")  # absent where vLLM refused the configuration
    specs = inputs.get("layer_specs")
    if specs is None:
        assert model["sliding_window"] is None, f"{case['id']}: no layer specs to count its sliding-window layers"
        sliding = 0
    else:
        sliding = sum(spec["layers"] for spec in specs if spec["spec"] == "SlidingWindowSpec")
    # With --max-model-len -1 vLLM resolves the model's own length first, then auto-fits from it.
    auto_fit = resolved is not None and inputs["max_model_len"] == AUTO_FIT_MAX_MODEL_LEN
    model_length = resolved["max_model_len"] if auto_fit else None
    shape = ModelShape(
        num_hidden_layers=model["num_hidden_layers"],
        num_key_value_heads=model["num_key_value_heads_total"],
        head_dim=model["head_dim"],
        weight_bytes=0,
        dtype_bytes=DTYPE_BYTES[model["model_dtype"]],
        mtp_layers=model["extra_full_layers_on_last_pp_rank"],
        sliding_window=model["sliding_window"] if sliding else None,
        sliding_window_layers=sliding,
        max_context=model_length,
    )
    flags = inputs["serve_flags"]
    speculative = json.loads(flags[flags.index("--speculative-config") + 1]) if "--speculative-config" in flags else {}
    serve = ServeConfig(
        tensor_parallel=inputs["tensor_parallel"],
        pipeline_parallel=inputs["pipeline_parallel"],
        max_model_len=inputs["max_model_len"],
        max_num_seqs=inputs["max_num_seqs"],
        kv_cache_dtype=inputs["kv_cache_dtype"],
        # vLLM resolved neither where it refused the configuration: the planner's defaults stand in.
        max_num_batched_tokens=inputs["max_num_batched_tokens"] or ServeConfig.max_num_batched_tokens,
        block_size=inputs["block_size"] or ServeConfig.block_size,
        hybrid_kv_cache_manager=not (resolved or {}).get("disable_hybrid_kv_cache_manager", False),
        speculative_method=speculative.get("method"),
    )
    return shape, serve


def test_the_fixture_is_the_recorded_copy_with_28_cases() -> None:
    assert hashlib.sha256(FIXTURE.read_bytes()).hexdigest() == FIXTURE_SHA256
    assert FIXTURE_SHA256 in (FIXTURE.parent / "README.md").read_text()
    assert DATA["vllm_version"] == "0.23.0"
    assert len(DATA["cases"]) == len(CASES) == 28


@pytest.mark.parametrize("case_id", list(CASES))
def test_planner_matches_vllm(case_id: str) -> None:
    case = CASES[case_id]
    inputs, vllm = case["inputs"], case["vllm"]
    shape, serve = planner_inputs(case)
    plan = plan_from_available(shape, serve, inputs["available_kv_bytes_per_rank"])

    if "config_error" in vllm:
        # vLLM refused the flags in create_engine_config: no KV check ran, so nothing else to compare.
        kind, message = vllm["config_error"].split(": ", 1)
        assert plan.vllm_error == VllmError(kind, message)
        assert [p.code for p in plan.problems if p.severity is Severity.ERROR] == ["mtp-pp"]
        assert not plan.ok
        return

    # The per-rank admission check, in rank order, up to where vLLM stopped.
    for check in vllm["per_rank_checks"]:
        row = plan.rows[check["rank"]]
        assert row.kv_available_bytes == check["available_bytes"]
        if "needed_bytes" in check:
            assert row.kv_needed_bytes == check["needed_bytes"], f"rank {row.rank}"
    assert [row.kv_layers for row in plan.rows] == [sum(r["layers_by_spec"].values()) for r in inputs["ranks"]]
    (spec,) = {(s["num_kv_heads"], s["page_size_bytes"]) for s in inputs["layer_specs"]}
    assert (plan.kv_heads_per_rank, plan.page_bytes) == spec

    if "error" in vllm:
        error = vllm["error"]
        failing = vllm["per_rank_checks"][-1]["rank"]
        assert plan.vllm_error == VllmError(
            error["type"], error["message"], rank=failing, estimated_max_model_len=error.get("estimated_max_model_len")
        )
        # Every rank's needed bytes and estimate, as vLLM's helpers give them past the rank where vLLM stopped.
        for rank in vllm["all_ranks_fit"]:
            row = plan.rows[rank["rank"]]
            assert row.kv_needed_bytes == rank["needed_bytes"], f"rank {row.rank}"
            assert row.estimated_max_model_len == rank.get("estimated_max_model_len"), f"rank {row.rank}"
        assert not plan.ok
        return

    assert plan.vllm_error is None
    assert [row.num_blocks for row in plan.rows] == vllm["num_blocks_per_rank_before_min"]
    assert plan.num_blocks == vllm["num_blocks"]
    assert [g.blocks_per_request for g in plan.groups] == [g["blocks_per_request"] for g in vllm["kv_cache_groups"]]
    assert plan.blocks_per_request == vllm["blocks_per_request"]
    assert plan.max_concurrency == vllm["max_concurrency"]
    assert plan.kv_cache_tokens == vllm["kv_cache_tokens"]
    assert [plan.kv_cache_size_line, plan.max_concurrency_line] == vllm["lines"] == vllm["logged_lines"]
    auto_fit = vllm.get("max_model_len_auto_fit")
    assert (plan.auto_fit_from, plan.max_model_len) == (
        (auto_fit["from"], auto_fit["to"]) if auto_fit else (None, inputs["max_model_len"])
    )
    assert all(p.severity is Severity.WARNING for p in plan.problems)


def test_the_first_failing_rank_is_reported_and_the_length_that_fits_everywhere_is_suggested() -> None:
    """vLLM stops at rank 1 (3 GiB for 27 layers: 58240 tokens) and never looks at rank 2 (2 GiB for 26: 40320)."""
    case = CASES["hy3-tp1-pp3-first-failing-rank"]
    shape, serve = planner_inputs(case)
    plan = plan_from_available(shape, serve, case["inputs"]["available_kv_bytes_per_rank"])
    assert plan.vllm_error is not None
    assert (plan.vllm_error.rank, plan.vllm_error.estimated_max_model_len) == (1, 58240)
    (problem,) = plan.problems
    assert problem.code == "max-model-len"
    assert "needs 6.75 GiB of KV cache on rank 1 but only 3.00 GiB is available" in problem.message
    assert (
        "the estimated maximum model length is 58240 (vLLM stops at the first rank that fails), but rank 2 fits only "
        "40320: set max_model_len to at most 40320" in problem.message
    )


def test_vllm_serve_batch_default_follows_what_nvml_reports() -> None:
    defaults = DATA["gb10_batch_defaults"]
    reported = defaults["total_memory_121.69GiB"]
    assert (
        vllm_default_max_num_batched_tokens(reported["get_device_total_memory"])
        == (reported["max_num_batched_tokens"]["OPENAI_API_SERVER"])
    )
    assert (
        vllm_default_max_num_batched_tokens(None)
        == (defaults["nvml_not_supported"]["max_num_batched_tokens"]["OPENAI_API_SERVER"])
    )
    defaulted = [c for c in CASES.values() if c["inputs"]["max_num_batched_tokens_source"].startswith("vLLM's default")]
    for case in defaulted:
        inputs = case["inputs"]
        if inputs["max_num_batched_tokens"] is None:  # refused before vLLM resolved it
            continue
        device_total = inputs["device"].get("total_memory_bytes")  # absent: NVML raised
        assert vllm_default_max_num_batched_tokens(device_total) == inputs["max_num_batched_tokens"], case["id"]
    assert len(defaulted) == 26


# --- the profile cases, from the spec, as `hy3spark plan` plans them ---------------------------------------------


def spec_plan(example: str, **serving: Any) -> Any:
    """`hy3spark plan examples/<example>` with serving fields replaced."""
    data = yaml.safe_load((REPO / "examples" / example).read_text())
    data.setdefault("serving", {}).update(serving)
    loaded = parse_spec(yaml.safe_dump(data), example)
    return planning.plan_for(loaded, planning.overhead_for(loaded, None, None))


PROFILE_CASES = [case_id for case_id, case in CASES.items() if "hy3spark_plan" in case]


@pytest.mark.parametrize("case_id", PROFILE_CASES)
def test_profile_specs_plan_what_vllm_logged(case_id: str) -> None:
    """The spec plans the max_num_batched_tokens it renders: the profiles' 2048, what vLLM picks on a GB10 whose NVML
    cannot report its memory, and 8192 (vLLM's default where NVML reports 121.69 GiB) when the spec says so."""
    case = CASES[case_id]
    inputs = case["inputs"]
    example = case["hy3spark_plan"]["command"].split()[2].removeprefix("examples/")
    nvml_reports = "total_memory_bytes" in inputs["device"]
    assert inputs["max_num_batched_tokens"] == (8192 if nvml_reports else 2048)
    plan = spec_plan(example, **({"max_num_batched_tokens": 8192} if nvml_reports else {}))
    assert [row.kv_available_bytes for row in plan.rows] == inputs["available_kv_bytes_per_rank"]
    assert [row.num_blocks for row in plan.rows] == case["vllm"]["num_blocks_per_rank_before_min"]
    assert [plan.kv_cache_size_line, plan.max_concurrency_line] == case["vllm"]["lines"]
    assert len(PROFILE_CASES) == 5


def test_the_gpt_oss_spec_plans_the_batch_size_it_renders() -> None:
    """The ambiguity ENGINES.md describes: vLLM's default differs between a GB10 whose NVML cannot report its memory
    (2048) and one that can (8192), and the lines differ with it. The profile renders 2048 explicitly and plans it."""
    nvml = CASES["gptoss120b-profile-gb10-nvml-unsupported"]["vllm"]["lines"]
    reported = CASES["gptoss120b-profile-tp1-hybrid"]["vllm"]["lines"]
    assert nvml != reported
    plan = spec_plan("gpt-oss-single.yml")
    assert [plan.kv_cache_size_line, plan.max_concurrency_line] == nvml
    argv = VllmEngine(load_spec(REPO / "examples" / "gpt-oss-single.yml").spec).serve_argv()
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "2048"


@pytest.mark.parametrize(
    ("case_id", "example", "serving"),
    [
        ("gptoss-disable-hybrid-kv-cache-manager", "gpt-oss-single.yml",
         {"extra_args": ["--disable-hybrid-kv-cache-manager"]}),
        ("llama405b-tp2-len30001", "llama-405b-pair.yml", {"max_model_len": 30001}),
        ("llama405b-block-size-32", "llama-405b-pair.yml", {"max_model_len": 30001, "extra_args": ["--block-size=32"]}),
        ("llama405b-tp2-bf16", "llama-405b-pair.yml", {"kv_cache_dtype": "auto"}),
    ],
)  # fmt: skip
def test_extra_args_and_serving_fields_reach_the_plan(case_id: str, example: str, serving: dict[str, Any]) -> None:
    """Cases planned with a profile's memory: the spec's serving fields and extra_args give vLLM's numbers."""
    case = CASES[case_id]
    plan = spec_plan(example, **serving)
    assert [row.kv_available_bytes for row in plan.rows] == case["inputs"]["available_kv_bytes_per_rank"]
    assert [plan.kv_cache_size_line, plan.max_concurrency_line] == case["vllm"]["lines"]


def test_extra_args_are_read_as_vllm_reads_them() -> None:
    assert planning.kv_extra_args(["--block_size", "2K", "--block-size=32", "--enforce-eager"]) == {"block_size": 32}
    # A field of the spec now (serving.max_num_batched_tokens): validation refuses it in extra_args, and the plan
    # never reads it there.
    assert planning.kv_extra_args(["--max_num_batched_tokens", "4096"]) == {}
    assert planning.kv_extra_args(["--block-size", "16", "--block_size=32"]) == {"block_size": 32}
    assert planning.kv_extra_args(["--disable-hybrid-kv-cache-manager", "--no-disable-hybrid-kv-cache-manager"]) == {
        "disable_hybrid_kv_cache_manager": False
    }


def test_the_default_spec_plans_the_hy3_profile_vector() -> None:
    loaded = load_spec()
    plan = planning.plan_for(loaded, planning.overhead_for(loaded, None, None))
    assert [plan.kv_cache_size_line, plan.max_concurrency_line] == CASES["hy3-profile-gb10-nvml-unsupported"]["vllm"][
        "lines"
    ]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2048", 2048), ("2k", 2_000), ("2K", 2_048), ("1m", 1_000_000), ("1M", 1_048_576),
     ("1g", 1_000_000_000), ("1G", 1_073_741_824)],
)  # fmt: skip
def test_extra_args_take_vllms_human_readable_numbers(value: str, expected: int) -> None:
    """vLLM's human_readable_int: a lower-case suffix is decimal (k = 1000), an upper-case one binary (K = 1024)."""
    assert planning.kv_extra_args(["--block-size", value]) == {"block_size": expected}


def test_a_kv_flag_without_its_value_is_a_clean_error() -> None:
    with pytest.raises(planning.Hy3SparkError, match=r"^serving.extra_args: --block-size needs a value$"):
        planning.kv_extra_args(["--enforce-eager", "--block_size"])


def test_a_spec_with_mtp_and_pipeline_parallel_is_refused_like_vllm() -> None:
    """vLLM's vector hy3-tp2-pp2-mtp-rejected: the profile's MTP speculative_config with PP > 1 never loads."""
    message = CASES["hy3-tp2-pp2-mtp-rejected"]["vllm"]["config_error"].split(": ", 1)[1]
    plan = spec_plan("hy3-two-spark.yml", tensor_parallel=1, pipeline_parallel=2)
    assert plan.vllm_error == VllmError("NotImplementedError", message)
    assert [p.code for p in plan.problems] == ["mtp-pp"]


def test_a_spec_without_speculative_config_plans_no_draft_layer() -> None:
    # The profile's 80 layers only: 23,876,052,834 B // 16,384 B // 80 = 18,215 blocks per rank (x 16 tokens).
    plan = spec_plan("hy3-two-spark.yml", speculative_config=None)
    assert [row.kv_layers for row in plan.rows] == [80, 80]
    assert plan.kv_cache_size_line == "GPU KV cache size: 291,440 tokens"


def test_a_kv_flag_anywhere_in_extra_args_takes_the_next_argument() -> None:
    assert planning.kv_extra_args(["--enforce-eager", "--block-size", "32", "--disable-hybrid-kv-cache-manager"]) == {
        "block_size": 32,
        "disable_hybrid_kv_cache_manager": True,
    }
