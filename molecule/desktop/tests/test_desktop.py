"""desktop scenario: the two-card desktop (one machine, two GPUs, no fabric, serving.launcher native: vLLM's mp
executor, no Ray, the API on 127.0.0.1). Converge, idempotence (changed=0) and check ran before with the tensor
split (cluster.yml, as examples/two-card-tp.yml); these tests run in file order against the live node: the tensor
split as converge left it, then the pipeline split (the same spec with tensor_parallel 1 and pipeline_parallel 2, as
examples/two-card-pp.yml) rendered and deployed to the same node, converged twice (the second changes nothing),
checked the same way; then the tensor split again with the engine run from a venv on the node (hy3spark_engine_venv,
made by prepare.yml) with no container, converged twice and once in --check, checked, watched by drift and
reported by status; then teardown.

The engine is the vLLM TEST DOUBLE with two fake GPUs; vLLM 0.23.0 recorded no KV outcome for Qwen3-32B, so it
serves without KV lines (cluster.yml): nothing here reads KV numbers. Bench against both splits and the comparison
are tests/test_bench.py's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import scenario
from scenario import REPO, flat, node, playbook, recap

SCENARIO = Path(__file__).resolve().parent.parent
NODE = "desktop"
LAN_IP = "10.95.4.11"  # the node's address besides loopback (molecule.yml): the API must not answer there
CONTAINER = "qwen32-head"  # the profile's container.name_prefix
API_PORT = scenario.API_PORT
SERVED = "qwen3-32b"
SERVE_SCRIPT = "/etc/hy3spark/serve.sh"
SERVE_LOG = "/var/log/hy3spark/serve.log"
RUN_FILE = "/var/lib/hy3spark/serve.json"
START_MARKER = "hy3spark: starting "  # serve.sh's first line (hy3spark.serving.start_marker)
TP = {"tensor": 2, "pipeline": 1}
PP = {"tensor": 1, "pipeline": 2}

def processes() -> list[tuple[int, int, list[str]]]:
    return scenario.processes(NODE, CONTAINER)


def engine() -> tuple[int, list[str], set[int]]:
    """The one engine (a `vllm serve` whose parent is none), its argv, and the PIDs of the ranks it forked."""
    found = scenario.serving(NODE, CONTAINER)
    engines = {pid: argv for pid, (ppid, argv) in found.items() if ppid not in found}
    assert len(engines) == 1, engines
    pid, argv = next(iter(engines.items()))
    return pid, argv, {child for child, (ppid, _argv) in found.items() if ppid == pid}


def api(path: str, body: dict | None = None) -> tuple[int, dict]:
    return scenario.api(NODE, path, body)  # no serving.api_key_env: a loopback endpoint needs no key


def connects(ip: str, port: int) -> bool:
    return scenario.connects(NODE, ip, port)


def last_start_log() -> str:
    """The serve log since the engine's last start (the log is appended to across restarts)."""
    text = node(NODE).check_output(f"cat {SERVE_LOG}")
    return text[text.rindex(START_MARKER) :]


# --- what both splits must show --------------------------------------------------------------------------------------


def check_no_ray_and_the_container_holds_the_node(rendered: Path) -> None:
    info = json.loads(node(NODE).check_output(f"docker inspect {CONTAINER}"))[0]
    definition = json.loads((rendered / "files" / NODE / "container.json").read_text())
    assert info["Config"]["Cmd"] == definition["command"] == ["sleep", "infinity"]
    assert info["HostConfig"]["NetworkMode"] == "host"
    assert info["State"]["Running"]
    names = [os.path.basename(argv[0]) for _pid, _ppid, argv in processes() if argv]
    assert not {"ray", "raylet", "gcs_server"} & set(names), names
    assert not [argv for _pid, _ppid, argv in processes() if any("ray" in a.split("/")[-1] for a in argv[:2])]
    listed = node(NODE).check_output("docker ps -a --format '{{.Names}}'").split()
    assert listed == [CONTAINER], "one node container, no Ray container"


def check_the_engine_runs_the_split(rendered: Path, split: dict[str, int]) -> list[str]:
    script = node(NODE).file(SERVE_SCRIPT)
    assert script.content_string == (rendered / "files" / NODE / "etc/hy3spark/serve.sh").read_text()
    assert script.mode == 0o755
    _pid, argv, _ranks = engine()
    assert argv[argv.index("serve") - 1].endswith("vllm") and argv[argv.index("serve") + 1] == "Qwen/Qwen3-32B-AWQ"
    assert argv[argv.index("--tensor-parallel-size") + 1] == str(split["tensor"])
    if split["pipeline"] > 1:
        assert argv[argv.index("--pipeline-parallel-size") + 1] == str(split["pipeline"])
    else:
        assert "--pipeline-parallel-size" not in argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "mp"
    for flag in ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless"):
        assert flag not in argv, f"one machine: no {flag}"
    return argv


