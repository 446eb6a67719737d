"""The vLLM test double in its serving image, on a real two-node Ray cluster in plain Docker containers.

A Ray head and a Ray worker run in two containers of hy3spark/serving:<hash> on a user network (fixed addresses,
one fake GPU each, each with its own VLLM_HOST_IP and NCCL_SOCKET_IFNAME), each with its own Hugging Face cache
mounted at the same path, as model_sync leaves them. `vllm serve` runs in the head container, as vllm_serve runs it.
Needs root and a Docker engine; builds the image when this checkout's tag is missing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hy3spark import capacity, nccl
from hy3spark.engines.vllm import VllmEngine
from hy3spark.spec import load_spec

REPO = Path(__file__).resolve().parent.parent
DOUBLE = REPO / "tests" / "engine_double"
sys.path.insert(0, str(DOUBLE))
from make_model import make_model  # noqa: E402

# Names are per run (other engineers run the suite in the same checkout); the subnet is the first free one of a few.
RUN = f"engine-double-{os.getpid()}"
NETWORK, HEAD, WORKER = RUN, f"{RUN}-head", f"{RUN}-worker"
LABEL = "org.hy3spark.test=engine-double"
SUBNETS = [f"10.250.{third}.0/24" for third in range(77, 97)]
HEAD_IP = WORKER_IP = ""  # set when the network exists
HUB = "/var/lib/hy3spark/hub"
CONFIG_ROOT = "/etc/hy3spark/vllm"
HY3 = "kodelow/Hy3-NVFP4-W4A16"  # on both nodes, bare special tokens (a patched tokenizer/parser pair)
HY3_SUFFIXED = "kodelow/Hy3-opensource"  # Hy3's released tokenizer: <think:opensource> ...
HEAD_ONLY = "kodelow/Hy3-head-only"  # synced to the head but not to the worker
PORT = 8888
API_KEY = "test-key-0123"
NCCL_LOGS = "/tmp/nccl.%h.%p.log"


def rendered(model: str, revision: str, **overrides: str) -> list[str]:
    """`vllm serve` exactly as hy3spark renders it for the default spec (hy3spark/engines/vllm.py), with this test's
    model and revision, and flag values overridden by name (tensor_parallel_size="4")."""
    argv = VllmEngine(load_spec().spec).serve_argv()
    assert argv[:3] == ["vllm", "serve", "kodelow/Hy3-NVFP4-W4A16"] and argv[3] == "--revision"
    argv[2], argv[4] = model, revision
    for name, value in overrides.items():
        argv[argv.index("--" + name.replace("_", "-")) + 1] = value
    return argv


def docker(*args: str, check: bool = True, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, timeout=timeout, **kwargs)


def remove_leftovers() -> None:
    """This run's containers and network, and those of runs whose process is gone (a killed pytest)."""
    runs = {RUN}
    for kind, field in (("ps -a", "{{.Names}}"), ("network ls", "{{.Name}}")):
        for name in docker(*kind.split(), "--filter", f"label={LABEL}", "--format", field).stdout.split():
            pid = name.split("-")[2]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                runs.add(f"engine-double-{pid}")
    for run in runs:
        docker("rm", "-f", f"{run}-head", f"{run}-worker", check=False)
        docker("network", "rm", run, check=False)


def create_network() -> None:
    global HEAD_IP, WORKER_IP
    for subnet in SUBNETS:
        if docker("network", "create", "--label", LABEL, "--subnet", subnet, NETWORK, check=False).returncode == 0:
            HEAD_IP, WORKER_IP = subnet.replace(".0/24", ".11"), subnet.replace(".0/24", ".12")
            return
    pytest.fail(f"no free subnet among {SUBNETS[0]}..{SUBNETS[-1]} for the test network")


