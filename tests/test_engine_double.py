"""The vLLM test double in its serving image, on a real two-node Ray cluster in plain Docker containers.

A Ray head and a Ray worker run in two containers of hy3spark/serving:<hash> on a user network (fixed addresses,
one fake GPU each, each with its own VLLM_HOST_IP and NCCL_SOCKET_IFNAME), each with its own Hugging Face cache
mounted at the same path, as model_sync leaves them. `vllm serve` runs in the head container, as vllm_serve runs it.
Needs root and a Docker engine; builds the image when this checkout's tag is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
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

from hy3spark import nccl, planning
from hy3spark.engines.vllm import VllmEngine
from hy3spark.spec import load_spec, parse_spec

REPO = Path(__file__).resolve().parent.parent
DOUBLE = REPO / "tests" / "engine_double"
sys.path.insert(0, str(DOUBLE))
import docker_runs  # noqa: E402
from docker_runs import docker, require_docker_as_root  # noqa: E402
from make_model import make_model  # noqa: E402
from test_operator_cli import SPEC as OPERATOR_CLI_SPEC  # noqa: E402

# Names are per run (other engineers run the suite in the same checkout); the subnet is the first free one of a few.
RUN = f"engine-double-{os.getpid()}"
NETWORK, HEAD, WORKER = RUN, f"{RUN}-head", f"{RUN}-worker"
LABEL = "org.hy3spark.test=engine-double"
SUBNETS = [f"10.250.{third}.0/24" for third in range(77, 97)]
HEAD_IP = WORKER_IP = ""  # set when the network exists
HUB = "/var/lib/hy3spark/hub"
CONFIG_ROOT = "/etc/hy3spark/vllm"
HY3 = "kodelow/Hy3-NVFP4-W4A16"  # on both nodes, bare special tokens (a patched tokenizer/parser pair)
HY3_SUFFIXED = "kodelow/Hy3-opensource"  # Hy3's released tokenizer: <think:opensource> ... (gpt-oss's shape)
HEAD_ONLY = "kodelow/Hy3-head-only"  # synced to the head but not to the worker
PORT = 8888
VLLM_PORT = 29510  # what hy3spark's node.env sets by default (serving.internal_port)
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


def remove_leftovers() -> None:
    """This run's containers and network, and those of runs whose process is gone (a killed pytest)."""
    docker_runs.remove_leftovers("engine-double", LABEL)


def create_network() -> None:
    global HEAD_IP, WORKER_IP
    HEAD_IP, WORKER_IP = docker_runs.create_network(NETWORK, LABEL, SUBNETS)


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
    require_docker_as_root("the image build runs debootstrap")
    built = subprocess.run([str(DOUBLE / "build-image")], capture_output=True, text=True, timeout=1500, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    image = built.stdout.strip().splitlines()[-1]
    tmp = tmp_path_factory.mktemp("engine-double")
    revisions = {}
    for hub in ("hub-head", "hub-worker"):
        revisions[HY3] = make_model(tmp / hub, HY3, suffix=None)
        revisions[HY3_SUFFIXED] = make_model(tmp / hub, HY3_SUFFIXED, preset="gpt-oss")
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


# --- without Docker: the double's parser, and its KV lines from vLLM's recorded vectors -------------------------


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


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.yml")
                                            if load_spec(p).spec.serving.engine == "vllm"))
def test_every_rendered_command_is_accepted(double_src: None, example: str) -> None:
    from vllm.double import args as cli_args

    spec = load_spec(REPO / "examples" / example).spec
    argv = VllmEngine(spec).serve_argv()
    parsed = cli_args.build_parser().parse_args(cli_args.preprocess(argv[1:]))
    assert parsed.model_tag == argv[2]
    assert parsed.distributed_executor_backend == {"ray": "ray", "native": "mp"}[spec.serving.launcher]
    assert parsed.tensor_parallel_size == int(argv[argv.index("--tensor-parallel-size") + 1])


KV_FIXTURE = REPO / "tests" / "fixtures" / "vllm-0.23.0" / "kv-cases.json"
VLLM_CASES = {case["id"]: case for case in json.loads(KV_FIXTURE.read_text())["cases"]}


