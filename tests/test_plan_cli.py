"""`hy3spark plan`: the per-rank budget, the two predicted vLLM lines, the gates, --calibrate and --json."""

from __future__ import annotations

import json
from pathlib import Path

from test_capacity import _SYNTHETIC_LOG


def test_default_hy3_pair(cli) -> None:
    result = cli("plan")
    assert result.code == 0
    assert "overhead: 3.00 GiB per rank (profile hy3-295b-nvfp4-tp2 default)" in result.out
    # Per rank: requested = ceil(0.90 x 121.69 GiB) = 109.52 GiB; weights 181 GB / 2 = 84.28 GiB; KV 22.24 GiB.
    assert "   0  spark-a            121.69     109.52    84.28      3.00      22.24    17991" in result.out
    assert "   1  spark-b            121.69     109.52    84.28      3.00      22.24    17991" in result.out
    assert "  GPU KV cache size: 287,856 tokens\n" in result.out
    assert "  Maximum concurrency for 131,072 tokens per request: 2.20x\n" in result.out
    assert "warning: only 2.20 requests of 131,072 tokens fit in the KV cache, fewer than max_num_seqs 6" in result.err


def test_startup_memory_check_fails_with_exit_1(cli) -> None:
    result = cli("plan", "--free", "100")
    assert result.code == 1
    assert "error: vLLM will refuse to start: free memory 100.00 GiB is less than the 109.52 GiB it requests" in (
        result.err)


def test_less_than_one_request_fails(cli, tmp_path: Path) -> None:
    spec = tmp_path / "c.yml"
    spec.write_text((Path(__file__).parent.parent / "hy3spark/default-cluster.yml").read_text()
                    + "serving:\n  max_model_len: 262144\n  overhead_gib: 21\n")
    result = cli("plan", str(spec))
    assert result.code == 1
    assert "overhead: 21.00 GiB per rank (the spec's serving.overhead_gib)" in result.out
    assert "error:" in result.err and "estimated maximum model length" in result.err


