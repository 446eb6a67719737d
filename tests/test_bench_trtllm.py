"""`hy3spark bench` against the TensorRT-LLM double (tests/trtllm_double), then its line beside a vLLM line.

The double runs as one rank in one container of hy3spark/trtllm-serving, the way the head runs it
(`mpirun -np 1 trtllm-llmapi-launch trtllm-serve REPO --tp_size 1 ...`: real Open MPI, one node, no SSH), its port
published on 127.0.0.1 only. guidellm (scripts/bench-venv) drives the load, as in tests/test_bench.py, whose vLLM
double, fixtures and helpers this file reuses. trtllm-serve has no API key, so the spec names none; the model is
addressed by its repository name; the KV line of the `up` record is the one the double logged.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_bench
from docker_runs import docker, remove_leftovers
from test_bench import READ_IDLE, SPEC, _docker_usable, _hy3spark, _up_record, compare_cells, up_record, wait_healthy

from hy3spark import bench, status
from hy3spark.engines import engine_for
from hy3spark.spec import load_spec

REPO = Path(__file__).resolve().parent.parent
DOUBLE = REPO / "tests" / "trtllm_double"
MODEL = "nvidia/Qwen3-235B-A22B-FP4"
PORT = 8355
PREFIX = "benchtrt"
LABEL = "org.hy3spark.test=bench-trtllm"
# The lab's name for its TensorRT-LLM run (README: `hy3spark bench examples/pair-trtllm-235b.yml --label ...`).
LAB_LABEL = "pair-trtllm-235b"
# test_bench's fixtures, used as they are: the bench venv (guidellm) and the vLLM double.
bench_venv = test_bench.bench_venv
endpoint = test_bench.endpoint
# The same machine as test_bench's vLLM spec (bench-head), served by TensorRT-LLM: the profile of
# examples/pair-trtllm-235b.yml on one node, one rank (tp 1), no API key (trtllm-serve has none).
TRTLLM_SPEC = """\
name: pair-trtllm
profile: qwen3-235b-fp4-trtllm-tp2
head:
  name: bench-head
  fabric_ip: 10.0.0.1/24
  ssh_user: root
  gpus: 1
fabric:
  interfaces: [eth0]
  mtu: 1500
model:
  revision: 0123456789abcdef0123456789abcdef01234567
serving:
  host: 127.0.0.1
  tensor_parallel: 1
container:
  name_prefix: benchtrt
  gpus: false