@dataclass
class Cluster:
    image: str
    revisions: dict[str, str]

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A command in the foreground in the head container (where vllm_serve runs `vllm serve`)."""
        return docker("exec", HEAD, *argv, check=False, timeout=timeout)

    def gpus_in_use(self, expected: str, timeout: float = 30) -> str:
        """Ray's GPU usage ("0.0/2.0 GPU"), polled until it is the expected value (Ray frees a finished job's
        placement group a moment after the driver exits)."""
        deadline = time.monotonic() + timeout
        while True:
            status = docker("exec", HEAD, "ray", "status").stdout
            match = re.search(r"[\d.]+/[\d.]+ GPU", status)
            assert match, status
            if match.group(0) == expected or time.monotonic() > deadline:
                return match.group(0)
            time.sleep(1)


def run_ray_node(image: str, tmp: Path, name: str) -> None:
    head = name == HEAD
    ip, hub, ifname = (HEAD_IP, "hub-head", "eth-head") if head else (WORKER_IP, "hub-worker", "eth-w")
    env = {
        "VLLM_HOST_IP": ip,
        "NCCL_SOCKET_IFNAME": ifname,
        "NCCL_IB_HCA": "=rocep1s0f1,roceP2p1s0f1",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_FILE": NCCL_LOGS,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": HUB,
        "VLLM_CONFIG_ROOT": CONFIG_ROOT,
        "VLLM_DOUBLE_PG_TIMEOUT_S": "4",
    }
    start = ["ray", "start", "--node-ip-address", ip, "--num-gpus", "1", "--disable-usage-stats"]
    start += ["--head", "--port", "6379", "--include-dashboard=false"] if head else ["--address", f"{HEAD_IP}:6379"]
    start += ["--memory", "1000000000", "--object-store-memory", "200000000", "--block"]
    docker(
        "run", "-d", "--name", name, "--label", LABEL, "--network", NETWORK, "--ip", ip, "--shm-size", "256m",
        *(arg for key, value in env.items() for arg in ("-e", f"{key}={value}")),
        "-v", f"{tmp / hub}:{HUB}:ro", "-v", f"{tmp / 'config'}:{CONFIG_ROOT}:ro", image, *start,
    )  # fmt: skip


def wait_for(name: str, ready: str, deadline_s: float, restart: Any) -> None:
    """Poll `ray status` on the head until it matches `ready`. On a loaded machine a raylet can miss Ray's fixed
    30 s startup window and exit: `restart` starts that node again (at most twice)."""
    deadline, restarts, status = time.monotonic() + deadline_s, 0, ""
    while time.monotonic() < deadline:
        if docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip() != "true":
            if restarts == 2:
                break
            restarts += 1
            restart()
        status = docker("exec", HEAD, "ray", "status", check=False).stdout
        if re.search(ready, status):
            return
        time.sleep(2)
    logs = docker("logs", "--tail", "15", name, check=False)
    pytest.fail(f"Ray on {name} not ready ({ready}):\n{status}\n{name} log:\n{logs.stdout}{logs.stderr}")


def start_ray(image: str, tmp: Path) -> None:
    def restart_head() -> None:
        docker("rm", "-f", HEAD)
        run_ray_node(image, tmp, HEAD)

    run_ray_node(image, tmp, HEAD)
    wait_for(HEAD, r"0\.0/1\.0 GPU", 180, restart_head)
    run_ray_node(image, tmp, WORKER)
    wait_for(WORKER, r"0\.0/2\.0 GPU", 180, lambda: docker("start", WORKER))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if shutil.which("docker") is None or docker("info", check=False).returncode != 0:
        pytest.skip("needs a Docker engine")
    if os.geteuid() != 0:
        pytest.skip("needs root (the image build runs debootstrap)")
    built = subprocess.run([str(DOUBLE / "build-image")], capture_output=True, text=True, timeout=1500, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    image = built.stdout.strip().splitlines()[-1]
    tmp = tmp_path_factory.mktemp("engine-double")
    revisions = {}
    for hub in ("hub-head", "hub-worker"):
        revisions[HY3] = make_model(tmp / hub, HY3, suffix=None)
        revisions[HY3_SUFFIXED] = make_model(tmp / hub, HY3_SUFFIXED)
    revisions[HEAD_ONLY] = make_model(tmp / "hub-head", HEAD_ONLY, suffix=None)
    (tmp / "config").mkdir()
    # What vllm_serve writes: without it the head's NCCL_SOCKET_IFNAME would be copied over the worker's own.
    (tmp / "config" / "ray_non_carry_over_env_vars.json").write_text(json.dumps(["NCCL_SOCKET_IFNAME"]))
    remove_leftovers()
    create_network()
    try:
        start_ray(image, tmp)
        yield Cluster(image=image, revisions=revisions)
    finally:
        remove_leftovers()


# --- without Docker: the double's parser and KV arithmetic against hy3spark's own code --------------------------


@pytest.fixture(scope="module")
def double_src() -> Iterator[None]:
    """Import the double's `vllm` package from its source tree (no real vLLM is installed next to hy3spark)."""
    sys.path.insert(0, str(DOUBLE / "src"))
    try:
        yield
    finally:
        sys.path.remove(str(DOUBLE / "src"))
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.yml")))
def test_every_rendered_command_is_accepted(double_src: None, example: str) -> None:
    from vllm.double import args as cli_args

    argv = VllmEngine(load_spec(REPO / "examples" / example).spec).serve_argv()
    parsed = cli_args.build_parser().parse_args(cli_args.preprocess(argv[1:]))
    assert parsed.model_tag == argv[2]
    assert parsed.distributed_executor_backend == "ray"
    assert parsed.tensor_parallel_size == int(argv[argv.index("--tensor-parallel-size") + 1])