def test_calibrate_from_a_log(cli, tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(_SYNTHETIC_LOG)  # SYNTHETIC: built from vLLM's real log formats (see tests/test_capacity.py)
    result = cli("plan", "--calibrate", str(log))
    assert result.code == 0
    # The worker's 109.52 - 84.29 - 22.21 = 3.02 GiB is the largest overhead, so that is what the plan uses.
    assert f"overhead: 3.02 GiB per rank (calibrated from {log})" in result.out


def test_calibrate_with_an_unusable_log(cli, tmp_path: Path) -> None:
    log = tmp_path / "short.log"
    log.write_text("INFO something else\n")
    result = cli("plan", "--calibrate", str(log))
    assert result.code == 1
    assert "'Available KV cache memory: <N> GiB'" in result.err and "Traceback" not in result.err
    assert cli("plan", "--calibrate", str(tmp_path / "missing.log")).code == 1


def test_json(cli) -> None:
    result = cli("plan", "--json", "--overhead", "3")
    data = json.loads(result.out)
    assert data["overhead_source"] == "--overhead"
    assert data["lines"] == ["GPU KV cache size: 287,856 tokens",
                             "Maximum concurrency for 131,072 tokens per request: 2.20x"]
    assert [r["node"] for r in data["ranks"]] == ["spark-a", "spark-b"]
    assert data["problems"][0]["severity"] == "warning"


def test_gpt_oss_on_a_spark_plans_vllms_2048_token_batch_default(cli) -> None:
    """A GB10's NVML cannot report its memory, so `vllm serve` batches 2048 tokens (vLLM 0.23.0's vector
    gptoss120b-profile-gb10-nvml-unsupported)."""
    example = str(Path(__file__).parent.parent / "examples" / "gpt-oss-single.yml")
    result = cli("plan", example)
    assert result.code == 0
    assert "  GPU KV cache size: 932,107 tokens\n" in result.out
    assert "  Maximum concurrency for 131,072 tokens per request: 7.11x\n" in result.out


def test_a_bad_kv_flag_in_extra_args_is_a_clean_error(cli, tmp_path: Path) -> None:
    spec = tmp_path / "c.yml"
    spec.write_text((Path(__file__).parent.parent / "examples/gpt-oss-single.yml").read_text().replace(
        "  api_key_env: null\n", "  api_key_env: null\n  extra_args: [--block-size, lots]\n"))
    result = cli("plan", str(spec))
    assert result.code == 1
    assert "serving.extra_args: --block-size 'lots' is not a whole number" in result.err
    assert "Traceback" not in result.err


def test_calibrate_with_a_missing_log_names_it(cli, tmp_path: Path) -> None:
    missing = tmp_path / "missing.log"
    result = cli("plan", "--calibrate", str(missing))
    assert result.code == 1
    assert f"--calibrate {missing}: No such file or directory" in result.err
    assert "Traceback" not in result.err


def test_calibrate_from_an_info_log_takes_requested_memory_from_the_spec(cli, tmp_path: Path) -> None:
    """Without vLLM's DEBUG 'Requested memory' line: ceil(0.90 x the spec's 121.69 GiB) = 117,597,278,306 B."""
    log = tmp_path / "vllm.log"
    log.write_text("\n".join(line for line in _SYNTHETIC_LOG.splitlines() if "Requested memory" not in line))
    result = cli("plan", "--calibrate", str(log))
    assert result.code == 0
    # 117,597,278,306 B - 84.29 GiB - 22.21 GiB = 3.02 GiB on the worker, the larger of the two.
    assert f"overhead: 3.02 GiB per rank (calibrated from {log})" in result.out


def _pp_spec(tmp_path: Path, serving: str) -> str:
    spec = tmp_path / "pp.yml"
    spec.write_text((Path(__file__).parent.parent / "hy3spark/default-cluster.yml").read_text()
                    + "serving:\n  tensor_parallel: 1\n  pipeline_parallel: 2\n  speculative_config: null\n" + serving)
    return str(spec)


def test_pipeline_parallel_shows_each_stage_and_its_layers(cli, tmp_path: Path) -> None:
    """Hy3 over PP2 without MTP: 40 layers a stage, 181 GB / 2 per stage, 8 KV heads per rank (fp8: 32 KiB a page)."""
    result = cli("plan", _pp_spec(tmp_path, ""))
    assert result.code == 0
    assert "KV memory   blocks stage layers   (GiB)" in result.out
    rows = [line for line in result.out.splitlines() if line.startswith(("   0  ", "   1  "))]
    assert rows == ["   0  spark-a            121.69     109.52    84.28      3.00      22.24    18215     0     40",
                    "   1  spark-b            121.69     109.52    84.28      3.00      22.24    18215     1     40"]


def test_pipeline_parallel_with_mtp_is_refused(cli, tmp_path: Path) -> None:
    spec = tmp_path / "mtp.yml"
    spec.write_text((Path(__file__).parent.parent / "hy3spark/default-cluster.yml").read_text()
                    + "serving:\n  tensor_parallel: 1\n  pipeline_parallel: 2\n")
    result = cli("plan", str(spec), "--json")
    assert result.code == 1
    data = json.loads(result.out)
    assert [p["code"] for p in data["problems"]] == ["mtp-pp"]
    assert data["vllm_error"]["type"] == "NotImplementedError" and data["remedy"] is None


def test_json_names_the_failing_rank_and_the_knobs(cli, tmp_path: Path) -> None:
    """262,144 tokens over PP2 at 0.90 with 10 GiB of overhead: 15.24 GiB of KV a stage, 20.00 GiB needed (40 layers
    x 8 KV heads x 256 x 1 B a token): 199,696 tokens fit; 109.52 + 4.76 GiB is 0.939 of 121.69, so 0.94."""
    result = cli("plan", _pp_spec(tmp_path, "  max_model_len: 262144\n  overhead_gib: 10\n"), "--json")
    assert result.code == 1
    data = json.loads(result.out)
    assert [(r["pp_rank"], r["kv_layers"]) for r in data["ranks"]] == [(0, 40), (1, 40)]
    assert data["vllm_error"]["rank"] == 0 and data["vllm_error"]["type"] == "ValueError"
    remedy = data["remedy"]
    assert remedy["rank"] == 0 and remedy["max_model_len"] == data["vllm_error"]["estimated_max_model_len"]
    assert (remedy["max_model_len"], remedy["gpu_memory_utilization"]) == (199_696, 0.94)
    (problem,) = data["problems"]
    assert "(PP stage 0 of 2, 40 KV layers)" in problem["message"]
    assert "set max_model_len to at most 199696, or raise gpu_memory_utilization to at least 0.94" in problem["message"]
