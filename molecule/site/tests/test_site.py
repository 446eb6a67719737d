"""site scenario: what an ops engineer relies on after `site.yml`, then the faults they will meet, then the way back.

Converge ran the deployment on two dnodes, idempotence ran it again (changed=0) and check mode once more. The tests
run in file order: first the serving cluster as converge left it, then each fault case (a broken run must fail
with a message that names the cause, and the next clean run must recover), then teardown.yml.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import scenario
import yaml
from scenario import RAY_NODES, REPO, flat, node, playbook, recap
from wheel_venv import Installed, installed_wheel

SCENARIO = Path(__file__).resolve().parent.parent
SPEC = SCENARIO / "cluster.yml"
HEAD, WORKER = "site-head", "site-worker"
NODES = (HEAD, WORKER)
FABRIC_IP = {HEAD: "10.95.0.11", WORKER: "10.95.0.12"}
CONTAINER = {HEAD: "hy3-head", WORKER: "hy3-worker"}
KEY_ENV = "HY3SPARK_SITE_API_KEY"
API_KEY = os.environ.get(KEY_ENV, "")
SERVED = "hy3"
RENDERED = SCENARIO / ".rendered"
RUN_FILE = "/var/lib/hy3spark/serve.json"
DRIFT_RECORD = "/var/lib/hy3spark/deployed.json"
SERVE_LOG = "/var/log/hy3spark/serve.log"
MODEL_SNAPSHOT = ("/var/lib/hy3spark/hub/models--kodelow--Hy3-NVFP4-W4A16/snapshots/"
                  "5173a1f0c0ffee5173a1f0c0ffee5173a1f0c0ff")


def inspect(name: str) -> dict:
    return json.loads(node(name).check_output(f"docker inspect {CONTAINER[name]}"))[0]


def api(path: str, body: dict | None = None, key: str | None = API_KEY) -> tuple[int, dict]:
    return scenario.api(HEAD, path, body, key or "")


def run_record() -> dict:
    return json.loads(node(HEAD).check_output(f"cat {RUN_FILE}"))


def converge_vars() -> dict:
    """converge.yml's test-only play inputs (see there): the same values wherever another run must match its runs."""
    return yaml.safe_load((SCENARIO / "converge.yml").read_text())[0]["vars"]


def engine_pids() -> list[int]:
    """`vllm serve` processes in the head container (its own PID namespace, where the role records the PID)."""
    code = (
        "import os\n"
        "for p in sorted(int(p) for p in os.listdir('/proc') if p.isdigit()):\n"
        "    try: argv = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')\n"
        "    except OSError: continue\n"
        "    if any(os.path.basename(a) == b'vllm' and argv[i + 1:i + 2] == [b'serve'] for i, a in enumerate(argv)):\n"
        "        print(p)\n"
    )
    return [int(p) for p in node(HEAD).check_output("docker exec %s python3 -c %s", CONTAINER[HEAD], code).split()]


# --- the serving cluster, as converge and idempotence left it -------------------------------------------------------


def test_ray_reports_two_nodes_and_two_gpus() -> None:
    out = node(HEAD).check_output("docker exec %s python3 -c %s", CONTAINER[HEAD], RAY_NODES)
    nodes = json.loads(out.strip().splitlines()[-1])
    assert sorted(ip for ip, _ in nodes) == sorted(FABRIC_IP.values())
    assert sum(gpus for _, gpus in nodes) == 2.0


@pytest.mark.parametrize("name", NODES)
def test_ray_container_runs_the_rendered_definition(name: str) -> None:
    info = inspect(name)
    host = info["HostConfig"]
    rendered = json.loads((RENDERED / "files" / name / "container.json").read_text())
    assert info["State"]["Running"]
    assert info["Config"]["Cmd"] == rendered["command"]
    assert host["NetworkMode"] == "host" and host["IpcMode"] == "host"
    # The spec renders memlock -1 for the Sparks; this machine's hard limit is 8 MiB, which converge.yml passes
    # through the roles' ulimits inputs instead (see there). The stack limit is the rendered one.
    assert rendered["ulimits"] == ["memlock:-1:-1", "stack:67108864:67108864"]
    assert {(u["Name"], u["Soft"], u["Hard"]) for u in host["Ulimits"]} == {
        ("memlock", 8388608, 8388608), ("stack", 67108864, 67108864)}
    assert sorted(re.sub(r":rw$", "", b) for b in host["Binds"]) == sorted(rendered["volumes"])
    assert info["Config"]["Labels"]["io.hy3spark.cluster"] == "site-test"
    assert not host.get("DeviceRequests"), "container.gpus is false in the test spec: no GPU request"
    assert not host.get("Devices"), "no /dev/infiniband on the test nodes: nothing passed in"


