"""The TensorRT-LLM test double (tests/trtllm_double): its flag table and options file without Docker, then the
real thing: `mpirun ... trtllm-llmapi-launch trtllm-serve ...` across two containers of hy3spark/trtllm-serving
over SSH on the MPI port (2233), one rank per node, with pinned host keys.

The containers sit on a user network (not the host's), each with its own sshd (the per-cluster host key and
authorized key mounted from files this test makes, as the deployment role makes them) and its own hub cache.
mpirun runs in the first container, as the launcher role runs it on the head. Needs root and a Docker engine for
the second half; builds the image when this checkout's tag is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hy3spark import nccl

REPO = Path(__file__).resolve().parent.parent
DOUBLE = REPO / "tests" / "trtllm_double"
SRC = DOUBLE / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(REPO / "tests" / "engine_double"))
import docker_runs  # noqa: E402
from docker_runs import docker, require_docker_as_root  # noqa: E402
from make_model import make_model  # noqa: E402
from trtllm_double import cli, engine, options  # noqa: E402

# The source tree also holds the stand-in `tensorrt_llm`: keep it off the path of every other test.
sys.path.remove(str(SRC))

MODEL = "nvidia/Qwen3-235B-A22B-FP4"
HEAD_ONLY = "nvidia/only-on-the-head"
PORT = 8355
SSH_PORT = 2233
# NVIDIA's two-Spark playbook: the options file and the launch line (ENGINES.md, "TensorRT-LLM on two Sparks").
PLAYBOOK_OPTIONS = """\
print_iter_log: false
kv_cache_config:
  dtype: auto
  free_gpu_memory_fraction: 0.9
cuda_graph_config:
  enable_padding: true
"""
PLAYBOOK_ARGS = [MODEL, "--tp_size", "2", "--backend", "pytorch", "--max_num_tokens", "32768", "--max_batch_size",
                 "4", "--extra_llm_api_options", "/etc/trtllm/extra-llm-api-config.yml", "--port", str(PORT)]


def run_double(*argv: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """`trtllm-serve ARGV` as the image runs it (the double's package on the path), in a child Python."""
    return subprocess.run([sys.executable, "-m", "trtllm_double.serve", *argv], capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, "PYTHONPATH": str(SRC), **(env or {})})


def expected_text(model: str, prompt: str, count: int) -> str:
    seed = hashlib.sha256(f"{model}\0{prompt}".encode()).hexdigest()[:16]
    return " ".join(engine.word(seed, i) for i in range(count))


# --- without Docker: the flag table, the parser, the options file, one rank serving -----------------------------


def test_the_table_holds_the_flags_the_deployment_renders() -> None:
    table = cli.TABLE
    assert table["source"]["repository"] == "NVIDIA/TensorRT-LLM"
    assert table["source"]["path"] == "tensorrt_llm/commands/serve.py"
    assert len(table["source"]["commit"]) == 40
    by_opt = cli.OPTIONS
    expected = {
        "--tp_size": ("tensor_parallel_size", "int", 1), "--pp_size": ("pipeline_parallel_size", "int", 1),
        "--backend": ("backend", "choice", "pytorch"), "--max_num_tokens": ("max_num_tokens", "int", 8192),
        "--max_batch_size": ("max_batch_size", "int", 2048), "--max_seq_len": ("max_seq_len", "int", None),
        "--extra_llm_api_options": ("extra_llm_api_options", "str", None), "--port": ("port", "int", 8000),
        "--host": ("host", "str", "localhost"), "--log_level": ("log_level", "choice", "info"),
        "--trust_remote_code": ("trust_remote_code", "bool", False),
        "--kv_cache_free_gpu_memory_fraction": ("free_gpu_memory_fraction", "float", 0.9),
    }
    for opt, (dest, kind, default) in expected.items():
        option = by_opt[opt]
        assert (option["dest"], option["type"], option["default"]) == (dest, kind, default), opt
    assert [a["name"] for a in table["arguments"]] == ["model"]
    assert "--api_key" not in by_opt and "--api-key" not in by_opt  # trtllm-serve has none (TensorRT-LLM#9950)
    assert "--served_model_name" not in by_opt  # the model is served under its repository name


