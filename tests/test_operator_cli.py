"""The operator's CLI (`hy3spark up/status/logs/check/down`) against a real two-node test cluster.

The cluster: two `hy3spark/dnode` systemd containers (each with its own Docker engine, where the Ray head and worker
containers run as on two Sparks), on a management network (10.96.0.0/24, what the controller's SSH uses: each node's
`ssh_host`) and an internal 9000-MTU fabric (10.96.1.0/24). The controller is this machine: the CLI runs as a
subprocess (not a terminal), renders its own inventory from the spec, and connects over SSH as root with a test key
and pinned host keys (no host key checking is turned off). Prepared as site.yml expects a fresh Spark: the serving
image (real Ray + the vLLM TEST DOUBLE, tests/engine_double) loaded under the spec's image.ref, the synthetic
Hy3-shaped model in the head's hub cache, a wheelhouse for model_sync's huggingface_hub venv (no PyPI in the nodes).

One cluster serves every positive case (module fixture), the tests run in file order: usage errors first, then
`up`, `status`, `logs`, `check`, a failing `up`, `down`, and last the search of every file the runs left for the
secrets. The fixture removes the nodes and networks at the end, on failure too, and what a killed earlier run left.

Test-machine inputs the spec cannot carry go in a group_vars file beside the CLI's rendered inventory (the CLI
re-renders its own files there and leaves others alone): memlock at this sandbox's 8 MiB hard limit (no
CAP_SYS_RESOURCE: runc cannot set the rendered unlimited memlock) and pip from the wheelhouse.

Needs root, Docker and the images of `.cache/images.env` (scripts/test builds them before pytest); skips otherwise.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
IMAGES_ENV = REPO / ".cache" / "images.env"
WHEELHOUSE = REPO / ".cache" / "operator-cli-wheels"
MAKE_MODEL = REPO / "tests" / "engine_double" / "make_model.py"

CLUSTER = "cli-test"
HEAD, WORKER = "opcli-head", "opcli-worker"
NODES = (HEAD, WORKER)
MGMT_NET, FABRIC_NET = "opcli-0-mgmt", "opcli-1-fabric"  # Docker names interfaces in this order: eth0, eth1
MGMT_SUBNET, FABRIC_SUBNET = "10.96.0.0/24", "10.96.1.0/24"
MGMT = {HEAD: "10.96.0.11", WORKER: "10.96.0.12"}
FABRIC = {HEAD: "10.96.1.11", WORKER: "10.96.1.12"}
NOBODY = "10.96.0.99"  # on the management network, nothing answers there
LABEL = "org.hy3spark.test=operator-cli"
IMAGE_REF = "hy3spark/engine-double:cli"
REVISION = "0c11c0ffee0c11c0ffee0c11c0ffee0c11c0ffee"
CONTAINERS = {HEAD: "hy3-head", WORKER: "hy3-worker"}
SERVED = "hy3"
SERVE_LOG = "/var/log/hy3spark/serve.log"

# Known fake secrets: searched for in every file the runs leave and in every process's command line.
HF_TOKEN = "hf_FAKE1234567890abcdefghij"
API_KEY = f"opcli-{secrets.token_hex(16)}"
SECRETS = {"HF_TOKEN": HF_TOKEN, "VLLM_API_KEY": API_KEY}

SPEC = f"""\
# Test spec of tests/test_operator_cli.py: the Hy3 profile on two dnodes; the controller connects to each node's
# management address, the nodes talk over the fabric (eth1). No GPUs: Ray is told one per node, the engine is the
# vLLM test double; the model is a synthetic Hy3-shaped snapshot (a few KB whose index says 181 GB).
name: {CLUSTER}
profile: hy3-295b-nvfp4-tp2
head:
  name: {HEAD}
  fabric_ip: {FABRIC[HEAD]}/24
  ssh_host: {MGMT[HEAD]}
  ssh_user: root
workers:
  - name: {WORKER}
    fabric_ip: {FABRIC[WORKER]}/24
    ssh_host: {MGMT[WORKER]}
    ssh_user: root