"""


@pytest.fixture
def trtllm_spec(tmp_path: Path) -> Path:
    path = tmp_path / "pair-trtllm.yml"
    path.write_text(TRTLLM_SPEC)
    return path


# --- without Docker ------------------------------------------------------------------------------------------------
def test_tool_vllm_is_not_available_for_trtllm(cli, trtllm_spec: Path, tmp_path: Path) -> None:
    result = cli("bench", str(trtllm_spec), "--tool", "vllm", "--target", "http://127.0.0.1:9/v1", "--runs-dir",
                 str(tmp_path))
    assert result.code == 1
    assert ("--tool vllm runs `vllm bench serve` in the head container: not available for engine trtllm (its image "
            "has no vLLM); use --tool guidellm (the default)") in result.err
    assert not (tmp_path / "labbook.md").exists()


def test_kv_readings_trtllm_logs_and_the_one_it_does_not(trtllm_spec: Path, tmp_path: Path) -> None:
    # TensorRT-LLM's KV cache manager line (hy3spark/engines/trtllm.py quotes it); it logs no concurrency line.
    line = "[TensorRT-LLM][INFO] [MemUsageChange] Allocated 52.31 GiB for max tokens in paged KV cache (1071232)."
    engine = engine_for(load_spec(trtllm_spec).spec)
    assert status.kv_lines_of(load_spec(trtllm_spec).spec, ["[TensorRT-LLM][INFO] Number of tokens per block: 32.",
                                                             line]) == [line]
    kv = bench.kv_of((tmp_path / "20260102T030405Z-pair-trtllm.json", {"kv_lines": [line]}), engine.name,
                     engine.log_lines())
    assert kv is not None
    assert (kv["kv_cache_tokens"], kv["max_concurrency"], kv["not_logged"]) == (1071232, None, ["max_concurrency"])
    assert bench.kv_text(kv) == "KV cache 1,071,232 tokens, max concurrency not available for engine trtllm"
    # An up that recorded no KV line: the number is unknown, the reading trtllm never gives still says so.
    kv = bench.kv_of((tmp_path / "x.json", {"kv_lines": []}), engine.name, engine.log_lines())
    assert bench.kv_text(kv) == "KV cache ? tokens, max concurrency not available for engine trtllm"


# --- against the TensorRT-LLM double, one rank under mpirun --------------------------------------------------------
@pytest.fixture(scope="module")
def trtllm_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The double's base URL and the container's name."""
    if not _docker_usable():
        pytest.skip("needs root and a running Docker engine (scripts/ensure-docker)")
    built = subprocess.run([str(DOUBLE / "build-image")], capture_output=True, text=True, timeout=900, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    image = built.stdout.strip().splitlines()[-1]
    sys.path.insert(0, str(REPO / "tests" / "engine_double"))
    from make_model import make_model

    hub = tmp_path_factory.mktemp("hub")
    make_model(hub, MODEL, preset="small", total_size=10**9)
    remove_leftovers(PREFIX, LABEL)
    name = f"{PREFIX}-{os.getpid()}-head"
    try:
        docker("run", "-d", "--name", name, "--label", LABEL, "-p", f"127.0.0.1::{PORT}", "-v", f"{hub}:/hub:ro",
               "-e", "HF_HUB_CACHE=/hub", image, "mpirun", "-np", "1", "trtllm-llmapi-launch", "trtllm-serve", MODEL,
               "--tp_size", "1", "--backend", "pytorch", "--host", "0.0.0.0", "--port", str(PORT))
        port = docker("port", name, str(PORT)).stdout.split(":")[-1].strip()
        root = f"http://127.0.0.1:{port}"
        wait_healthy(root, name, 60, 0.5)
        yield f"{root}/v1", name
    finally:
        remove_leftovers(PREFIX, LABEL)


def test_trtllm_and_vllm_lines_side_by_side(
    bench_venv: Path, endpoint: str, trtllm_endpoint: tuple[str, str], trtllm_spec: Path, tmp_path: Path
) -> None:
    target, container = trtllm_endpoint
    runs, labbook = tmp_path / "runs", tmp_path / "runs" / "labbook.md"
    # up's records: TensorRT-LLM's KV line as the double logged it, picked by the filter status applies.
    logs = docker("logs", container)
    lines = status.kv_lines_of(load_spec(trtllm_spec).spec, (logs.stdout + logs.stderr).splitlines())
    assert len(lines) == 1, logs.stdout
    allocated = re.search(r"paged KV cache \((\d+)\)", lines[0])
    assert allocated, lines
    tokens = int(allocated.group(1))
    up_record(trtllm_spec, runs, "2026-01-02T05:00:00Z", lines)
    vllm_spec = tmp_path / "bench-test.yml"
    vllm_spec.write_text(SPEC)
    _up_record(vllm_spec, runs, "2026-01-02T04:00:00Z", "1,234,560", "12.35")

    settings = ["--concurrency", "1,2", "--requests", "4", "--max-tokens", "16", "--prompt-tokens", "32",
                "--runs-dir", str(runs), "--link", "record"]
    vllm = _hy3spark("bench", str(vllm_spec), "--target", endpoint, "--label", "pair-vllm", *settings)
    assert vllm.returncode == 0, vllm.stderr[-3000:]
    # No key in bench's environment (trtllm-serve checks none): nothing is missing, nothing is said about a key.
    proc = _hy3spark("bench", str(trtllm_spec), "--target", target, "--label", LAB_LABEL, *settings, "--json",
                     key=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "API key" not in proc.stderr and "warning" not in proc.stderr, proc.stderr

    result = json.loads(proc.stdout)
    assert result["endpoint"] == {"target": target, "model": MODEL, "engine": "trtllm",
                                  "version": "1.2.0rc6+testdouble", "version_from": "endpoint /version"}
    assert result["tool"].startswith("guidellm 0.8.")
    assert result["split"] == {"tensor_parallel": 1, "pipeline_parallel": 1, "launcher": "mpi", "nodes": 1}
    assert result["kv"]["kv_cache_tokens"] == tokens and result["kv"]["not_logged"] == ["max_concurrency"]
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    # The double has no per-token delay: the numbers are fast, and what is checked is that they are its answers' own.
    report = json.loads(Path(result["report"]).read_text())
    for lv, level in zip(result["levels"], report["benchmarks"], strict=True):
        # Against a double with no delay guidellm's max_requests constraint, with two worker processes, has stopped a
        # level at 2 of 4 requests on a loaded box (request_totals total 2, none incomplete): what is checked is that
        # bench reports guidellm's own counts, none errored.
        totals = level["metrics"]["request_totals"]
        assert (lv["completed"], lv["errored"]) == (totals["successful"], 0) and 1 <= lv["completed"] <= 4, totals
        assert lv["output_tokens_per_s"] > lv["requests_per_s"] > 0 and lv["ttft_ms_p50"] <= lv["ttft_ms_p99"]
        assert 0 <= lv["tpot_ms_p50"] <= lv["tpot_ms_p99"]
        # Every request decoded exactly 16 tokens, by the server's own usage counts.
        counted = level["metrics"]["output_token_count"]["successful"]
        assert (counted["count"], counted["total_sum"]) == (lv["completed"], 16 * lv["completed"])
    scenario = json.loads((Path(result["report"]).parent / "scenario.json").read_text())
    assert scenario["spec"]["backend"]["model"] == MODEL  # requests name the repository, as trtllm-serve serves it

    line = [x for x in labbook.read_text().splitlines() if f"| bench {LAB_LABEL} |" in x]
    assert len(line) == 1
    assert line[0].startswith(f"| {result['date']} | bench {LAB_LABEL} | trtllm 1.2.0rc6+testdouble | guidellm 0.8.")
    assert ("| TP1 x PP1, mpi, 1 node | link run record 20260102T050000Z-pair-trtllm.json (idle): bench-head GPU0 "
            "gen1 x16 of gen4 x16") in line[0]
    assert f"| KV cache {tokens:,} tokens, max concurrency not available for engine trtllm |" in line[0]
    for lv in result["levels"]:
        assert (f"c{lv['concurrency']}: {lv['output_tokens_per_s']:.1f} tok/s, {lv['requests_per_s']:.2f} req/s, "
                f"TTFT p50/p99 {lv['ttft_ms_p50']:.0f}/{lv['ttft_ms_p99']:.0f} ms") in line[0]
    # up's own lines name the engine as well.
    assert "| up pair-trtllm | trtllm ? |" in labbook.read_text()

    listing = _hy3spark("labbook", "--runs-dir", str(runs))
    assert listing.returncode == 0, listing.stderr
    assert [x.split("  ")[1:3] for x in listing.stdout.splitlines()] == [
        ["pair-vllm", "vllm 0.23.0+testdouble"], [LAB_LABEL, "trtllm 1.2.0rc6+testdouble"]]

    proc = _hy3spark("labbook", "--compare", "pair-vllm", LAB_LABEL, "--runs-dir", str(runs))
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    header, cells = compare_cells(proc.stdout)
    assert header == ["pair-vllm", LAB_LABEL]
    assert cells["engine"] == ["vllm 0.23.0+testdouble", "trtllm 1.2.0rc6+testdouble"]
    assert cells["model"] == ["tiny", MODEL]
    assert cells["split"] == ["TP1 x PP1, ray, 1 node", "TP1 x PP1, mpi, 1 node"]
    assert cells["KV cache tokens"] == ["1,234,560", f"{tokens:,}"]
    assert cells["max concurrency"] == ["12.35x", "not available for engine trtllm"]
    assert cells["bench-head GPU1"] == ["gen1 x8 of gen4 x16"] * 2 == [bench.gpu_text(READ_IDLE["gpus"][1])] * 2
    for c in (1, 2):
        for row in ("output tok/s", "requests/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms"):
            assert len(cells[f"c{c} {row}"]) == 2 and "-" not in cells[f"c{c} {row}"], (row, cells)
    assert cells["c1 output tok/s"][1] == f"{result['levels'][0]['output_tokens_per_s']:.1f}"