@pytest.mark.parametrize(
    ("layers", "kv_heads", "weights", "mtp", "tp", "pp", "kv_dtype", "util", "max_len"),
    [
        (80, 8, 181_000_000_000, 1, 2, 1, "fp8_e4m3", 0.90, 131072),  # Hy3 on two Sparks (the reference)
        (80, 8, 181_000_000_000, 1, 1, 2, "fp8_e4m3", 0.90, 65536),  # the same split by pipeline
        (126, 8, 203_000_000_000, 0, 2, 1, "fp8", 0.92, 32768),  # Llama-3.1-405B AWQ
        (64, 8, 65_000_000_000, 0, 1, 1, "auto", 0.85, 40960),  # Qwen3-32B on one node, bf16 KV
        (81, 8, 90_000_000_000, 0, 2, 2, "auto", 0.90, 16384),  # odd layers over 2 PP stages
    ],
)
def test_kv_lines_match_the_capacity_planner(
    double_src: None, layers: int, kv_heads: int, weights: int, mtp: int, tp: int, pp: int, kv_dtype: str,
    util: float, max_len: int,
) -> None:  # fmt: skip
    from vllm.double import kv

    config = {"num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": kv_heads,
              "head_dim": 128, "num_nextn_predict_layers": mtp, "torch_dtype": "bfloat16"}  # fmt: skip
    speculative = {"method": "mtp", "num_speculative_tokens": 1} if mtp else None
    sizing = kv.Sizing(
        shape=kv.Shape.from_config(config, "auto", speculative), tp=tp, pp=pp, kv_cache_dtype=kv_dtype,
        block_size=16, gpu_memory_utilization=util, max_model_len=max_len, weight_bytes=weights,
        kv_cache_memory_bytes=None,
    )  # fmt: skip
    double = kv.capacity(sizing, [kv.available_bytes(sizing)] * (tp * pp))
    plan = capacity.plan(
        capacity.ModelShape(num_hidden_layers=layers, num_key_value_heads=kv_heads, head_dim=128,
                            weight_bytes=weights, mtp_layers=mtp),
        capacity.ServeConfig(tensor_parallel=tp, pipeline_parallel=pp, max_model_len=max_len, max_num_seqs=4,
                             kv_cache_dtype=kv_dtype),
        capacity.Budget(gpu_memory_utilization=util, total_memory_bytes=capacity.GB10_TOTAL_MEMORY_BYTES,
                        overhead_bytes=3 * capacity.GIB, overhead_source="test"),
    )  # fmt: skip
    assert (double.num_blocks, f"GPU KV cache size: {double.tokens:,} tokens") == (
        plan.num_blocks,
        plan.kv_cache_size_line,
    )
    assert f"Maximum concurrency for {max_len:,} tokens per request: {double.concurrency:.2f}x" == (
        plan.max_concurrency_line
    )