def test_make_flags_extracts_a_click_command(tmp_path: Path) -> None:
    """The extractor reads click decorators as click names them (first longest-prefix option is the dest)."""
    sys.path.insert(0, str(DOUBLE))
    try:
        import make_flags
    finally:
        sys.path.remove(str(DOUBLE))
    source = tmp_path / "serve.py"
    source.write_text(
        'import click\n\n@click.command("serve")\n@click.argument("model", type=str)\n'
        '@click.option("--free_gpu_memory_fraction", "--kv_cache_free_gpu_memory_fraction", type=float, '
        'default=0.9, help="x")\n'
        '@click.option("--config", "--extra_llm_api_options", "extra_llm_api_options", type=str, default=None)\n'
        '@click.option("--max_batch_size", type=int, default=BuildConfig.model_fields["max_batch_size"].default)\n'
        '@click.option("--trust_remote_code", is_flag=True, default=False)\n'
        "def serve(**kw):\n    pass\n")
    table = json.loads(make_flags.render(source.read_text(), "0" * 40))
    assert [(o["opts"], o["dest"], o["default"]) for o in table["options"]] == [
        (["--free_gpu_memory_fraction", "--kv_cache_free_gpu_memory_fraction"], "free_gpu_memory_fraction", 0.9),
        (["--config", "--extra_llm_api_options"], "extra_llm_api_options", None),
        (["--max_batch_size"], "max_batch_size", 2048),
        (["--trust_remote_code"], "trust_remote_code", False),
    ]
    source.write_text(source.read_text().replace("default=0.9", "default=Unknown.value"))
    with pytest.raises(SystemExit, match=r"unknown expression 'Unknown\.value'"):
        make_flags.render(source.read_text(), "0" * 40)


def test_the_playbook_command_parses() -> None:
    args = cli.parse(PLAYBOOK_ARGS)
    assert args["model"] == MODEL
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"]) == (2, 1)
    assert (args["max_num_tokens"], args["max_batch_size"], args["port"]) == (32768, 4, PORT)
    assert args["extra_llm_api_options"] == "/etc/trtllm/extra-llm-api-config.yml"
    assert args["host"] == "localhost" and args["log_level"] == "info"
    assert cli.parse(["serve", *PLAYBOOK_ARGS]) == args  # the group's default command, named or not


@pytest.mark.parametrize(("argv", "value"), [
    (["m", "--config", "o.yml"], ("extra_llm_api_options", "o.yml")),
    (["m", "--kv_cache_free_gpu_memory_fraction", "0.8"], ("free_gpu_memory_fraction", 0.8)),
    (["m", "--free_gpu_memory_fraction=0.7"], ("free_gpu_memory_fraction", 0.7)),
    (["m", "--backend", "trt"], ("backend", "tensorrt")),
    (["--tp_size", "2", "m", "--tp_size", "4"], ("tensor_parallel_size", 4)),
    (["m", "--trust_remote_code"], ("trust_remote_code", True)),
    (["m", "--log_level", "debug"], ("log_level", "debug")),
    (["--", "-odd-name"], ("model", "-odd-name")),
])
def test_click_forms(argv: list[str], value: tuple[str, Any]) -> None:
    assert cli.parse(argv)[value[0]] == value[1]


@pytest.mark.parametrize(("argv", "message"), [
    (["m", "--tensor-parallel-size", "2"], "No such option: --tensor-parallel-size (Possible options: "
                                           "--context_parallel_size, --pipeline_parallel_size, "
                                           "--tensor_parallel_size)"),
    (["m", "--tp-size", "2"], "No such option: --tp-size (Possible options: --ep_size, --pp_size, --tp_size)"),
    (["m", "--trust_remote"], "No such option: --trust_remote Did you mean --trust_remote_code?"),
    (["m", "--api_key", "k"], "No such option: --api_key"),
    (["m", "--port", "abc"], "Invalid value for '--port': 'abc' is not a valid integer."),
    (["m", "--tp_size", "two"], "Invalid value for '--tensor_parallel_size' / '--tp_size': 'two' is not a valid "
                                "integer."),
    (["m", "--backend", "vllm"], "Invalid value for '--backend': 'vllm' is not one of 'pytorch', 'tensorrt', "
                                 "'_autodeploy'."),
    (["m", "--trust_remote_code=1"], "Option '--trust_remote_code' does not take a value."),
    (["m", "--port"], "Option '--port' requires an argument."),
    (["--tp_size", "2"], "Missing argument 'MODEL'."),
    (["m", "n"], "Got unexpected extra argument (n)"),
])
def test_click_errors(argv: list[str], message: str) -> None:
    with pytest.raises(cli.UsageError) as caught:
        cli.parse(argv)
    assert str(caught.value) == message


