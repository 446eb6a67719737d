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

Beside the numbers each run keeps what explains them: the split (TP x PP, launcher), the KV lines of the last `up`
(its run record), and each GPU's PCIe link read on the nodes WHILE the load runs (roles/preflight's gpu_link tasks,
`playbooks/preflight.yml --tags gpu_link`, repeated until the load ends; the last reading that finished before the
load ended counts), because the current generation drops at idle. When the nodes cannot be asked, the idle readings
of the last `up`'s run record stand in, and the line says so. `hy3spark labbook --compare` shows runs side by side.

Any engine: the model is the spec's served_name as /v1/models lists it (TensorRT-LLM's is the repository), the engine
is the endpoint's own word for itself (/v1/models' owned_by, in hy3spark's names), its version what the endpoint's
/version says (vLLM and trtllm-serve both serve it), else the last `up` record's reading, else "unknown". A reading
an engine does not give (TensorRT-LLM logs no maximum-concurrency line) says "not available for engine NAME".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hy3spark import content
from hy3spark.errors import Hy3SparkError

TOKENIZER_DIR = "hy3spark-tokenizer"
# guidellm reads its settings, the scenario's included, from GUIDELLM__* variables: the key travels in the child's
# environment (readable only by this user), never on a command line nor in a file.
GUIDELLM_KEY_ENV = "GUIDELLM__SPEC__BACKEND__API_KEY"
# /v1/models' owned_by -> the engine's name in hy3spark (serving.engine), so a vLLM line and a TensorRT-LLM line of one
# cluster name their engines the way the spec does. An owner not listed here is kept as the endpoint says it.
ENGINE_OF_OWNER = {"vllm": "vllm", "tensorrt_llm": "trtllm"}
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
    # Where the version was read: "endpoint /version", "run record <file>"; None: nowhere (the labbook says unknown).
    version_from: str | None = None


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
    # {tensor_parallel, pipeline_parallel, launcher, nodes}
    split: dict[str, Any] = field(default_factory=dict)
    # {source, under_load, nodes: {node: preflight_gpu_link reading or None}, note}; None: not read (--link off)
    link: dict[str, Any] | None = None
    # {source, lines, engine, kv_cache_tokens, max_concurrency, not_logged}; None: no run record of this cluster
    kv: dict[str, Any] | None = None

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


def probe(target: str, api_key: str | None, key_env: str | None, engine_hint: str,
          served_name: str | None = None) -> Endpoint:
    """The served model (/v1/models: `served_name` when listed, else the first), the engine (its owned_by) and
    version (/version, which vLLM and trtllm-serve serve)."""
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
    card = next((m for m in data if served_name and m.get("id") == served_name), data[0])
    if served_name and card.get("id") != served_name:
        print(f"warning: {target}/models lists {', '.join(str(m.get('id')) for m in data)}, not the spec's "
              f"served_name {served_name}: benching {card.get('id')}", file=sys.stderr)
    owner = str(card.get("owned_by") or "")
    version = None
    # Not every server answers /version (vLLM and trtllm-serve do, at the root): run() then looks further.
    with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
        got = _get(f"{target.removesuffix('/v1')}/version", api_key)
        version = str(got["version"]) if isinstance(got, dict) and got.get("version") else None
    return Endpoint(target=target, model=str(card.get("id")), engine=ENGINE_OF_OWNER.get(owner, owner or engine_hint),
                    version=version, version_from="endpoint /version" if version else None)


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


# --- what explains the numbers: the split, the KV lines, the GPU links under load ----------------------------------
# Each KV reading and the engine's log_lines() pattern that gives it (its last group is the number).
KV_READINGS = {"kv_cache_tokens": "kv_cache", "max_concurrency": "concurrency"}
LINK_MODES = ("nodes", "record", "off")


def split_of(spec: Any) -> dict[str, Any]:
    s = spec.serving
    return {"tensor_parallel": s.tensor_parallel, "pipeline_parallel": s.pipeline_parallel,
            "launcher": getattr(s, "launcher", "ray"), "nodes": len(spec.nodes)}