@pytest.mark.parametrize(("tp", "pp", "max_len"), [(1, 1, 131072), (2, 1, 131072), (1, 2, 65536)])
def test_sliding_window_groups_match_the_capacity_planner(double_src: None, tp: int, pp: int, max_len: int) -> None:
    """gpt-oss-120b: 36 layers alternating sliding (window 128) and full attention, 8 KV heads of 64."""
    from vllm.double import kv

    config = {"num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
              "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18}  # fmt: skip
    sizing = kv.Sizing(
        shape=kv.Shape.from_config(config, "auto", None), tp=tp, pp=pp, kv_cache_dtype="auto", block_size=16,
        gpu_memory_utilization=0.80, max_model_len=max_len, weight_bytes=65_000_000_000, kv_cache_memory_bytes=None,
    )  # fmt: skip
    double = kv.capacity(sizing, [kv.available_bytes(sizing)] * (tp * pp))
    plan = capacity.plan(
        capacity.ModelShape(num_hidden_layers=36, num_key_value_heads=8, head_dim=64, weight_bytes=65_000_000_000,
                            sliding_window=128, sliding_window_layers=18),
        capacity.ServeConfig(tensor_parallel=tp, pipeline_parallel=pp, max_model_len=max_len, max_num_seqs=8),
        capacity.Budget(gpu_memory_utilization=0.80, total_memory_bytes=capacity.GB10_TOTAL_MEMORY_BYTES,
                        overhead_bytes=3 * capacity.GIB, overhead_source="test"),
    )  # fmt: skip
    assert len(sizing.groups) == len(plan.groups) == 2
    assert f"GPU KV cache size: {double.tokens:,} tokens" == plan.kv_cache_size_line
    assert f"Maximum concurrency for {max_len:,} tokens per request: {double.concurrency:.2f}x" == (
        plan.max_concurrency_line
    )


def test_a_request_that_cannot_fit_fails_in_both(double_src: None) -> None:
    """Llama-405B with 230 GB of weights on two Sparks: one 32k request does not fit; vLLM refuses to start."""
    from vllm.double import kv

    config = {"num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8, "head_dim": 128}
    sizing = kv.Sizing(
        shape=kv.Shape.from_config(config, "auto", None), tp=2, pp=1, kv_cache_dtype="fp8", block_size=16,
        gpu_memory_utilization=0.92, max_model_len=32768, weight_bytes=230_000_000_000, kv_cache_memory_bytes=None,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"the estimated maximum model length is 15408\."):
        kv.capacity(sizing, [kv.available_bytes(sizing)] * 2)
    plan = capacity.plan(
        capacity.ModelShape(num_hidden_layers=126, num_key_value_heads=8, head_dim=128, weight_bytes=230_000_000_000),
        capacity.ServeConfig(tensor_parallel=2, max_model_len=32768, max_num_seqs=4, kv_cache_dtype="fp8"),
        capacity.Budget(gpu_memory_utilization=0.92, total_memory_bytes=capacity.GB10_TOTAL_MEMORY_BYTES,
                        overhead_bytes=3 * capacity.GIB, overhead_source="test"),
    )  # fmt: skip
    assert not plan.ok
    assert any("15,408" in p.message or "15408" in p.message for p in plan.problems), plan.problems


# --- in Docker: the serving image on a two-node Ray cluster ----------------------------------------------------


def test_version_says_test_double(cluster: Cluster) -> None:
    out = docker("exec", HEAD, "vllm", "--version").stdout.strip()
    assert out == "0.23.0+testdouble"


@pytest.mark.parametrize("flag", ["--foo", "--disable-log-requests"])
def test_unknown_flag_is_rejected_like_vllm(cluster: Cluster, flag: str) -> None:
    result = cluster.run([*rendered(HY3, cluster.revisions[HY3]), flag])
    assert result.returncode == 2
    assert result.stderr.splitlines()[0].startswith("usage: vllm [-h] [-v]")
    assert result.stderr.strip().endswith(f"vllm: error: unrecognized arguments: {flag}")


def test_bad_value_is_rejected_by_the_serve_parser(cluster: Cluster) -> None:
    result = cluster.run(rendered(HY3, cluster.revisions[HY3], kv_cache_dtype="fp4"))
    assert result.returncode == 2
    assert "usage: vllm serve [model_tag] [options]" in result.stderr
    assert "vllm serve: error: argument --kv-cache-dtype: invalid choice: 'fp4'" in result.stderr


def test_placement_fails_when_tp_exceeds_the_gpus(cluster: Cluster) -> None:
    result = cluster.run(rendered(HY3, cluster.revisions[HY3], tensor_parallel_size="4"))
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert re.search(
        r"Waiting for creating a placement group of specs for \d+ seconds\. specs=\[\{'GPU': 1\.0, "
        rf"'node:{HEAD_IP}': 0\.001\}}, \{{'GPU': 1\.0\}}",
        out,
    ), out
    assert "Check `ray status` and `ray list nodes` to see if you have enough resources" in out
    assert "ValueError: Cannot provide a placement group requiring 4.0 GPUs" in out
    assert "within 4 seconds" in out
    assert "Engine core initialization failed. See root cause above." in out
    assert "Application startup complete." not in out
    assert cluster.gpus_in_use("0.0/2.0 GPU") == "0.0/2.0 GPU"  # the failed engine released what it held


def test_model_missing_on_the_worker_fails_naming_the_node(cluster: Cluster) -> None:
    result = cluster.run(rendered(HEAD_ONLY, cluster.revisions[HEAD_ONLY]))
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert f"is not in the Hugging Face cache on node {WORKER_IP}" in out
    assert f"ip={WORKER_IP}" in out  # Ray's RayTaskError names the worker too
    assert "EngineCore failed to start." in out


def test_model_missing_everywhere_fails_like_vllm_offline(cluster: Cluster) -> None:
    result = cluster.run(rendered("kodelow/not-synced", "main"))
    assert result.returncode == 1
    assert "ValueError: Invalid repository ID or local directory specified: 'kodelow/not-synced'" in result.stderr


PARSERS = "/opt/vllm/lib/python3.11/site-packages/vllm/{}/hy_v3_{}_parser.py"
TOOL_PARSER, REASONING_PARSER = PARSERS.format("tool_parsers", "tool"), PARSERS.format("reasoning", "reasoning")
# What the Hy3 recipe (and vllm_serve) does to vLLM 0.23's parsers: "<think>" -> "<think:opensource>", ...
PATCH = r's/"<(\/?)(think|tool_calls|tool_call|tool_sep|arg_key|arg_value)>"/"<\1\2:opensource>"/g'
TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


@contextmanager
def serving_suffixed_model(port: str) -> Iterator[str]:
    """Hy3's released tokenizer (<think:opensource> ...) served on one node (TP 1, no Ray) with the hy_v3 parsers."""
    log = f"/tmp/suffixed-{port}.log"
    command = (
        f"exec vllm serve {HY3_SUFFIXED} --served-model-name hy3 --port {port} --max-model-len 4096 "
        "--kv-cache-memory-bytes 4G --reasoning-parser hy_v3 --tool-call-parser hy_v3 --enable-auto-tool-choice "
        f"--trust-remote-code > {log} 2>&1"
    )
    docker("exec", "-d", HEAD, "sh", "-c", command)
    url = f"http://{HEAD_IP}:{port}"
    try:
        wait_healthy(url, log)
        yield url
    finally:
        docker("exec", HEAD, "pkill", "-f", f"port {port}", check=False)


def chat(url: str, **extra: Any) -> tuple[int, Any]:
    return post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **extra})


