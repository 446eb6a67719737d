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
    )
    line = bench.labbook_line(result)
    assert line.endswith("|\n") and line.count("\n") == 1
    assert line.count("|") == 7  # six cells: the label's own "|" is escaped
    assert "bench tp2 / mtp | vllm ? | guidellm 0.8.1: 5 req/level, max_tokens 64, synthetic 128 tokens" in line
    assert "c1: 20.0 tok/s, 0.31 req/s, TTFT p50/p99 120/131 ms, TPOT p50/p99 48.0/50.0 ms, 1 errored" in line
    assert line.rstrip().endswith("| 20260102T030405Z-tp2-mtp |")


# --- against the engine double ------------------------------------------------------------------------------------
def _docker_usable() -> bool:
    if shutil.which("docker") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


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
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{root}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            logs = subprocess.run(["docker", "logs", "--tail", "30", name], capture_output=True, text=True)
            assert time.monotonic() < deadline, f"the double did not come up:\n{logs.stdout}{logs.stderr}"
            time.sleep(1)
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
    assert result["endpoint"] == {"target": endpoint, "model": "tiny", "engine": "vllm", "version": "0.23.0+testdouble"}
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