@pytest.mark.parametrize("name", NODES)
def test_each_container_has_its_own_vllm_host_ip(name: str) -> None:
    env = dict(e.split("=", 1) for e in inspect(name)["Config"]["Env"])
    assert env["VLLM_HOST_IP"] == FABRIC_IP[name]
    assert env["MASTER_ADDR"] == FABRIC_IP[HEAD]
    assert env["NCCL_SOCKET_IFNAME"] == "eth1"


@pytest.mark.parametrize("name", NODES)
def test_node_env_file_is_the_render_byte_for_byte(name: str) -> None:
    f = node(name).file("/etc/hy3spark/node.env")
    assert f.mode == 0o600 and f.user == "root"
    assert f.content_string == (RENDERED / "files" / name / "etc/hy3spark/node.env").read_text()


@pytest.mark.parametrize("name", NODES)
def test_ray_non_carry_over_list_is_on_every_node(name: str) -> None:
    f = node(name).file("/etc/hy3spark/vllm/ray_non_carry_over_env_vars.json")
    rendered = RENDERED / "files" / HEAD / "etc/hy3spark/vllm/ray_non_carry_over_env_vars.json"
    assert f.content_string == rendered.read_text()
    assert {"VLLM_HOST_IP", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "UCX_NET_DEVICES", "VLLM_API_KEY",
            "HF_TOKEN"} <= set(json.loads(f.content_string))


def test_serve_script_and_secrets_file() -> None:
    script = node(HEAD).file("/etc/hy3spark/serve.sh")
    assert script.mode == 0o755
    assert script.content_string == (RENDERED / "files" / HEAD / "etc/hy3spark/serve.sh").read_text()
    assert "--distributed-executor-backend ray" in script.content_string
    secrets = node(HEAD).file("/etc/hy3spark-secrets/secrets.env")
    assert secrets.mode == 0o600 and secrets.user == "root"
    assert node(HEAD).file("/etc/hy3spark-secrets").mode == 0o700
    assert f"VLLM_API_KEY={API_KEY}" in secrets.content_string.splitlines()
    assert not node(HEAD).file("/etc/hy3spark/secrets.env").exists


def test_models_lists_the_served_name() -> None:
    status, body = api("/v1/models")
    assert status == 200
    assert [m["id"] for m in body["data"]] == [SERVED]


def test_endpoint_refuses_requests_without_the_key() -> None:
    status, _ = api("/v1/models", key="")
    assert status == 401


def test_completion_returns_text() -> None:
    status, body = api("/v1/completions", {"model": SERVED, "prompt": "Hello", "max_tokens": 8})
    assert status == 200
    assert body["choices"][0]["text"].strip()