def test_the_shipped_kv_table_is_the_one_made_from_vllms_vectors() -> None:
    """kv_vectors.json cannot drift from the fixture: it is exactly what make_kv_table.py makes of it."""
    sys.path.insert(0, str(DOUBLE))
    try:
        import make_kv_table
    finally:
        sys.path.remove(str(DOUBLE))
    shipped = (DOUBLE / "src" / "vllm" / "double" / "kv_vectors.json").read_text()
    assert make_kv_table.render(make_kv_table.build_table(KV_FIXTURE)) == shipped
    table = json.loads(shipped)
    assert table["source"]["sha256"] == hashlib.sha256(KV_FIXTURE.read_bytes()).hexdigest()
    assert [v["id"] for v in table["vectors"]] == list(VLLM_CASES)


@pytest.mark.parametrize("case_id", list(VLLM_CASES))
def test_each_vector_gives_vllms_recorded_outcome(double_src: None, case_id: str) -> None:
    """The lookup by a vector's own configuration and memory answers with what vLLM logged or raised."""
    from vllm.double import kv

    (vector,) = [v for v in kv.table()["vectors"] if v["id"] == case_id]
    vllm = VLLM_CASES[case_id]["vllm"]
    config = dict(vector["config"])
    if "config_error" in vllm:
        with pytest.raises(NotImplementedError) as refused:
            kv.check_config(config)
        assert f"NotImplementedError: {refused.value}" == vllm["config_error"]
        return
    kv.check_config(config)  # vLLM accepted it
    found = kv.lookup(config, VLLM_CASES[case_id]["inputs"]["available_kv_bytes_per_rank"])
    assert found.id == case_id
    assert [f"{level}: {message}" for level, message in found.log] == vllm["log"]
    if "error" in vllm:
        with pytest.raises(ValueError) as raised:
            found.raise_error()
        assert str(raised.value) == vllm["error"]["message"]
        assert found.error is not None and found.error["rank"] == vllm["per_rank_checks"][-1]["rank"]
    else:
        found.raise_error()
        assert found.num_blocks == vllm["num_blocks"]
        assert [m for _level, m in found.log if m.startswith(("GPU KV", "Maximum concurrency"))] == vllm["lines"]


def test_other_memory_or_configuration_has_no_vector(double_src: None) -> None:
    from vllm.double import kv

    (vector,) = [v for v in kv.table()["vectors"] if v["id"] == "hy3-profile-tp2-mtp-fp8"]
    with pytest.raises(kv.NoVector) as other_memory:
        kv.lookup(vector["config"], [23876052834, 23876052833])
    message = str(other_memory.value)
    assert message.startswith("the vLLM test double has no vLLM 0.23.0 KV vector for architecture=HYV3ForCausalLM, ")
    assert "tensor_parallel=2, " in message and "with available KV bytes per rank [23876052834, 23876052833]" in message
    assert "hy3-profile-tp2-mtp-fp8: [23876052834, 23876052834]" in message
    assert "add a case to tests/fixtures/vllm-0.23.0/kv-cases.json" in message
    with pytest.raises(kv.NoVector, match=r"no vLLM 0.23.0 KV vector for .*max_model_len=65536, ") as other_len:
        kv.lookup({**vector["config"], "max_model_len": 65536}, [23876052834, 23876052834])
    assert "vectors with this configuration" not in str(other_len.value)


def test_pp_stages_split_like_the_vectors(double_src: None) -> None:
    """The double's stage split (vLLM's get_pp_indices) against every rank vLLM recorded."""
    from vllm.double import kv

    ranks = 0
    for case in VLLM_CASES.values():
        inputs = case["inputs"]
        for rank in inputs.get("ranks", []):
            stages = kv.pp_layer_ranges(inputs["model"]["num_hidden_layers"], inputs["pipeline_parallel"])
            assert stages[rank["pp_rank"]] == range(*rank["hidden_layers"]), (case["id"], rank["rank"])
            ranks += 1
    assert ranks == 79  # every recorded rank of the 27 cases vLLM accepted
    # No vector splits unevenly over more than 3 stages; get_pp_indices gives the remainder to the stages before the
    # last one (the same rule the planner's test_pp_splits_layers_like_vllm_and_the_fullest_stage_limits checks).
    assert [len(stage) for stage in kv.pp_layer_ranges(94, 4)] == [23, 24, 24, 23]


