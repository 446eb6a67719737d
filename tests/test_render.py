"""Rendering: golden files for every profile, real `netplan generate`, and the CLI's --out/--diff/--only/--format."""

from __future__ import annotations

import io
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import golden
import pytest
import yaml
from golden import REPO, cases, changes, portable, summary

from hy3spark.context import RAY_PYTHONPATH_ARGV
from hy3spark.render import render_all
from hy3spark.spec import load_spec, parse_spec

CASES = cases()
REVIEW = "review the diff, then run tests/golden.py"


def _unreviewed(found: list[golden.Change]) -> str:
    return f"{summary(found)}; {REVIEW} (it shows this diff again and asks)\n" + "".join(c.diff() for c in found)


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_matches_golden(name: str) -> None:
    want = {f"tests/golden/{name}/{o.path}": portable(o.content) for o in render_all(load_spec(CASES[name]))}
    found = changes(REPO, want, trees=(f"tests/golden/{name}",))
    assert not found, _unreviewed(found)


def _netplan() -> str:
    exe = shutil.which("netplan") or ("/usr/sbin/netplan" if Path("/usr/sbin/netplan").exists() else None)
    assert exe, "netplan is missing: install Debian's netplan.io (scripts/ensure-docker does)"
    return exe


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_netplan_file_passes_netplan_generate(name: str, tmp_path: Path) -> None:
    loaded = load_spec(CASES[name])
    netplans = [o for o in render_all(loaded) if o.kind == "netplan"]
    assert bool(netplans) is (loaded.spec.fabric is not None), "a netplan file exactly when the spec has a fabric"
    for out in netplans:
        root = tmp_path / out.path.split("/")[1]
        target = root / "etc/netplan/60-hy3spark-fabric.yaml"
        target.parent.mkdir(parents=True)
        target.write_text(out.content)
        target.chmod(0o600)
        proc = subprocess.run([_netplan(), "generate", "--root-dir", str(root)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        networkd = root / "run/systemd/network"
        unit = next(networkd.glob("10-netplan-*.network")).read_text()
        assert "Name=enp1s0f1np1" in unit
        assert "Address=10.0.0." in unit
        link = next(networkd.glob("10-netplan-*.link")).read_text()
        assert "MTUBytes=9000" in link


def test_netplan_never_names_the_management_interface() -> None:
    for name in CASES:
        for out in render_all(load_spec(CASES[name])):
            if out.kind == "netplan":
                ifaces = yaml.safe_load(out.content)["network"]["ethernets"]
                assert list(ifaces) == ["enp1s0f1np1"]
                assert "192.168." not in out.content
                assert out.mode == 0o600


def test_each_node_env_has_its_own_vllm_host_ip() -> None:
    outputs = {o.path: o.content for o in render_all(load_spec(None))}
    assert "VLLM_HOST_IP=10.0.0.1\n" in outputs["files/spark-a/etc/hy3spark/node.env"]
    assert "VLLM_HOST_IP=10.0.0.2\n" in outputs["files/spark-b/etc/hy3spark/node.env"]
    for node in ("spark-a", "spark-b"):
        env = outputs[f"files/{node}/etc/hy3spark/node.env"]
        assert "MASTER_ADDR=10.0.0.1\n" in env
        assert "NCCL_IB_HCA==rocep1s0f1,roceP2p1s0f1\n" in env
        assert "NCCL_SOCKET_IFNAME=enp1s0f1np1\n" in env
        assert "RAY_memory_monitor_refresh_ms=0\n" in env


def test_default_serve_command_has_the_recipes_flags() -> None:
    outputs = {o.path: o.content for o in render_all(load_spec(None))}
    serve = outputs["files/spark-a/etc/hy3spark/serve.sh"]
    line = next(x for x in serve.splitlines() if x.startswith("exec vllm"))
    argv = shlex.split(line)[1:]
    recipe = shlex.split(
        "--served-model-name hy3 --port 8888 --tensor-parallel-size 2 --distributed-executor-backend ray "
        "--max-model-len 131072 --max-num-seqs 6 --max-num-batched-tokens 2048 --kv-cache-dtype fp8_e4m3 "
        "--gpu-memory-utilization 0.90 "
        "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":1}' --tool-call-parser hy_v3 "
        "--reasoning-parser hy_v3 --enable-auto-tool-choice --trust-remote-code --enforce-eager")
    assert argv[:5] == ["vllm", "serve", "kodelow/Hy3-NVFP4-W4A16", "--revision", "main"]
    assert argv[5:] == recipe
    assert "--api-key" not in serve


def test_default_containers_have_the_recipes_settings() -> None:
    outputs = {o.path: o.content for o in render_all(load_spec(None))}
    head = json.loads(outputs["files/spark-a/container.json"])
    assert head["network_mode"] == "host" and head["ipc_mode"] == "host" and head["gpus"] is True
    assert head["ulimits"] == ["memlock:-1:-1", "stack:67108864:67108864"]
    # ray.metrics off: Ray's Prometheus servers go to loopback through the sitecustomize on PYTHONPATH.
    assert head["command"][:3] == RAY_PYTHONPATH_ARGV
    assert head["command"][3:6] == ["ray", "start", "--head"]
    assert "--include-dashboard=false" in head["command"]
    assert head["command"][head["command"].index("--node-ip-address") + 1] == "10.0.0.1"
    worker = json.loads(outputs["files/spark-b/container.json"])
    assert worker["command"][3:7] == ["ray", "start", "--address", "10.0.0.1:6379"]
    assert worker["command"][worker["command"].index("--node-ip-address") + 1] == "10.0.0.2"
    run = outputs["files/spark-b/docker-run.sh"]
    assert "--ulimit memlock=-1 --ulimit stack=67108864" in run and "--gpus all" in run


def test_earlyoom_protect_avoids_engines_and_never_prefers_them() -> None:
    import re

    outputs = {o.path: o.content for o in render_all(load_spec(None))}
    args = outputs["files/spark-a/etc/default/earlyoom"].split('EARLYOOM_ARGS="')[1].split('"')[0].split()
    avoid = re.compile(args[args.index("--avoid") + 1])
    prefer = re.compile(args[args.index("--prefer") + 1])
    # Bare names and the titles the engines really give their processes, as earlyoom sees them (comm, 15 chars).
    for proc in ("vllm", "VLLM", "ray", "raylet", "python3", "python", "trtllm-serve", "VLLM::EngineCor", "ray::IDLE",
                 "ray::RayWorkerW"):
        assert avoid.search(proc), proc
        assert not prefer.search(proc), proc


def test_single_node_inventory_has_no_workers() -> None:
    outputs = {o.path: o.content for o in render_all(load_spec(CASES["gpt-oss-single"]))}
    hosts = yaml.safe_load(outputs["inventory/hosts.yml"])
    assert hosts["all"]["children"]["hy3spark_head"]["hosts"] == {"spark-a": {"ansible_host": "192.168.1.10",
                                                                            "ansible_user": "ubuntu"}}
    assert hosts["all"]["children"]["hy3spark_workers"]["hosts"] == {}
    assert not any(p.startswith("files/spark-b") for p in outputs)


def test_four_spark_cluster_renders_one_env_per_node() -> None:
    text = (Path(CASES["hy3-two-spark"]).read_text()
            .replace("workers:\n", "workers:\n" + "".join(
                f"  - name: spark-{c}\n    fabric_ip: 10.0.0.{i}/24\n    ssh_user: ubuntu\n"
                for c, i in (("c", 3), ("d", 4))))
            .replace("serving:\n", "serving:\n  tensor_parallel: 4\n"))  # a second serving: key is refused
    loaded = parse_spec(text, "four.yml")
    outputs = {o.path: o.content for o in render_all(loaded)}
    for name, ip in (("spark-a", 1), ("spark-b", 2), ("spark-c", 3), ("spark-d", 4)):
        assert f"VLLM_HOST_IP=10.0.0.{ip}\n" in outputs[f"files/{name}/etc/hy3spark/node.env"]
    assert "--tensor-parallel-size 4" in outputs["files/spark-a/etc/hy3spark/serve.sh"]
    hosts = yaml.safe_load(outputs["inventory/hosts.yml"])
    assert sorted(hosts["all"]["children"]["hy3spark_workers"]["hosts"]) == ["spark-b", "spark-c", "spark-d"]


# --- the CLI -----------------------------------------------------------------------------------------------------
def test_render_with_no_arguments_previews_the_default(cli) -> None:
    result = cli("render")
    assert result.code == 0
    assert "==> files/spark-a/etc/netplan/60-hy3spark-fabric.yaml (mode 0600) <==" in result.out
    assert "==> files/pi/models.json (mode 0644) <==" in result.out
    assert "exec vllm serve kodelow/Hy3-NVFP4-W4A16" in result.out


def test_render_only_by_kind_and_glob(cli) -> None:
    result = cli("render", "--only", "netplan")
    assert result.out.count("==> ") == 2 and "netplan" in result.out
    result = cli("render", "--only", "files/spark-b/*")
    assert "files/spark-a" not in result.out and "files/spark-b/etc/hy3spark/node.env" in result.out
    result = cli("render", "--only", "nothing-like-this")
    assert result.code == 1 and "matches no rendered file" in result.err


def test_render_json(cli) -> None:
    result = cli("render", "--format", "json", "--only", "pi")
    data = json.loads(result.out)
    assert [f["path"] for f in data["files"]] == ["files/pi/models.json", "files/pi/settings.json"]
    models = json.loads(data["files"][0]["content"])
    assert models["providers"]["hy3-local"]["baseUrl"] == "http://10.0.0.1:8888/v1"
    assert models["providers"]["hy3-local"]["apiKey"] == "VLLM_API_KEY"


def test_render_out_then_diff(cli, tmp_path: Path) -> None:
    out = tmp_path / "r"
    result = cli("render", "--out", str(out))
    assert result.code == 0 and "wrote 26 files" in result.out
    assert (out / "files/spark-a/etc/netplan/60-hy3spark-fabric.yaml").stat().st_mode & 0o777 == 0o600
    assert (out / "files/spark-a/etc/hy3spark/node.env").stat().st_mode & 0o777 == 0o600
    assert not list(out.rglob(".*.yml.*")), "no temp files left behind"
    assert cli("render", "--diff", str(out)).out.startswith("no changes")

    spec = tmp_path / "c.yml"
    spec.write_text((Path(__file__).parent.parent / "hy3spark/default-cluster.yml").read_text()
                    .replace("mtu: 9000", "mtu: 4200"))
    diff = cli("render", str(spec), "--diff", str(out))
    assert diff.code == 1
    assert "-      mtu: 9000\n+      mtu: 4200\n" in diff.out

    # A spec with one worker fewer: --out removes the files the old render made and this one does not.
    single = tmp_path / "single.yml"
    single.write_text(spec.read_text().split("workers:")[0] + "fabric:\n  interfaces: [enp1s0f1np1]\n"
                      "  hcas: [rocep1s0f1, roceP2p1s0f1]\nserving:\n  tensor_parallel: 1\n")
    result = cli("render", str(single), "--out", str(out))
    assert result.code == 0, result.err
    assert "removed files/spark-b/etc/hy3spark/node.env (no longer rendered)" in result.out
    assert not (out / "files/spark-b/etc/hy3spark/node.env").exists()
    assert not (out / "inventory/host_vars/spark-b.yml").exists()


def test_render_out_refuses_bad_spec_and_keeps_the_previous_render(cli, tmp_path: Path) -> None:
    out = tmp_path / "r"
    assert cli("render", "--out", str(out)).code == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    bad = tmp_path / "bad.yml"
    bad.write_text("name: x\nprofile: hy3-295b-nvfp4-tp2\n")
    result = cli("render", str(bad), "--out", str(out))
    assert result.code == 3 and "head: is required" in result.err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_repo_inventory_is_the_default_render() -> None:
    """The committed inventory/ is what `./hy3 render --out .` gives for the embedded default: never stale, and no
    host_vars left over from a node the default no longer has."""
    want = {o.path: o.content for o in render_all(load_spec(None)) if o.kind == "inventory"}
    assert set(want) == {"inventory/hosts.yml", "inventory/group_vars/all/hy3spark.yml",
                         "inventory/host_vars/spark-a.yml", "inventory/host_vars/spark-b.yml"}
    found = changes(REPO, want, trees=("inventory",))
    assert not found, _unreviewed(found)


# --- tests/golden.py: a diff to review, never a blind rewrite ----------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def golden_copy(tmp_path: Path) -> Path:
    """A copy of the goldens and inventory/ to let golden.py loose on; the render still comes from the repo."""
    for tree in golden.TREES:
        shutil.copytree(REPO / tree, tmp_path / tree)
    return tmp_path


def _golden(root: Path, *argv: str, stdin: io.StringIO | None = None) -> tuple[int, str]:
    out = io.StringIO()
    code = golden.main(list(argv), root=root, stdin=stdin or io.StringIO(""), out=out)
    return code, out.getvalue()


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_golden_check_passes_on_the_committed_goldens(golden_copy: Path) -> None:
    assert _golden(golden_copy, "--check") == (0, "goldens and inventory/ match the render (tests/golden, inventory)\n")


def test_golden_check_prints_the_diff_and_writes_nothing(golden_copy: Path) -> None:
    # The golden with VLLM_API_KEY dropped: what a buggy render accepted blindly would have left behind.
    nco = "tests/golden/default/files/spark-a/etc/hy3spark/vllm/ray_non_carry_over_env_vars.json"
    (golden_copy / nco).write_text((golden_copy / nco).read_text().replace('    "VLLM_API_KEY",\n', ""))
    before = _tree(golden_copy)
    code, out = _golden(golden_copy, "--check")
    assert code == 1
    assert f"--- a/{nco}\n+++ b/{nco}\n" in out
    assert '\n+    "VLLM_API_KEY",\n' in out
    assert "1 file(s) differ: 1 changed, 0 new, 0 stale" in out and REVIEW in out
    assert _tree(golden_copy) == before


def test_golden_without_a_terminal_needs_accept(golden_copy: Path) -> None:
    env = "tests/golden/hy3-two-spark/files/spark-b/etc/hy3spark/node.env"
    (golden_copy / env).write_text((golden_copy / env).read_text().replace("VLLM_HOST_IP=10.0.0.2", "VLLM_HOST_IP=x"))
    before = _tree(golden_copy)
    code, out = _golden(golden_copy)
    assert code == 1
    assert "-VLLM_HOST_IP=x\n+VLLM_HOST_IP=10.0.0.2\n" in out
    assert "not written: no terminal to ask on" in out and "tests/golden.py --accept" in out
    assert _tree(golden_copy) == before

    code, out = _golden(golden_copy, "--accept")
    assert code == 0 and "-VLLM_HOST_IP=x\n+VLLM_HOST_IP=10.0.0.2\n" in out and "wrote 1 file(s)" in out
    assert "VLLM_HOST_IP=10.0.0.2\n" in (golden_copy / env).read_text()
    assert _golden(golden_copy, "--check")[0] == 0


@pytest.mark.parametrize(("answer", "written"), [("y\n", True), ("yes\n", True), ("n\n", False), ("\n", False)])
def test_golden_on_a_terminal_asks_before_writing(golden_copy: Path, answer: str, written: bool) -> None:
    hosts = golden_copy / "inventory/hosts.yml"
    hosts.write_text(hosts.read_text().replace('ansible_user: "ubuntu"', 'ansible_user: "root"', 1))
    code, out = _golden(golden_copy, stdin=_Terminal(answer))
    assert '-          ansible_user: "root"\n+          ansible_user: "ubuntu"\n' in out
    assert "accept? [y/N] " in out
    assert code == (0 if written else 1)
    assert ('ansible_user: "root"' not in hosts.read_text()) is written
    assert ("not written" in out) is not written


def test_golden_accept_adds_missing_and_removes_stale_files(golden_copy: Path) -> None:
    missing = golden_copy / "tests/golden/llama-405b-pair/files/pi/settings.json"
    content = missing.read_text()
    missing.unlink()
    stale = golden_copy / "inventory/host_vars/spark-z.yml"
    stale.write_text("hy3spark_node: {}\n")
    gone_case = golden_copy / "tests/golden/retired-example/files/pi/models.json"
    gone_case.parent.mkdir(parents=True)
    gone_case.write_text("{}\n")

    code, out = _golden(golden_copy, "--accept")
    assert code == 0
    assert "--- /dev/null\n+++ b/tests/golden/llama-405b-pair/files/pi/settings.json\n" in out
    assert "--- a/inventory/host_vars/spark-z.yml\n+++ /dev/null\n@@ -1 +0,0 @@\n-hy3spark_node: {}\n" in out
    assert "3 file(s) differ: 0 changed, 1 new, 2 stale" in out
    assert missing.read_text() == content
    assert not stale.exists()
    assert not (golden_copy / "tests/golden/retired-example").exists(), "emptied directories are removed too"
    assert _golden(golden_copy, "--check")[0] == 0


def test_golden_refuses_check_with_accept(golden_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        golden.main(["--check", "--accept"], root=golden_copy)
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


# --- TensorRT-LLM on two Sparks (issue 12): what `hy3spark render examples/pair-trtllm-235b.yml` shows -------------
TRTLLM = REPO / "examples" / "pair-trtllm-235b.yml"


def _trtllm_outputs() -> dict[str, str]:
    return {o.path: o.content for o in render_all(load_spec(TRTLLM))}


def test_trtllm_hostfile_lists_both_fabric_addresses_one_slot_each() -> None:
    outputs = _trtllm_outputs()
    for node in ("spark-a", "spark-b"):
        hostfile = outputs[f"files/{node}/etc/hy3spark/openmpi-hostfile"]
        assert [line for line in hostfile.splitlines() if not line.startswith("#")] == [
            "10.0.0.1 slots=1", "10.0.0.2 slots=1"]
        assert "192.168." not in hostfile, "never a management address"
        container = json.loads(outputs[f"files/{node}/container.json"])
        assert "/etc/hy3spark/openmpi-hostfile:/etc/openmpi-hostfile:ro" in container["volumes"]


def test_trtllm_options_file_is_the_specs_extra_llm_api_options() -> None:
    outputs = _trtllm_outputs()
    options = yaml.safe_load(outputs["files/spark-a/etc/hy3spark/engine-options.yml"])
    assert options == {"cuda_graph_config": {"enable_padding": True},
                       "kv_cache_config": {"dtype": "auto", "free_gpu_memory_fraction": 0.9},
                       "print_iter_log": False}
    assert "files/spark-b/etc/hy3spark/engine-options.yml" not in outputs, "only rank 0's trtllm-serve reads it"
    text = TRTLLM.read_text().replace("  port: 8355\n", "  port: 8355\n  cuda_graph_config: null\n")
    rendered = {o.path: o.content for o in render_all(parse_spec(text, "c.yml"))}
    assert yaml.safe_load(rendered["files/spark-a/etc/hy3spark/engine-options.yml"])["cuda_graph_config"] is None


def test_trtllm_launch_line_is_mpirun_then_trtllm_serve() -> None:
    outputs = _trtllm_outputs()
    serve = outputs["files/spark-a/etc/hy3spark/serve.sh"]
    line = next(x for x in serve.splitlines() if x.startswith("exec mpirun"))
    argv = shlex.split(line)[1:]
    launch = argv.index("trtllm-llmapi-launch")
    assert argv[0] == "mpirun" and "-x" in argv[:launch] and argv[launch - 2:launch] == ["-x", "HF_TOKEN"]
    assert argv[launch + 1:launch + 3] == ["trtllm-serve", "nvidia/Qwen3-235B-A22B-FP4"]
    engine = argv[launch + 3:]
    # Behind the API front (the example sets serving.api_key_env): trtllm-serve on loopback, one port up.
    assert engine[engine.index("--tp_size") + 1] == "2" and engine[engine.index("--port") + 1] == "8356"
    assert engine[engine.index("--host") + 1] == "127.0.0.1"
    assert engine[engine.index("--extra_llm_api_options") + 1] == "/etc/hy3spark/engine-options.yml"
    assert "files/spark-b/etc/hy3spark/serve.sh" not in outputs, "mpirun starts the worker's rank"
    # The secrets come on the script's stdin and are exported before it execs mpirun; the API front starts in the
    # background first, with the key's NAME on its line, and the key is unset before mpirun (no rank gets it).
    front = ("python3 /etc/hy3spark/api-front.py --listen 0.0.0.0:8355 --upstream 127.0.0.1:8356 "
             "--key-env HY3SPARK_API_KEY &")
    assert serve.index('eval "$secrets"') < serve.index(front) < serve.index(
        "unset HY3SPARK_API_KEY\nexec mpirun")
    assert "-x HY3SPARK_API_KEY" not in serve
    no_key = TRTLLM.read_text().replace("  api_key_env: HY3SPARK_API_KEY\n", "  open_endpoint: true\n")
    open_serve = {o.path: o.content for o in render_all(parse_spec(no_key, "c.yml"))}[
        "files/spark-a/etc/hy3spark/serve.sh"]
    assert "api-front" not in open_serve and "unset HY3SPARK" not in open_serve
    assert "--port 8355 --host 0.0.0.0" in open_serve


def test_trtllm_containers_run_the_mpi_sshd_on_its_port() -> None:
    outputs = _trtllm_outputs()
    for node, role in (("spark-a", "head"), ("spark-b", "worker")):
        container = json.loads(outputs[f"files/{node}/container.json"])
        assert container["command"] == ["/bin/sh", "-c", "mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e -p 2233 -f "
                                        "/etc/hy3spark/mpi/sshd_config"]
        assert (container["network_mode"], container["ipc_mode"]) == ("host", "host")
        assert container["ulimits"] == ["memlock:-1:-1", "stack:67108864:67108864"]
        assert container["optional_devices"] == ["/dev/infiniband"] and container["name"] == f"trtllm-{role}"
        assert "/var/lib/hy3spark/hub:/var/lib/hy3spark/hub" in container["volumes"]
        assert container["image"] == "nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc5"


def test_trtllm_render_holds_no_secret_value(monkeypatch: pytest.MonkeyPatch, cli) -> None:
    token = "hf_" + "T" * 34
    monkeypatch.setenv("HF_TOKEN", token)
    result = cli("render", str(TRTLLM), "--format", "json")
    code, out, err = result.code, result.out, result.err
    assert code == 0 and token not in out + err
    assert "HF_TOKEN" in out, "named (mpirun -x HF_TOKEN), never valued"