def check_two_ranks_on_the_one_node(split: dict[str, int]) -> None:
    pid, _argv, ranks = engine()
    status, body = api("/double/workers")
    assert status == 200, body
    workers = body["workers"]
    assert sorted(w["rank"] for w in workers) == [0, 1]
    assert {w["pid"] for w in workers} == ranks, f"both ranks are processes the engine {pid} forked: {ranks}"
    assert len({w["hostname"] for w in workers}) == 1
    log = last_start_log()
    assert "distributed_init_method=tcp://127.0.0.1:" in log
    # vLLM's rank names: Worker_TP<t> under the tensor split, Worker_PP<p> under the pipeline split.
    prefix = "Worker_TP" if split["pipeline"] == 1 else "Worker_PP"
    for rank in (0, 1):
        assert f"({prefix}{rank} pid=" in log, log
    second = "PP rank 1, TP rank 0" if split["pipeline"] == 2 else "PP rank 0, TP rank 1"
    assert f"rank 1 in world size 2 is assigned as DP rank 0, {second}," in log, log


def check_the_api_answers_on_loopback_only() -> None:
    assert connects("127.0.0.1", API_PORT)
    assert not connects(LAN_IP, API_PORT), "the endpoint binds 127.0.0.1: nothing answers on the node's LAN address"
    listening = node(NODE).check_output("ss -Hltn 'sport = :%s'", str(API_PORT)).split("\n")
    assert [line.split()[3] for line in listening if line.strip()] == [f"127.0.0.1:{API_PORT}"], listening