def test_unpatched_hy_v3_parsers_fail_chat_with_the_opensource_tokenizer(cluster: Cluster) -> None:
    """vLLM 0.23's bare-token parsers, at vLLM's paths, cannot find Hy3's tokens: chat fails, completions work."""
    for path in (TOOL_PARSER, REASONING_PARSER):
        source = docker("exec", HEAD, "cat", path).stdout
        assert "token_suffix" not in source
    assert (
        '        self.tool_calls_start_token: str = "<tool_calls>"\n' in docker("exec", HEAD, "cat", TOOL_PARSER).stdout
    )
    assert '        return "<think>"\n' in docker("exec", HEAD, "cat", REASONING_PARSER).stdout
    with serving_suffixed_model("8899") as url:
        status, body = chat(url)
        assert status == 400
        assert body["error"]["message"] == (
            "HYV3ReasoningParser reasoning parser could not locate think start/end tokens in the tokenizer!"
        )
        status, body = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
        assert status == 200 and body["choices"][0]["text"].startswith(" hy3spark")


def test_patched_hy_v3_parsers_serve_chat_and_tools(cluster: Cluster) -> None:
    for path in (TOOL_PARSER, REASONING_PARSER):
        docker("exec", HEAD, "cp", "-p", path, f"{path}.orig")
        docker("exec", HEAD, "sed", "-i", "-E", PATCH, path)
    try:
        with serving_suffixed_model("8898") as url:
            status, body = chat(url, chat_template_kwargs={"reasoning_effort": "high"})
            assert status == 200, body
            message = body["choices"][0]["message"]
            assert message["reasoning"].startswith("The request asks about")
            assert message["content"].startswith(" hy3spark engine double says:")
            status, body = chat(url, tools=TOOLS)
            assert status == 200, body
    finally:
        for path in (TOOL_PARSER, REASONING_PARSER):  # later tests serve a bare-token tokenizer again
            docker("exec", HEAD, "mv", f"{path}.orig", path)