def test_chat_works_because_the_hy_v3_parsers_know_the_suffixed_tokens() -> None:
    """Unpatched vLLM 0.23 parsers answer every chat request with 400 on Hy3's `:opensource` tokenizer."""
    status, body = api("/v1/chat/completions",
                       {"model": SERVED, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"]


def test_each_rank_kept_its_own_node_settings() -> None:
    """The engine copies the head's NCCL/GLOO/VLLM_* env to the Ray workers unless ray_non_carry_over_env_vars.json
    lists them: the worker's rank must still see its own VLLM_HOST_IP (test-double endpoint /double/workers)."""
    status, body = api("/double/workers")
    assert status == 200, body
    ranks = body["workers"]
    assert {r["hostname"]: r["vllm_host_ip"] for r in ranks} == FABRIC_IP
    assert {r["node_ip"]: r["vllm_host_ip"] for r in ranks} == {ip: ip for ip in FABRIC_IP.values()}
    # Each rank loaded the model on its own node, at the same path (model_sync's copy on the worker).
    assert {r["model_path"] for r in ranks} == {MODEL_SNAPSHOT}
    # The head's API key stayed on the head: the engine copies VLLM_* to the workers unless the list names it.
    assert {r["hostname"]: r["secret_env_names"] for r in ranks} == {name: [] for name in FABRIC_IP}


def test_engine_output_reaches_docker_logs_and_the_serve_log() -> None:
    logs = node(HEAD).run(f"docker logs {CONTAINER[HEAD]}")
    both = logs.stdout + logs.stderr
    assert "Application startup complete." in both
    assert "Application startup complete." in node(HEAD).file(SERVE_LOG).content_string


def test_api_key_is_not_visible() -> None:
    assert API_KEY
    assert API_KEY not in node(HEAD).check_output("ps -eo args")
    for name in NODES:
        assert API_KEY not in node(name).check_output(f"docker inspect {CONTAINER[name]}")
    assert API_KEY not in node(HEAD).check_output(f"cat {RUN_FILE}")


def test_hy_v3_parsers_were_patched_for_the_suffixed_tokens() -> None:
    record = run_record()
    assert record["parsers"] and set(record["parsers"].values()) == {"patched"}
    for path in record["parsers"]:
        text = node(HEAD).check_output(f"docker exec {CONTAINER[HEAD]} cat {path}")
        assert '"<tool_calls:opensource>"' in text or '"<think:opensource>"' in text
        assert '"<tool_calls>"' not in text and '"<think>"' not in text


def test_run_record_holds_the_kv_cache_lines() -> None:
    record = run_record()
    assert node(HEAD).file(RUN_FILE).mode == 0o600
    # vLLM 0.23.0's own numbers for the Hy3 profile on a GB10 (tests/fixtures/vllm-0.23.0, made by vLLM's KV code):
    # the double prints the vector's lines, so the deployment is compared with vLLM, not with our planner.
    cases = json.loads((REPO / "tests/fixtures/vllm-0.23.0/kv-cases.json").read_text())["cases"]
    vllm = next(case for case in cases if case["id"] == "hy3-profile-gb10-nvml-unsupported")["vllm"]
    assert record["kv_cache_line"].endswith(vllm["lines"][0]), record
    assert record["kv_cache_tokens"] == vllm["kv_cache_tokens"] == 287856
    assert record["max_concurrency_line"].endswith(vllm["lines"][1]), record
    assert record["max_concurrency"] == float(vllm["max_concurrency_printed"])
    assert "--distributed-executor-backend" in record["argv"]


def test_idempotent_run_left_the_engine_and_containers_alone() -> None:
    """The run record was written by the first converge; idempotence (changed=0) kept it, so these are the first
    run's engine and containers."""
    record = run_record()
    assert engine_pids() == [record["engine_pid"]]
    for name in NODES:
        assert inspect(name)["Id"] == record["containers"][name]
    assert inspect(HEAD)["State"]["StartedAt"] == record["head_started_at"]


# --- re-runs: in sync, forced, and after a hand edit -----------------------------------------------------------------


def test_deployment_record_is_private_and_holds_no_secret() -> None:
    for name in NODES:
        record = node(name).file(DRIFT_RECORD)
        assert (record.mode, record.user) == (0o600, "root")
        assert API_KEY not in record.content_string
        state = json.loads(record.content_string)["state"]
        assert state["containers"][CONTAINER[name]]["id"] == inspect(name)["Id"]
        # What the roles declare (roles/*/meta/state.yml): ray_node's env file, observed by hash, mode and owner.
        assert state["files"]["/etc/hy3spark/node.env"]["mode"] == "0600"


def test_rerun_in_sync_skips_the_roles_and_checks_the_endpoint() -> None:
    result = playbook(str(SCENARIO / "converge.yml"))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "Every node matches its last complete run" in flat(out), out
    assert recap(out) == {HEAD: 0, WORKER: 0}, out
    # The drift check and the completion only: no role task ran (each would add to ok=).
    # The drift check and the endpoint check (/v1/models, one completion): a dozen tasks, never the roles.
    assert all(ok <= 12 for ok in recap(out, "ok").values()), out
    assert f"{SERVED} answered: " in out, out
    assert API_KEY not in out


def test_check_mode_of_every_role_on_a_healthy_cluster() -> None:
    # Molecule's own check step meets an in-sync cluster, where the drift check skips every role: so the roles'
    # check mode runs here, forced through all of them. Nothing would change, and check mode must not touch anything.
    # (A forced real run through every role is Molecule's idempotence step: a partial run to the drift check, so
    # every role runs, changed=0; test_idempotent_run_left_the_engine_and_containers_alone checks it restarted
    # nothing.)
    result = playbook(str(SCENARIO / "converge.yml"), "--check", "--diff", "-e", "drift_full_run=true")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "drift_full_run is set: every role runs." in flat(out), out
    assert all(ok > 50 for ok in recap(out, "ok").values()), out
    assert recap(out) == {HEAD: 0, WORKER: 0}, out
    assert API_KEY not in out
    test_idempotent_run_left_the_engine_and_containers_alone()


def test_hand_edit_on_one_node_runs_the_roles_and_is_repaired() -> None:
    earlyoom = "/etc/default/earlyoom"
    before = node(WORKER).file(earlyoom).content_string
    node(WORKER).check_output(f"sh -c 'echo \"# edited by hand\" >> {earlyoom}'")
    result = playbook(str(SCENARIO / "converge.yml"))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert f"{HEAD}: matches; {WORKER}: files {earlyoom}" in flat(out), out
    changed = recap(out)
    assert changed[HEAD] == 0 and changed[WORKER] > 0, out
    assert node(WORKER).file(earlyoom).content_string == before
    test_idempotent_run_left_the_engine_and_containers_alone()
    again = playbook(str(SCENARIO / "converge.yml"))
    assert "Every node matches its last complete run" in flat(again.stdout), again.stdout


# --- faults: each failing run names its cause, and the next run recovers from it --------------------------------
# One after another, each fault's run also shows that it recovered from the one before (the worker's Ray is back; the
# engine starts with the spec's command), and the last clean run recovers from the last: three failing runs and one
# clean one instead of three of each.


def test_fault_worker_dies_before_serving() -> None:
    # The worker's Ray container dies as soon as it starts (killed, as the kernel's OOM killer would): a watcher on
    # the worker kills every start of it. The run must fail at the Ray gate, before serving, and say why.
    with scenario.killed_on_start(node(WORKER), CONTAINER[WORKER]):
        result = playbook(str(SCENARIO / "converge.yml"))
        out = result.stdout + result.stderr
        assert result.returncode != 0, out
        assert "Ray reports 1 of 2 nodes and 1 of 2 GPUs (alive: 10.95.0.11)" in out, out
        # The boot unit starts the container again every 5 s and the fault kills each start: the gate finds it
        # killed, or in the moment between a start and its kill.
        assert re.search(rf"{WORKER} \({FABRIC_IP[WORKER]}\): container {CONTAINER[WORKER]} (exited with exit code "
                         r"137 \(SIGKILL\)|is running but its Ray is not in the cluster)", out), out
        assert "GPU KV cache size" not in out, "the engine must not be started on a broken cluster"


def variant(name: str, old: str, new: str) -> Path:
    """The scenario's spec with one edit, rendered: its group_vars file, to pass as `-e @file` over the inventory."""
    directory = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / name
    spec = (SCENARIO / "cluster.yml").read_text()
    assert old in spec, f"{old!r} is not in cluster.yml"
    directory.mkdir(exist_ok=True)
    (directory / "cluster.yml").write_text(spec.replace(old, new))
    render = [sys.executable, "-m", "hy3spark", "render", str(directory / "cluster.yml"), "--out",
              str(directory / "out")]
    subprocess.run(render, cwd=REPO, check=True, capture_output=True)
    return directory / "out/inventory/group_vars/all/hy3spark.yml"


def test_fault_engine_exits_at_startup() -> None:
    """The image's engine refuses the serve command at startup, as when the image holds another vLLM than the one
    whose option table the spec is checked against. A spec can no longer carry an unknown option (serving.extra_args
    is checked against vLLM 0.23's table), so the word is added to the rendered serve command."""
    group_vars = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "fault-unknown-flag.yml"
    rendered = yaml.safe_load(variant("fault-unknown-flag", "", "").read_text())
    rendered["hy3spark"]["serving"]["argv"].append("--no-such-flag")
    group_vars.write_text(yaml.safe_dump(rendered))
    result = playbook(str(SCENARIO / "converge.yml"), "-e", f"@{group_vars}", "-v")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "The engine exited" in out, out
    assert "unrecognized arguments: --no-such-flag" in out, out
    assert API_KEY not in out
    # The run recovered from the fault before (the worker's Ray container killed at every start) on its way.
    assert "Ray reports 1 of 2 nodes" not in out, out
    test_ray_reports_two_nodes_and_two_gpus()


def test_fault_nccl_falls_back_to_sockets_on_the_worker() -> None:
    # The engine double's NIC is fake, so the test decides what NCCL reports: here the worker's rank finds no usable
    # RDMA device and NCCL silently takes TCP (NET/Socket), as on a Spark whose HCA names are wrong. The engine
    # starts and answers; the transport gate must still fail the run, naming the worker and its channels.
    # The variable sits in each node's env file (host_vars): the whole variant inventory is deployed.
    group_vars = variant("fault-nccl-socket", "  gpus: false\n",
                         f"  gpus: false\n  env: {{VLLM_DOUBLE_NCCL_NET: {WORKER}=Socket}}\n")
    rendered = group_vars.parents[2]
    assert f"VLLM_DOUBLE_NCCL_NET: {WORKER}=Socket" in (rendered / "host_vars" / f"{WORKER}.yml").read_text()
    inventory = scenario.variant_inventory(rendered.parent.parent, rendered)
    result = playbook(str(SCENARIO / "converge.yml"), inventory=inventory)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    text = flat(out)
    assert "Fail when NCCL fell back to TCP or logged no channel" in text, out
    assert f"fatal: [{HEAD}]" in out, out
    assert "4 channel(s) go over NET/Socket, NCCL's TCP fallback, instead of RDMA" in text, out
    # Every listed channel touches the worker; the head's own rank kept RDMA.
    # The listing prints once in the task's message and once more in the failure summary: count distinct lines.
    sockets = set(re.findall(r"channel \d+: rank \d -> rank \d \(\S+ -> \S+\) \[\w+\] via NET/Socket/0", out))
    assert len(sockets) == 4, out
    assert all(f"{WORKER} ->" in line or f"-> {WORKER})" in line for line in sockets), out
    assert API_KEY not in out
    assert any(e.startswith("VLLM_DOUBLE_NCCL_NET=") for e in inspect(WORKER)["Config"]["Env"])
    # The run recovered from the fault before: the engine started again with the spec's own command, and answers.
    (argv,) = scenario.engines(HEAD, CONTAINER[HEAD]).values()
    assert "--no-such-flag" not in argv and "--served-model-name" in argv, argv
    test_completion_returns_text()
    # The clean spec again: the variable leaves the env file AND the running container (docker_container would keep
    # a removed variable by default, so a fixed spec would never fix the fault), and the gate passes.
    result = playbook(str(SCENARIO / "converge.yml"))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    for name in NODES:
        assert not any(e.startswith("VLLM_DOUBLE_NCCL_NET=") for e in inspect(name)["Config"]["Env"]), name
    assert "NET/Socket" not in out, out
    record = run_record()
    assert "--no-such-flag" not in record["argv"]
    assert engine_pids() == [record["engine_pid"]]
    test_ray_reports_two_nodes_and_two_gpus()
    test_completion_returns_text()


# --- the collection as an ops engineer installs it ----------------------------------------------------------------


def test_the_installed_collection_runs_site_by_full_name() -> None:
    """`ansible-galaxy collection build` + `install`, then `ansible-playbook hy3spark.cluster.site` with none of the
    checkout's role or plugin paths: the roles call every plugin by full name, so every task, module, filter and
    lookup must come from the installed copy. On the healthy cluster the fault cases left behind it changes nothing:
    first as is (the drift check finds every node in sync with the record the checkout's runs wrote, the installed
    content being byte for byte the same), then forced through every role (drift_full_run), which is what runs the
    modules, filters and lookups. Here, after the faults and before teardown, the cluster is converged and serving."""
    work = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "collection"
    work.mkdir(exist_ok=True)
    build = subprocess.run(["ansible-galaxy", "collection", "build", "--force", "--output-path", str(work), str(REPO)],
                           capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stdout + build.stderr
    (tarball,) = work.glob("hy3spark-cluster-*.tar.gz")
    installed = work / "collections"
    install = subprocess.run(["ansible-galaxy", "collection", "install", "--force", "-p", str(installed), str(tarball)],
                             capture_output=True, text=True, check=False)
    assert install.returncode == 0, install.stdout + install.stderr
    collection = installed / "ansible_collections" / "hy3spark" / "cluster"
    # converge.yml's test-only play inputs (see there), as extra vars: the same values, so the same run inputs.
    inputs = work / "converge-vars.yml"
    inputs.write_text(yaml.safe_dump(converge_vars()))
    # community.docker and the other collections come with the `ansible` package, on ansible-core's own sys.path.
    env = {k: v for k, v in os.environ.items()
           if k not in ("ANSIBLE_ROLES_PATH", "ANSIBLE_LIBRARY", "ANSIBLE_FILTER_PLUGINS", "ANSIBLE_LOOKUP_PLUGINS")}
    env.update(ANSIBLE_COLLECTIONS_PATH=str(installed), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", COLUMNS="1000")
    inventory = str(Path(scenario.INVENTORY).parent)
    for extra, says in (((), "Every node matches its last complete run"),
                        (("-e", "drift_full_run=true"), "drift_full_run is set: every role runs.")):
        argv = ["ansible-playbook", "hy3spark.cluster.site", "-i", inventory, "-vv", "-e", f"@{inputs}", *extra]
        result = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900, check=False)
        out = result.stdout + result.stderr
        assert result.returncode == 0, out[-20000:]
        assert says in flat(out), out[-20000:]
        assert recap(out) == {HEAD: 0, WORKER: 0}, out[-20000:]
        paths = sorted(set(re.findall(r"^task path: (\S+):\d+$", out, re.M)))
        assert paths and [p for p in paths if not p.startswith(f"{collection}/")] == [], paths
        assert API_KEY not in out
    # The forced run went through every role from the installed copy, plugins included.
    for role in ("preflight", "network", "earlyoom", "image", "model_sync", "ray_node", "vllm_serve"):
        assert any(p.startswith(f"{collection}/roles/{role}/") for p in paths), role
    assert all(ok > 50 for ok in recap(out, "ok").values()), out[-20000:]
    test_idempotent_run_left_the_engine_and_containers_alone()


# --- the wheel as an ops engineer installs it: `hy3spark up` and `down` from a fresh venv -----------------------------


@pytest.fixture(scope="module")
def wheel() -> Iterator[Installed]:
    """The wheel built from this checkout, installed with its dependencies in a fresh venv in a temporary directory
    (tests/wheel_venv.py, as tests/test_wheel.py does), its user's environment only PATH, HOME, XDG_* and LC_ALL (no
    PYTHONPATH, VIRTUAL_ENV or ANSIBLE_*: nothing leads back to the checkout or .venv). Beside the inventory the CLI
    renders for this spec under its runs directory ($XDG_STATE_HOME/hy3spark; it keeps files it did not make), the
    test machine's inputs: the nodes are Molecule platforms that Ansible reaches with `docker exec` (the spec's
    ssh_host is each platform's container name), with pipelining as in Molecule's runs, and converge.yml's
    test-only play inputs, so that the run's inputs are those of the scenario's own runs."""
    name = yaml.safe_load(SPEC.read_text())["name"]
    with installed_wheel("hy3spark-site-wheel-") as installed:
        extra = installed.home / "state" / "hy3spark" / "inventory" / name / "inventory" / "group_vars" / "all"
        extra.mkdir(parents=True)
        connection = {"ansible_connection": "community.docker.docker", "ansible_pipelining": True}
        (extra / "test-machine.yml").write_text(yaml.safe_dump({**connection, **converge_vars()}))
        (installed.home / "cwd").mkdir()
        yield installed


def hy3spark(wheel: Installed, *argv: str) -> subprocess.CompletedProcess[str]:
    """The installed executable from an empty directory, with the spec's API key exported as an operator would. The
    spec is the scenario's own file: the rendered inventory names its path, and the drift check hashes that among
    the run's inputs (a copy elsewhere would be another input, and every role would run)."""
    return wheel.run(*argv, str(SPEC), cwd=wheel.home / "cwd", timeout=900, env={KEY_ENV: API_KEY})


def test_the_installed_wheel_up_finds_the_cluster_in_sync(wheel: Installed) -> None:
    """`hy3spark up` of the installed wheel on the healthy cluster: the drift check finds every node as the
    checkout's runs recorded it (the wheel's content being the checkout's, byte for byte), so the roles are skipped
    and one completion checks the endpoint: changed=0 on both nodes, exit 0, the engine and containers untouched."""
    proc = hy3spark(wheel, "up")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-20000:]
    assert "site.yml: ok in" in proc.stdout, out[-20000:]
    match = re.search(r"^run record: (\S+)$", proc.stdout, re.M)
    assert match, proc.stdout
    record = json.loads(Path(match.group(1)).read_text())
    assert record["status"] == "successful" and record["exit_code"] == 0
    assert record["ray"] == {"nodes": 2, "gpus_total": 2.0, "gpus_used": 2.0}
    assert record["kv_lines"], record
    # ansible-runner's artifacts of the site.yml run: ansible-playbook's output and the command it ran.
    (artifacts,) = (Path(record["artifacts"]) / "artifacts").iterdir()
    log = (artifacts / "stdout").read_text()
    assert "Every node matches its last complete run" in flat(log), log[-20000:]
    assert recap(log) == {HEAD: 0, WORKER: 0}, log[-20000:]
    assert f"{SERVED} answered: " in log, log[-20000:]
    command = json.loads((artifacts / "command").read_text())
    shipped = wheel.site_packages / "hy3spark" / "_content"
    assert command["env"]["ANSIBLE_COLLECTIONS_PATH"] == str(shipped), command["env"]
    for key in ("ANSIBLE_CONFIG", "ANSIBLE_ROLES_PATH"):
        assert command["env"][key].startswith(f"{shipped}/"), command["env"]
    assert str(REPO) not in json.dumps(command), command
    # Neither the API key nor the cluster's Ray token in the output, ansible-runner's artifacts or the run records.
    ray_token = node(HEAD).check_output("cat /etc/hy3spark/ray-token").strip()
    assert API_KEY not in out and ray_token not in out
    leaks = [str(p) for p in wheel.home.rglob("*") if p.is_file()
             and (API_KEY.encode() in p.read_bytes() or ray_token.encode() in p.read_bytes())]
    assert leaks == []
    test_idempotent_run_left_the_engine_and_containers_alone()


def test_the_installed_wheel_checks_the_cluster_and_a_dry_run_changes_nothing(wheel: Installed) -> None:
    """`hy3spark check --dry-run` of the installed wheel: the preflight table for both nodes, then site.yml in check
    and diff mode (the drift check finds the cluster in sync), exit 0, and nothing restarted."""
    proc = hy3spark(wheel, "check", "--dry-run")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-20000:]
    for name in NODES:
        assert re.search(rf"^{name}\s+mtu\s+PASS\s+9000\s+9000$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^preflight: \d+ pass, 0 fail", proc.stdout, re.M), proc.stdout
    assert "site.yml: ok in" in proc.stdout, out[-20000:]
    assert API_KEY not in out
    test_idempotent_run_left_the_engine_and_containers_alone()


# --- restarts (docs/restarts.md): nodes and the engine come back by themselves, with no Ansible run -------------------
# Each case waits for the head's supervisor to serve a new engine and for a completion, and prints the seconds from
# the event to that completion (RECOVERY lines). The engine double loads nothing: a real Spark adds its model load.


def supervised_engine() -> int:
    state = scenario.supervisor_state(HEAD)
    assert state.get("state") == "serving", state
    return int(state["pid"])


def serving_again(old_pid: int, case: str, start: float, timeout: float = 600) -> dict:
    def check() -> dict | None:
        state = scenario.supervisor_state(HEAD)
        if state.get("state") == "serving" and state.get("pid") not in (None, old_pid) \
                and scenario.answers(HEAD, SERVED, API_KEY):
            return state
        return None
    state, _ = scenario.wait_for(f"{case}: the endpoint serving again", check, timeout, every=2)
    scenario.report_recovery(case, time.monotonic() - start)
    assert isinstance(state, dict)
    # The run record follows the supervisor's engine, so the next Ansible run leaves it alone.
    assert run_record()["engine_pid"] == state["pid"] == engine_pids()[0], (state, run_record())
    test_ray_reports_two_nodes_and_two_gpus()
    return state


def test_units_start_each_container_at_boot_and_the_supervisor_watches_the_engine() -> None:
    for name in NODES:
        u = scenario.unit(name, scenario.NODE_UNIT)
        assert (u["ActiveState"], u["UnitFileState"]) == ("active", "enabled"), (name, u)
    u = scenario.unit(HEAD, scenario.SUPERVISOR_UNIT)
    assert (u["ActiveState"], u["UnitFileState"]) == ("active", "enabled"), u
    assert scenario.unit(WORKER, scenario.SUPERVISOR_UNIT)["UnitFileState"] != "enabled"
    assert supervised_engine() == run_record()["engine_pid"]


def test_restart_engine_sigkilled() -> None:
    old = supervised_engine()
    start = time.monotonic()
    node(HEAD).check_output("docker exec %s kill -9 %s", CONTAINER[HEAD], str(old))
    state = serving_again(old, "engine SIGKILLed", start)
    assert any("exited" in e["event"] for e in state["events"]), state["events"]


def test_restart_worker_node() -> None:
    old = supervised_engine()
    start = time.monotonic()
    scenario.reboot(WORKER)
    serving_again(old, "worker node restarted", start)


def test_restart_head_node() -> None:
    old = supervised_engine()
    start = time.monotonic()
    scenario.reboot(HEAD)
    serving_again(old, "head node restarted", start)


def test_restart_both_nodes() -> None:
    old = supervised_engine()
    start = time.monotonic()
    scenario.reboot(HEAD, WORKER)
    serving_again(old, "both nodes restarted", start)


def test_a_rerun_after_the_restarts_restarts_nothing() -> None:
    """The supervisor's engine is the run record's: site.yml finds it serving and leaves it and the containers alone
    (the drift check sees the new engine and containers and runs the roles, which change nothing that serves)."""
    pid = supervised_engine()
    started = {name: inspect(name)["State"]["StartedAt"] for name in NODES}
    result = playbook(str(SCENARIO / "converge.yml"))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "leaving the engine alone" in out, out
    assert engine_pids() == [pid]
    assert {name: inspect(name)["State"]["StartedAt"] for name in NODES} == started
    again = playbook(str(SCENARIO / "converge.yml"))
    assert again.returncode == 0 and recap(again.stdout) == {HEAD: 0, WORKER: 0}, again.stdout


# --- the way back -----------------------------------------------------------------------------------------------------


def test_teardown_removes_every_container_of_ours_and_keeps_the_model(wheel: Installed) -> None:
    """`hy3spark down` of the installed wheel first, then the checkout's teardown.yml again: nothing left to do."""
    proc = hy3spark(wheel, "down")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-20000:]
    assert "playbooks/teardown.yml: ok in" in proc.stdout, out[-20000:]
    assert API_KEY not in out
    for name in NODES:
        assert f"{name}: MemAvailable " in out, out
        left = node(name).check_output("docker ps -aq --filter label=io.hy3spark.cluster")
        assert left.strip() == ""
        assert node(name).file(f"{MODEL_SNAPSHOT}/config.json").exists
        assert node(name).file("/etc/hy3spark/node.env").exists
        assert node(name).file("/etc/netplan/60-hy3spark-fabric.yaml").exists
        assert f"inet {FABRIC_IP[name]}/24" in node(name).check_output("ip -o -4 addr show dev eth1")
    again = playbook(str(REPO / "playbooks/teardown.yml"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert recap(again.stdout) == {HEAD: 0, WORKER: 0}, again.stdout


def test_after_down_a_reboot_brings_nothing_back() -> None:
    """`hy3spark down` disabled the boot units and the supervisor: after both nodes reboot, nothing of ours runs."""
    for name in NODES:
        assert scenario.unit(name, scenario.NODE_UNIT)["UnitFileState"] == "disabled", name
    assert scenario.unit(HEAD, scenario.SUPERVISOR_UNIT)["UnitFileState"] == "disabled"
    scenario.reboot(HEAD, WORKER)
    for name in NODES:
        scenario.wait_for(f"{name}: systemd up", lambda n=name: node(n).run("systemctl is-system-running --wait")
                          .stdout.strip() in ("running", "degraded"), 180)
    time.sleep(10)  # a unit that would start a container retries every 5 s
    for name in NODES:
        assert node(name).check_output("docker ps -q").strip() == "", name
        assert scenario.unit(name, scenario.NODE_UNIT)["ActiveState"] == "inactive", name
    assert scenario.unit(HEAD, scenario.SUPERVISOR_UNIT)["ActiveState"] == "inactive"
