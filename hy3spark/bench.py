"""hy3spark bench: the lab's load test, run by an established load generator, one line per run in the lab notebook.

Four numbers per concurrency level: output tokens/s, requests/s, time to first token (TTFT) and time per output
token (TPOT), the latter two at p50 and p99. TPOT is vLLM's definition (the first token excluded:
(latency - TTFT) / (output tokens - 1)), which guidellm calls ITL; guidellm's own "TPOT" includes the first token.

Two tools:
- guidellm (default), from its own venv (scripts/bench-venv: it needs torch, kept out of hy3spark's venv). It is
  given the whole run as a scenario file, and the API key in its environment, never on a command line.
- `vllm bench serve` inside the head container, when the engine image has it (real vLLM images do; the test
  double does not, and says so).

Synthetic prompts need a tokenizer to cut them to length. With no --processor, a small byte-level BPE tokenizer is
trained offline once (on guidellm's own Faker text) and kept in the bench venv, so no hub is ever asked; the token
counts in the numbers come from the server's usage reports, not from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hy3spark import content
from hy3spark.errors import Hy3SparkError

TOKENIZER_DIR = "hy3spark-tokenizer"
# guidellm reads its settings, the scenario's included, from GUIDELLM__* variables: the key travels in the child's
# environment (readable only by this user), never on a command line nor in a file.
GUIDELLM_KEY_ENV = "GUIDELLM__SPEC__BACKEND__API_KEY"
PROMPT_SUFFIXES = {".txt": "text_file", ".text": "text_file", ".jsonl": "json_file", ".json": "json_file",
                   ".csv": "csv_file"}

# Runs with the bench venv's Python (tokenizers, transformers and faker come with guidellm).
TOKENIZER_SCRIPT = """
import json, sys
from pathlib import Path
from faker import Faker
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
fake = Faker("en_US")
fake.seed_instance(0)
corpus = [fake.text(max_nb_chars=2000) for _ in range(300)]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=2048, show_progress=False, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(corpus, trainer)
tok.save(str(out / "tokenizer.json"))
config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20, "eos_token": "<|endoftext|>"}
(out / "tokenizer_config.json").write_text(json.dumps(config))
"""


@dataclass
class Settings:
    """What one run measures; the same for every level."""

    concurrency: list[int]
    requests: int
    max_tokens: int
    prompt_tokens: int
    prompts: Path | None = None
    processor: str | None = None

    @property
    def prompt_set(self) -> str:
        return str(self.prompts) if self.prompts else f"synthetic {self.prompt_tokens} tokens"


@dataclass
class Level:
    concurrency: int
    completed: int
    errored: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p99: float


@dataclass
class Endpoint:
    target: str
    model: str
    engine: str
    version: str | None


@dataclass
class BenchResult:
    label: str
    date: str
    tool: str
    endpoint: Endpoint
    settings: Settings
    levels: list[Level]
    report: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["settings"]["prompts"] = self.settings.prompt_set
        return data


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise Hy3SparkError(f"--concurrency {text!r}: give comma-separated whole numbers, e.g. 1,2,4") from None
    if not levels or any(c < 1 for c in levels):
        raise Hy3SparkError(f"--concurrency {text!r}: every level must be at least 1")
    return levels


# --- the endpoint ------------------------------------------------------------------------------------------------
def _get(url: str, api_key: str | None, timeout: float = 10.0) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def probe(target: str, api_key: str | None, key_env: str | None, engine_hint: str) -> Endpoint:
    """The served model (/v1/models), the engine (its owned_by) and version (/version, which vLLM serves)."""
    target = target.rstrip("/")
    try:
        models = _get(f"{target}/models", api_key)
    except urllib.error.HTTPError as err:
        if err.code == 401:
            how = f"export {key_env}" if key_env else "set serving.api_key_env in the spec and export that variable"
            have = "was refused" if api_key else "is missing"
            raise Hy3SparkError(f"{target}/models answered 401: the API key {have} ({how})") from None
        raise Hy3SparkError(f"{target}/models answered HTTP {err.code}; is this an OpenAI-compatible server?") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise Hy3SparkError(f"cannot reach {target}/models ({reason}); is the engine serving? (hy3spark status)") \
            from None
    data = (models or {}).get("data") or []
    if not data:
        raise Hy3SparkError(f"{target}/models lists no model")
    version = None
    # Not every engine serves /version (vLLM does, at the root): the labbook then says "?".
    with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
        got = _get(f"{target.removesuffix('/v1')}/version", api_key)
        version = str(got["version"]) if isinstance(got, dict) and got.get("version") else None
    return Endpoint(target=target, model=str(data[0].get("id")), engine=str(data[0].get("owned_by") or engine_hint),
                    version=version)


# --- guidellm ------------------------------------------------------------------------------------------------------
def bench_venv() -> Path:
    venv = Path(os.environ.get("HY3SPARK_BENCH_VENV") or content.default_bench_venv())
    if not (venv / "bin" / "guidellm").exists():
        raise Hy3SparkError(f"guidellm is not installed in {venv}: run scripts/bench-venv (once, from a checkout; "
                            "it installs guidellm and a CPU torch in their own venv), or point HY3SPARK_BENCH_VENV "
                            "at a venv that has guidellm")
    return venv


def ensure_tokenizer(venv: Path) -> Path:
    out = venv / TOKENIZER_DIR
    if not (out / "tokenizer.json").exists():
        proc = subprocess.run([str(venv / "bin" / "python"), "-c", TOKENIZER_SCRIPT, str(out)],
                              capture_output=True, text=True, env=_offline_env(None))
        if proc.returncode != 0:
            raise Hy3SparkError(f"could not build the offline tokenizer in {out}:\n{proc.stderr[-2000:]}")
    return out


def _offline_env(secret_env: str | None, api_key: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (secret_env, GUIDELLM_KEY_ENV)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    if api_key:
        env[GUIDELLM_KEY_ENV] = api_key
    return env


def guidellm_scenario(endpoint: Endpoint, settings: Settings, processor: str, report: Path,
                      label: str) -> dict[str, Any]:
    backend: dict[str, Any] = {"kind": "openai_http", "target": endpoint.target, "model": endpoint.model,
                               "request_format": "/v1/completions"}
    if settings.prompts is not None:
        kind = PROMPT_SUFFIXES.get(settings.prompts.suffix.lower())
        if kind is None:
            raise Hy3SparkError(f"--prompts {settings.prompts}: use a .txt (one prompt per line), .jsonl/.json "
                                "(a 'prompt' field) or .csv file")
        if not settings.prompts.is_file():
            raise Hy3SparkError(f"--prompts {settings.prompts}: no such file")
        data = {"kind": kind, "path": str(settings.prompts.resolve())}
        backend["max_tokens"] = settings.max_tokens
    else:
        # output_tokens makes guidellm send max_tokens with ignore_eos: every request decodes exactly that many.
        data = {"kind": "synthetic_text", "prompt_tokens": settings.prompt_tokens,
                "output_tokens": settings.max_tokens}
    return {
        "spec": {
            "backend": backend,
            "profile": {"kind": "concurrent"},
            "constraints": [{"kind": "max_requests", "count": settings.requests}],
            "tokenizer": {"kind": "huggingface_auto", "model": processor},
            "data": [data],
            "outputs": [{"kind": "json", "path": str(report)}],
        },
        "benchmarks": [{"profile.streams": c} for c in settings.concurrency],
        "metadata": {"labels": {"hy3spark_label": label}},
    }


def _percentiles(metric: dict[str, Any]) -> tuple[float, float]:
    p = metric["successful"]["percentiles"]
    return float(p["p50"]), float(p["p99"])


def parse_guidellm(report: dict[str, Any]) -> list[Level]:
    levels = []
    for bench in report.get("benchmarks", []):
        m = bench["metrics"]
        totals = m["request_totals"]
        concurrency = int(bench["config"]["strategy"].get("streams") or bench["config"]["strategy"]["max_concurrency"])
        if not totals.get("successful"):
            raise Hy3SparkError(f"guidellm: no request succeeded at concurrency {concurrency} "
                                f"({totals.get('errored', 0)} errored)")
        ttft = _percentiles(m["time_to_first_token_ms"])
        tpot = _percentiles(m["inter_token_latency_ms"])  # vLLM's TPOT: first token excluded
        levels.append(Level(
            concurrency=concurrency, completed=int(totals["successful"]), errored=int(totals.get("errored", 0)),
            output_tokens_per_s=float(m["output_tokens_per_second"]["successful"]["mean"]),
            requests_per_s=float(m["requests_per_second"]["successful"]["mean"]),
            ttft_ms_p50=ttft[0], ttft_ms_p99=ttft[1], tpot_ms_p50=tpot[0], tpot_ms_p99=tpot[1],
        ))
    if not levels:
        raise Hy3SparkError("guidellm's report has no benchmark in it")
    return levels


def guidellm_version(venv: Path) -> str:
    proc = subprocess.run([str(venv / "bin" / "guidellm"), "--version"], capture_output=True, text=True)
    return proc.stdout.strip().rsplit(" ", 1)[-1] or "?"


def run_guidellm(endpoint: Endpoint, settings: Settings, out_dir: Path, label: str, api_key: str | None,
                 key_env: str | None) -> tuple[list[Level], str, Path]:
    venv = bench_venv()
    processor = settings.processor or str(ensure_tokenizer(venv))
    report = out_dir / "guidellm.json"
    log = out_dir / "guidellm.log"
    # The scenario holds the whole run and no secret: kept beside the report, `guidellm run --scenario` repeats it.
    scenario = out_dir / "scenario.json"
    scenario.write_text(json.dumps(guidellm_scenario(endpoint, settings, processor, report, label), indent=2) + "\n")
    argv = [str(venv / "bin" / "guidellm"), "run", "--scenario", str(scenario), "--disable-console-interactive"]
    print(f"guidellm: {len(settings.concurrency)} level(s) x {settings.requests} requests against "
          f"{endpoint.target} (log {log})", file=sys.stderr)
    with log.open("w") as fh:
        proc = subprocess.run(argv, cwd=out_dir, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=_offline_env(key_env, api_key))
    if proc.returncode != 0 or not report.exists():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise Hy3SparkError(f"guidellm failed (exit {proc.returncode}); the end of {log}:\n{tail}")
    return parse_guidellm(json.loads(report.read_text())), f"guidellm {guidellm_version(venv)}", report


# --- vllm bench serve, inside the head container -------------------------------------------------------------------
def _docker(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    docker = shutil.which("docker")
    if docker is None:
        raise Hy3SparkError("--tool vllm runs `docker exec` in the head container: no docker command here")
    return subprocess.run([docker, *argv], capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)


def vllm_bench_available(container: str) -> None:
    """Raise, saying why, unless `vllm bench serve` exists in `container` on this machine."""
    if _docker("container", "inspect", container).returncode != 0:
        raise Hy3SparkError(f"--tool vllm: the head container {container} is not running on this machine; run "
                            "hy3spark bench --tool vllm on the head itself, or use --tool guidellm (the default)")
    proc = _docker("exec", container, "vllm", "bench", "serve", "--help")
    if proc.returncode != 0 or "--max-concurrency" not in proc.stdout:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        version = _docker("exec", container, "vllm", "--version").stdout.strip() or "version unknown"
        raise Hy3SparkError(f"--tool vllm: `vllm bench serve` is not available in the head container {container} "
                            f"(vllm {version} says: {said[-1] if said else f'exit {proc.returncode}'}); this engine "
                            "image has no vLLM benchmark: use --tool guidellm (the default)")


def parse_vllm(result: dict[str, Any], concurrency: int) -> Level:
    def pick(*keys: str) -> float:
        for key in keys:
            if result.get(key) is not None:
                return float(result[key])
        raise Hy3SparkError(f"vllm bench serve's result lacks {keys[0]}")

    return Level(
        concurrency=concurrency, completed=int(result.get("completed", 0)), errored=int(result.get("failed", 0)),
        output_tokens_per_s=pick("output_throughput"), requests_per_s=pick("request_throughput"),
        ttft_ms_p50=pick("p50_ttft_ms", "median_ttft_ms"), ttft_ms_p99=pick("p99_ttft_ms"),
        tpot_ms_p50=pick("p50_tpot_ms", "median_tpot_ms"), tpot_ms_p99=pick("p99_tpot_ms"),
    )


def run_vllm(endpoint: Endpoint, settings: Settings, out_dir: Path, container: str, tokenizer: str,
             api_key: str | None) -> tuple[list[Level], str, Path]:
    vllm_bench_available(container)
    if settings.prompts is not None:
        raise Hy3SparkError("--tool vllm runs vLLM's random dataset; --prompts needs --tool guidellm")
    # vllm bench serve reads OPENAI_API_KEY; `docker exec -e NAME` takes the value from this environment.
    env = dict(os.environ, OPENAI_API_KEY=api_key) if api_key else None
    levels, results = [], {}
    for c in settings.concurrency:
        remote = f"/tmp/hy3spark-bench-c{c}.json"
        argv = ["exec", *(["-e", "OPENAI_API_KEY"] if api_key else []), container, "vllm", "bench", "serve",
                "--backend", "vllm", "--base-url", endpoint.target.removesuffix("/v1"), "--endpoint",
                "/v1/completions", "--model", endpoint.model, "--tokenizer", tokenizer, "--dataset-name", "random",
                "--random-input-len", str(settings.prompt_tokens), "--random-output-len", str(settings.max_tokens),
                "--ignore-eos", "--num-prompts", str(settings.requests), "--max-concurrency", str(c),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
                "--result-dir", "/tmp", "--result-filename", Path(remote).name]
        print(f"vllm bench serve: concurrency {c}, {settings.requests} requests", file=sys.stderr)
        proc = _docker(*argv, env=env)
        if proc.returncode != 0:
            raise Hy3SparkError(f"vllm bench serve failed at concurrency {c}:\n{(proc.stderr or proc.stdout)[-2000:]}")
        got = _docker("exec", container, "cat", remote)
        _docker("exec", container, "rm", "-f", remote)
        results[str(c)] = json.loads(got.stdout)
        levels.append(parse_vllm(results[str(c)], c))
    report = out_dir / "vllm-bench.json"
    report.write_text(json.dumps(results, indent=2) + "\n")
    version = _docker("exec", container, "vllm", "--version").stdout.strip() or "?"
    return levels, f"vllm bench serve {version}", report


# --- the lab notebook ----------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def labbook_line(result: BenchResult) -> str:
    s, e = result.settings, result.endpoint
    levels = "; ".join(
        f"c{lv.concurrency}: {lv.output_tokens_per_s:.1f} tok/s, {lv.requests_per_s:.2f} req/s, "
        f"TTFT p50/p99 {lv.ttft_ms_p50:.0f}/{lv.ttft_ms_p99:.0f} ms, TPOT p50/p99 {lv.tpot_ms_p50:.1f}/"
        f"{lv.tpot_ms_p99:.1f} ms" + (f", {lv.errored} errored" if lv.errored else "")
        for lv in result.levels
    )
    report = Path(result.report).parent.name if result.report else "-"
    return (f"| {result.date} | bench {_cell(result.label)} | {_cell(e.engine)} {_cell(e.version or '?')} "
            f"| {_cell(result.tool)}: {s.requests} req/level, max_tokens {s.max_tokens}, {_cell(s.prompt_set)} "
            f"| {levels} | {report} |\n")


def print_table(result: BenchResult) -> None:
    e = result.endpoint
    print(f"bench {result.label}: {e.engine} {e.version or '?'} at {e.target}, model {e.model}, {result.tool}")
    print(f"{'concurrency':>11} {'output tok/s':>12} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9} {'ok':>4} {'err':>4}   (ms)")
    for lv in result.levels:
        print(f"{lv.concurrency:>11} {lv.output_tokens_per_s:>12.1f} {lv.requests_per_s:>7.2f} "
              f"{lv.ttft_ms_p50:>9.1f} {lv.ttft_ms_p99:>9.1f} {lv.tpot_ms_p50:>9.2f} {lv.tpot_ms_p99:>9.2f} "
              f"{lv.completed:>4} {lv.errored:>4}")


# --- one run -------------------------------------------------------------------------------------------------------
def run(loaded: Any, *, settings: Settings, tool: str, label: str | None, target: str | None, labbook: Path,
        runs_dir: Path) -> BenchResult:
    """Probe the endpoint, run the tool over every level, keep its report, append one labbook line."""
    import re

    from hy3spark.context import build_context
    from hy3spark.records import append_labbook, now

    spec = loaded.spec
    if tool == "guidellm":
        bench_venv()  # before anything else: a missing venv is a setup step, not a run failure
    context = build_context(loaded)
    key_env = spec.serving.api_key_env
    api_key = os.environ.get(key_env) if key_env else None
    if key_env and not api_key:
        print(f"warning: {key_env} is not set: requests go without an API key", file=sys.stderr)
    endpoint = probe(target or context["hy3spark"]["serving"]["base_url"], api_key, key_env, spec.serving.engine)
    label = label or spec.name
    date = now()
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "run"
    out_dir = runs_dir / "bench" / f"{date.replace('-', '').replace(':', '')}-{slug}"
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        if tool == "vllm":
            container = context["nodes"][spec.head.name]["container"]["name"]
            model = context["hy3spark"]["model"]
            tokenizer = (f"{model['repo_dir']}/snapshots/{model['revision']}"
                         if re.fullmatch(r"[0-9a-f]{40}", model["revision"] or "") else model["repo"])
            levels, tool_name, report = run_vllm(endpoint, settings, out_dir, container, tokenizer, api_key)
        else:
            levels, tool_name, report = run_guidellm(endpoint, settings, out_dir, label, api_key, key_env)
    except Hy3SparkError:
        if not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    result = BenchResult(label=label, date=date, tool=tool_name, endpoint=endpoint, settings=settings, levels=levels,
                         report=str(report))
    (out_dir / "result.json").write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    append_labbook(labbook, labbook_line(result))
    return result