def check_models_completion_and_chat() -> None:
    status, body = api("/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [SERVED], body
    assert body["data"][0]["max_model_len"] == 32768
    status, body = api("/v1/completions", {"model": SERVED, "prompt": "Hello", "max_tokens": 8})
    assert status == 200 and body["choices"][0]["text"].strip(), body
    status, body = api(
        "/v1/chat/completions", {"model": SERVED, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    )
    assert status == 200 and body["choices"][0]["message"]["content"], body


def check_the_run_record(argv: list[str]) -> None:
    record = json.loads(node(NODE).check_output(f"cat {RUN_FILE}"))
    pid, _argv, _ranks = engine()
    assert record["engine_pid"] == pid
    assert record["argv"][1:] == argv[argv.index("serve") :]
    assert record["rank_pids"] == {}, "one node: no --headless rank node"
    assert record["base_url"] == f"http://127.0.0.1:{API_PORT}/v1"


# --- the tensor split, as converge and idempotence left it ---------------------------------------------------------


def test_tp_no_ray_and_one_container_holding_the_node() -> None:
    check_no_ray_and_the_container_holds_the_node(SCENARIO / ".rendered")


def test_tp_engine_runs_the_tensor_split_on_loopback_with_the_mp_executor() -> None:
    argv = check_the_engine_runs_the_split(SCENARIO / ".rendered", TP)
    check_the_run_record(argv)


def test_tp_two_ranks_on_the_one_node() -> None:
    check_two_ranks_on_the_one_node(TP)


def test_tp_api_answers_on_loopback_only() -> None:
    check_the_api_answers_on_loopback_only()


def test_tp_models_completion_and_chat() -> None:
    check_models_completion_and_chat()


# --- the pipeline split, deployed to the same node ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The pipeline split's render and an inventory that deploys it to the scenario's node."""
    work = tmp_path_factory.mktemp("two-card-pp")
    text = (SCENARIO / "cluster.yml").read_text()
    tp_split = "  tensor_parallel: 2\n  pipeline_parallel: 1\n"
    assert text.count(tp_split) == 1
    spec = work / "cluster.yml"
    spec.write_text(text.replace(tp_split, "  tensor_parallel: 1\n  pipeline_parallel: 2\n"))
    rendered = work / "rendered"
    subprocess.run(
        [sys.executable, "-m", "hy3spark", "render", str(spec), "--out", str(rendered)],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    return rendered, scenario.variant_inventory(work, rendered / "inventory")


def test_pp_converge_restarts_the_engine_with_the_pipeline_split(pp: tuple[Path, Path]) -> None:
    rendered, inventory = pp
    before, _argv, _ranks = engine()
    result = playbook(str(SCENARIO / "converge.yml"), inventory=inventory)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "(re)starting the engine: the serve script, secrets, image or node containers changed" in flat(out), out
    after, argv, _ranks = engine()
    assert after != before
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    assert (rendered / "files" / NODE / "etc/hy3spark/serve.sh").read_text().count("--pipeline-parallel-size 2") == 1


def test_pp_idempotence(pp: tuple[Path, Path]) -> None:
    _rendered, inventory = pp
    pid, _argv, _ranks = engine()
    result = playbook(str(SCENARIO / "converge.yml"), inventory=inventory)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and recap(result.stdout) == {NODE: 0}, out
    assert "leaving the engine alone: the same command is serving" in flat(out), out
    assert engine()[0] == pid


def test_pp_no_ray_and_one_container_holding_the_node(pp: tuple[Path, Path]) -> None:
    check_no_ray_and_the_container_holds_the_node(pp[0])


def test_pp_engine_runs_the_pipeline_split_on_loopback_with_the_mp_executor(pp: tuple[Path, Path]) -> None:
    argv = check_the_engine_runs_the_split(pp[0], PP)
    check_the_run_record(argv)


def test_pp_two_ranks_on_the_one_node() -> None:
    check_two_ranks_on_the_one_node(PP)


def test_pp_api_answers_on_loopback_only() -> None:
    check_the_api_answers_on_loopback_only()


def test_pp_models_completion_and_chat() -> None:
    check_models_completion_and_chat()


# --- the engine from a venv on the host, no container (hy3spark_engine_venv) -----------------------------------------

VENV = "/opt/vllm"  # made by prepare.yml: the same double, pip-installed on the node itself
UNIT = "hy3spark-engine.service"
WITH_VENV = ("-e", f"hy3spark_engine_venv={VENV}")

# Every `vllm serve` process on the node itself as pid -> [parent pid, argv, cgroup path]: no container is involved.
_HOST_SERVING = (
    "import json, os\n"
    "out = {}\n"
    "for p in (int(p) for p in os.listdir('/proc') if p.isdigit()):\n"
    "    try:\n"
    "        argv = [a for a in open(f'/proc/{p}/cmdline', 'rb').read().decode(errors='replace').split('\\0') if a]\n"
    "        ppid = int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1])\n"
    "        cgroup = open(f'/proc/{p}/cgroup').read().splitlines()[-1].split(':', 2)[2]\n"
    "    except (OSError, IndexError, ValueError):\n"
    "        continue\n"
    "    if any(os.path.basename(a) == 'vllm' and argv[i + 1:i + 2] == ['serve'] for i, a in enumerate(argv)):\n"
    "        out[p] = [ppid, argv, cgroup]\n"
    "print(json.dumps(out))\n"
)


def host_serving() -> dict[int, tuple[int, list[str], str]]:
    out = json.loads(node(NODE).check_output("python3 -c %s", _HOST_SERVING))
    return {int(pid): (ppid, argv, cgroup) for pid, (ppid, argv, cgroup) in out.items()}


def host_engine() -> tuple[int, list[str], set[int]]:
    """The one engine on the host (a `vllm serve` whose parent is none), its argv, and the ranks it forked."""
    found = host_serving()
    engines = {pid: argv for pid, (ppid, argv, _cgroup) in found.items() if ppid not in found}
    assert len(engines) == 1, found
    pid, argv = next(iter(engines.items()))
    return pid, argv, {child for child, (ppid, _argv, _cgroup) in found.items() if ppid == pid}


def unit_show() -> dict[str, str]:
    out = node(NODE).check_output(f"systemctl show {UNIT} --property LoadState,ActiveState,MainPID")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_venv_converge_removes_the_container_and_starts_the_engine_on_the_host() -> None:
    result = playbook(str(SCENARIO / "converge.yml"), *WITH_VENV)
    out = flat(result.stdout + result.stderr)
    assert result.returncode == 0, out
    assert f"No container: the engine runs from the venv {VENV} on the host" in out, out
    assert "(re)starting the engine: no engine is running" in out, out
    assert node(NODE).check_output("docker ps -aq").strip() == "", "the PP deployment's container is gone"
    assert unit_show()["ActiveState"] == "active"


def test_venv_idempotence() -> None:
    pid, _argv, _ranks = host_engine()
    result = playbook(str(SCENARIO / "converge.yml"), *WITH_VENV)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and recap(result.stdout) == {NODE: 0}, out
    assert "leaving the engine alone: the same command is serving" in flat(out), out
    assert host_engine()[0] == pid


def test_venv_check_mode_changes_nothing() -> None:
    pid, _argv, _ranks = host_engine()
    result = playbook(str(SCENARIO / "converge.yml"), *WITH_VENV, "--check", "--diff")
    assert result.returncode == 0 and recap(result.stdout) == {NODE: 0}, result.stdout + result.stderr
    assert host_engine()[0] == pid


def test_venv_the_engine_and_its_ranks_run_on_the_host_in_the_unit() -> None:
    assert node(NODE).check_output("docker ps -aq").strip() == "", "no container at all"
    pid, argv, ranks = host_engine()
    shown = unit_show()
    assert shown["ActiveState"] == "active" and int(shown["MainPID"]) == pid, "serve.sh execs the engine: its PID"
    assert argv[argv.index("serve") - 1] == f"{VENV}/bin/vllm", argv
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "mp"
    assert len(ranks) == 2, ranks
    for _ppid, _argv, cgroup in host_serving().values():
        assert cgroup.endswith(f"/{UNIT}"), cgroup
    status, body = api("/double/workers")
    assert status == 200 and {w["pid"] for w in body["workers"]} == ranks, body
    record = json.loads(node(NODE).check_output(f"cat {RUN_FILE}"))
    assert (record["engine_pid"], record["venv"], record["unit"]) == (pid, VENV, UNIT)
    assert record["containers"] == {} and record["image_id"] is None
    # The serve log the gates read, and the unit's journal, both hold this start's lines.
    assert last_start_log().count(START_MARKER) == 1 and "Application startup complete." in last_start_log()
    assert START_MARKER in node(NODE).check_output(f"journalctl -u {UNIT} --no-pager -o cat")


def test_venv_api_answers_on_loopback_only() -> None:
    check_the_api_answers_on_loopback_only()


def test_venv_models_completion_and_chat() -> None:
    check_models_completion_and_chat()


def test_venv_drift_watches_the_engine_on_the_host(tmp_path: Path) -> None:
    """What drift records of the serving role and node_container with the venv: the unit and the engine's processes
    on the host (no container); a second look is in sync, and a restarted engine is named."""
    play = tmp_path / "drift.yml"
    play.write_text(
        "- hosts: all\n  gather_facts: false\n  become: true\n  tasks:\n"
        "    - hy3spark.cluster.hy3spark_drift:\n"
        "        watch: \"{{ lookup('hy3spark.cluster.hy3spark_state', 'node_container', 'vllm_serve') }}\"\n"
        "        record: /tmp/drift-venv.json\n        inputs: test\n        state: \"{{ item }}\"\n"
        "      loop: [recorded, compared]\n      register: drift\n"
        "    - ansible.builtin.debug:\n        msg: \"DRIFT {{ drift.results[1].differs | to_json }}\"\n"
    )
    result = playbook(str(play), *WITH_VENV)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "DRIFT []" in flat(result.stdout), result.stdout
    recorded = json.loads(node(NODE).check_output("cat /tmp/drift-venv.json"))["state"]
    pid, argv, ranks = host_engine()
    assert recorded["containers"] == {}
    assert recorded["units"][UNIT]["active"] == "active" and recorded["units"][UNIT]["argv"] == argv
    assert {int(row.split()[0]) for row in recorded["processes"][f"host {UNIT}"]} == {pid} | ranks


def test_venv_status_reports_the_unit() -> None:
    result = playbook(str(REPO / "playbooks/status.yml"), *WITH_VENV)
    out = flat(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    # The callback's YAML or JSON alike.
    for expected in (rf"\bunit\W+{re.escape(UNIT)}", r"\bActiveState\W+active\b", rf"\bvenv\W+{VENV}\b",
                     r"\bvllm\W+0\.23\.0\+testdouble", r"\bcontainers\W+\[\]"):
        assert re.search(expected, out), (expected, out)


# --- the way back -----------------------------------------------------------------------------------------------------


def test_teardown_leaves_nothing_of_ours_and_keeps_the_model_cache(pp: tuple[Path, Path]) -> None:
    _rendered, inventory = pp
    result = playbook(str(REPO / "playbooks/teardown.yml"), inventory=inventory)
    assert result.returncode == 0, result.stdout + result.stderr
    assert node(NODE).check_output("docker ps -aq --filter label=io.hy3spark.cluster").strip() == ""
    assert node(NODE).check_output("docker ps -aq").strip() == ""
    # The venv deployment's unit is stopped too, though this run does not name the venv: nothing of ours is left.
    assert unit_show()["ActiveState"] in ("inactive", "failed") and host_serving() == {}
    assert not connects("127.0.0.1", API_PORT)
    assert node(NODE).file("/var/lib/hy3spark/hub/models--Qwen--Qwen3-32B-AWQ/snapshots").is_directory, (
        "the model cache is kept"
    )
    again = playbook(str(REPO / "playbooks/teardown.yml"), inventory=inventory)
    assert again.returncode == 0 and recap(again.stdout) == {NODE: 0}, again.stdout
