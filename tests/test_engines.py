"""The engine seam (hy3spark/engines): what each engine answers, checked against the real engine's own output."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path

import pytest
import yaml

from hy3spark.context import build_context
from hy3spark.engines import ENGINES, engine_for, engine_front
from hy3spark.spec import SERVING_SECTIONS, load_spec

REPO = Path(__file__).resolve().parent.parent
KV_FIXTURE = REPO / "tests" / "fixtures" / "vllm-0.23.0" / "kv-cases.json"


def test_every_engine_has_a_serving_section_and_the_reverse() -> None:
    assert set(ENGINES) == set(SERVING_SECTIONS)


def test_vllms_log_patterns_read_the_lines_vllm_0_23_logged() -> None:
    # Every KV-cache and concurrency line of the recorded vectors (what vLLM 0.23.0 itself printed) is matched, and
    # the numbers read from it are the ones in the line.
    engine = engine_for(load_spec().spec)
    kv, concurrency = (re.compile(engine.log_lines()[k]) for k in ("kv_cache", "concurrency"))
    lines = [line for case in json.loads(KV_FIXTURE.read_text())["cases"] for line in case["vllm"].get("log", [])]
    kv_lines = [line for line in lines if "GPU KV cache size" in line]
    concurrency_lines = [line for line in lines if "Maximum concurrency" in line]
    assert len(kv_lines) >= 20 and len(concurrency_lines) >= 20
    for line in kv_lines:
        match = kv.search(line)
        assert match and f"GPU KV cache size: {match.group(1)} tokens" in line, line
    for line in concurrency_lines:
        match = concurrency.search(line)
        assert match and line.endswith(f"{match.group(1)} tokens per request: {match.group(2)}x"), line
    assert not any(kv.search(line) for line in concurrency_lines)


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.yml")))
def test_the_context_publishes_the_engine_as_the_engine_answers(example: str) -> None:
    loaded = load_spec(REPO / "examples" / example)
    engine = engine_for(loaded.spec)
    published = build_context(loaded)["hy3spark"]
    assert published["engine"] == {"name": engine.name, "launcher": engine.launcher, "process": engine.process(),
                                   "log_lines": engine.log_lines()}
    assert published["secrets"] == engine.secret_env()
    assert published["serving"]["argv"] == engine.serve_argv()
    # The serving role recognises the engine as roles/vllm_serve/files/engine.py does: an argv word named `exe`
    # followed by `arg`, anywhere in the command line (vLLM's starts with it; TensorRT-LLM's follows mpirun's own).
    argv, process = published["serving"]["argv"], engine.process()
    assert any(word == process["exe"] and argv[i + 1:i + 2] == [process["arg"]] for i, word in enumerate(argv))


def test_vllm_reads_each_secret_from_the_variable_the_spec_names() -> None:
    loaded = load_spec(REPO / "examples" / "hy3-two-spark.yml")
    spec = loaded.spec
    assert engine_for(spec).secret_env() == {"VLLM_API_KEY": spec.serving.api_key_env, "HF_TOKEN": spec.model.token_env}
    public = spec.model_copy(update={"model": spec.model.model_copy(update={"token_env": None})})
    assert engine_for(public).secret_env() == {"VLLM_API_KEY": spec.serving.api_key_env}


def test_each_nodes_env_carries_its_own_address_and_the_shared_settings() -> None:
    loaded = load_spec(REPO / "examples" / "hy3-two-spark.yml")
    nodes = build_context(loaded)["nodes"]
    for node in loaded.spec.nodes:
        env = nodes[node.name]["env"]
        assert env["VLLM_HOST_IP"] == str(node.fabric_ip.ip)
        assert env["MASTER_ADDR"] == str(loaded.spec.head.fabric_ip.ip)
        assert env["VLLM_CONFIG_ROOT"] == build_context(loaded)["hy3spark"]["paths"]["vllm_config_root"]


def test_the_status_endpoint_is_the_clients_url_honouring_serving_host() -> None:
    from hy3spark.context import client_url, probe_url

    loaded = load_spec(REPO / "examples" / "hy3-two-spark.yml")
    spec = loaded.spec
    head_ip, port = str(spec.head.fabric_ip.ip), spec.serving.port
    assert str(spec.serving.host) == "0.0.0.0"
    assert (client_url(spec), probe_url(spec)) == (f"http://{head_ip}:{port}/v1", f"http://127.0.0.1:{port}")
    host = ipaddress.IPv4Address("192.168.1.10")
    bound = spec.model_copy(update={"serving": spec.serving.model_copy(update={"host": host})})
    assert (client_url(bound), probe_url(bound)) == (f"http://192.168.1.10:{port}/v1", f"http://192.168.1.10:{port}")


# --- TensorRT-LLM (issue 12): trtllm-serve under the mpi launcher --------------------------------------------------
TRTLLM_EXAMPLE = REPO / "examples" / "pair-trtllm-235b.yml"


def test_trtllm_launches_through_mpirun_on_the_head_only() -> None:
    loaded = load_spec(TRTLLM_EXAMPLE)
    engine = engine_for(loaded.spec)
    assert (engine.name, engine.launcher, engine.launchers) == ("trtllm", "mpi", ("mpi",))
    argv = engine.serve_argv()
    assert engine.node_argv(0) == argv and engine.node_argv(1) == [], "mpirun starts the worker's rank over SSH"
    launch = argv.index("trtllm-llmapi-launch")
    assert argv[:4] == ["mpirun", "--mca", "plm_rsh_args", "-p 2233 -F /etc/hy3spark/mpi/ssh_config"]
    assert argv[launch:] == [
        "trtllm-llmapi-launch", "trtllm-serve", "nvidia/Qwen3-235B-A22B-FP4", "--revision", "main", "--tp_size", "2",
        "--backend", "pytorch", "--max_num_tokens", "32768", "--max_batch_size", "4", "--max_seq_len", "32768",
        "--extra_llm_api_options", "/etc/hy3spark/engine-options.yml", "--port", "8356", "--host", "127.0.0.1"]
    # -x NAME: names only, the secrets' last (their values come from the serve script's 0600 file); the API front's
    # key is no rank's.
    passed = [argv[i + 1] for i in range(4, launch, 2)]
    assert argv[4:launch:2] == ["-x"] * len(passed) and passed[-1] == "HF_TOKEN"
    assert not [n for n in passed if "=" in n or n.startswith("OMPI_")] and "HY3SPARK_API_KEY" not in passed


def test_trtllm_node_env_is_open_mpis_and_the_fabrics() -> None:
    loaded = load_spec(TRTLLM_EXAMPLE)
    nodes = build_context(loaded)["nodes"]
    for name in ("spark-a", "spark-b"):
        env = nodes[name]["env"]
        for key in ("UCX_NET_DEVICES", "NCCL_SOCKET_IFNAME", "OMPI_MCA_btl_tcp_if_include"):
            assert env[key] == "enp1s0f1np1", f"{name}: {key} is the fabric netdev"
        assert env["OMPI_MCA_orte_default_hostfile"] == "/etc/openmpi-hostfile"
        assert env["OMPI_MCA_rmaps_ppr_n_pernode"] == "1"
        assert env["NCCL_IB_HCA"] == "=rocep1s0f1,roceP2p1s0f1"
        assert not [k for k in env if k.startswith(("VLLM_", "RAY_"))] and "HF_TOKEN" not in env


def test_trtllm_reads_the_hub_token_and_its_api_front_the_key() -> None:
    """trtllm-serve checks no key (NVIDIA/TensorRT-LLM#9950): the API front reads it, from HY3SPARK_API_KEY in the
    secrets file, answers on serving.port and forwards to trtllm-serve on 127.0.0.1:serving.port + 1."""
    spec = load_spec(TRTLLM_EXAMPLE).spec
    engine = engine_for(spec)
    assert engine.secret_env() == {"HY3SPARK_API_KEY": "HY3SPARK_API_KEY", "HF_TOKEN": "HF_TOKEN"}
    assert engine_front(engine) == {
        "argv": ["python3", "/etc/hy3spark/api-front.py", "--listen", "0.0.0.0:8355", "--upstream", "127.0.0.1:8356",
                 "--key-env", "HY3SPARK_API_KEY"],
        "key_env": "HY3SPARK_API_KEY", "engine_port": 8356}
    serving = spec.serving.model_copy(update={"api_key_env": None, "open_endpoint": True})
    public = spec.model_copy(update={"model": spec.model.model_copy(update={"token_env": None}), "serving": serving})
    open_engine = engine_for(public)
    assert open_engine.secret_env() == {} and engine_front(open_engine) is None
    argv = open_engine.serve_argv()
    assert "HF_TOKEN" not in argv and argv[-4:] == ["--port", "8355", "--host", "0.0.0.0"]
    assert engine_front(engine_for(load_spec(None).spec)) is None  # vLLM checks its key itself


def test_trtllm_publishes_its_options_and_the_mpi_launcher_its_hosts() -> None:
    group = build_context(load_spec(TRTLLM_EXAMPLE))["hy3spark"]
    assert group["engine_options"] == {"cuda_graph_config": {"enable_padding": True},
                                       "kv_cache_config": {"dtype": "auto", "free_gpu_memory_fraction": 0.9},
                                       "print_iter_log": False}
    assert group["mpi"] == {"port": 2233, "hosts": ["10.0.0.1", "10.0.0.2"],
                            "hostfile": "/etc/hy3spark/openmpi-hostfile", "container_hostfile": "/etc/openmpi-hostfile",
                            "dir": "/etc/hy3spark/mpi", "sshd_config": "/etc/hy3spark/mpi/sshd_config",
                            "ssh_config": "/etc/hy3spark/mpi/ssh_config",
                            "host_key": "/etc/hy3spark/mpi/ssh_host_ed25519_key",
                            "client_key": "/etc/hy3spark/mpi/id_ed25519",
                            "known_hosts": "/etc/hy3spark/mpi/known_hosts",
                            "authorized_keys": "/etc/hy3spark/mpi/authorized_keys"}
    assert group["serving"]["served_name"] == "nvidia/Qwen3-235B-A22B-FP4" == group["pi_settings"]["defaultModel"]
    assert group["plan"]["kv_cache_tokens"] is None and "models vLLM only" in group["plan"]["warnings"][0]
    vllm = build_context(load_spec(REPO / "examples" / "hy3-two-spark.yml"))["hy3spark"]
    assert vllm["engine_options"] is None and vllm["mpi"] is None


def test_trtllm_kv_cache_line_pattern() -> None:
    # TensorRT-LLM's KV cache manager's line (the double, tests/trtllm_double/, is to record the pinned image's own).
    pattern = re.compile(engine_for(load_spec(TRTLLM_EXAMPLE).spec).log_lines()["kv_cache"])
    line = "[TensorRT-LLM][INFO] [MemUsageChange] Allocated 52.31 GiB for max tokens in paged KV cache (1071232)."
    match = pattern.search(line)
    assert match and match.group(1) == "1071232"


def test_trtllms_option_table_names_its_source_and_every_option_it_refuses() -> None:
    from hy3spark.engines import trtllm

    table = trtllm.table()
    assert table["source"]["repo"] == "NVIDIA/TensorRT-LLM" and len(table["source"]["commit"]) == 40
    assert table["trtllm_image"] == load_spec(TRTLLM_EXAMPLE).spec.image.ref
    dests = {o["dest"] for o in table["options"]}
    assert (set(trtllm.OWNED) - {"model"}) | trtllm.LAUNCHER | set(trtllm.OTHER) <= dests
    assert trtllm.check(["--tp_size", "2"]) and trtllm.check(["--log_level", "debug"]) == []


def test_plan_says_it_plans_vllm_only(capsys: pytest.CaptureFixture[str]) -> None:
    from hy3spark.cli import main

    assert main(["plan", str(TRTLLM_EXAMPLE)]) != 0
    err = capsys.readouterr().err
    assert "hy3spark's capacity planner models vLLM only, and serving.engine is trtllm" in err
    assert "Traceback" not in err


def test_site_yml_has_a_play_for_every_launcher_an_engine_runs_under() -> None:
    """Each launcher any engine declares is deployed by its own playbook, chosen in site.yml by
    hy3spark.engine.launcher (a launcher without one would skip every launcher play and seem to deploy); the
    playbook runs that launcher's role. The scenarios run them: molecule/site (ray), native, trtllm (mpi)."""
    plays = yaml.safe_load((REPO / "playbooks" / "site.yml").read_text())
    chosen = {}
    for play in plays:
        found = re.fullmatch(r"not drift_in_sync and hy3spark\.engine\.launcher == '(\w+)'", str(play.get("when", "")))
        if found and "import_playbook" in str(play):
            chosen[found.group(1)] = play["ansible.builtin.import_playbook"]
    launchers = {launcher for engine in ENGINES.values() for launcher in engine.launchers}
    assert launchers == {"ray", "native", "mpi"} and set(chosen) == launchers, chosen
    roles = {"ray": "ray_head", "native": "node_container", "mpi": "mpi_node"}
    for launcher, book in chosen.items():
        text = (REPO / "playbooks" / book).read_text()
        assert f"role: {roles[launcher]}" in text, (launcher, book)
    # No play refuses a launcher any more: every one has its role.
    assert not any("not built yet" in str(play) for play in plays)


def test_trtllms_packaged_table_is_the_one_the_double_extracts() -> None:
    """The engine's hand-written table and the double's, made by tests/trtllm_double/make_flags.py from the same
    serve.py, agree option for option (the packaged one adds click's implicit --help)."""
    from hy3spark.engines import trtllm

    extracted = json.loads((REPO / "tests" / "trtllm_double" / "src" / "trtllm_double" / "flags.json").read_text())
    assert extracted["source"]["commit"] == trtllm.table()["source"]["commit"]
    theirs = {tuple(o["opts"]): (o["dest"], not o["is_flag"]) for o in extracted["options"]}
    ours = {tuple(o["strings"]): (o["dest"], o["takes_value"]) for o in trtllm.table()["options"]}
    assert ours == {**theirs, ("--help",): ("help", False)}


def test_a_trtllm_option_that_takes_a_secret_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """None does today (no --api_key in trtllm-serve); a table regenerated from a release that adds one refuses it."""
    from hy3spark.engines import trtllm

    options = {**trtllm._options(), "--api_key": {"strings": ["--api_key"], "dest": "api_key", "takes_value": True},
               "--hf_token": {"strings": ["--hf_token"], "dest": "hf_token", "takes_value": True}}
    monkeypatch.setattr(trtllm, "_options", lambda: options)
    found = trtllm.check(["--api_key", "sk-abc", "--hf_token=hf_x", "--log_level", "info"])
    assert [i for i, _ in found] == [0, 2] and all("would put a secret on the process command line" in m
                                                   for _, m in found)
    assert not any("sk-abc" in m or "hf_x" in m for _, m in found)