fabric:
  interfaces: [eth1]
  # A Spark's two RoCE twins. The nodes have no RDMA device (preflight skips the HCA check); the engine double
  # reports RDMA channels when NCCL_IB_HCA reaches the containers through the node env file, TCP otherwise.
  hcas: [rocep1s0f1, roceP2p1s0f1]
  mtu: 9000
image:
  ref: {IMAGE_REF}
model:
  revision: {REVISION}
  size_bytes: 1000000
  token_env: HF_TOKEN
serving:
  api_key_env: VLLM_API_KEY
  health_timeout_s: 180
  extra_args: []
ray:
  object_store_memory_bytes: 78643200
container:
  gpus: false
"""

# The spec's inputs a test machine cannot have: group_vars beside the CLI's rendered inventory.
TEST_MACHINE_VARS = """\
ray_head_ulimits: &ulimits ["memlock:8388608:8388608", "stack:67108864:67108864"]
ray_worker_ulimits: *ulimits
model_sync_pip_extra_args: --no-index --find-links /opt/wheels
"""


# --- helpers --------------------------------------------------------------------------------------------------------
def sh(*argv: str, input_path: Path | None = None, timeout: float = 300, check: bool = True) -> str:
    stdin = input_path.open("rb") if input_path else subprocess.DEVNULL
    try:
        out = subprocess.run(argv, stdin=stdin, capture_output=True, text=True, timeout=timeout, check=False)
    finally:
        if input_path:
            stdin.close()
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr or out.stdout}")
    return out.stdout


def node_sh(name: str, script: str, timeout: float = 300, check: bool = True) -> str:
    return sh("docker", "exec", name, "bash", "-c", script, timeout=timeout, check=check)


def images() -> dict[str, str]:
    if not IMAGES_ENV.is_file():
        return {}
    pairs = (line.split("=", 1) for line in IMAGES_ENV.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def remove_everything() -> None:
    """Inner containers first (they nest in the nodes' cgroups), then the nodes with their volumes, then networks."""
    for name in NODES:
        if subprocess.run(["docker", "inspect", name], capture_output=True, check=False).returncode == 0:
            node_sh(name, "ids=$(docker ps -aq 2>/dev/null); [ -z \"$ids\" ] || docker rm -f $ids", check=False,
                    timeout=120)
            sh("docker", "rm", "-f", "-v", name, check=False, timeout=120)
    for net in (MGMT_NET, FABRIC_NET):
        sh("docker", "network", "rm", net, check=False)


@dataclass
class Cluster:
    root: Path
    runs: Path
    spec: Path
    env: dict[str, str]
    tmpdir: Path  # the CLI's TMPDIR: where its secrets hand-over file lives during a run
    seen_in_cmdlines: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)  # what one test leaves for the next (they run in order)

    def spec_file(self, name: str, text: str) -> Path:
        path = self.root / name
        path.write_text(text)
        return path

    def cli(self, *argv: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        """The CLI as a user runs it, not on a terminal; while it runs, watch every command line for the secrets."""
        proc = subprocess.Popen([sys.executable, "-m", "hy3spark", *argv], cwd=REPO, env=self.env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        watcher = CmdlineWatcher()
        watcher.start()
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"hy3spark {' '.join(argv)} ran over {timeout} s:\n{err[-4000:]}") from None
        finally:
            self.seen_in_cmdlines.extend(watcher.stop())
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class CmdlineWatcher(threading.Thread):
    """Polls /proc/*/cmdline (every process on the machine) for the secret values."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self._halt = threading.Event()
        self.found: list[str] = []
        self.polls = 0

    def run(self) -> None:
        values = [v.encode() for v in SECRETS.values()]
        while not self._halt.is_set():
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                        cmdline = fh.read()
                except OSError:
                    continue
                for value in values:
                    if value in cmdline:
                        words = cmdline.replace(b"\0", b" ")[:300]
                        self.found.append(f"pid {entry.name}: {words!r}")
            self.polls += 1
            self._halt.wait(0.2)

    def stop(self) -> list[str]:
        self._halt.set()
        self.join()
        assert self.polls > 0
        return self.found


def start_node(name: str, image: str) -> None:
    sh("docker", "create", "--name", name, "--hostname", name, "--label", LABEL,
       "--cap-add", "SYS_ADMIN", "--cap-add", "NET_ADMIN",
       "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined", "--cgroupns", "host",
       "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw", "-v", "/var/lib/docker",
       "--tmpfs", "/run", "--tmpfs", "/run/lock", "--tmpfs", "/tmp", "--shm-size", "512m",
       "--stop-signal", "SIGRTMIN+3", "--network", MGMT_NET, "--ip", MGMT[name], image, "/lib/systemd/systemd")
    sh("docker", "network", "connect", "--ip", FABRIC[name], FABRIC_NET, name)
    sh("docker", "start", name)


def prepare_node(name: str, image_tar: Path, serving_image: str, pubkey: str) -> str:
    """A fresh Spark as site.yml expects it; returns the node's `known_hosts` line (its own ed25519 host key)."""
    node_sh(name, "for i in $(seq 120); do systemctl is-system-running 2>/dev/null | grep -Eq 'running|degraded' "
                  "&& break; sleep 1; done; systemctl start ssh.service docker.service", timeout=180)
    node_sh(name, f"install -d -m 0700 /root/.ssh && echo '{pubkey}' > /root/.ssh/authorized_keys && "
                  "chmod 0600 /root/.ssh/authorized_keys")
    # netplan apply calls udevadm and writes /sys: a real host has both.
    node_sh(name, "mount -o remount,rw /sys && systemctl start systemd-udevd.service")
    node_sh(name, "for i in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done; docker info >/dev/null")
    sh("docker", "exec", "-i", name, "docker", "load", input_path=image_tar, timeout=600)
    node_sh(name, f"docker tag {serving_image} {IMAGE_REF}")
    if name == HEAD:
        sh("docker", "exec", "-i", name, "python3", "-", "--cache", "/var/lib/hy3spark/hub",
           "--repo", "kodelow/Hy3-NVFP4-W4A16", "--commit", REVISION, input_path=MAKE_MODEL)
        sh("docker", "cp", f"{WHEELHOUSE}/.", f"{name}:/opt/wheels")
    key = node_sh(name, "cat /etc/ssh/ssh_host_ed25519_key.pub").split()
    return f"{MGMT[name]} {key[0]} {key[1]}"


def wheelhouse() -> None:
    """huggingface_hub's wheels (the version this venv has) for model_sync's venv on the head."""
    import huggingface_hub

    version = huggingface_hub.__version__
    if not list(WHEELHOUSE.glob(f"huggingface_hub-{version}-*.whl")):
        sh(sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(WHEELHOUSE),
           f"huggingface_hub=={version}", timeout=300)


# --- the cluster ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0 or shutil.which("docker") is None:
        pytest.skip("needs root and Docker")
    tags = images()
    dnode, serving = tags.get("HY3SPARK_DNODE_IMAGE"), tags.get("HY3SPARK_SERVING_IMAGE")
    if not dnode or not serving:
        pytest.skip(f"{IMAGES_ENV} names no dnode/serving image: run scripts/build-images (scripts/test does)")
    for image in (dnode, serving):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True, check=False).returncode:
            pytest.skip(f"image {image} is missing: run scripts/build-images (scripts/test does)")
    root = tmp_path_factory.mktemp("operator-cli")
    remove_everything()  # what a killed earlier run left
    try:
        yield build_cluster(root, dnode, serving)
    finally:
        remove_everything()