def kv_of(record: tuple[Path, dict[str, Any]] | None, engine: str, patterns: dict[str, str]) -> dict[str, Any] | None:
    """The KV lines the last `up` of this cluster recorded (what the engine logged at startup), read with the engine's
    own patterns (`patterns`: its log_lines()). A reading the engine logs no line for is `not_logged`, not None."""
    if record is None:
        return None
    path, data = record
    lines = [str(x).split("] ")[-1] for x in data.get("kv_lines") or []]

    def number(key: str) -> str | None:
        found = (m for x in lines if key in patterns and (m := re.search(patterns[key], x)))
        match = next(found, None)
        return match.group(match.lastindex or 0).replace(",", "") if match else None

    tokens, conc = number("kv_cache"), number("concurrency")
    return {"source": f"run record {path.name}", "lines": lines, "engine": engine,
            "kv_cache_tokens": None if tokens is None else int(tokens),
            "max_concurrency": None if conc is None else float(conc),
            "not_logged": [reading for reading, key in KV_READINGS.items() if key not in patterns]}


def link_from_record(record: tuple[Path, dict[str, Any]] | None, why: str) -> dict[str, Any]:
    """The idle readings the last `up`'s preflight took, standing in for readings under load."""
    if record is None or not record[1].get("gpu_link"):
        return {"source": "not read", "under_load": False, "nodes": {}, "note": f"{why}; no run record with readings"}
    return {"source": f"run record {record[0].name} (idle)", "under_load": False, "nodes": record[1]["gpu_link"],
            "note": why}


def read_links_on_nodes(loaded: Any, runs_dir: Path, ansible: Any = None) -> dict[str, Any]:
    """Every node's GPU link, read once by the preflight role's gpu_link tasks (nvidia-smi on each node)."""
    from hy3spark.playbooks import render_inventory, secret_names
    from hy3spark.runner import failure_summary, run_playbook

    result = run_playbook("playbooks/preflight.yml", render_inventory(loaded, runs_dir), runs_dir=runs_dir,
                          secret_names=secret_names(loaded), tags="gpu_link",
                          extra_args=ansible.cmdline() if ansible else None)
    readings = {n.name: result.results.get(n.name, {}).get("hy3spark_report_gpu_link") for n in loaded.spec.nodes}
    if result.exit_code != 0 or all(v is None for v in readings.values()):
        raise Hy3SparkError(failure_summary(result).splitlines()[0] if result.exit_code else
                            "the gpu_link tasks reported nothing")
    return readings


