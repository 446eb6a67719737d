"""`hy3spark bench` against the engine double: guidellm (from scripts/bench-venv) drives a real HTTP load.

The double runs in the serving image with plain Docker, its port published on 127.0.0.1 only, with a per-token
delay, so the measured time per output token has a known value. The API key goes from this process's environment
to the double and to guidellm; the test watches every command line on the machine while the bench runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hy3spark import bench
from hy3spark.engines import vllm as vllm_engine
from hy3spark.errors import Hy3SparkError

REPO = Path(__file__).resolve().parent.parent
TOKEN_DELAY_S = 0.05
PREFILL_DELAY_S = 0.1
KEY_ENV = "HY3SPARK_BENCH_TEST_KEY"
KEY = "bench-test-key-3f9a0c"
PREFIX = f"hy3bench{os.getpid()}"
SPEC = f"""\
name: bench-test
profile: gpt-oss-120b-single
head:
  name: bench-head
  fabric_ip: 10.0.0.1/24
  ssh_user: root
fabric:
  interfaces: [eth0]
  mtu: 1500
serving:
  host: 127.0.0.1
  api_key_env: {KEY_ENV}
container:
  name_prefix: {PREFIX}
  gpus: false
"""


# --- without Docker: parsing and the notebook line ------------------------------------------------------------------
def test_concurrency_levels_are_validated() -> None:
    assert bench.parse_levels("1,2,4") == [1, 2, 4]
    for bad in ("", "0,1", "one"):
        with pytest.raises(Hy3SparkError, match="--concurrency"):
            bench.parse_levels(bad)


def test_vllm_bench_result_gives_the_four_numbers() -> None:
    # The keys `vllm bench serve --save-result --metric-percentiles 50,99` writes.
    result = {"completed": 20, "failed": 0, "output_throughput": 412.5, "request_throughput": 1.61,
              "median_ttft_ms": 180.0, "p50_ttft_ms": 181.0, "p99_ttft_ms": 950.0, "median_tpot_ms": 48.0,
              "p50_tpot_ms": 47.5, "p99_tpot_ms": 61.0}
    level = bench.parse_vllm(result, 4)
    assert (level.output_tokens_per_s, level.requests_per_s) == (412.5, 1.61)
    assert (level.ttft_ms_p50, level.ttft_ms_p99, level.tpot_ms_p50, level.tpot_ms_p99) == (181.0, 950.0, 47.5, 61.0)
    with pytest.raises(Hy3SparkError, match="lacks p99_ttft_ms"):
        bench.parse_vllm({k: v for k, v in result.items() if k != "p99_ttft_ms"}, 4)


def test_guidellm_scenario_levels_and_prompt_sets(tmp_path: Path) -> None:
    endpoint = bench.Endpoint("http://127.0.0.1:8888/v1", "hy3", "vllm", "0.23.0")
    settings = bench.Settings(concurrency=[1, 2, 4], requests=20, max_tokens=256, prompt_tokens=512)
    scenario = bench.guidellm_scenario(endpoint, settings, "/tok", tmp_path / "r.json", "lab")
    spec = scenario["spec"]
    assert scenario["benchmarks"] == [{"profile.streams": 1}, {"profile.streams": 2}, {"profile.streams": 4}]
    assert spec["constraints"] == [{"kind": "max_requests", "count": 20}]
    assert spec["data"] == [{"kind": "synthetic_text", "prompt_tokens": 512, "output_tokens": 256}]
    assert "api_key" not in spec["backend"]  # the key travels in guidellm's environment only
    assert spec["outputs"] == [{"kind": "json", "path": str(tmp_path / "r.json")}]

    for name, kind in (("p.txt", "text_file"), ("p.jsonl", "json_file"), ("p.csv", "csv_file")):
        settings.prompts = tmp_path / name
        settings.prompts.write_text("What is a DGX Spark?\n")
        spec = bench.guidellm_scenario(endpoint, settings, "/tok", tmp_path / "r.json", "lab")["spec"]
        assert spec["data"] == [{"kind": kind, "path": str(tmp_path / name)}]
        assert spec["backend"]["max_tokens"] == 256
    settings.prompts = tmp_path / "p.parquet"
    with pytest.raises(Hy3SparkError, match=r"use a \.txt"):
        bench.guidellm_scenario(endpoint, settings, "/tok", tmp_path / "r.json", "lab")
    settings.prompts = tmp_path / "missing.txt"
    with pytest.raises(Hy3SparkError, match=r"missing\.txt: no such file"):
        bench.guidellm_scenario(endpoint, settings, "/tok", tmp_path / "r.json", "lab")


def test_labbook_line_is_one_table_row() -> None:
    result = bench.BenchResult(
        label="tp2 | mtp", date="2026-01-02T03:04:05Z", tool="guidellm 0.8.1",
        endpoint=bench.Endpoint("http://127.0.0.1:8888/v1", "hy3", "vllm", None),
        settings=bench.Settings(concurrency=[1], requests=5, max_tokens=64, prompt_tokens=128),
        levels=[bench.Level(1, 5, 1, 20.04, 0.31, 120.4, 130.6, 48.04, 49.96)],
        report="/x/runs/bench/20260102T030405Z-tp2-mtp/guidellm.json",
        split={"tensor_parallel": 2, "pipeline_parallel": 1, "launcher": "native", "nodes": 1},
        link={"source": "nodes under load", "under_load": True,
              "nodes": {"desk": READ_UNDER_LOAD, "spark-b": {"status": "skipped", "reason": "nvidia-smi not found",
                                                             "gpus": [], "topo": None}}},
        kv={"source": "run record x.json", "lines": [], "engine": "vllm", "kv_cache_tokens": 123456,
            "max_concurrency": 4.56, "not_logged": []},
    )
    line = bench.labbook_line(result)
    assert line.endswith("|\n") and line.count("\n") == 1
    assert line.count("|") == 10  # nine cells: the label's own "|" is escaped
    assert "bench tp2 / mtp | vllm unknown | guidellm 0.8.1: 5 req/level, max_tokens 64, synthetic 128 tokens" in line
    assert ("| TP2 x PP1, native, 1 node | link nodes under load: desk GPU0 gen4 x16 of gen4 x16, desk GPU1 gen4 x8 "
            "of gen4 x16, desk GPU0-GPU1 PHB, spark-b skipped (nvidia-smi not found) "
            "| KV cache 123,456 tokens, max concurrency 4.56x |") in line
    assert "c1: 20.0 tok/s, 0.31 req/s, TTFT p50/p99 120/131 ms, TPOT p50/p99 48.0/50.0 ms, 1 errored" in line
    assert line.rstrip().endswith("| 20260102T030405Z-tp2-mtp |")


# Hand-made from nvidia-smi's documented --query-gpu output (no real reading of this query is in ../shared/fixtures),
# as roles/preflight's filter parses it: the desktop's two cards, the second in an x8 slot; at idle both drop to gen1.
READ_UNDER_LOAD = {"status": "read", "reason": "", "topo": {"GPU0-GPU1": "PHB"}, "gpus": [
    {"index": 0, "name": "NVIDIA GeForce RTX 4090", "memory_total_mib": 24564, "pcie_gen_current": 4,
     "pcie_width_current": 16, "pcie_gen_max": 4, "pcie_width_max": 16},
    {"index": 1, "name": "NVIDIA GeForce RTX 4090", "memory_total_mib": 24564, "pcie_gen_current": 4,
     "pcie_width_current": 8, "pcie_gen_max": 4, "pcie_width_max": 16}]}
READ_IDLE = {**READ_UNDER_LOAD, "gpus": [{**g, "pcie_gen_current": 1} for g in READ_UNDER_LOAD["gpus"]]}


def test_link_sampler_keeps_the_last_reading_taken_during_the_load() -> None:
    calls = []

    def read() -> dict:
        calls.append(time.monotonic())
        time.sleep(0.05)
        return {"desk": {"n": len(calls)}}

    sampler = bench.LinkSampler(read).start()
    time.sleep(0.3)  # the load
    got = sampler.stop()
    assert got and got["under_load"] and got["source"] == "nodes under load"
    # The reading in flight when the load ended is waited for (it holds the secrets hand-over) but does not count.
    assert got["nodes"]["desk"]["n"] == len(calls) - 1 and sampler.samples == len(calls) >= 3

    def slow() -> dict:
        time.sleep(0.2)
        return {"desk": READ_IDLE}

    sampler = bench.LinkSampler(slow).start()
    got = sampler.stop()  # a load shorter than one reading
    assert got == {"source": "nodes after the load", "under_load": False, "nodes": {"desk": READ_IDLE},
                   "note": "the load ended before the first reading did"}

    def unreachable() -> dict:
        raise Hy3SparkError("playbooks/preflight.yml failed (rc 4, status failed) after 3 s\n  UNREACHABLE ...")

    sampler = bench.LinkSampler(unreachable).start()
    assert sampler.stop() is None and sampler.error == "playbooks/preflight.yml failed (rc 4, status failed) after 3 s"


VLLM_LOG_LINES = {"kv_cache": vllm_engine.KV_CACHE_LINE, "concurrency": vllm_engine.CONCURRENCY_LINE}


def test_kv_and_idle_links_come_from_the_last_run_record(tmp_path: Path) -> None:
    path = tmp_path / "20260102T030405Z-bench-test.json"
    data = {"kv_lines": ["(EngineCore_DP0 pid=72) INFO 01-02 03:04:05 [kv_cache_utils.py:1087] GPU KV cache size: "
                         "1,234,560 tokens",
                         "(EngineCore_DP0 pid=72) INFO 01-02 03:04:05 [kv_cache_utils.py:1091] Maximum concurrency "
                         "for 100,003 tokens per request: 12.35x"],
            "gpu_link": {"desk": READ_IDLE}}
    kv = bench.kv_of((path, data), "vllm", VLLM_LOG_LINES)
    assert kv == {"source": f"run record {path.name}", "lines": [
        "GPU KV cache size: 1,234,560 tokens", "Maximum concurrency for 100,003 tokens per request: 12.35x"],
        "engine": "vllm", "kv_cache_tokens": 1234560, "max_concurrency": 12.35, "not_logged": []}
    assert bench.kv_text(kv) == "KV cache 1,234,560 tokens, max concurrency 12.35x"
    assert bench.kv_of(None, "vllm", VLLM_LOG_LINES) is None
    link = bench.link_from_record((path, data), "--link record")
    assert link["source"] == f"run record {path.name} (idle)" and not link["under_load"]
    assert bench.link_rows(link)["desk GPU1"] == "gen1 x8 of gen4 x16"
    assert bench.link_from_record(None, "why")["source"] == "not read"


# --- against the engine double ------------------------------------------------------------------------------------
def _docker_usable() -> bool:
    if shutil.which("docker") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def wait_healthy(root: str, name: str, timeout_s: float, poll_s: float) -> None:
    """Until the engine double in container `name` answers 200 on {root}/health; its log tail when it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{root}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        logs = subprocess.run(["docker", "logs", "--tail", "30", name], capture_output=True, text=True)
        assert time.monotonic() < deadline, f"the double did not come up:\n{logs.stdout}{logs.stderr}"
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def bench_venv() -> Path:
    proc = subprocess.run(["bash", str(REPO / "scripts" / "bench-venv"), "--print"], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail("the bench venv (guidellm) is missing: run scripts/bench-venv first (it installs guidellm and a "
                    "CPU torch into .cache/bench-venv, about 4 minutes once)")
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not _docker_usable():
        pytest.skip("needs root and a running Docker engine (scripts/ensure-docker)")
    build_image = str(REPO / "tests" / "engine_double" / "build-image")
    image = subprocess.run(["bash", build_image, "--tag-only"], capture_output=True, text=True).stdout.strip()
    if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode != 0:
        build = subprocess.run(["bash", build_image], capture_output=True, text=True)
        assert build.returncode == 0, build.stderr[-3000:]
        image = build.stdout.strip().splitlines()[-1]
    sys.path.insert(0, str(REPO / "tests" / "engine_double"))
    from make_model import make_model

    hub = tmp_path_factory.mktemp("hub")
    # gpt-oss-120b's shape: the double prints the KV lines of a vLLM 0.23.0 vector (gptoss-len100003-mnbt8192).
    make_model(hub, "test/tiny-bench", preset="gpt-oss")
    name = f"{PREFIX}-head"
    subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    run = subprocess.run(
        ["docker", "run", "-d", "--name", name, "-p", "127.0.0.1::8000", "-v", f"{hub}:/hub:ro",
         "-e", "HF_HUB_CACHE=/hub", "-e", "HF_HUB_OFFLINE=1", "-e", "VLLM_API_KEY",
         "-e", f"VLLM_DOUBLE_TOKEN_DELAY_S={TOKEN_DELAY_S}", "-e", f"VLLM_DOUBLE_PREFILL_DELAY_S={PREFILL_DELAY_S}",
         image, "vllm", "serve", "test/tiny-bench", "--served-model-name", "tiny", "--host", "0.0.0.0", "--port",
         "8000", "--max-model-len", "100003", "--max-num-batched-tokens", "8192", "--kv-cache-memory-bytes", "30G",
         "--max-num-seqs", "8"],
        capture_output=True, text=True, env=dict(os.environ, VLLM_API_KEY=KEY),
    )
    assert run.returncode == 0, run.stderr
    try:
        port = subprocess.run(["docker", "port", name, "8000"], capture_output=True, text=True).stdout.split(":")[-1]
        root = f"http://127.0.0.1:{port.strip()}"
        wait_healthy(root, name, 90, 1)
        yield f"{root}/v1"
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yml"
    path.write_text(SPEC)
    return path


def _hy3spark(*argv: str, key: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    if key:
        env[KEY_ENV] = KEY
    return subprocess.run([sys.executable, "-m", "hy3spark", *argv], cwd=REPO, capture_output=True, text=True,
                          env=env)


def _command_lines_with(needle: str, stop: threading.Event, seen: list[str]) -> None:
    while not stop.is_set():
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmdline:
                seen.append(cmdline)
        time.sleep(0.2)


def test_missing_bench_venv_names_the_script(cli, spec: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HY3SPARK_BENCH_VENV", str(tmp_path / "no-venv"))
    result = cli("bench", str(spec), "--target", "http://127.0.0.1:9/v1", "--runs-dir", str(tmp_path))
    assert result.code == 1
    assert f"guidellm is not installed in {tmp_path / 'no-venv'}: run scripts/bench-venv" in result.err
    assert not (tmp_path / "labbook.md").exists()


def test_bench_measures_the_double_and_appends_one_labbook_line(
    bench_venv: Path, endpoint: str, spec: Path, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    labbook = tmp_path / "labbook.md"
    labbook.write_text("# Lab notebook\n\n| 2026-01-01T00:00:00Z | up bench-test | vllm ? | successful in 1 s |\n")
    before = labbook.read_text().splitlines()
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_command_lines_with, args=(KEY, stop, seen), daemon=True)
    watcher.start()
    try:
        proc = _hy3spark("bench", str(spec), "--target", endpoint, "--label", "test", "--concurrency", "1,2",
                         "--requests", "4", "--max-tokens", "16", "--prompt-tokens", "32", "--labbook", str(labbook),
                         "--runs-dir", str(runs), "--json")
    finally:
        stop.set()
        watcher.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not seen, "the API key appeared on a command line"

    result = json.loads(proc.stdout)
    assert result["endpoint"] == {"target": endpoint, "model": "tiny", "engine": "vllm", "version": "0.23.0+testdouble",
                                  "version_from": "endpoint /version"}
    assert result["tool"].startswith("guidellm 0.8.")
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    for lv in result["levels"]:
        assert (lv["completed"], lv["errored"]) == (4, 0)
        assert lv["output_tokens_per_s"] > 0 and lv["requests_per_s"] > 0
        # Each request: the prefill delay, then 16 tokens TOKEN_DELAY_S apart (bounded above for a loaded machine).
        assert PREFILL_DELAY_S * 1000 * 0.9 < lv["ttft_ms_p50"] <= lv["ttft_ms_p99"] < 2000
        assert TOKEN_DELAY_S * 1000 * 0.9 < lv["tpot_ms_p50"] < TOKEN_DELAY_S * 1000 * 1.6
        assert lv["tpot_ms_p50"] <= lv["tpot_ms_p99"]
        # 16 tokens per request at about 0.85 s each: tokens/s is 16 x requests/s (guidellm counts both per level).
        assert lv["output_tokens_per_s"] == pytest.approx(16 * lv["requests_per_s"], rel=0.05)
        assert lv["requests_per_s"] < lv["concurrency"] / (PREFILL_DELAY_S + 15 * TOKEN_DELAY_S) * 1.1

    after = labbook.read_text().splitlines()
    assert after[: len(before)] == before and len(after) == len(before) + 1
    line = after[-1]
    assert line.startswith(f"| {result['date']} | bench test | vllm 0.23.0+testdouble | guidellm 0.8.")
    assert "4 req/level, max_tokens 16, synthetic 32 tokens" in line and "c1: " in line and "; c2: " in line

    out_dir = Path(result["report"]).parent
    assert out_dir.parent == runs / "bench"
    assert {p.name for p in out_dir.iterdir()} == {"guidellm.json", "guidellm.log", "result.json", "scenario.json"}
    for path in [labbook, *out_dir.iterdir()]:
        assert KEY not in path.read_text(), f"the API key leaked into {path}"


def test_missing_api_key_is_named(endpoint: str, spec: Path, tmp_path: Path) -> None:
    proc = _hy3spark("bench", str(spec), "--target", endpoint, "--labbook", str(tmp_path / "lab.md"),
                     "--runs-dir", str(tmp_path), key=False)
    assert proc.returncode == 1
    assert f"{KEY_ENV} is not set" in proc.stderr
    assert f"answered 401: the API key is missing (export {KEY_ENV})" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "lab.md").exists()


def test_vllm_tool_says_the_double_has_no_vllm_bench(endpoint: str, spec: Path, tmp_path: Path) -> None:
    proc = _hy3spark("bench", str(spec), "--tool", "vllm", "--target", endpoint, "--labbook",
                     str(tmp_path / "lab.md"), "--runs-dir", str(tmp_path))
    assert proc.returncode == 1
    assert f"`vllm bench serve` is not available in the head container {PREFIX}-head" in proc.stderr
    assert "vllm 0.23.0+testdouble says:" in proc.stderr
    assert "use --tool guidellm (the default)" in proc.stderr
    assert not (tmp_path / "lab.md").exists()


# --- the two-card comparison: two bench runs, then `hy3spark labbook --compare` ------------------------------------
# A GPU double (the GPUs are the one thing a test machine lacks): nvidia-smi answering the preflight role's two
# queries as the desktop's cards do under load (hand-made from the documented formats, as READ_UNDER_LOAD).
NVIDIA_SMI = """#!/bin/sh
case "$*" in
  "--query-gpu=index,name,memory.total,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,\
pcie.link.width.max --format=csv,noheader,nounits")
    printf '0, NVIDIA GeForce RTX 4090, 24564, 4, 16, 4, 16\\n1, NVIDIA GeForce RTX 4090, 24564, 4, 8, 4, 16\\n' ;;
  "topo -m")
    printf '\\tGPU0\\tGPU1\\tCPU Affinity\\tNUMA Affinity\\tGPU NUMA ID\\n'
    printf 'GPU0\\t X \\tPHB\\t0-31\\t0\\t\\tN/A\\nGPU1\\tPHB\\t X \\t0-31\\t0\\t\\tN/A\\n'
    printf '\\nLegend:\\n\\n  X    = Self\\n' ;;
  *) echo "nvidia-smi double: unexpected arguments: $*" >&2; exit 2 ;;
esac
"""


def compare_cells(table: str) -> tuple[list[str], dict[str, list[str]]]:
    """`hy3spark labbook --compare`'s table read by its columns, as the dashes under the header mark them: the runs'
    labels, and each row's cells by the row's name."""
    out = table.splitlines()
    spans, at = [], 0
    for dashes in out[1].split("  "):
        spans.append((at, at + len(dashes)))
        at += len(dashes) + 2
    cells = {line[:spans[0][1]].strip(): [line[a:b].strip() for a, b in spans[1:]] for line in out[2:]}
    return [out[0][a:b].strip() for a, b in spans[1:]], cells


def up_record(spec: Path, runs: Path, started: str, kv_lines: list[str]) -> Path:
    """What `hy3spark up` leaves, written by the real record writer: the KV lines the engine logged (as status
    collects them) and the idle link readings bench-head's preflight reported (hand-made, in the role's format)."""
    from hy3spark import records
    from hy3spark.runner import RunResult
    from hy3spark.spec import load_spec

    loaded = load_spec(spec)
    result = RunResult("site.yml", "successful", 0, runs, [], {}, {}, 1.0,
                       {"bench-head": {"hy3spark_report_gpu_link": READ_IDLE}})
    summary = {"nodes": {}, "kv_lines": kv_lines}
    return records.write_record(loaded, runs, result, summary, started, runs / "labbook.md")


def _up_record(spec: Path, runs: Path, started: str, kv_tokens: str, concurrency: str) -> Path:
    """`up`'s record of this split, with the KV lines vLLM logs (hand-made, in its format)."""
    return up_record(spec, runs, started, [
        f"(EngineCore_DP0 pid=72) INFO 01-02 03:04:05 [kv_cache_utils.py:1087] GPU KV cache size: {kv_tokens} tokens",
        f"(EngineCore_DP0 pid=72) INFO 01-02 03:04:05 [kv_cache_utils.py:1091] Maximum concurrency for 100,003 "
        f"tokens per request: {concurrency}x"])


def test_bench_tp_and_pp_side_by_side_with_the_links_read_under_load(
    bench_venv: Path, endpoint: str, tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    runs, labbook = tmp_path / "runs", tmp_path / "runs" / "labbook.md"
    splits = {"two-card-tp": (2, 1, "2026-01-02T03:00:00Z", "1,234,560", "12.35"),
              "two-card-pp": (1, 2, "2026-01-02T04:00:00Z", "1,310,720", "13.11")}
    for label, (tp, pp, started, kv_tokens, concurrency) in splits.items():
        spec = tmp_path / f"{label}.yml"
        spec.write_text(SPEC.replace("  ssh_user: root\n", "  ssh_user: root\n  gpus: 2\n").replace(
            "  host: 127.0.0.1\n", f"  host: 127.0.0.1\n  tensor_parallel: {tp}\n  pipeline_parallel: {pp}\n"))
        _up_record(spec, runs, started, kv_tokens, concurrency)
        # The desktop is the controller itself: the nodes are asked over a local connection, where the double is.
        env_path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
        proc = subprocess.run(
            [sys.executable, "-m", "hy3spark", "bench", str(spec), "--target", endpoint, "--label", label,
             "--concurrency", "1", "--requests", "6", "--max-tokens", "48", "--prompt-tokens", "32",
             "--runs-dir", str(runs), "-e", "ansible_connection=local",
             "-e", f"ansible_python_interpreter={sys.executable}"],
            cwd=REPO, capture_output=True, text=True, env={**os.environ, KEY_ENV: KEY, "PATH": env_path})
        assert proc.returncode == 0, proc.stderr[-3000:]
    # A third run without asking the nodes: the last up's idle readings, said as such.
    proc = _hy3spark("bench", str(tmp_path / "two-card-pp.yml"), "--target", endpoint, "--label", "pp-idle-link",
                     "--concurrency", "1", "--requests", "2", "--max-tokens", "8", "--prompt-tokens", "32",
                     "--runs-dir", str(runs), "--link", "record")
    assert proc.returncode == 0, proc.stderr[-3000:]

    lines = [x for x in labbook.read_text().splitlines() if "| bench " in x]
    assert len(lines) == 3
    assert ("| TP2 x PP1, ray, 1 node | link nodes under load: bench-head GPU0 gen4 x16 of gen4 x16, bench-head GPU1 "
            "gen4 x8 of gen4 x16, bench-head GPU0-GPU1 PHB | KV cache 1,234,560 tokens, max concurrency 12.35x |"
            ) in lines[0]
    assert "| TP1 x PP2, ray, 1 node | link nodes under load: " in lines[1]
    assert "KV cache 1,310,720 tokens, max concurrency 13.11x" in lines[1]
    assert "| link run record 20260102T040000Z-bench-test.json (idle): bench-head GPU0 gen1 x16 of gen4 x16" in lines[2]

    proc = _hy3spark("labbook", "--compare", "two-card-tp", "two-card-pp", "pp-idle-link", "--runs-dir", str(runs))
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    header, cells = compare_cells(proc.stdout)
    assert header == ["two-card-tp", "two-card-pp", "pp-idle-link"]
    assert [c.strip() for c in cells["split"]] == ["TP2 x PP1, ray, 1 node", "TP1 x PP2, ray, 1 node",
                                                   "TP1 x PP2, ray, 1 node"]
    assert [c.strip() for c in cells["link read"]] == [
        "nodes under load", "nodes under load", "run record 20260102T040000Z-bench-test.json (idle)"]
    assert [c.strip() for c in cells["bench-head GPU1"]] == ["gen4 x8 of gen4 x16", "gen4 x8 of gen4 x16",
                                                            "gen1 x8 of gen4 x16"]
    assert [c.strip() for c in cells["bench-head GPU0-GPU1"]] == ["PHB", "PHB", "PHB"]
    assert [c.strip() for c in cells["KV cache tokens"]] == ["1,234,560", "1,310,720", "1,310,720"]
    assert [c.strip() for c in cells["max concurrency"]] == ["12.35x", "13.11x", "13.11x"]
    for row in ("c1 output tok/s", "c1 requests/s", "c1 TTFT p50 / p99 ms", "c1 TPOT p50 / p99 ms"):
        assert len(cells[row]) == 3 and "-" not in [c.strip() for c in cells[row]], (row, cells[row])
    # The numbers are the runs' own: TPOT p50 near the double's per-token delay.
    tpot_p50 = [float(c.split("/")[0]) for c in cells["c1 TPOT p50 / p99 ms"]]
    assert all(TOKEN_DELAY_S * 1000 * 0.9 < t < TOKEN_DELAY_S * 1000 * 1.6 for t in tpot_p50), tpot_p50

    as_json = json.loads(_hy3spark("labbook", "--compare", "two-card-tp", "two-card-pp", "--runs-dir", str(runs),
                                   "--json").stdout)
    assert [r["label"] for r in as_json] == ["two-card-tp", "two-card-pp"]
    assert as_json[0]["link"]["under_load"] is True and as_json[0]["link"]["nodes"]["bench-head"] == READ_UNDER_LOAD
    missing = _hy3spark("labbook", "--compare", "two-card-tp", "nope", "--runs-dir", str(runs))
    assert missing.returncode == 1
    assert "no bench line labelled 'nope' (labels: two-card-tp, two-card-pp, pp-idle-link)" in missing.stderr