def build_cluster(root: Path, dnode: str, serving: str) -> Cluster:
    sh("docker", "network", "create", "--subnet", MGMT_SUBNET, "--label", LABEL, MGMT_NET)
    sh("docker", "network", "create", "--subnet", FABRIC_SUBNET, "--internal", "--label", LABEL,
       "-o", "com.docker.network.driver.mtu=9000", FABRIC_NET)
    for name in NODES:
        start_node(name, dnode)
    ssh_dir = root / "ssh"
    ssh_dir.mkdir(mode=0o700)
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "operator-cli-test", "-f", str(ssh_dir / "id"))
    pubkey = (ssh_dir / "id.pub").read_text().strip()
    wheelhouse()
    image_tar = root / "serving.tar"
    sh("docker", "save", "--output", str(image_tar), serving, timeout=600)
    known = [prepare_node(name, image_tar, serving, pubkey) for name in NODES]
    image_tar.unlink()
    (ssh_dir / "known_hosts").write_text("\n".join(known) + "\n")

    runs = root / "runs"
    # Test-machine inputs beside the inventory the CLI renders for this cluster (it keeps files it did not make).
    overrides = runs / "inventory" / CLUSTER / "inventory" / "group_vars" / "all" / "test-machine.yml"
    overrides.parent.mkdir(parents=True)
    overrides.write_text(TEST_MACHINE_VARS)
    tmpdir = root / "tmp"
    tmpdir.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "MOLECULE_"))}
    env.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "LC_ALL": "C.UTF-8",
        "TMPDIR": str(tmpdir),
        "ANSIBLE_PRIVATE_KEY_FILE": str(ssh_dir / "id"),
        # Host keys pinned: ansible.cfg keeps host_key_checking on.
        "ANSIBLE_SSH_COMMON_ARGS": f"-o UserKnownHostsFile={ssh_dir / 'known_hosts'} -o ConnectTimeout=10",
        **SECRETS,
    })
    spec = root / "cluster.yml"
    spec.write_text(SPEC)
    return Cluster(root=root, runs=runs, spec=spec, env=env, tmpdir=tmpdir)