def test_the_command_exits_2_with_clicks_usage() -> None:
    result = run_double(MODEL, "--tp_size", "2", "--max_num_tokes", "8")
    assert result.returncode == 2
    assert result.stderr == ("Usage: trtllm-serve serve [OPTIONS] MODEL\nTry 'trtllm-serve serve --help' for help.\n"
                             "\nError: No such option: --max_num_tokes Did you mean --max_num_tokens?\n")
    assert result.stdout == ""
    helped = run_double("--help")
    assert helped.returncode == 0 and "--kv_cache_free_gpu_memory_fraction FLOAT" in helped.stdout


def test_the_playbook_options_are_valid_and_replace_the_flags_section() -> None:
    import yaml

    extra = yaml.safe_load(PLAYBOOK_OPTIONS)
    assert options.validate(extra) == []
    merged, replaced = options.merged(cli.parse([MODEL, "--kv_cache_free_gpu_memory_fraction", "0.5"]), extra)
    assert merged["kv_cache_config"] == {"dtype": "auto", "free_gpu_memory_fraction": 0.9}
    assert merged["cuda_graph_config"] == {"enable_padding": True} and merged["print_iter_log"] is False
    assert replaced == ["kv_cache_config", "cuda_graph_config"]


@pytest.mark.parametrize(("extra", "where", "message"), [
    ({"print_iter_logs": False}, "print_iter_logs", "Extra inputs are not permitted [type=extra_forbidden"),
    ({"max_num_seqs": 4}, "max_num_seqs", "Extra inputs are not permitted"),  # vLLM's name, not TensorRT-LLM's
    ({"kv_cache_config": {"free_gpu_memory_fraction": 1.5}}, "kv_cache_config.free_gpu_memory_fraction",
     "must be a float between 0 and 1"),
    ({"kv_cache_config": {"free_gpu_memory_fraction": "most"}}, "kv_cache_config.free_gpu_memory_fraction",
     "Input should be a valid number"),
    ({"kv_cache_config": {"gpu_memory_utilization": 0.9}}, "kv_cache_config.gpu_memory_utilization",
     "Extra inputs are not permitted"),
    ({"kv_cache_config": {"dtype": "fp16"}}, "kv_cache_config.dtype", "Input should be 'auto', 'fp8', 'nvfp4'"),
    ({"cuda_graph_config": {"enable_padding": "yes"}}, "cuda_graph_config.enable_padding",
     "Input should be a valid boolean"),
    ({"cuda_graph_config": {"padding": True}}, "cuda_graph_config.padding", "Extra inputs are not permitted"),
    ({"print_iter_log": "no"}, "print_iter_log", "Input should be a valid boolean"),
    ({"kv_cache_config": 0.9}, "kv_cache_config", "Input should be a valid dictionary"),
])
def test_options_errors_name_the_field(extra: dict[str, Any], where: str, message: str) -> None:
    problems = options.validate(extra)
    assert len(problems) == 1
    assert problems[0].startswith(f"{where}\n  ") and message in problems[0]