def test_extra_full_layers_sit_on_the_last_stage(double_src: None, tmp_path: Path) -> None:
    """gpt-oss + one MTP layer under PP2 is laid out as vLLM laid out its extra full layer (vector
    gptoss-extra-full-layer-pp2); vLLM recorded that case without speculative decoding: only the method differs."""
    from vllm.double import args as cli_args
    from vllm.double import kv, serve
    from vllm.double.model import resolve

    path = _model_dir(tmp_path, "gpt-oss")
    config = json.loads((path / "config.json").read_text())
    drafted = tmp_path / "drafted"
    drafted.mkdir()
    (drafted / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    argv = ["serve", str(drafted), "-pp", "2", "--max-num-batched-tokens", "8192", "--speculative-config",
            '{"method":"mtp","num_speculative_tokens":1}']  # fmt: skip
    parsed = cli_args.build_parser().parse_args(cli_args.preprocess(argv))
    model = resolve(str(drafted), None)
    mine = kv.engine_config(model.config, parsed, serve.model_checks(parsed, model))
    (vector,) = [v for v in kv.table()["vectors"] if v["id"] == "gptoss-extra-full-layer-pp2"]
    assert mine["stages"] == vector["config"]["stages"] == [{"full": 9, "sliding": 9}, {"full": 10, "sliding": 9}]
    assert {k for k in vector["config"] if mine[k] != vector["config"][k]} == {"speculative_method"}


def _hy3_argv() -> list[str]:
    return VllmEngine(load_spec().spec).serve_argv()


def _argv(spec: str, *extra: str) -> list[str]:
    return [*VllmEngine(load_spec(REPO / spec).spec).serve_argv(), *extra]


GEMMA3_27B = {
    "architectures": ["Gemma3ForCausalLM"],
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "sliding_window": 1024,
    # Gemma 3: five sliding-window layers, then one global (full) layer.
    "layer_types": [("full_attention" if i % 6 == 5 else "sliding_attention") for i in range(62)],
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
LLAMA_405B = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
HY3_FLAGS = ("--trust-remote-code", "--kv-cache-dtype", "fp8")


@pytest.mark.parametrize(
    ("case_id", "model", "flags"),
    [
        ("hy3-profile-gb10-nvml-unsupported", "hy3", "DEFAULT_SPEC"),
        ("gptoss120b-profile-gb10-nvml-unsupported", "gpt-oss", "examples/gpt-oss-single.yml"),
        ("hy3-tp2-pp2-mtp-rejected", "hy3", ("-tp", "2", "-pp", "2", "--max-model-len", "131072", "--kv-cache-dtype",
                                            "fp8_e4m3", "--speculative-config", '{"method":"mtp"}',
                                            "--trust-remote-code")),
        ("hy3-tp1-pp3-uneven-len100001", "hy3", ("-pp", "3", "--max-model-len", "100001", *HY3_FLAGS,
                                                 "--max-num-batched-tokens", "8192")),
        ("gptoss-tp1-pp2-hybrid", "gpt-oss", ("-pp", "2", "--max-num-batched-tokens", "8192")),
        ("gptoss-len100003-mnbt2048", "gpt-oss", ("--max-model-len", "100003", "--max-num-batched-tokens", "2048")),
        ("gemma3-27b-5to1-hybrid-tp2", GEMMA3_27B, ("-tp", "2", "--max-num-batched-tokens", "8192")),
        ("llama405b-auto-fit-max-model-len", LLAMA_405B, ("-tp", "2", "--max-model-len", "-1", "--kv-cache-dtype",
                                                          "fp8", "--max-num-batched-tokens", "8192")),
        ("llama405b-block-size-32", LLAMA_405B, ("-tp", "2", "--max-model-len", "30001", "--kv-cache-dtype", "fp8",
                                                 "--block-size", "32", "--max-num-batched-tokens", "8192")),
    ],
)  # fmt: skip
def test_the_double_describes_its_configuration_as_the_vectors_do(
    double_src: None, tmp_path: Path, case_id: str, model: str | dict[str, Any], flags: str | tuple[str, ...]
) -> None:
    """config.json and the flags, read by the double, give the vector's configuration key exactly."""
    from vllm.double import args as cli_args
    from vllm.double import kv, serve
    from vllm.double.model import resolve

    if flags == "DEFAULT_SPEC":
        argv = _hy3_argv()
    elif isinstance(flags, str):
        argv = _argv(flags)
    else:
        argv = ["vllm", "serve", "MODEL", *flags]
    if isinstance(model, str):
        path = _model_dir(tmp_path, model)
    else:
        path = tmp_path / "model"
        path.mkdir()
        (path / "config.json").write_text(json.dumps(model))
    argv[2] = str(path)
    parsed = cli_args.build_parser().parse_args(cli_args.preprocess(argv[1:]))
    loaded = resolve(str(path), None)
    config = kv.engine_config(loaded.config, parsed, serve.model_checks(parsed, loaded))
    (vector,) = [v for v in kv.table()["vectors"] if v["id"] == case_id]
    assert {key: config[key] for key in vector["config"]} == vector["config"]


def _model_dir(cache: Path, preset: str) -> Path:
    commit = make_model(cache, f"test/{preset}", preset=preset, suffix=None)
    return cache / f"models--test--{preset}" / "snapshots" / commit


@pytest.fixture
def start_double(
    double_src: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Any:
    """The double's real engine startup (config checks, workers, memory, KV lookup), in this process: the `uni`
    executors run the workers here instead of on Ray. Returns (log, vector) or raises what the engine raised."""
    from vllm.double import args as cli_args
    from vllm.double import kv, serve
    from vllm.double.model import resolve

    def start(argv: list[str], preset: str, **env: str) -> tuple[str, Any]:
        for name in ("VLLM_DOUBLE_GPU_MEMORY_GIB", "VLLM_DOUBLE_GPU_FREE_GIB", "VLLM_DOUBLE_OVERHEAD_GIB",
                     "VLLM_DOUBLE_NVML_MEMORY", "NCCL_DEBUG"):  # fmt: skip
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        argv = list(argv)
        argv[2] = str(_model_dir(tmp_path, preset))
        parsed = cli_args.build_parser().parse_args(cli_args.preprocess(argv[1:]))
        world = parsed.tensor_parallel_size * parsed.pipeline_parallel_size
        monkeypatch.setenv("VLLM_DOUBLE_LOCAL_GPUS", str(world))
        model = resolve(argv[2], None)
        max_len = serve.model_checks(parsed, model)
        config = kv.engine_config(model.config, parsed, max_len)
        kv.check_config(config)
        try:
            executor, vector = serve.start_engine(parsed, model, max_len, "uni", config)
            executor.shutdown()  # its rank 0 holds the store's port open
        finally:
            log = capsys.readouterr().out
        return log, vector

    return start


def _logged(log: str, message: str) -> bool:
    return re.search(rf"^\(EngineCore pid=\d+\) INFO [\d-]+ [\d:]+ \[kv_cache_utils\.py:\d+\] {re.escape(message)}$",
                     log, re.M) is not None  # fmt: skip


SERVED_SPECS = {
    "the default spec (test_engine_double's serving)": lambda: load_spec(),
    "tests/test_operator_cli.py's spec": lambda: parse_spec(OPERATOR_CLI_SPEC, "tests/test_operator_cli.py"),
    "molecule/site/cluster.yml": lambda: load_spec(REPO / "molecule" / "site" / "cluster.yml"),
    "examples/hy3-two-spark.yml": lambda: load_spec(REPO / "examples" / "hy3-two-spark.yml"),
    "examples/gpt-oss-single.yml": lambda: load_spec(REPO / "examples" / "gpt-oss-single.yml"),
}


@pytest.mark.parametrize("nvml", ["unsupported", "reported"])
@pytest.mark.parametrize("spec", list(SERVED_SPECS))
def test_served_specs_land_on_vllms_profile_vectors(start_double: Any, spec: str, nvml: str) -> None:
    """What the site and operator tests start: the profile's own command on a synthetic model with the profile's
    checkpoint size and the fake GPU's defaults. Each lands on vLLM's profile vector with the same memory, and the
    planner predicts the lines the double logs (from vLLM's data, not from the planner). The profiles render
    --max-num-batched-tokens 2048 explicitly, so whether NVML reports the GPU's memory (vLLM's default would be 8192)
    or not (2048) no longer changes the vector: both land on the 2048 one."""
    loaded = SERVED_SPECS[spec]()
    preset = "gpt-oss" if loaded.spec.model.arch.sliding_window else "hy3"
    argv = VllmEngine(loaded.spec).serve_argv()
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "2048"
    expected = {"hy3": "hy3-profile-gb10-nvml-unsupported", "gpt-oss": "gptoss120b-profile-gb10-nvml-unsupported"}[
        preset]
    log, vector = start_double(argv, preset, VLLM_DOUBLE_NVML_MEMORY=nvml)
    assert vector.id == expected
    case = VLLM_CASES[expected]
    gib = [f"Available KV cache memory: {b / 2**30:.2f} GiB" for b in case["inputs"]["available_kv_bytes_per_rank"]]
    assert [line.split("] ", 1)[1] for line in log.splitlines() if "Available KV cache memory" in line] == gib
    for line in case["vllm"]["lines"]:
        assert _logged(log, line), log
    assert _logged(log, f"hy3spark TEST DOUBLE: KV cache outcome recorded from vLLM 0.23.0 for this configuration "
                        f"(vector {expected} of tests/fixtures/vllm-0.23.0/kv-cases.json)")  # fmt: skip
    # The planner plans a DGX Spark (NVML cannot report the GB10's memory). molecule/site's spec declares the synthetic
    # model's size on disk (1 MB, for preflight's disk check), not the 181 GB its index carries: no prediction there.
    if nvml == "unsupported" and loaded.spec.model.size_bytes > 10**9:
        plan = planning.plan_for(loaded, planning.overhead_for(loaded, None, None))
        assert [plan.kv_cache_size_line, plan.max_concurrency_line] == case["vllm"]["lines"]


def test_the_site_memory_is_the_profile_vectors(double_src: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hy3 TP2 on the default fake GB10 (121.69 GiB, 0.90, 3.0 GiB overhead with --enforce-eager): 23,876,052,834 B."""
    from vllm.double import kv

    for name in ("VLLM_DOUBLE_GPU_MEMORY_GIB", "VLLM_DOUBLE_OVERHEAD_GIB"):
        monkeypatch.delenv(name, raising=False)
    memory = kv.Memory(gpu_memory_utilization=0.90, weights_per_rank=181_000_000_000 // 2, kv_cache_memory_bytes=None,
                       enforce_eager=True)  # fmt: skip
    inputs = VLLM_CASES["hy3-profile-tp2-mtp-fp8"]["inputs"]
    assert kv.available_bytes(memory) == inputs["available_kv_bytes_per_rank"][0] == 23_876_052_834
    assert kv.gpu_total_bytes() == inputs["device"]["total_memory_bytes"]


def test_a_kv_cache_too_small_for_one_request_fails_with_vllms_text(start_double: Any) -> None:
    """gpt-oss-120b with 1 GiB of KV cache (vector gptoss-too-little-memory): vLLM's ValueError, word for word."""
    argv = ["vllm", "serve", "MODEL", "--kv-cache-memory-bytes", "1G", "--max-num-batched-tokens", "8192"]
    with pytest.raises(ValueError) as raised:
        start_double(argv, "gpt-oss")
    assert str(raised.value) == VLLM_CASES["gptoss-too-little-memory"]["vllm"]["error"]["message"]
    assert "the estimated maximum model length is 20784." in str(raised.value)


def test_the_ray_scenarios_toy_model_has_no_vector(start_double: Any) -> None:
    """No vector, no numbers: the double refuses to start rather than invent a KV cache size."""
    from vllm.double import kv

    with pytest.raises(kv.NoVector) as refused:
        start_double(["vllm", "serve", "MODEL", "--max-model-len", "4096"], "small")
    message = str(refused.value)
    assert message.startswith("the vLLM test double has no vLLM 0.23.0 KV vector for architecture=LlamaForCausalLM, "
                              "num_hidden_layers=4, ")  # fmt: skip
    assert "max_model_len=4096, " in message and "max_num_batched_tokens=2048, " in message
    assert message.endswith(
        "add a case to tests/fixtures/vllm-0.23.0/kv-cases.json (made by running vLLM 0.23.0) "
        "and regenerate src/vllm/double/kv_vectors.json with tests/engine_double/make_kv_table.py"
    )


def test_mtp_with_pipeline_parallel_is_refused_before_the_engine_starts(start_double: Any) -> None:
    argv = [*_hy3_argv(), "--pipeline-parallel-size", "2"]
    with pytest.raises(NotImplementedError) as refused:
        start_double(argv, "hy3")
    assert f"NotImplementedError: {refused.value}" == VLLM_CASES["hy3-tp2-pp2-mtp-rejected"]["vllm"]["config_error"]


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
def serving_suffixed_model(port: str, reasoning: bool = True) -> Iterator[str]:
    """Hy3's released tokenizer (<think:opensource> ...) served on one node (TP 1, no Ray) with the hy_v3 parsers.

    The model has gpt-oss-120b's shape (vLLM recorded no one-GPU Hy3 case): 30 GiB of KV cache, max_model_len 100003
    and 8192 batched tokens are vLLM 0.23.0's vector gptoss-len100003-mnbt8192."""
    log = f"/tmp/suffixed-{port}.log"
    command = (
        f"exec vllm serve {HY3_SUFFIXED} --served-model-name hy3 --port {port} --max-model-len 100003 "
        "--max-num-batched-tokens 8192 --kv-cache-memory-bytes 30G "
        f"{'--reasoning-parser hy_v3 ' if reasoning else ''}--tool-call-parser hy_v3 "
        f"--enable-auto-tool-choice --trust-remote-code > {log} 2>&1"
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


def test_unpatched_hy_v3_parsers_fail_with_the_opensource_tokenizer(cluster: Cluster) -> None:
    """vLLM 0.23's bare-token parsers, at vLLM's paths, cannot find Hy3's tokens: the reasoning parser fails the
    startup (vLLM builds it while configuring the engine), the tool parser each chat request with tools."""
    for path in (TOOL_PARSER, REASONING_PARSER):
        source = docker("exec", HEAD, "cat", path).stdout
        assert "token_suffix" not in source
    assert (
        '        self.tool_calls_start_token: str = "<tool_calls>"\n' in docker("exec", HEAD, "cat", TOOL_PARSER).stdout
    )
    assert '        return "<think>"\n' in docker("exec", HEAD, "cat", REASONING_PARSER).stdout
    started = docker("exec", HEAD, "vllm", "serve", HY3_SUFFIXED, "--port", "8897", "--reasoning-parser", "hy_v3",
                     "--trust-remote-code", check=False)  # fmt: skip
    assert started.returncode == 1
    assert started.stderr.rstrip().endswith(
        "RuntimeError: HYV3ReasoningParser reasoning parser could not locate think start/end tokens in the tokenizer!"
    )
    with serving_suffixed_model("8899", reasoning=False) as url:
        status, body = chat(url, tools=TOOLS)
        assert status == 400
        assert body["error"]["message"] == (
            "HYV3 Tool parser could not locate tool call start/end tokens in the tokenizer!"
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
        "-e",
        f"VLLM_PORT={VLLM_PORT}",
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


def test_startup_lines_are_vllms_and_the_planner_predicts_them(serving: str) -> None:
    """The rendered default spec on two fake GB10s: vLLM 0.23.0's own lines for Hy3 TP2 + MTP, fp8 KV, 23,876,052,834
    available bytes per rank (vector hy3-profile-gb10-nvml-unsupported), and the planner's prediction equals them."""
    log = serve_log()
    vector = VLLM_CASES["hy3-profile-gb10-nvml-unsupported"]["vllm"]
    loaded = load_spec()
    plan = planning.plan_for(loaded, planning.overhead_for(loaded, None, None))
    engine_line = r"^\(EngineCore pid=\d+\) INFO [\d-]+ [\d:]+ \[kv_cache_utils\.py:\d+\] "
    for line in vector["lines"]:
        assert re.search(engine_line + re.escape(line) + "$", log, re.M), log
    assert [plan.kv_cache_size_line, plan.max_concurrency_line] == vector["lines"]
    assert "(vector hy3-profile-gb10-nvml-unsupported of tests/fixtures/vllm-0.23.0/kv-cases.json)" in log
    # Both ranks log it; Ray's log deduplication may fold the second copy into "[repeated 2x across cluster]".
    assert "Available KV cache memory: 22.24 GiB" in log
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


def test_vllms_internal_ports_listen_where_vllm_opens_them(serving: str) -> None:
    """VLLM_PORT set: rank 0 (on the head) serves the torch.distributed store on every address at VLLM_PORT, and its
    TP group spans both nodes, so its broadcast queue listens on the head's own address at the next free port; the
    worker node holds rank 1 and listens on none of them."""

    def listening(node: str) -> set[str]:
        return {line.split()[3] for line in docker("exec", node, "ss", "-ltnH").stdout.splitlines()}

    assert {f"0.0.0.0:{VLLM_PORT}", f"{HEAD_IP}:{VLLM_PORT + 1}"} <= listening(HEAD)
    assert not [a for a in listening(WORKER) if VLLM_PORT <= int(a.rsplit(":", 1)[1]) < VLLM_PORT + 8]
    _, raw = request(serving, "/double/workers", key=None)
    workers = {w["rank"]: w for w in json.loads(raw)["workers"]}
    assert [workers[r]["listening"] for r in (0, 1)] == [[f"0.0.0.0:{VLLM_PORT}", f"{HEAD_IP}:{VLLM_PORT + 1}"], []]
    # Several nodes: the init method names the driver's VLLM_HOST_IP (ray_executor.py), each rank logs it.
    assert f"distributed_init_method=tcp://{HEAD_IP}:{VLLM_PORT} backend=nccl" in serve_log()


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