# --- tests (file order) ---------------------------------------------------------------------------------------------
def cli_plain(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hy3spark", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


def record_of(stdout: str) -> tuple[Path, dict]:
    match = re.search(r"^run record: (\S+)$", stdout, re.M)
    assert match, f"no 'run record:' line in {stdout!r}"
    path = Path(match.group(1))
    return path, json.loads(path.read_text())


def serve_log_lines(pattern: str) -> list[str]:
    return node_sh(HEAD, f"grep -a -E {pattern!r} {SERVE_LOG} || true").splitlines()


def health() -> int:
    """/health of the engine, asked from the head node over the fabric (the endpoint's address)."""
    code = ("import sys, urllib.request, urllib.error\n"
            "try: print(urllib.request.urlopen(sys.argv[1], timeout=10).status)\n"
            "except urllib.error.HTTPError as e: print(e.code)\n"
            "except OSError: print(0)\n")
    return int(sh("docker", "exec", HEAD, "python3", "-c", code, f"http://{FABRIC[HEAD]}:8888/health").strip())


def ours(name: str) -> list[str]:
    return node_sh(name, f"docker ps -a --filter label=io.hy3spark.cluster={CLUSTER} --format '{{{{.Names}}}}'"
                   ).split()


def leftovers(runs: Path) -> list[str]:
    """Processes still working for the CLI: ansible(-playbook) is started with paths under the runs directory."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(runs) in cmdline:
                found.append(f"{entry.name} {cmdline[:200]}")
    return found


def test_bad_spec_exits_3_before_anything_runs(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yml"
    spec.write_text(SPEC.replace(f"fabric_ip: {FABRIC[WORKER]}/24", f"fabric_ip: {FABRIC[HEAD]}/24"))
    runs = tmp_path / "runs"
    proc = cli_plain("up", str(spec), "--runs-dir", str(runs), cwd=REPO)
    assert proc.returncode == 3, proc.stderr
    assert "workers[0].fabric_ip" in proc.stderr and "Traceback" not in proc.stderr
    assert not runs.exists(), "a bad spec must stop the CLI before it renders or runs anything"


def test_up_deploys_and_records_the_run(cluster: Cluster) -> None:
    proc = cluster.cli("up", str(cluster.spec), "--runs-dir", str(cluster.runs))
    assert proc.returncode == 0, proc.stderr[-6000:]
    # Not a terminal: plain progress lines per play and per host and task, no escape sequences.
    assert "\x1b[" not in proc.stderr
    assert "PLAY Preflight every node before changing anything" in proc.stderr
    assert "PLAY Serve the model" in proc.stderr
    assert re.search(rf"^  {HEAD}\s+changed\s+Start the engine in {CONTAINERS[HEAD]}$", proc.stderr, re.M)
    assert re.search(rf"^  {WORKER}\s+(ok|changed)\s+\S", proc.stderr, re.M)
    assert "site.yml: ok in" in proc.stdout

    path, record = record_of(proc.stdout)
    assert path.parent == cluster.runs / "records"
    assert record["status"] == "successful" and record["exit_code"] == 0
    assert record["spec_sha256"] == hashlib.sha256(cluster.spec.read_bytes()).hexdigest()
    image_id = node_sh(HEAD, f"docker image inspect --format '{{{{.Id}}}}' {IMAGE_REF}").strip()
    assert image_id.startswith("sha256:")
    assert record["image_ids"] == {HEAD: image_id, WORKER: image_id}
    assert record["versions"]["ray"] == "2.60.0" and record["versions"]["vllm"] == "0.23.0+testdouble"
    # The two lines the engine logged at startup, exactly as in the head's serve log.
    assert record["kv_lines"] == serve_log_lines("GPU KV cache size|Maximum concurrency for")
    assert re.search(r"GPU KV cache size: [\d,]+ tokens$", record["kv_lines"][0])
    assert re.search(r"Maximum concurrency for 131,072 tokens per request: [\d.]+x$", record["kv_lines"][1])
    # The NCCL channels the ranks logged: RDMA (the double's, as NCCL_IB_HCA reached both containers).
    assert record["transport"] and "NET/IB" in record["transport"] and "Socket" not in record["transport"]
    assert record["ray"] == {"nodes": 2, "gpus_total": 2.0, "gpus_used": 2.0}
    assert list(record["phases_s"]) == [
        "Compare every node with its last complete run", "Preflight every node before changing anything",
        "Configure the fabric and SSH between the nodes",
        "Check the fabric end to end", "Fence the cluster-internal ports with hy3spark's firewall table",
        "Reconcile earlyoom with the spec's policy", "Distribute the engine image and the model", "Start the Ray head",
        "Join the Ray workers", "Serve the model", "Record the deployment, or check the endpoint"]
    assert all(t > 0 for t in record["phases_s"].values())
    assert sum(record["phases_s"].values()) <= record["duration_s"] + 1

    lines = [x for x in (cluster.runs / "labbook.md").read_text().splitlines() if x.startswith("| ")]
    assert len(lines) == 1 and path.name in lines[0] and "successful" in lines[0]
    assert record["kv_lines"][0].split("] ")[-1] in lines[0]
    cluster.state["record"] = path


def test_second_up_finds_the_cluster_in_sync_and_full_run_changes_nothing(cluster: Cluster) -> None:
    engine = re.compile(rf"^  {HEAD}\s+(ok|changed)\s+Run container {CONTAINERS[HEAD]}$", re.M)
    proc = cluster.cli("up", str(cluster.spec), "--runs-dir", str(cluster.runs))
    assert proc.returncode == 0, proc.stderr[-6000:]
    # The drift check found every node as recorded: the roles were skipped, one completion checked the endpoint.
    assert re.search(rf"^  {HEAD}\s+ok\s+Check that the completion returned text$", proc.stderr, re.M), proc.stderr
    assert not engine.search(proc.stderr) and not re.search(r"^  \S+\s+changed\s", proc.stderr, re.M), proc.stderr
    _path, record = record_of(proc.stdout)
    assert record["status"] == "successful" and record["image_ids"][HEAD].startswith("sha256:")
    # --full-run: every role runs again, and changes nothing.
    proc = cluster.cli("up", str(cluster.spec), "--full-run", "--runs-dir", str(cluster.runs))
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert engine.search(proc.stderr), proc.stderr
    assert not re.search(r"^  \S+\s+changed\s", proc.stderr, re.M), proc.stderr
    path, record = record_of(proc.stdout)
    assert record["status"] == "successful" and record["kv_lines"]
    cluster.state["record"] = path  # this cluster's last run, for the status tests


def test_unreachable_host_exits_4_naming_it(cluster: Cluster) -> None:
    # Another cluster in the same runs directory, on addresses of the management network where nothing answers.
    spec = cluster.spec_file("nobody.yml", SPEC.replace(f"name: {CLUSTER}", "name: cli-nobody")
                             .replace(f"ssh_host: {MGMT[HEAD]}", "ssh_host: 10.96.0.98")
                             .replace(f"ssh_host: {MGMT[WORKER]}", f"ssh_host: {NOBODY}"))
    proc = cluster.cli("up", str(spec), "--runs-dir", str(cluster.runs), timeout=300)
    assert proc.returncode == 4, proc.stderr[-4000:]
    assert f"UNREACHABLE host {WORKER}" in proc.stderr and NOBODY in proc.stderr
    assert f"UNREACHABLE host {HEAD}" in proc.stderr


def test_status_json_reports_the_serving_cluster(cluster: Cluster) -> None:
    proc = cluster.cli("status", str(cluster.spec), "--runs-dir", str(cluster.runs), "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    status = json.loads(proc.stdout)
    assert status["ray"]["nodes"] == 2 and status["ray"]["gpus_total"] == 2.0
    assert status["endpoint"]["health"] == 200
    # /v1/models needs the API key: listing the model proves the key reached the play through the hand-over file.
    assert status["endpoint"]["models"] == [SERVED]
    assert status["kv_lines"] == json.loads(cluster.state["record"].read_text())["kv_lines"]
    for name in NODES:
        containers = {c["Names"]: c["State"] for c in status["nodes"][name]["containers"]}
        assert containers == {CONTAINERS[name]: "running"}
    assert status["nodes"][HEAD]["image_id"] == status["nodes"][WORKER]["image_id"]
    # The last run of THIS cluster, though another cluster's run was recorded after it in the same directory.
    assert status["last_run"]["file"] == str(cluster.state["record"])
    assert status["last_run"]["status"] == "successful"
    cluster.state["status"] = status


def test_status_for_people_names_every_node_in_full(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    from hy3spark import status

    status.print_status(cluster.state["status"])  # not a terminal: plain lines
    plain = capsys.readouterr().out
    for name in NODES:
        # docs/restarts.md: the node's boot unit on every node, the engine's supervisor on the head.
        units = "hy3spark-node.service active, enabled" + (
            "; hy3spark-supervisor.service active, enabled" if name == HEAD else "")
        assert re.search(rf"^{name}  \w+  containers {CONTAINERS[name]} \(running\)  units {re.escape(units)}  "
                         r"image [0-9a-f]{12}  memory [\d.]+ GiB free  ray 2\.60\.0  vllm 0\.23\.0\+testdouble$",
                         plain, re.M), plain
    screen = io.StringIO()
    status.print_status(cluster.state["status"], Console(file=screen, force_terminal=True, width=80))
    table = screen.getvalue()
    for out in (plain, table):
        assert f"cluster {CLUSTER}" in out and HEAD in out and WORKER in out
        assert "Ray: 2 node(s), 2 GPU(s)" in out
        assert f"endpoint http://{FABRIC[HEAD]}:8888: healthy; models: {SERVED}" in out
        assert "GPU KV cache size:" in out and "Maximum concurrency for 131,072 tokens per request:" in out
        assert f"last run: {json.loads(cluster.state['record'].read_text())['started']} successful" in out
        assert re.search(r"^supervisor: serving, engine PID \d+ \(since ", out, re.M), out


def test_logs_no_follow_prints_the_serve_log_tail(cluster: Cluster) -> None:
    # The engine's supervisor asks /health every 30 s and the engine logs each request: by now more than the
    # default 100 lines may follow the start, so the tail read reaches back to it.
    proc = cluster.cli("logs", str(cluster.spec), "--no-follow", "-n", "2000", "--runs-dir", str(cluster.runs))
    assert proc.returncode == 0, proc.stderr
    assert "Application startup complete." in proc.stdout
    assert f"hy3spark: starting vllm for {CLUSTER}" in proc.stdout
    proc = cluster.cli("logs", str(cluster.spec), "--no-follow", "-n", "5", "--runs-dir", str(cluster.runs))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == node_sh(HEAD, f"tail -n 5 {SERVE_LOG}")


def test_logs_follow_detaches_on_ctrl_c_and_the_engine_keeps_serving(cluster: Cluster) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "hy3spark", "logs", str(cluster.spec), "-n", "3",
                             "--runs-dir", str(cluster.runs)], cwd=REPO, env=cluster.env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    watcher = CmdlineWatcher()
    watcher.start()
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while len(lines) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(lines) >= 3, f"no tail within 120 s: {lines}"
        # A request makes the engine log a line: following means it shows up.
        assert health() == 200
        while not any("GET /health" in x and FABRIC[HEAD] in x for x in lines[3:]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert any("GET /health" in x for x in lines[3:]), f"the new log line never showed: {lines}"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl+C sends to the terminal's foreground process group
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("hy3spark logs did not detach within 60 s of Ctrl+C")
    finally:
        cluster.seen_in_cmdlines.extend(watcher.stop())
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    reader.join(timeout=10)
    err = proc.stderr.read()
    assert rc == 0, err
    assert "detached (the engine keeps running)" in err and "Traceback" not in err
    assert leftovers(cluster.runs) == []
    assert health() == 200


def test_failing_up_names_the_host_and_the_task(cluster: Cluster) -> None:
    """The image's engine refuses the serve command at startup, as when the image holds another vLLM than the one
    whose option table the spec is checked against. A spec can no longer carry an unknown option (serving.extra_args
    is checked against vLLM 0.23's table), so the rendered serve command gets one through the extra vars."""
    rendered = cluster.root / "bad-flag"
    subprocess.run([sys.executable, "-m", "hy3spark", "render", str(cluster.spec), "--out", str(rendered)], cwd=REPO,
                   check=True, capture_output=True)
    group = yaml.safe_load((rendered / "inventory/group_vars/all/hy3spark.yml").read_text())
    group["hy3spark"]["serving"]["argv"].append("--no-such-flag")
    bad = cluster.spec_file("bad-flag.yml", yaml.safe_dump({"hy3spark": group["hy3spark"]}))
    proc = cluster.cli("up", str(cluster.spec), "--tags", "serve", "-e", f"@{bad}", "--runs-dir", str(cluster.runs))
    assert proc.returncode == 1, proc.stderr[-4000:]
    summary = proc.stderr[proc.stderr.index("site.yml failed"):]
    assert re.search(rf"FAILED host {HEAD}, task '[^']+'", summary), summary
    # The cause is at the end of the serve log's tail: the summary must keep it.
    assert "vllm: error: unrecognized arguments: --no-such-flag" in summary, summary
    assert "\x1b[" not in summary
    _path, record = record_of(proc.stdout)
    assert record["status"] == "failed" and record["exit_code"] == 1
    assert [f["host"] for f in record["failures"]] == [HEAD]
    assert record["phases_s"]["Serve the model"] > 0
    # What ran when it failed is on record too.
    assert set(record["image_ids"]) == {HEAD, WORKER} and record["image_ids"][HEAD].startswith("sha256:")
    assert record["versions"]["ray"] == "2.60.0"


def test_status_after_a_failed_start_shows_no_stale_engine_lines(cluster: Cluster) -> None:
    proc = cluster.cli("status", str(cluster.spec), "--runs-dir", str(cluster.runs), "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    status = json.loads(proc.stdout)
    assert status["endpoint"]["health"] != 200 and status["endpoint"]["models"] == []
    # The serve log still holds the previous engine's startup lines; they describe no running engine.
    assert len(serve_log_lines("GPU KV cache size")) == 1
    assert status["kv_lines"] == [] and status["transport"] is None
    assert status["ray"]["nodes"] == 2
    assert status["last_run"]["status"] == "failed"


def test_check_prints_the_preflight_table_and_a_dry_run_changes_nothing(cluster: Cluster) -> None:
    script = "/etc/hy3spark/serve.sh"
    before = node_sh(HEAD, f"sha256sum {script}")
    proc = cluster.cli("check", str(cluster.spec), "--dry-run", "--tags", "serve", "--runs-dir", str(cluster.runs))
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = proc.stdout
    for name in NODES:
        assert re.search(rf"^{name}\s+mtu\s+PASS\s+9000\s+9000$", table, re.M), table
    assert re.search(r"^preflight: \d+ pass, 0 fail", table, re.M)
    # The dry run shows the serve script going back to the good spec's command, and changes nothing.
    assert re.search(rf"^--- before: {script}$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^-.*--no-such-flag", proc.stdout, re.M)
    assert node_sh(HEAD, f"sha256sum {script}") == before
    assert health() != 200
    # --json: ONE document holding both runs.
    proc = cluster.cli("check", str(cluster.spec), "--dry-run", "--json", "--tags", "serve", "--runs-dir",
                       str(cluster.runs))
    assert proc.returncode == 0, proc.stderr[-4000:]
    both = json.loads(proc.stdout)
    assert (both["preflight"]["playbook"], both["dry_run"]["playbook"], both["exit_code"]) == (
        "playbooks/preflight.yml", "site.yml", 0)
    assert any(script in d for d in both["dry_run"]["diffs"])


def test_interrupted_check_exits_130(cluster: Cluster) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "hy3spark", "check", str(cluster.spec),
                             "--runs-dir", str(cluster.runs)], cwd=REPO, env=cluster.env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = proc.stderr.readline()
        assert first.startswith("PLAY "), first
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        _out, err = proc.communicate()
    assert rc == 130, err
    assert "interrupted" in err and "Traceback" not in err
    # The SIGINT reached ansible-playbook too: give it a moment to finish exiting (seen to take a fraction of a
    # second on a loaded machine), but a process still there after 15 s is one the CLI left behind.
    deadline = time.monotonic() + 15
    while leftovers(cluster.runs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftovers(cluster.runs) == []


def test_down_leaves_no_container_of_ours(cluster: Cluster) -> None:
    proc = cluster.cli("down", str(cluster.spec), "--runs-dir", str(cluster.runs))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in NODES:
        assert re.search(rf"^{name}: MemAvailable [\d.]+ GiB before, [\d.]+ GiB after teardown", proc.stdout, re.M)
        assert ours(name) == []
        assert node_sh(name, "docker ps -aq") == ""


def test_no_secret_in_any_file_or_command_line(cluster: Cluster) -> None:
    files = [p for p in cluster.root.rglob("*") if p.is_file() and not p.is_symlink()]
    # ansible-runner dumped each run's whole environment into artifacts/*/command: the secrets must have been
    # out of it (a playbook run gets the hand-over file's name instead).
    commands = {p: json.loads(p.read_text()) for p in files if p.name == "command" and "artifacts" in p.parts}
    assert len(commands) >= 8
    for path, command in commands.items():
        assert not set(SECRETS) & set(command["env"]), path
        if path.parents[2].name.startswith("run-"):
            assert "HY3SPARK_SECRETS_FILE" in command["env"], path
    assert any(p.parent.name == "job_events" for p in files)
    leaks = [f"{p}: {name}" for p in files for name, value in SECRETS.items() if value.encode() in p.read_bytes()]
    assert leaks == []
    # Every private data dir is the run's own, 0700.
    private = [p for p in cluster.runs.iterdir() if p.is_dir() and p.name not in ("records", "inventory")]
    assert len(private) >= 8
    for p in private:
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
    assert list(cluster.tmpdir.iterdir()) == [], "the secrets hand-over files are deleted after each run"
    assert cluster.seen_in_cmdlines == []