class LinkSampler:
    """Reads the links again and again while the load runs. What counts is the last reading that finished before the
    load ended (the load was running when it was taken); a load shorter than one reading gets the first reading
    after it, marked as such."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read
        self._stop = threading.Event()
        self._during: dict[str, Any] | None = None
        self._after: dict[str, Any] | None = None
        self.samples = 0
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="hy3spark-link", daemon=True)

    def start(self) -> LinkSampler:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            try:
                nodes = self._read()
            except Exception as exc:  # any failure to ask the nodes falls back to the record
                self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                return
            self.samples += 1
            if self._stop.is_set():
                self._after = nodes
                return
            self._during = nodes

    def stop(self, timeout_s: float = 300.0) -> dict[str, Any] | None:
        """The load has ended: the reading that counts, or None (then `error` may say why)."""
        self._stop.set()
        # Always wait for the reading in flight: it holds the secrets hand-over file, removed when it ends.
        self._thread.join(timeout_s)
        if self._during is not None:
            return {"source": "nodes under load", "under_load": True, "nodes": self._during,
                    "note": f"{self.samples} reading(s) during the load"}
        if self._after is not None:
            return {"source": "nodes after the load", "under_load": False, "nodes": self._after,
                    "note": "the load ended before the first reading did"}
        return None


# --- the lab notebook ----------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def split_text(split: dict[str, Any]) -> str:
    if not split:
        return "?"
    nodes = split.get("nodes")
    return (f"TP{split.get('tensor_parallel')} x PP{split.get('pipeline_parallel')}, {split.get('launcher')}"
            + (f", {nodes} node{'s' if nodes != 1 else ''}" if nodes else ""))


def gpu_text(gpu: dict[str, Any]) -> str:
    """gen4 x16 of gen4 x16 (current of max); "no PCIe link reported" when nvidia-smi had none ([N/A])."""
    keys = ("pcie_gen_current", "pcie_width_current", "pcie_gen_max", "pcie_width_max")
    v = [gpu.get(k) for k in keys]
    if all(x is None for x in v):
        return "no PCIe link reported"

    def gw(gen: Any, width: Any) -> str:
        return f"gen{'?' if gen is None else gen} x{'?' if width is None else width}"

    return f"{gw(v[0], v[1])} of {gw(v[2], v[3])}"


def link_rows(link: dict[str, Any] | None) -> dict[str, str]:
    """{"node GPU0": "gen4 x16 of gen4 x16", "node GPU0-GPU1": "PHB", "node": "skipped (nvidia-smi not found)"}."""
    rows: dict[str, str] = {}
    for node, reading in ((link or {}).get("nodes") or {}).items():
        if not reading:
            rows[node] = "not read"
        elif reading.get("status") != "read":
            rows[node] = f"{reading.get('status')} ({reading.get('reason') or '?'})"
        elif not reading.get("gpus"):
            rows[node] = "no GPU listed"
        else:
            for gpu in reading["gpus"]:
                rows[f"{node} GPU{gpu.get('index')}"] = gpu_text(gpu)
            for pair, kind in (reading.get("topo") or {}).items():
                rows[f"{node} {pair}"] = kind
    return rows


def link_source(link: dict[str, Any] | None) -> str:
    if not link:
        return "not read"
    return str(link.get("source") or "?")


def kv_reading(kv: dict[str, Any] | None, reading: str, missing: str = "?") -> str:
    """One KV reading as text: `missing` when not read, "not available for engine NAME" when the engine logs none."""
    if kv and reading in (kv.get("not_logged") or []):
        return f"not available for engine {kv.get('engine')}"
    value = (kv or {}).get(reading)
    if value is None:
        return missing
    return f"{value:,}" if reading == "kv_cache_tokens" else f"{value:g}x"


def kv_text(kv: dict[str, Any] | None) -> str:
    if not kv:
        return "no KV lines"
    return f"KV cache {kv_reading(kv, 'kv_cache_tokens')} tokens, max concurrency {kv_reading(kv, 'max_concurrency')}"


def engine_text(endpoint: dict[str, Any]) -> str:
    return f"{endpoint['engine']} {endpoint.get('version') or 'unknown'}"


def labbook_line(result: BenchResult) -> str:
    s, e = result.settings, result.endpoint
    levels = "; ".join(
        f"c{lv.concurrency}: {lv.output_tokens_per_s:.1f} tok/s, {lv.requests_per_s:.2f} req/s, "
        f"TTFT p50/p99 {lv.ttft_ms_p50:.0f}/{lv.ttft_ms_p99:.0f} ms, TPOT p50/p99 {lv.tpot_ms_p50:.1f}/"
        f"{lv.tpot_ms_p99:.1f} ms" + (f", {lv.errored} errored" if lv.errored else "")
        for lv in result.levels
    )
    link = ", ".join(f"{k} {v}" for k, v in link_rows(result.link).items()) or "-"
    report = Path(result.report).parent.name if result.report else "-"
    return (f"| {result.date} | bench {_cell(result.label)} | {_cell(engine_text(asdict(e)))} "
            f"| {_cell(result.tool)}: {s.requests} req/level, max_tokens {s.max_tokens}, {_cell(s.prompt_set)} "
            f"| {_cell(split_text(result.split))} | link {_cell(link_source(result.link))}: {_cell(link)} "
            f"| {_cell(kv_text(result.kv))} | {levels} | {report} |\n")


def print_table(result: BenchResult) -> None:
    e = result.endpoint
    print(f"bench {result.label}: {engine_text(asdict(e))} at {e.target}, model {e.model}, {result.tool}")
    print(f"{'concurrency':>11} {'output tok/s':>12} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9} {'ok':>4} {'err':>4}   (ms)")
    for lv in result.levels:
        print(f"{lv.concurrency:>11} {lv.output_tokens_per_s:>12.1f} {lv.requests_per_s:>7.2f} "
              f"{lv.ttft_ms_p50:>9.1f} {lv.ttft_ms_p99:>9.1f} {lv.tpot_ms_p50:>9.2f} {lv.tpot_ms_p99:>9.2f} "
              f"{lv.completed:>4} {lv.errored:>4}")


# --- one run -------------------------------------------------------------------------------------------------------
def run(loaded: Any, *, settings: Settings, tool: str, label: str | None, target: str | None, labbook: Path,
        runs_dir: Path, link: str = "nodes", ansible: Any = None,
        read_links: Callable[[], dict[str, Any]] | None = None) -> BenchResult:
    """Probe the endpoint, run the tool over every level (reading the GPU links on the nodes meanwhile), keep its
    report, append one labbook line. `link`: nodes (under load, the record when the nodes cannot be asked), record
    (the last `up`'s idle readings), off. `read_links` replaces the nodes' reading (tests)."""
    from hy3spark.context import build_context
    from hy3spark.engines import engine_for
    from hy3spark.records import append_labbook, newest_record, now

    spec = loaded.spec
    if link not in LINK_MODES:
        raise Hy3SparkError(f"--link {link!r}: one of {', '.join(LINK_MODES)}")
    if tool == "vllm" and spec.serving.engine != "vllm":
        raise Hy3SparkError(f"--tool vllm runs `vllm bench serve` in the head container: not available for engine "
                            f"{spec.serving.engine} (its image has no vLLM); use --tool guidellm (the default)")
    if tool == "guidellm":
        bench_venv()  # before anything else: a missing venv is a setup step, not a run failure
    context = build_context(loaded)
    key_env = spec.serving.api_key_env
    api_key = os.environ.get(key_env) if key_env else None
    if key_env and not api_key:
        print(f"warning: {key_env} is not set: requests go without an API key", file=sys.stderr)
    endpoint = probe(target or context["hy3spark"]["serving"]["base_url"], api_key, key_env, spec.serving.engine,
                     spec.serving.served_name)
    if endpoint.engine != spec.serving.engine:
        print(f"warning: {endpoint.target} is served by {endpoint.engine}, not the spec's serving.engine "
              f"{spec.serving.engine}: the line names {endpoint.engine}", file=sys.stderr)
    label = label or spec.name
    date = now()
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "run"
    out_dir = runs_dir / "bench" / f"{date.replace('-', '').replace(':', '')}-{slug}"
    out_dir.mkdir(parents=True, exist_ok=True)
    record = newest_record(runs_dir, spec.name)
    if endpoint.version is None and record is not None and endpoint.engine == spec.serving.engine:
        recorded = (record[1].get("versions") or {}).get(endpoint.engine)
        if recorded:
            endpoint.version, endpoint.version_from = str(recorded), f"run record {record[0].name}"
    sampler = None
    if link == "nodes":
        print("reading the GPU links on the nodes while the load runs (roles/preflight, tag gpu_link)",
              file=sys.stderr)
        sampler = LinkSampler(read_links or (lambda: read_links_on_nodes(loaded, runs_dir, ansible))).start()
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
        if sampler is not None:
            sampler.stop()
        if not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    links: dict[str, Any] | None = None
    if sampler is not None:
        links = sampler.stop()
        if links is None:
            why = f"the nodes could not be asked ({sampler.error or 'no reading'})"
            print(f"warning: GPU links: {why}; using the last run record's idle readings", file=sys.stderr)
            links = link_from_record(record, why)
    elif link == "record":
        links = link_from_record(record, "--link record")
    result = BenchResult(label=label, date=date, tool=tool_name, endpoint=endpoint, settings=settings, levels=levels,
                         report=str(report), split=split_of(spec), link=links,
                         kv=kv_of(record, spec.serving.engine, engine_for(spec).log_lines()))
    (out_dir / "result.json").write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    append_labbook(labbook, labbook_line(result))
    return result


# --- side by side: `hy3spark labbook --compare` ------------------------------------------------------------------
def labbook_runs(labbook: Path) -> list[dict[str, str]]:
    """The bench lines of a lab notebook, oldest first: {date, label, engine, run} (engine: its name and version as
    the line gives them; run: the report directory's name)."""
    if not labbook.is_file():
        raise Hy3SparkError(f"no lab notebook at {labbook} (hy3spark bench writes it; --labbook names another)")
    runs = []
    for line in labbook.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 3 and cells[1].startswith("bench "):
            runs.append({"date": cells[0], "label": cells[1].removeprefix("bench "), "engine": cells[2],
                         "run": cells[-1]})
    return runs


def load_runs(labbook: Path, runs_dir: Path, wanted: list[str]) -> list[dict[str, Any]]:
    """Each wanted run's result.json: a label's newest line, or the line whose report directory has that name."""
    runs = labbook_runs(labbook)
    out = []
    for name in wanted:
        line = next((r for r in reversed(runs) if name in (r["label"], r["run"])), None)
        if line is None:
            have = ", ".join(dict.fromkeys(r["label"] for r in runs)) or "none"
            raise Hy3SparkError(f"{labbook}: no bench line labelled {name!r} (labels: {have})")
        places = [runs_dir / "bench" / line["run"] / "result.json",
                  labbook.parent / "bench" / line["run"] / "result.json"]
        path = next((p for p in places if p.is_file()), None)
        if path is None:
            raise Hy3SparkError(f"bench {name!r} ({line['date']}): its result {places[0]} is missing (--runs-dir "
                                "names the runs directory it was written to)")
        data = json.loads(path.read_text())
        data["run"] = line["run"]
        out.append(data)
    return out


def _ms(a: float, b: float, digits: int) -> str:
    return f"{a:.{digits}f} / {b:.{digits}f}"


def compare_rows(runs: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(row name, one cell per run): identity, split, link, KV, then the four numbers of every level."""
    def each(fn: Callable[[dict[str, Any]], str]) -> list[str]:
        return [fn(r) for r in runs]

    rows: list[tuple[str, list[str]]] = [
        ("engine", each(lambda r: engine_text(r["endpoint"]))),
        ("date", each(lambda r: str(r.get("date")))),
        ("model", each(lambda r: str(r["endpoint"]["model"]))),
        ("tool", each(lambda r: f"{r['tool']}, {r['settings']['requests']} req/level, max_tokens "
                                f"{r['settings']['max_tokens']}, {r['settings']['prompts']}")),
        ("split", each(lambda r: split_text(r.get("split") or {}))),
        ("link read", each(lambda r: link_source(r.get("link")))),
    ]
    links = [link_rows(r.get("link")) for r in runs]
    for key in dict.fromkeys(k for lr in links for k in lr):
        rows.append((f"  {key}", [lr.get(key, "-") for lr in links]))
    rows.append(("KV cache tokens", each(lambda r: kv_reading(r.get("kv"), "kv_cache_tokens", "-"))))
    rows.append(("max concurrency", each(lambda r: kv_reading(r.get("kv"), "max_concurrency", "-"))))
    levels = [{lv["concurrency"]: lv for lv in r["levels"]} for r in runs]
    for c in sorted({c for lv in levels for c in lv}):
        got = [lv.get(c) for lv in levels]
        rows += [
            (f"c{c} output tok/s", [f"{x['output_tokens_per_s']:.1f}" if x else "-" for x in got]),
            (f"c{c} requests/s", [f"{x['requests_per_s']:.2f}" if x else "-" for x in got]),
            (f"c{c} TTFT p50 / p99 ms", [_ms(x["ttft_ms_p50"], x["ttft_ms_p99"], 0) if x else "-" for x in got]),
            (f"c{c} TPOT p50 / p99 ms", [_ms(x["tpot_ms_p50"], x["tpot_ms_p99"], 1) if x else "-" for x in got]),
        ]
        if any(x and x.get("errored") for x in got):
            rows.append((f"c{c} errored", [str(x["errored"]) if x else "-" for x in got]))
    return rows


def compare_table(runs: list[dict[str, Any]]) -> str:
    """The runs as columns, one row per measure: plain text, nothing cut (a notebook keeps it as it is)."""
    rows = compare_rows(runs)
    header = ("", [str(r["label"]) for r in runs])
    first = max(len(name) for name, _ in [header, *rows])
    widths = [max(len(cells[i]) for _, cells in [header, *rows]) for i in range(len(runs))]

    def line(name: str, cells: list[str]) -> str:
        return "  ".join([name.ljust(first), *(c.ljust(w) for c, w in zip(cells, widths, strict=True))]).rstrip()

    out = [line(*header), "  ".join("-" * w for w in [first, *widths])]
    out += [line(name, cells) for name, cells in rows]
    return "\n".join(out) + "\n"