def request(url: str, path: str, data: dict[str, Any] | None = None, key: str | None = API_KEY) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps(data).encode() if data is not None else None
    req = urllib.request.Request(url + path, data=body, headers=headers, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def post(url: str, path: str, data: dict[str, Any], key: str | None = API_KEY) -> tuple[int, Any]:
    status, raw = request(url, path, data, key)
    return status, json.loads(raw)


def wait_healthy(url: str, log: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if request(url, "/health", key=None)[0] == 200:
                return
        except OSError:
            pass
        if docker("exec", HEAD, "pgrep", "-f", "vllm serve", check=False).returncode != 0:
            pytest.fail("vllm serve exited:\n" + docker("exec", HEAD, "tail", "-n", "40", log).stdout)
        time.sleep(1)
    pytest.fail("no /health within the timeout:\n" + docker("exec", HEAD, "tail", "-n", "40", log).stdout)


@pytest.fixture(scope="module")
def serving(cluster: Cluster) -> Iterator[str]:
    """The rendered command serving in the background in the head container, the API key from the env (as vllm_serve
    passes it: from a 0600 file, never on the command line)."""
    command = shlex.join(rendered(HY3, cluster.revisions[HY3]))
    for node in (HEAD, WORKER):  # earlier (failed) starts wrote NCCL logs too
        docker("exec", node, "sh", "-c", "rm -f /tmp/nccl.*.log")
    docker(
        "exec",
        "-d",
        "-e",
        f"VLLM_API_KEY={API_KEY}",
        "-e",
        "VLLM_DOUBLE_HEALTH_INTERVAL_S=1",
        HEAD,
        "sh",
        "-c",
        f"exec {command} > /tmp/serve.log 2>&1",
    )
    url = f"http://{HEAD_IP}:{PORT}"
    wait_healthy(url, "/tmp/serve.log")
    yield url


def serve_log() -> str:
    return docker("exec", HEAD, "cat", "/tmp/serve.log").stdout


def test_startup_lines_match_the_capacity_planner(serving: str) -> None:
    log = serve_log()
    plan = capacity.plan(
        capacity.ModelShape(
            num_hidden_layers=80, num_key_value_heads=8, head_dim=128, weight_bytes=181_000_000_000, mtp_layers=1
        ),
        capacity.ServeConfig(tensor_parallel=2, max_model_len=131072, max_num_seqs=6, kv_cache_dtype="fp8_e4m3"),
        capacity.Budget(
            gpu_memory_utilization=0.90,
            total_memory_bytes=capacity.GB10_TOTAL_MEMORY_BYTES,
            overhead_bytes=3 * capacity.GIB,
            overhead_source="test double default",
        ),
    )
    engine_line = r"\(EngineCore pid=\d+\) INFO [\d-]+ [\d:]+ \[kv_cache_utils\.py:\d+\] "
    assert re.search(engine_line + plan.kv_cache_size_line + "$", log, re.M), log
    assert re.search(rf"\[kv_cache_utils\.py:\d+\] {re.escape(plan.max_concurrency_line)}$", log, re.M), log
    assert plan.kv_cache_size_line == "GPU KV cache size: 287,856 tokens"
    assert plan.max_concurrency_line == "Maximum concurrency for 131,072 tokens per request: 2.20x"
    assert re.search(rf"\(APIServer pid=\d+\) INFO .* Starting vLLM server on http://0\.0\.0\.0:{PORT}$", log, re.M)
    assert re.search(r"\(APIServer pid=\d+\) INFO:     Application startup complete\.$", log, re.M)
    assert "hy3spark TEST DOUBLE" in log
    assert API_KEY not in log


def test_each_rank_runs_on_its_own_node_with_its_own_env(serving: str) -> None:
    status, raw = request(serving, "/double/workers", key=None)
    assert status == 200
    workers = {w["rank"]: w for w in json.loads(raw)["workers"]}
    assert [(workers[r]["node_ip"], workers[r]["vllm_host_ip"]) for r in (0, 1)] == [
        (HEAD_IP, HEAD_IP),
        (WORKER_IP, WORKER_IP),
    ]
    # ray_non_carry_over_env_vars.json lists NCCL_SOCKET_IFNAME: the worker keeps its own.
    assert workers[0]["env"]["NCCL_SOCKET_IFNAME"] == "eth-head"
    assert workers[1]["env"]["NCCL_SOCKET_IFNAME"] == "eth-w"
    # Not listed here, the head's VLLM_API_KEY is copied to every rank, as vLLM does (hence hy3spark lists it).
    assert [workers[r]["secret_env_names"] for r in (0, 1)] == [["VLLM_API_KEY"], ["VLLM_API_KEY"]]
    assert all(
        w["model_path"].startswith(f"{HUB}/models--kodelow--Hy3-NVFP4-W4A16/snapshots/") for w in workers.values()
    )


def test_workers_hold_the_gpus_and_nccl_reports_rdma(cluster: Cluster, serving: str) -> None:
    assert cluster.gpus_in_use("2.0/2.0 GPU") == "2.0/2.0 GPU"
    logs = {node: docker("exec", node, "sh", "-c", "cat /tmp/nccl.*.log").stdout for node in (HEAD, WORKER)}
    report = nccl.parse_logs(logs)
    result = nccl.gate(report)
    assert result.passed, result.message
    assert result.counts[nccl.Transport.IB_GDRDMA] == 8  # 2 ranks x 2 channels x (send + receive)


def test_health_models_and_api_key(serving: str) -> None:
    assert request(serving, "/health", key=None) == (200, b"")
    assert request(serving, "/v1/models", key=None) == (401, b'{"error": "Unauthorized"}')
    assert request(serving, "/v1/models", key="wrong")[0] == 401
    status, raw = request(serving, "/v1/models")
    assert status == 200
    models = json.loads(raw)
    assert [m["id"] for m in models["data"]] == ["hy3"]
    assert models["data"][0]["root"] == HY3 and models["data"][0]["max_model_len"] == 131072


def test_completion_is_deterministic_with_usage(serving: str) -> None:
    request_body = {"model": "hy3", "prompt": "Say hello to the Spark pair", "max_tokens": 12}
    first = post(serving, "/v1/completions", request_body)
    second = post(serving, "/v1/completions", request_body)
    assert first[0] == 200
    choice = first[1]["choices"][0]
    assert choice["text"].startswith(" hy3spark engine double says:")
    assert choice["finish_reason"] == "length"
    assert first[1]["usage"] == {
        "prompt_tokens": 6,
        "total_tokens": 18,
        "completion_tokens": 12,
        "prompt_tokens_details": None,
    }
    assert choice["text"] == second[1]["choices"][0]["text"]
    status, body = post(serving, "/v1/completions", {"model": "other", "prompt": "x"})
    assert status == 404 and body["error"]["message"] == "The model `other` does not exist."
    status, body = post(serving, "/v1/completions", {"model": "hy3", "prompt": "x", "max_tokens": 200000})
    assert status == 400 and "maximum context length is 131072 tokens" in body["error"]["message"]


def test_streaming_chat_sends_openai_chunks_then_done(serving: str) -> None:
    body = {
        "model": "hy3",
        "messages": [{"role": "user", "content": "Stream something"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"reasoning_effort": "high"},
    }
    status, raw = request(serving, "/v1/chat/completions", body)
    assert status == 200
    events = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line]
    assert all(line.startswith("data: ") for line in raw.decode().split("\n\n") if line)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning", "") for c in chunks if c["choices"])
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert reasoning.startswith("The request asks about")
    assert content.startswith(" hy3spark engine double says:") and content.endswith(".")
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_a_dead_worker_takes_the_engine_down(serving: str) -> None:
    docker("kill", WORKER)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "Finished server process" not in serve_log():
        time.sleep(1)
    log = serve_log()
    assert "EngineCore encountered a fatal error." in log
    assert "EngineDeadError" in log
    while (
        time.monotonic() < deadline and docker("exec", HEAD, "pgrep", "-f", "vllm serve", check=False).returncode == 0
    ):
        time.sleep(1)
    assert docker("exec", HEAD, "pgrep", "-f", "vllm serve", check=False).returncode == 1, "vllm serve still runs"
    with pytest.raises(OSError):  # nothing listens on the port any more
        request(serving, "/health", key=None)