def test_a_bad_options_file_fails_the_start_with_pydantics_error(tmp_path: Path) -> None:
    path = tmp_path / "extra.yml"
    path.write_text(PLAYBOOK_OPTIONS + "enable_paddng: true\nkv_cache_config_typo: {}\n")
    result = run_double(MODEL, "--extra_llm_api_options", str(path))
    assert result.returncode == 1
    assert "ValidationError: 2 validation errors for TorchLlmArgs\nenable_paddng\n  Extra inputs are not " \
           "permitted" in result.stderr
    assert "Uvicorn running" not in result.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 10) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def wait_http(url: str, deadline_s: float, alive: Any = None) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if http(url, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        if alive is not None and not alive():
            break
        time.sleep(0.3)
    pytest.fail(f"{url} did not answer 200 in {deadline_s} s")


def test_one_rank_serves_without_a_launcher(tmp_path: Path) -> None:
    """No mpirun: one rank in trtllm-serve's own process (tp 1); tp 2 is refused there."""
    hub = tmp_path / "hub"
    make_model(hub, MODEL, preset="small", total_size=10**9)
    env = {"HF_HUB_CACHE": str(hub)}
    refused = run_double(MODEL, "--tp_size", "2", "--port", str(free_port()), env=env)
    assert refused.returncode == 1 and "tp_size * pp_size = 2 needs 2 GPUs" in refused.stderr
    missing = run_double("nvidia/not-cached", "--port", str(free_port()), env=env)
    assert missing.returncode == 1 and "is not in the local Hugging Face cache" in missing.stderr
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trtllm_double.serve", MODEL, "--port", str(port)],
                            env={**os.environ, "PYTHONPATH": str(SRC), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health", 20, alive=lambda: proc.poll() is None)
        status, body = http(f"{base}/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [MODEL]
        status, body = http(f"{base}/v1/completions", {"model": MODEL, "prompt": "two sparks", "max_tokens": 7})
        reply = json.loads(body)
        assert reply["choices"][0]["text"] == expected_text(MODEL, "two sparks", 7)
        assert reply["usage"] == {"prompt_tokens": 2, "completion_tokens": 7, "total_tokens": 9}
        assert http(f"{base}/version")[1] == json.dumps({"version": "1.2.0rc6+testdouble"}).encode()
        assert http(f"{base}/v1/nothing")[0] == 404
        assert http(f"{base}/v1/models", {"x": 1})[0] == 405
        assert http(f"{base}/v1/completions", {"max_tokens": 3})[0] == 400
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert f"INFO:     Uvicorn running on http://localhost:{port} (Press CTRL+C to quit)" in err
    assert "INFO:     Finished server process" in err
    assert "[TensorRT-LLM][INFO] MPI size: 1, MPI local size: 1, rank: 0" in out


# --- with Docker: two nodes, real Open MPI over SSH ----------------------------------------------------------------

RUN = f"trtllm-double-{os.getpid()}"
LABEL = "org.hy3spark.test=trtllm-double"
SUBNETS = [f"10.250.{third}.0/24" for third in range(140, 160)]
HUB = "/var/lib/hy3spark/hub"
MPI_DIR = "/etc/hy3spark/mpi"  # the head's client side: key, known_hosts, hostfile, options


def remove_leftovers() -> None:
    """This run's containers and network, and those of earlier runs whose pytest is gone."""
    docker_runs.remove_leftovers("trtllm-double", LABEL)


@dataclass
class Pair:
    image: str
    head: str
    worker: str
    head_ip: str
    worker_ip: str
    tmp: Path

    def mpirun(self, *launch: str, known_hosts: str = "known_hosts", extra: tuple[str, ...] = (),
               passed: tuple[str, ...] = ("HF_HUB_CACHE", "NCCL_DEBUG", "NCCL_IB_HCA")) -> str:
        """The launch line as the head runs it: the hostfile, one rank per node, ssh on the MPI port with the
        cluster key and the pinned host keys (no StrictHostKeyChecking=no), variables passed by name."""
        rsh = (f"-p {SSH_PORT} -i {MPI_DIR}/id_ed25519 -o UserKnownHostsFile={MPI_DIR}/{known_hosts} "
               "-o BatchMode=yes -o ConnectTimeout=10")
        words = ["mpirun", "--hostfile", f"{MPI_DIR}/hostfile", "-np", "2", "--map-by", "ppr:1:node",
                 "-mca", "plm_rsh_args", rsh, "-mca", "btl_tcp_if_include", "eth0",
                 *(word for name in passed for word in ("-x", name)), *extra,
                 "trtllm-llmapi-launch", "trtllm-serve", *launch]
        return " ".join(f"'{w}'" if " " in w or w.startswith("-p ") else w for w in words)

    def run(self, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return docker("exec", self.head, "bash", "-c", command, check=False, timeout=timeout)


def keypair(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    require_docker_as_root("the image build runs debootstrap")
    if shutil.which("ssh-keygen") is None:
        pytest.skip("needs ssh-keygen (openssh-client) to make the cluster's keys")
    built = subprocess.run([str(DOUBLE / "build-image")], capture_output=True, text=True, timeout=900, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    image = built.stdout.strip().splitlines()[-1]
    tmp = tmp_path_factory.mktemp("trtllm-double")
    remove_leftovers()
    head_ip, worker_ip = docker_runs.create_network(RUN, LABEL, SUBNETS)
    client = tmp / "client"
    client.mkdir()
    keypair(client / "id_ed25519", "hy3spark-mpi")
    pins = []
    for name, ip in (("head", head_ip), ("worker", worker_ip)):
        node = tmp / name
        node.mkdir()
        keypair(node / "ssh_host_ed25519_key", f"{RUN}-{name}")
        shutil.copy(client / "id_ed25519.pub", node / "authorized_keys")
        key = " ".join((node / "ssh_host_ed25519_key.pub").read_text().split()[:2])
        pins.append(f"[{ip}]:{SSH_PORT} {key}\n")
    (client / "known_hosts").write_text("".join(pins))
    (client / "known_hosts.head-only").write_text(pins[0])
    (client / "hostfile").write_text(f"{head_ip} slots=1\n{worker_ip} slots=1\n")
    (client / "extra-llm-api-config.yml").write_text(PLAYBOOK_OPTIONS)
    (client / "bad-options.yml").write_text("kv_cache_config:\n  free_gpu_memory_fraction: 0.9\nbogus_key: 1\n")
    for name in ("head", "worker"):
        make_model(tmp / f"hub-{name}", MODEL, preset="small", total_size=10**9)
    make_model(tmp / "hub-head", HEAD_ONLY, preset="small", total_size=10**9)
    names = {"head": f"{RUN}-head", "worker": f"{RUN}-worker"}
    try:
        for name, ip in (("head", head_ip), ("worker", worker_ip)):
            docker(
                "run", "-d", "--name", names[name], "--hostname", names[name], "--label", LABEL, "--network", RUN,
                "--ip", ip, "-e", f"HF_HUB_CACHE={HUB}", "-e", "NCCL_DEBUG=INFO",
                "-e", "NCCL_IB_HCA==rocep1s0f1,roceP2p1s0f1",
                "-v", f"{tmp / name}:/etc/trtllm-ssh:ro", "-v", f"{tmp / f'hub-{name}'}:{HUB}:ro",
                *(["-v", f"{client}:{MPI_DIR}:ro"] if name == "head" else []),
                image, "trtllm-double-sshd",
            )  # fmt: skip
        for name in names.values():
            deadline = time.monotonic() + 30
            while "Server listening" not in docker("logs", name, check=False).stderr:
                assert time.monotonic() < deadline, docker("logs", name, check=False).stderr
                time.sleep(0.3)
        yield Pair(image, names["head"], names["worker"], head_ip, worker_ip, tmp)
    finally:
        remove_leftovers()


def test_host_keys_are_pinned(pair: Pair) -> None:
    """An unpinned node is refused: mpirun cannot start its daemon there, and says which host."""
    result = pair.run(pair.mpirun(MODEL, "--tp_size", "2", known_hosts="known_hosts.head-only"), timeout=60)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "Host key verification failed" in output
    assert "ORTE was unable to reliably start one or more daemons" in output
    assert "Uvicorn running" not in output


def test_ranks_that_cannot_meet_fail_loudly(pair: Pair) -> None:
    """MPI's own traffic pinned to the loopback: the ranks never meet, each says so, and the job aborts."""
    command = pair.mpirun(MODEL, "--tp_size", "2", extra=("-x", "TRTLLM_DOUBLE_JOIN_TIMEOUT_S=4"))
    result = pair.run(command.replace("btl_tcp_if_include eth0", "btl_tcp_if_include lo"), timeout=90)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert f"[RANK 1] [E] rank 1 on {pair.worker} could not join the other 1 rank(s)" in output
    assert "MPI_ABORT was invoked" in output
    assert "Uvicorn running" not in output


def test_a_rank_without_the_model_fails_the_start_naming_its_node(pair: Pair) -> None:
    result = pair.run(pair.mpirun(HEAD_ONLY, "--tp_size", "2", "--port", str(PORT)), timeout=90)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert f"RuntimeError: Executor worker returned error: rank 1 on {pair.worker}: {HEAD_ONLY} (revision main) " \
           f"is not in the local Hugging Face cache {HUB} on host {pair.worker}" in output
    assert "Uvicorn running" not in output


def test_rank_1_dying_at_start_ends_the_job(pair: Pair) -> None:
    """The planted fault (a file in the worker's container): rank 1 dies while loading; mpirun ends the job."""
    docker("exec", pair.worker, "bash", "-c", "mkdir -p /run/trtllm-double && touch /run/trtllm-double/die-at-start")
    try:
        result = pair.run(pair.mpirun(MODEL, "--tp_size", "2", "--port", str(PORT)), timeout=90)
    finally:
        docker("exec", pair.worker, "rm", "-f", "/run/trtllm-double/die-at-start")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert f"[RANK 1] [E] hy3spark TEST DOUBLE: rank 1 on {pair.worker} dies at start" in output
    assert "Uvicorn running" not in output
    assert "trtllm_double" not in docker("exec", pair.head, "ps", "-eo", "args").stdout


def test_a_bad_options_file_stops_the_job(pair: Pair) -> None:
    result = pair.run(pair.mpirun(MODEL, "--tp_size", "2", "--extra_llm_api_options",
                                  f"{MPI_DIR}/bad-options.yml"), timeout=90)
    assert result.returncode != 0
    assert "1 validation error for TorchLlmArgs\nbogus_key\n  Extra inputs are not permitted" in result.stderr


def wait_for_file(pair: Pair, path: str, deadline_s: float, log: str) -> None:
    deadline = time.monotonic() + deadline_s
    while pair.run(f"test -e {path}").returncode != 0:
        assert time.monotonic() < deadline, pair.run(f"cat {log}").stdout
        time.sleep(0.3)


def test_only_what_mpirun_passes_reaches_the_other_rank_and_sigterm_stops_the_job(pair: Pair) -> None:
    """The worker's container has NCCL_IB_HCA, but its rank is started over SSH: without `-x NCCL_IB_HCA` it never
    sees it and NCCL falls back to sockets there (the transport gate says so). SIGTERM to mpirun stops everything."""
    port = PORT + 1
    launch = pair.mpirun(MODEL, "--tp_size", "2", "--host", "0.0.0.0", "--port", str(port),
                         passed=("HF_HUB_CACHE", "NCCL_DEBUG"))
    docker("exec", "-d", pair.head, "bash", "-c", f"{launch} >/tmp/env.log 2>&1; echo $? >/tmp/env.rc")
    wait_http(f"http://{pair.head_ip}:{port}/health", 60,
              alive=lambda: pair.run("test -e /tmp/env.rc").returncode != 0)
    report = nccl.parse_logs([pair.run("cat /tmp/env.log").stdout])
    by_host = {rank.hostname: rank for rank in report.ranks}
    assert set(by_host) == {pair.head, pair.worker}
    assert {(c.src_host, c.transport) for c in report.channels if c.direction == "send"} == {
        (pair.head, nccl.Transport.IB_GDRDMA), (pair.worker, nccl.Transport.SOCKET)}
    result = nccl.gate(report)
    assert not result.passed and "NET/Socket" in result.failures[0]

    mpirun = docker("exec", pair.head, "pgrep", "-x", "mpirun").stdout.split()
    assert len(mpirun) == 1
    docker("exec", pair.head, "kill", "-TERM", mpirun[0])
    wait_for_file(pair, "/tmp/env.rc", 30, "/tmp/env.log")
    text = pair.run("cat /tmp/env.log").stdout
    assert "INFO:     Application shutdown complete." in text
    for node in (pair.head, pair.worker):
        left = docker("exec", node, "ps", "-eo", "args").stdout
        assert "trtllm_double" not in left and "orted" not in left, (node, left)


def test_two_ranks_serve_and_a_dead_rank_takes_the_server_down(pair: Pair) -> None:
    launch = [*PLAYBOOK_ARGS, "--host", "0.0.0.0"]
    launch[launch.index("--extra_llm_api_options") + 1] = f"{MPI_DIR}/extra-llm-api-config.yml"
    docker("exec", "-d", pair.head, "bash", "-c",
           f"{pair.mpirun(*launch)} >/tmp/serve.log 2>&1; echo $? >/tmp/serve.rc")
    base = f"http://{pair.head_ip}:{PORT}"

    def log() -> str:
        return docker("exec", pair.head, "cat", "/tmp/serve.log", check=False).stdout

    try:
        wait_http(f"{base}/health", 60, alive=lambda: pair.run("test -e /tmp/serve.rc").returncode != 0)
    except BaseException:
        print(log())
        raise
    # Each rank on its own node: rank 0's leader and the server on the head, rank 1's worker on the other node.
    head_ps = docker("exec", pair.head, "ps", "-eo", "args").stdout
    worker_ps = docker("exec", pair.worker, "ps", "-eo", "args").stdout
    assert "python3 -m trtllm_double.launch trtllm-serve" in head_ps and "trtllm_double.serve" in head_ps
    assert "python3 -m trtllm_double.launch trtllm-serve" in worker_ps and "trtllm_double.serve" not in worker_ps
    assert "orted" in worker_ps  # started by mpirun over SSH

    status, body = http(f"{base}/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [MODEL]
    status, body = http(f"{base}/v1/completions", {"model": MODEL, "prompt": "one endpoint", "max_tokens": 9})
    assert status == 200
    assert json.loads(body)["choices"][0]["text"] == expected_text(MODEL, "one endpoint", 9)
    request = urllib.request.Request(
        f"{base}/v1/chat/completions", headers={"content-type": "application/json"},
        data=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                         "stream": True, "stream_options": {"include_usage": True}}).encode())
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text.split()) == 5 and chunks[-1]["usage"]["completion_tokens"] == 5

    text = log()
    for line in ("mpi_rank: 0", "mpi_rank: 1", "tllm_mpi_size: 2", "rank1 run mgmn worker node with mpi_world_size: 2",
                 "rank0 run mgmn leader node with mpi_world_size: 2", f"rank0 host: {pair.head}",
                 f"MPI session of 2 rank(s) on 2 node(s): {pair.head}, {pair.worker}",
                 "[TensorRT-LLM][INFO] MPI size: 2, MPI local size: 1, rank: 0",
                 "[TensorRT-LLM][INFO] MPI size: 2, MPI local size: 1, rank: 1",
                 "Using RemoteMpiCommSessionClient to bind to external MPI processes at tcp://127.0.0.1:",
                 "Overriding kv_cache_config", "for max tokens in paged KV cache",
                 f"INFO:     Uvicorn running on http://0.0.0.0:{PORT} (Press CTRL+C to quit)"):
        assert line in text, line
    # NCCL's lines from both ranks (passed with -x, as the rank on the other node sees only what mpirun passes).
    report = nccl.parse_logs([text])
    assert sorted((r.rank, r.hostname, r.nnodes) for r in report.ranks) == [(0, pair.head, 2), (1, pair.worker, 2)]
    assert report.hosts == {pair.head, pair.worker} and all(c.inter_node for c in report.channels)
    assert nccl.gate(report).passed, nccl.gate(report).failures

    pid = docker("exec", pair.worker, "pgrep", "-f", "trtllm_double.launch").stdout.split()[0]
    killed = time.monotonic()
    docker("exec", pair.worker, "kill", "-KILL", pid)
    deadline = killed + 30
    while time.monotonic() < deadline:
        try:
            http(f"{base}/health", timeout=1)
        except OSError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the server still answers 30 s after rank 1 died:\n{log()}")
    down = time.monotonic() - killed
    wait_for_file(pair, "/tmp/serve.rc", 30, "/tmp/serve.log")
    assert pair.run("cat /tmp/serve.rc").stdout.strip() != "0"
    assert f"mpirun noticed that process rank 1 with PID {pid} on node {pair.worker_ip} exited on signal 9" in log()
    assert "trtllm_double" not in docker("exec", pair.head, "ps", "-eo", "args").stdout
    print(f"the server went down {down:.1f} s after rank 1 was killed")
