"""roles/drift's observer (plugins/modules/hy3spark_drift.py) and the hy3spark_content lookup, without a node.

The role itself runs in molecule/site (re-run in sync, forced full run, a hand edit found and repaired)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from collection_plugins import plugin

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def drift() -> ModuleType:
    return plugin("modules", "hy3spark_drift")


def snapshot(drift: ModuleType, tmp: Path) -> dict:
    """A record's state, through the same JSON round trip as the file on the node."""
    watch = {"files": [str(tmp / "netplan.yaml")], "trees": [str(tmp / "etc")], "models": [str(tmp / "hub")]}
    return json.loads(json.dumps(drift.observe(watch)))


@pytest.fixture
def node(tmp_path: Path) -> Path:
    (tmp_path / "etc/vllm").mkdir(parents=True)
    (tmp_path / "etc/node.env").write_text("VLLM_HOST_IP=10.0.0.2\n")
    (tmp_path / "etc/vllm/list.json").write_text("[]\n")
    (tmp_path / "netplan.yaml").write_text("network: {}\n")
    blobs = tmp_path / "hub/blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc").write_bytes(b"weights")
    (tmp_path / "hub/snapshots/rev").mkdir(parents=True)
    os.symlink("../../blobs/abc", tmp_path / "hub/snapshots/rev/model.safetensors")
    return tmp_path


def test_an_unchanged_node_matches_its_record(drift: ModuleType, node: Path) -> None:
    assert drift.differences(snapshot(drift, node), snapshot(drift, node)) == []


def test_several_changes_are_each_named(drift: ModuleType, node: Path) -> None:
    record = snapshot(drift, node)
    (node / "etc/node.env").write_text("VLLM_HOST_IP=10.0.0.1\n")  # content
    (node / "etc/vllm/list.json").chmod(0o600)  # mode
    (node / "etc/extra.conf").write_text("x\n")  # a new file in a watched tree
    (node / "netplan.yaml").unlink()  # a missing file
    os.truncate(node / "hub/blobs/abc", 3)  # a truncated shard
    assert drift.differences(record, snapshot(drift, node)) == [
        f"files {node}/netplan.yaml (missing)",
        f"models {node}/hub/blobs/abc (mtime_ns, size)",
        f"trees {node}/etc/extra.conf (new)",
        f"trees {node}/etc/node.env (sha256)",
        f"trees {node}/etc/vllm/list.json (mode)",
    ]


def test_hub_markers_of_absent_files_are_not_model_content(drift: ModuleType, node: Path) -> None:
    record = snapshot(drift, node)
    (node / "hub/.no_exist/rev").mkdir(parents=True)
    (node / "hub/.no_exist/rev/generation_config.json").write_text("")
    assert drift.differences(record, snapshot(drift, node)) == []


def test_a_relinked_snapshot_is_a_change(drift: ModuleType, node: Path) -> None:
    record = snapshot(drift, node)
    link = node / "hub/snapshots/rev/model.safetensors"
    link.unlink()
    os.symlink("../../blobs/other", link)
    assert drift.differences(record, snapshot(drift, node)) == [
        f"models {node}/hub/snapshots/rev/model.safetensors (link)"]


def test_the_record_is_written_0600_and_atomically(drift: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "state/deployed.json"
    drift.write_record(str(path), '{"inputs": "x"}\n')
    assert (path.stat().st_mode & 0o777, path.read_text()) == (0o600, '{"inputs": "x"}\n')
    assert sorted(p.name for p in path.parent.iterdir()) == ["deployed.json"]
    assert drift.read_record(str(tmp_path / "none.json")) is None
    (tmp_path / "bad.json").write_text("{")
    assert drift.read_record(str(tmp_path / "bad.json")) == {}


def test_missing_things_are_reported_as_missing(drift: ModuleType, tmp_path: Path) -> None:
    assert drift.file_state(str(tmp_path / "no")) == "missing"
    assert drift.tree_state(str(tmp_path / "no")) == "missing"
    assert drift.model_state(str(tmp_path / "no")) == "missing"


def test_content_hash_follows_the_roles_and_ignores_caches(tmp_path: Path) -> None:
    content = plugin("lookup", "hy3spark_content")
    for part in ("roles/drift", "playbooks", "templates", "plugins/lookup"):
        shutil.copytree(ROOT / part, tmp_path / part)
    shutil.copy(ROOT / "site.yml", tmp_path / "site.yml")
    before = content.content_sha256(tmp_path)
    (tmp_path / "roles/drift/__pycache__").mkdir(exist_ok=True)
    (tmp_path / "roles/drift/__pycache__/x.pyc").write_bytes(b"\0")
    (tmp_path / "roles/drift/.ruff_cache").mkdir()
    assert content.content_sha256(tmp_path) == before
    defaults = tmp_path / "roles/drift/defaults/main.yml"
    defaults.write_text(defaults.read_text() + "# changed\n")
    assert content.content_sha256(tmp_path) != before


# --- every watched kind, on a whole node ------------------------------------------------------------------------------
# The files, trees, SSH files and model cache are real files. Docker, systemd and iproute2 are stand-ins on PATH
# (`docker`, `systemctl`, `ip`) that print what the real tools print for the node World.data describes, for exactly
# the calls the module makes (any other call fails); the module reads the unit's argv from /proc of a real process.
# The real tools meet the module in molecule/site.
TOOL = """\
#!/bin/sh
key="$DRIFT_WORLD/$(basename "$0")-$(printf '%s ' "$@" | od -An -tx1 | tr -d ' \\n')"
[ -f "$key.out" ] || { echo "$(basename "$0") $*: not a call the drift module makes" >&2; exit 2; }
cat "$key.out"
exit "$(cat "$key.rc")"
"""

IFACE, UNIT, REF, CONTAINER = "enp1s0f1np1", "earlyoom", "hy3spark/engine:cli", "hy3-head"
ENGINE = "vllm serve /models/hy3 --port 8000"
TABLE = "inet hy3spark"
NFT_LISTING = ("table inet hy3spark {\n\tchain input {\n\t\ttype filter hook input priority filter; policy accept;\n"
               "\t\ttcp dport 6379 reject with tcp reset\n\t}\n}\n")
INPUTS = "0" * 64
NOBODY = 65534  # a uid and gid nothing here runs as


class World:
    """One node as the drift module sees it: real files under `root`, and what docker/systemctl/ip report."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.netplan, self.etc, self.hub, self.ssh = root / "netplan.yaml", root / "etc", root / "hub", root / "ssh"
        self.netplan.write_text("network: {}\n")
        (self.etc / "vllm").mkdir(parents=True)
        (self.etc / "node.env").write_text("VLLM_HOST_IP=10.0.0.2\n")
        (self.etc / "vllm/list.json").write_text("[]\n")
        self.ssh.mkdir(mode=0o700)
        (self.ssh / "authorized_keys").write_text("ssh-ed25519 AAAA hy3spark\n")
        (self.hub / "blobs").mkdir(parents=True)
        (self.hub / "blobs/abc").write_bytes(b"weights")
        (self.hub / "snapshots/rev").mkdir(parents=True)
        os.symlink("../../blobs/abc", self.hub / "snapshots/rev/model.safetensors")
        self.user = pwd.getpwuid(os.getuid())
        # user_files are paths under the user's home: these lead from it to the test's directory.
        self.user_paths = [os.path.relpath(p, self.user.pw_dir) for p in (self.ssh, self.ssh / "authorized_keys")]
        bin_dir = root / "bin"
        bin_dir.mkdir()
        for tool in ("docker", "systemctl", "ip", "ps", "nft"):
            (bin_dir / tool).write_text(TOOL)
            (bin_dir / tool).chmod(0o755)
        self.path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
        self.unit_processes: list[subprocess.Popen[bytes]] = []
        self.data: dict = {
            "images": {REF: "sha256:" + "1" * 64},
            "containers": {CONTAINER: {"Id": "c" * 64, "Image": "sha256:" + "1" * 64,
                                       "State": {"Running": True, "StartedAt": "2026-12-01T10:00:00.1Z"}}},
            "top": {CONTAINER: ["4242                Tue                 Dec 1 10:00:05 2026 /bin/sh /etc/serve.sh",
                                f"4250                Tue                 Dec 1 10:00:06 2026 python3 -m {ENGINE}",
                                "4300                Tue                 Dec 1 10:00:09 2026 ray::RayWorkerWrapper"]},
            "units": {UNIT: {"ActiveState": "active", "UnitFileState": "enabled",
                             "MainPID": self.start_unit(["-m", "4", "-s", "100"])}},
            "links": {IFACE: {"ifname": IFACE, "mtu": 9000, "operstate": "UP", "addr_info": [
                {"family": "inet", "local": "10.0.0.2", "prefixlen": 24, "scope": "global"}]}},
            "nft": {TABLE: NFT_LISTING},
        }

    def start_unit(self, args: list[str]) -> int:
        """A real process standing for the unit's main process: the module reads its argv from /proc."""
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", *args])
        self.unit_processes.append(proc)
        return proc.pid

    def watch(self) -> dict:
        return {
            "files": [str(self.netplan)],
            "trees": [str(self.etc)],
            "user_files": {"user": self.user.pw_name, "paths": self.user_paths},
            "interfaces": [IFACE],
            "units": [UNIT],
            "images": [REF],
            "containers": [CONTAINER],
            "processes": [{"container": CONTAINER, "match": ENGINE}],
            "models": [str(self.hub)],
            "nft_tables": [TABLE],
        }

    def answers(self) -> dict[tuple[str, ...], tuple[int, str]]:
        """What the real tools print (and their exit codes) for the calls the module makes, on this node now."""
        d = self.data
        container = d["containers"].get(CONTAINER)
        unit = d["units"].get(UNIT, {"ActiveState": "inactive", "UnitFileState": "", "MainPID": 0})
        link = d["links"].get(IFACE)
        return {
            ("docker", "image", "inspect", "--format", "{{.Id}}", REF):
                (0, d["images"][REF] + "\n") if REF in d["images"] else (1, ""),
            ("docker", "inspect", "--type", "container", CONTAINER):
                (0, json.dumps([container])) if container else (1, "[]\n"),
            ("docker", "top", CONTAINER, "-eo", "pid,lstart,args"):
                (0, "".join(f"{row}\n" for row in ["PID                 STARTED             COMMAND",
                                                    *d["top"][CONTAINER]]))
                if container and container["State"]["Running"] else (1, ""),
            ("systemctl", "show", UNIT, "--property", "ActiveState,UnitFileState,MainPID"):
                (0, "".join(f"{key}={unit[key]}\n" for key in ("ActiveState", "UnitFileState", "MainPID"))),
            ("ip", "-j", "addr", "show", "dev", IFACE): (0, json.dumps([link])) if link else (1, ""),
            ("nft", "list", "table", *TABLE.split()):
                (0, d["nft"][TABLE]) if TABLE in d["nft"] else (1, ""),
            ("ps", "-eo", "pid,lstart,args"):
                (0, "".join(f"{row}\n" for row in ["    PID                  STARTED COMMAND", *d["ps"]]))
                if "ps" in d else (1, ""),
        }

    def observe(self, drift: ModuleType, watch: dict | None = None) -> dict:
        """The node's state, through the same JSON round trip as the record on the node (`watch`: another watch
        than the whole node's)."""
        answers = self.root / "answers"
        shutil.rmtree(answers, ignore_errors=True)
        answers.mkdir()
        for (tool, *args), (rc, out) in self.answers().items():
            key = answers / f"{tool}-{''.join(f'{a} ' for a in args).encode().hex()}"
            key.with_suffix(".out").write_text(out)
            key.with_suffix(".rc").write_text(f"{rc}\n")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PATH", self.path)
            mp.setenv("DRIFT_WORLD", str(answers))
            return json.loads(json.dumps(drift.observe(watch or self.watch())))

    def stop(self) -> None:
        for proc in self.unit_processes:
            proc.kill()
            proc.wait()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.stop()


def chown_away(path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("giving a file another owner needs root (scripts/test runs as root)")
    os.lchown(path, NOBODY, NOBODY)


def keep_mtime(path: Path, change: Callable[[], object]) -> None:
    """A change that leaves the file's mtime as it was (rsync --times, a careful hand): only the change shows."""
    st = path.stat()
    change()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def relink(w: World) -> None:
    link = w.hub / "snapshots/rev/model.safetensors"
    link.unlink()
    os.symlink("../../blobs/other", link)


def no_exist_marker(w: World) -> None:
    (w.hub / ".no_exist/rev").mkdir(parents=True)
    (w.hub / ".no_exist/rev/generation_config.json").write_text("")


def engine_restarted(w: World) -> None:
    w.data["top"][CONTAINER][1] = f"5100                Tue                 Dec 1 11:30:00 2026 python3 -m {ENGINE}"


def unit_restarted_with(w: World, args: list[str]) -> None:
    w.data["units"][UNIT]["MainPID"] = w.start_unit(args)


def unit_stopped(w: World) -> None:
    w.data["units"][UNIT].update(ActiveState="inactive", MainPID=0)


def add_addresses(w: World) -> None:
    """What the kernel adds by itself: a link-local address and a SLAAC one (dynamic)."""
    w.data["links"][IFACE]["addr_info"] += [
        {"family": "inet6", "local": "fe80::1", "prefixlen": 64, "scope": "link"},
        {"family": "inet6", "local": "fd00::2", "prefixlen": 64, "scope": "global", "dynamic": True}]


# Each case: one kind of change on the node, and what drift must name (paths relative to the test's directory).
CHANGES: dict[str, tuple[Callable[[World], object], list[str]]] = {
    # files: content, mode, owner, gone
    "files-content": (lambda w: w.netplan.write_text("network: {version: 2}\n"),
                      ["files {root}/netplan.yaml (sha256)"]),
    "files-mode": (lambda w: w.netplan.chmod(0o600), ["files {root}/netplan.yaml (mode)"]),
    "files-owner": (lambda w: chown_away(w.netplan), ["files {root}/netplan.yaml (gid, uid)"]),
    "files-missing": (lambda w: w.netplan.unlink(), ["files {root}/netplan.yaml (missing)"]),
    # trees: every file and directory under a watched directory
    "trees-content": (lambda w: (w.etc / "node.env").write_text("VLLM_HOST_IP=10.0.0.9\n"),
                      ["trees {root}/etc/node.env (sha256)"]),
    "trees-mode": (lambda w: (w.etc / "node.env").chmod(0o600), ["trees {root}/etc/node.env (mode)"]),
    "trees-owner": (lambda w: chown_away(w.etc / "vllm/list.json"), ["trees {root}/etc/vllm/list.json (gid, uid)"]),
    "trees-directory-mode": (lambda w: (w.etc / "vllm").chmod(0o700), ["trees {root}/etc/vllm (mode)"]),
    "trees-new-file": (lambda w: (w.etc / "extra.conf").write_text("x\n"), ["trees {root}/etc/extra.conf (new)"]),
    "trees-file-gone": (lambda w: (w.etc / "vllm/list.json").unlink(), ["trees {root}/etc/vllm/list.json (gone)"]),
    # user_files: the deploying user's SSH directory and files
    "user_files-content": (lambda w: (w.ssh / "authorized_keys").write_text("ssh-ed25519 BBBB someone\n"),
                           ["user_files {ssh}/authorized_keys (sha256)"]),
    "user_files-owner": (lambda w: chown_away(w.ssh / "authorized_keys"),
                         ["user_files {ssh}/authorized_keys (gid, uid)"]),
    "user_files-directory-mode": (lambda w: w.ssh.chmod(0o755), ["user_files {ssh} (mode)"]),
    # interfaces: configured addresses and MTU; what the kernel adds by itself is no change
    "interfaces-address": (lambda w: w.data["links"][IFACE]["addr_info"][0].update(local="10.0.0.9"),
                           [f"interfaces {IFACE} (addresses)"]),
    "interfaces-mtu": (lambda w: w.data["links"][IFACE].update(mtu=1500), [f"interfaces {IFACE} (mtu)"]),
    "interfaces-missing": (lambda w: w.data["links"].pop(IFACE), [f"interfaces {IFACE} (missing)"]),
    "interfaces-kernel-addresses": (add_addresses, []),
    # nft_tables: the live table as nft lists it (flushed by hand, deleted, edited)
    "nft_tables-flushed": (lambda w: w.data["nft"].update({TABLE: "table inet hy3spark {\n}\n"}),
                           [f"nft_tables {TABLE} (sha256)"]),
    "nft_tables-missing": (lambda w: w.data["nft"].pop(TABLE), [f"nft_tables {TABLE} (missing)"]),
    # units: active and enabled state, the running process's argv
    "units-stopped": (unit_stopped, [f"units {UNIT} (active, argv)"]),
    "units-disabled": (lambda w: w.data["units"][UNIT].update(UnitFileState="disabled"), [f"units {UNIT} (enabled)"]),
    "units-argv": (lambda w: unit_restarted_with(w, ["-m", "10", "-s", "100"]), [f"units {UNIT} (argv)"]),
    "units-restart-same-argv": (lambda w: unit_restarted_with(w, ["-m", "4", "-s", "100"]), []),
    # images: the image ID behind the spec's ref
    "images-id": (lambda w: w.data["images"].update({REF: "sha256:" + "2" * 64}), [f"images {REF}"]),
    "images-missing": (lambda w: w.data["images"].pop(REF), [f"images {REF} (missing)"]),
    # containers: ID, image, running, start time
    "containers-recreated": (lambda w: w.data["containers"][CONTAINER].update(
        Id="d" * 64, State={"Running": True, "StartedAt": "2026-12-01T11:00:00.1Z"}),
        [f"containers {CONTAINER} (id, started_at)"]),
    "containers-restarted": (lambda w: w.data["containers"][CONTAINER]["State"].update(
        StartedAt="2026-12-01T11:00:00.1Z"), [f"containers {CONTAINER} (started_at)"]),
    "containers-image": (lambda w: w.data["containers"][CONTAINER].update(Image="sha256:" + "2" * 64),
                         [f"containers {CONTAINER} (image)"]),
    # A stopped or removed container takes the engine with it.
    "containers-stopped": (lambda w: w.data["containers"][CONTAINER]["State"].update(Running=False),
                           [f"containers {CONTAINER} (running)", f"processes {CONTAINER}"]),
    "containers-missing": (lambda w: w.data["containers"].pop(CONTAINER),
                           [f"containers {CONTAINER} (missing)", f"processes {CONTAINER}"]),
    # processes: the engine's PIDs and start times in the container; other processes there are no change
    "processes-engine-restarted": (engine_restarted, [f"processes {CONTAINER}"]),
    "processes-engine-gone": (lambda w: w.data["top"][CONTAINER].pop(1), [f"processes {CONTAINER}"]),
    "processes-other-process": (lambda w: w.data["top"][CONTAINER].append(
        "4400                Tue                 Dec 1 10:40:00 2026 ray::IDLE"), []),
    # models: every entry of the model's cache directory
    "models-mtime": (lambda w: os.utime(w.hub / "blobs/abc", ns=(0, 10**18)),
                     ["models {root}/hub/blobs/abc (mtime_ns)"]),
    "models-size": (lambda w: keep_mtime(w.hub / "blobs/abc", lambda: os.truncate(w.hub / "blobs/abc", 3)),
                    ["models {root}/hub/blobs/abc (size)"]),
    "models-owner": (lambda w: chown_away(w.hub / "blobs/abc"), ["models {root}/hub/blobs/abc (gid, uid)"]),
    "models-mode": (lambda w: (w.hub / "blobs/abc").chmod(0o600), ["models {root}/hub/blobs/abc (mode)"]),
    "models-link": (relink, ["models {root}/hub/snapshots/rev/model.safetensors (link)"]),
    "models-link-owner": (lambda w: chown_away(w.hub / "snapshots/rev/model.safetensors"),
                          ["models {root}/hub/snapshots/rev/model.safetensors (gid, uid)"]),
    "models-directory-owner": (lambda w: chown_away(w.hub / "snapshots"), ["models {root}/hub/snapshots (gid, uid)"]),
    "models-new-file": (lambda w: (w.hub / "blobs/def").write_bytes(b"more"), ["models {root}/hub/blobs/def (new)"]),
    "models-file-gone": (lambda w: (w.hub / "blobs/abc").unlink(), ["models {root}/hub/blobs/abc (gone)"]),
    "models-missing": (lambda w: shutil.rmtree(w.hub), ["models {root}/hub (missing)"]),
    "models-hub-markers": (no_exist_marker, []),
}


@pytest.mark.parametrize("case", CHANGES)
def test_each_watched_kind_of_change_is_named(drift: ModuleType, world: World, case: str) -> None:
    change, expected = CHANGES[case]
    record = {"inputs": INPUTS, "state": world.observe(drift)}
    assert drift.compare(record, INPUTS, world.observe(drift)) == [], "an unchanged node is in sync"
    change(world)
    names = [e.format(root=world.root, ssh=world.user_paths[0]) for e in expected]
    assert drift.compare(record, INPUTS, world.observe(drift)) == names


def test_every_watched_kind_is_observed(drift: ModuleType, world: World) -> None:
    """What the record holds for each kind (the fields the cases above change)."""
    state = world.observe(drift)
    assert sorted(state) == ["containers", "files", "images", "interfaces", "models", "nft_tables", "processes",
                             "trees", "units", "user_files"]
    assert state["nft_tables"] == {TABLE: {"sha256": hashlib.sha256(NFT_LISTING.encode()).hexdigest()}}
    uid, gid = os.getuid(), os.getgid()
    assert set(state["files"][str(world.netplan)]) == {"mode", "uid", "gid", "sha256"}
    assert state["user_files"][world.user_paths[0]] == {"mode": "0700", "uid": uid, "gid": gid, "type": "dir"}
    assert state["interfaces"] == {IFACE: {"mtu": 9000, "addresses": ["10.0.0.2/24"]}}
    assert state["units"] == {UNIT: {"active": "active", "enabled": "enabled",
                                     "argv": [sys.executable, "-c", "import time; time.sleep(600)", "-m", "4", "-s",
                                              "100"]}}
    assert state["images"] == {REF: "sha256:" + "1" * 64}
    assert state["containers"] == {CONTAINER: {"id": "c" * 64, "image": "sha256:" + "1" * 64, "running": True,
                                               "started_at": "2026-12-01T10:00:00.1Z"}}
    assert state["processes"] == {CONTAINER: ["4250 Tue Dec 1 10:00:06 2026"]}
    blob = (world.hub / "blobs/abc").stat()
    assert state["models"][str(world.hub)]["blobs/abc"] == {"mode": "0644", "uid": uid, "gid": gid, "size": 7,
                                                           "mtime_ns": blob.st_mtime_ns}
    assert state["models"][str(world.hub)]["snapshots/rev/model.safetensors"]["link"] == "../../blobs/abc"
    assert state["models"][str(world.hub)]["."]["type"] == "dir"


def test_changed_inputs_are_named(drift: ModuleType, world: World) -> None:
    state = world.observe(drift)
    record = {"inputs": INPUTS, "state": state}
    assert drift.compare(record, INPUTS, state) == []
    assert drift.compare(record, "1" * 64, state) == [
        "inputs (the spec, a role input, a secret or hy3spark's own code changed)"]
    assert drift.compare({"state": state}, INPUTS, state) == [drift.INPUTS_CHANGED], "a record without inputs"


def test_a_user_that_does_not_exist_is_named(drift: ModuleType, world: World) -> None:
    record = {"inputs": INPUTS, "state": world.observe(drift)}
    world.user = pwd.struct_passwd(("hy3spark-nobody-here", *world.user[1:]))
    assert drift.compare(record, INPUTS, world.observe(drift)) == [
        "user_files (user) (new)", f"user_files {world.user_paths[0]} (gone)",
        f"user_files {world.user_paths[1]} (gone)"]


def test_the_loopback_interface_through_the_real_ip(drift: ModuleType) -> None:
    """iproute2's own JSON: the loopback's 127.0.0.1/8 (scope host) is a configured address."""
    lo = drift.interface_state("lo")
    assert lo["mtu"] > 0 and "127.0.0.1/8" in lo["addresses"], lo
    assert drift.interface_state("hy3spark-none0") == "missing"


# --- the module as Ansible runs it ------------------------------------------------------------------------------------
PLAYBOOK = """\
- name: Record and compare as site.yml does
  hosts: localhost
  connection: local
  gather_facts: false
  vars:
    watch: {files: ["{{ dir }}/netplan.yaml"], trees: ["{{ dir }}/etc"], models: ["{{ dir }}/hub"]}
    record: "{{ dir }}/state/deployed.json"
  tasks:
    - name: Compare before any record
      hy3spark_drift: {watch: "{{ watch }}", record: "{{ record }}", inputs: "{{ inputs }}", state: compared}
      register: no_record
    - name: Record in check mode
      hy3spark_drift: {watch: "{{ watch }}", record: "{{ record }}", inputs: "{{ inputs }}", state: recorded}
      check_mode: true
      register: record_check
    - name: Look for the record after check mode
      ansible.builtin.stat: {path: "{{ record }}"}
      register: after_check
    - name: Record
      hy3spark_drift: {watch: "{{ watch }}", record: "{{ record }}", inputs: "{{ inputs }}", state: recorded}
      register: first
    - name: Record again
      hy3spark_drift: {watch: "{{ watch }}", record: "{{ record }}", inputs: "{{ inputs }}", state: recorded}
      register: second
    - name: Compare with the same inputs
      hy3spark_drift: {watch: "{{ watch }}", record: "{{ record }}", inputs: "{{ inputs }}", state: compared}
      register: same
    - name: Compare with other inputs
      hy3spark_drift: {watch: "{{ watch }}", record: "{{ record }}", inputs: other, state: compared}
      register: other
    - name: Edit a watched file by hand
      ansible.builtin.copy: {content: "network: {version: 2}\\n", dest: "{{ dir }}/netplan.yaml", mode: "0644"}
    - name: Compare after the edit
      hy3spark_drift: {watch: "{{ watch }}", record: "{{ record }}", inputs: "{{ inputs }}", state: compared}
      register: edited
    - name: Write what the module returned
      ansible.builtin.copy:
        content: "{{ {'no_record': no_record, 'record_check': record_check, 'after_check': after_check.stat.exists,
                      'first': first, 'second': second, 'same': same, 'other': other, 'edited': edited} | to_json }}"
        dest: "{{ dir }}/results.json"
        mode: "0600"
"""


def test_the_module_records_and_compares_in_a_playbook(node: Path) -> None:
    (node / "play.yml").write_text(PLAYBOOK)
    env = {**os.environ, "ANSIBLE_LIBRARY": str(ROOT / "plugins/modules"), "ANSIBLE_NOCOLOR": "1"}
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,",
                           "-e", f"ansible_python_interpreter={sys.executable}", "-e", f"dir={node}",
                           "-e", f"inputs={INPUTS}", str(node / "play.yml")],
                          env=env, cwd=node, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads((node / "results.json").read_text())
    assert (r["no_record"]["in_sync"], r["no_record"]["differs"]) == (
        False, ["no record (no complete site.yml run on this node yet)"])
    assert (r["record_check"]["changed"], r["after_check"]) == (True, False), "check mode writes no record"
    assert (r["first"]["changed"], r["second"]["changed"]) == (True, False)
    assert stat.S_IMODE((node / "state/deployed.json").stat().st_mode) == 0o600
    assert (r["same"]["in_sync"], r["same"]["differs"]) == (True, [])
    assert (r["other"]["in_sync"], r["other"]["differs"]) == (
        False, ["inputs (the spec, a role input, a secret or hy3spark's own code changed)"])
    assert (r["edited"]["in_sync"], r["edited"]["differs"]) == (False, [f"files {node}/netplan.yaml (sha256)"])


# --- what drift names when something comes back, and what it cannot see ----------------------------------------------
def test_what_was_missing_at_the_last_run_and_is_back_is_named(drift: ModuleType, world: World) -> None:
    content = world.netplan.read_text()
    world.netplan.unlink()
    image, container = world.data["images"].pop(REF), world.data["containers"].pop(CONTAINER)
    record = {"inputs": INPUTS, "state": world.observe(drift)}
    world.netplan.write_text(content)
    world.data["images"][REF], world.data["containers"][CONTAINER] = image, container
    assert drift.compare(record, INPUTS, world.observe(drift)) == [
        f"containers {CONTAINER} (was missing)", f"files {world.netplan} (was missing)", f"images {REF} (was missing)",
        f"processes {CONTAINER}"]


def test_a_kind_the_record_has_and_the_watch_no_longer_names_is_gone(drift: ModuleType, world: World) -> None:
    """A record written while another set of kinds was watched: every name of a kind on one side only is named."""
    state = world.observe(drift)
    without_user_files = {kind: names for kind, names in state.items() if kind != "user_files"}
    ssh, keys = world.user_paths
    assert drift.compare({"inputs": INPUTS, "state": state}, INPUTS, without_user_files) == [
        f"user_files {ssh} (gone)", f"user_files {keys} (gone)"]
    assert drift.compare({"inputs": INPUTS, "state": without_user_files}, INPUTS, state) == [
        f"user_files {ssh} (new)", f"user_files {keys} (new)"]


def test_the_engine_as_the_containers_first_process_is_watched(drift: ModuleType, world: World) -> None:
    """A container whose command is the engine itself: `docker top` lists it right under the header."""
    world.data["top"][CONTAINER] = [f"1                   Tue                 Dec 1 10:00:05 2026 python3 -m {ENGINE}"]
    record = {"inputs": INPUTS, "state": world.observe(drift)}
    assert record["state"]["processes"] == {CONTAINER: ["1 Tue Dec 1 10:00:05 2026"]}
    world.data["top"][CONTAINER] = []
    assert drift.compare(record, INPUTS, world.observe(drift)) == [f"processes {CONTAINER}"]


def test_the_engine_on_the_host_is_watched_in_its_unit_only(drift: ModuleType, world: World,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """From an operator's engine venv the engine runs on the host, in a systemd unit, with no container: `ps` there,
    and of its rows only the unit's processes (an engine someone else runs beside it is not ours)."""
    unit = "hy3spark-engine.service"
    world.data["ps"] = ["   4242 Tue Dec  1 10:00:05 2026 /bin/bash /etc/serve.sh",
                        f"   4250 Tue Dec  1 10:00:06 2026 /opt/vllm/bin/python3 /opt/vllm/bin/{ENGINE}",
                        f"   5100 Tue Dec  1 09:00:00 2026 /usr/bin/python3 -m {ENGINE}",
                        "   4300 Tue Dec  1 10:00:09 2026 tee -a /var/log/serve.log"]
    monkeypatch.setattr(drift, "in_unit", lambda pid, name: name == unit and pid in {"4242", "4250", "4300"})
    watch = {"processes": [{"container": None, "unit": unit, "match": ENGINE}]}
    record = {"inputs": INPUTS, "state": world.observe(drift, watch)}
    assert record["state"]["processes"] == {f"host {unit}": ["4250 Tue Dec 1 10:00:06 2026"]}
    assert drift.compare(record, INPUTS, world.observe(drift, watch)) == []
    world.data["ps"][1] = f"   4251 Tue Dec  1 11:00:00 2026 /opt/vllm/bin/python3 /opt/vllm/bin/{ENGINE}"
    assert drift.compare(record, INPUTS, world.observe(drift, watch)) == [f"processes host {unit}"]
    # Without a unit every matching process on the host counts; without ps nothing can be listed.
    assert world.observe(drift, {"processes": [{"container": None, "match": ENGINE}]})["processes"] == {
        "host": ["4251 Tue Dec 1 11:00:00 2026", "5100 Tue Dec 1 09:00:00 2026"]}
    del world.data["ps"]
    assert world.observe(drift, watch)["processes"] == {f"host {unit}": "no process list"}


def test_a_process_belongs_to_a_unit_by_its_cgroup(drift: ModuleType, tmp_path: Path) -> None:
    """/proc/PID/cgroup: the unified line (cgroup v2, here nested as in a container with systemd), or any line of
    v1's hierarchies; the unit is the last path segment, never a suffix of it."""
    (tmp_path / "7").mkdir()
    (tmp_path / "7/cgroup").write_text("0::/system.slice/docker-ab.scope/system.slice/hy3spark-engine.service\n")
    (tmp_path / "8").mkdir()
    (tmp_path / "8/cgroup").write_text("12:pids:/system.slice/hy3spark-engine.service\n"
                                       "1:name=systemd:/system.slice/hy3spark-engine.service\n")
    for pid in ("7", "8"):
        assert drift.in_unit(pid, "hy3spark-engine.service", proc=str(tmp_path))
        assert not drift.in_unit(pid, "engine.service", proc=str(tmp_path))
    assert not drift.in_unit("9", "hy3spark-engine.service", proc=str(tmp_path)), "a process that is gone"


def test_a_unit_whose_main_process_just_exited_is_observed_without_its_argv(drift: ModuleType, world: World) -> None:
    pid = world.start_unit(["-m", "4", "-s", "100"])
    world.unit_processes[-1].kill()
    world.unit_processes[-1].wait()
    world.data["units"][UNIT]["MainPID"] = pid
    assert world.observe(drift)["units"] == {UNIT: {"active": "active", "enabled": "enabled", "argv": None}}


# What docker and ip show; and the observation when neither can show anything (a missing or killed tool).
TOOL_WATCH = {"interfaces": [IFACE], "images": [REF], "containers": [CONTAINER],
              "processes": [{"container": CONTAINER, "match": ENGINE}]}
TOOLS_SHOW_NOTHING = {"files": {}, "trees": {}, "units": {}, "models": {}, "nft_tables": {},
                      "interfaces": {IFACE: "missing"},
                      "images": {REF: "missing"}, "containers": {CONTAINER: "missing"},
                      "processes": {CONTAINER: "container not running"}}


def test_a_node_without_docker_or_iproute2_names_them_missing(drift: ModuleType, world: World,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """No `docker` or `ip` on PATH: what they would show is missing (a comparison, not a failed check)."""
    empty = world.root / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert drift.observe(TOOL_WATCH) == TOOLS_SHOW_NOTHING


def test_a_hung_docker_is_named_missing_not_waited_for(drift: ModuleType, world: World,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A docker CLI stuck on its daemon: the call times out (here after 0.5 s instead of 60) and drift goes on."""
    (world.root / "bin/docker").write_text("#!/bin/sh\nsleep 30\n")
    real_run = subprocess.run
    monkeypatch.setattr(drift.subprocess, "run", lambda argv, **kw: real_run(argv, **{**kw, "timeout": 0.5}))
    monkeypatch.setenv("PATH", world.path)
    assert drift.observe({"images": [REF], "containers": [CONTAINER]}) == {
        "files": {}, "trees": {}, "units": {}, "models": {}, "nft_tables": {}, "interfaces": {}, "processes": {},
        "images": {REF: "missing"}, "containers": {CONTAINER: "missing"}}


def test_a_linked_directory_in_the_model_cache_is_watched_by_its_target(drift: ModuleType, world: World) -> None:
    """os.walk does not enter a linked directory: drift records the link itself, and a relink is named."""
    (world.hub / "blobs/shards").mkdir()
    (world.hub / "blobs/shards/part-1").write_bytes(b"w1")
    link = world.hub / "snapshots/rev/shards"
    os.symlink("../../blobs/shards", link)
    record = {"inputs": INPUTS, "state": world.observe(drift)}
    entries = record["state"]["models"][str(world.hub)]
    assert entries["snapshots/rev/shards"]["link"] == "../../blobs/shards"
    assert "snapshots/rev/shards/part-1" not in entries and "blobs/shards/part-1" in entries
    link.unlink()
    os.symlink("../../blobs/other", link)
    assert drift.compare(record, INPUTS, world.observe(drift)) == [f"models {world.hub}/snapshots/rev/shards (link)"]


def test_a_models_own_hidden_folder_is_model_content(drift: ModuleType, world: World) -> None:
    """Only the hub's .no_exist markers are left out: a repo's own dot-folder (.eval, .github) is model content."""
    (world.hub / "snapshots/rev/.eval").mkdir()
    (world.hub / "snapshots/rev/.eval/results.json").write_text("{}\n")
    record = {"inputs": INPUTS, "state": world.observe(drift)}
    (world.hub / "snapshots/rev/.eval/results.json").unlink()
    assert drift.compare(record, INPUTS, world.observe(drift)) == [
        f"models {world.hub}/snapshots/rev/.eval/results.json (gone)"]


# --- the module's own interface: its arguments in, its JSON result out (as Ansible runs it, without a playbook) -------
MODULE = ROOT / "plugins/modules/hy3spark_drift.py"


def run_module(tmp: Path, watch: dict, *, state: str = "compared", inputs: str = INPUTS, check_mode: bool = False,
               record: Path | None = None) -> dict:
    args = tmp / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {
        "watch": watch, "record": str(record or tmp / "state/deployed.json"), "inputs": inputs, "state": state,
        "_ansible_check_mode": check_mode}}))
    proc = subprocess.run([sys.executable, str(MODULE), str(args)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    result.pop("invocation", None)
    return result


def test_a_comparison_never_reports_a_change(node: Path) -> None:
    watch = {"files": [str(node / "netplan.yaml")]}
    assert run_module(node, watch) == {
        "changed": False, "in_sync": False, "differs": ["no record (no complete site.yml run on this node yet)"]}
    run_module(node, watch, state="recorded")
    (node / "netplan.yaml").write_text("network: {version: 2}\n")
    assert run_module(node, watch) == {
        "changed": False, "in_sync": False, "differs": [f"files {node}/netplan.yaml (sha256)"]}


def test_recording_again_after_a_change_rewrites_the_record(node: Path) -> None:
    watch, record = {"files": [str(node / "netplan.yaml")]}, node / "state/deployed.json"
    assert run_module(node, watch, state="recorded") == {"changed": True}
    assert stat.S_IMODE(record.parent.stat().st_mode) == 0o755, "the state directory: root writes, all read"
    (node / "netplan.yaml").write_text("network: {version: 2}\n")
    assert run_module(node, watch, state="recorded", check_mode=True) == {"changed": True}
    assert run_module(node, watch) == {"changed": False, "in_sync": False,
                                       "differs": [f"files {node}/netplan.yaml (sha256)"]}, "check mode wrote nothing"
    assert run_module(node, watch, state="recorded") == {"changed": True}
    assert run_module(node, watch) == {"changed": False, "in_sync": True, "differs": []}
    assert (stat.S_IMODE(record.stat().st_mode), sorted(p.name for p in record.parent.iterdir())) == (
        0o600, ["deployed.json"])


def test_a_record_others_can_read_is_rewritten_0600(node: Path) -> None:
    watch, record = {"files": [str(node / "netplan.yaml")]}, node / "state/deployed.json"
    run_module(node, watch, state="recorded")
    content = record.read_text()
    record.chmod(0o644)
    assert run_module(node, watch, state="recorded") == {"changed": True}
    assert (stat.S_IMODE(record.stat().st_mode), record.read_text()) == (0o600, content)
    assert run_module(node, watch, state="recorded") == {"changed": False}


def test_the_record_does_not_depend_on_the_order_of_the_watched_names(node: Path) -> None:
    first, second = str(node / "netplan.yaml"), str(node / "etc/node.env")
    assert run_module(node, {"files": [first, second]}, state="recorded") == {"changed": True}
    assert run_module(node, {"files": [second, first]}, state="recorded") == {"changed": False}


def test_an_unreadable_record_is_named(node: Path) -> None:
    record = node / "state/deployed.json"
    record.mkdir(parents=True)  # something that is not a file where the record belongs
    assert run_module(node, {"files": [str(node / "netplan.yaml")]}, record=record) == {
        "changed": False, "in_sync": False, "differs": [f"the record {record} is unreadable"]}


def test_a_record_that_cannot_be_replaced_stays_and_leaves_no_temporary_file(drift: ModuleType, tmp_path: Path
                                                                            ) -> None:
    state = tmp_path / "state"
    (state / "deployed.json").mkdir(parents=True)  # rename(2) of a file onto a directory fails
    with pytest.raises(IsADirectoryError):
        drift.write_record(str(state / "deployed.json"), '{"inputs": "x"}\n')
    assert sorted(p.name for p in state.iterdir()) == ["deployed.json"]
    assert (state / "deployed.json").is_dir()


class Health(http.server.BaseHTTPRequestHandler):
    """The engine's /health: 200 when it serves, 503 while it loads."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_engine_health_is_its_http_status_or_why_it_did_not_answer(drift: ModuleType, engine: str) -> None:
    assert drift.health(f"{engine}/health") == 200
    assert drift.health(f"{engine}/loading") == 503
    assert drift.health(f"http://127.0.0.1:{closed_port()}/health") == "[Errno 111] Connection refused"
    assert drift.health("head:8000/health") == "unknown url type: head", "a URL without its scheme"
    assert drift.health("head/health") == "unknown url type: 'head/health'"


def test_the_module_returns_health_only_when_asked(node: Path, engine: str) -> None:
    watch = {"files": [str(node / "netplan.yaml")]}
    assert "health" not in run_module(node, watch)
    assert "health" not in run_module(node, {**watch, "health": ""}), "a worker: the role passes no URL"
    assert run_module(node, {**watch, "health": f"{engine}/health"})["health"] == 200


def test_a_configured_address_of_any_scope_but_link_is_watched(drift: ModuleType, world: World) -> None:
    """Scopes as iproute2 prints them: only link-local addresses (and dynamic ones) come and go by themselves."""
    world.data["links"][IFACE]["addr_info"] += [
        {"family": "inet6", "local": "fec0::2", "prefixlen": 10, "scope": "site"},
        {"family": "inet", "local": "10.0.0.3", "prefixlen": 32, "scope": "host"},
    ]
    assert world.observe(drift)["interfaces"] == {
        IFACE: {"mtu": 9000, "addresses": ["10.0.0.2/24", "10.0.0.3/32", "fec0::2/10"]}}


def test_tools_killed_by_a_signal_are_named_missing(drift: ModuleType, world: World,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """docker or ip killed mid-call (the OOM killer: a negative return code) showed nothing: missing, not a crash."""
    (world.root / "bin/docker").write_text("#!/bin/sh\nkill -9 $$\n")
    # ip printed its JSON before it died: output of a killed tool is not trusted either.
    link = json.dumps([world.data["links"][IFACE]])
    (world.root / "bin/ip").write_text(f"#!/bin/sh\nprintf '%s\\n' '{link}'\nkill -9 $$\n")
    monkeypatch.setenv("PATH", world.path)
    assert drift.observe(TOOL_WATCH) == TOOLS_SHOW_NOTHING


def test_the_module_names_a_missing_argument(node: Path) -> None:
    args = node / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {}}))
    proc = subprocess.run([sys.executable, str(MODULE), str(args)], capture_output=True, text=True, timeout=120,
                          check=False)
    result = json.loads(proc.stdout)
    assert (proc.returncode, result["failed"], result["msg"]) == (
        1, True, "missing required arguments: inputs, record, watch")


def test_the_role_inputs_hashed_are_every_roles_found_beside_drift(tmp_path: Path) -> None:
    # drift_role_prefixes asks the content lookup for the roles instead of a list each new role must join: a role
    # added to the tree counts at once, and a misspelled term is an error, not an empty list.
    argv = [str(Path(sys.executable).parent / "ansible"), "localhost",
            "-m", "ansible.builtin.debug", "-a",
            "msg={{ query('hy3spark.cluster.hy3spark_content', 'roles') | to_json }}"]
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_STDOUT_CALLBACK": "json",
           "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1"}
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    roles = json.loads(json.loads(out)["plays"][0]["tasks"][0]["hosts"]["localhost"]["msg"])
    on_disk = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "meta" / "main.yml").is_file())
    assert roles == on_disk and {"drift", "ray_node", "vllm_serve"} <= set(roles)
    defaults = (ROOT / "roles" / "drift" / "defaults" / "main.yml").read_text()
    assert "query('hy3spark.cluster.hy3spark_content', 'roles') | reject('equalto', 'drift')" in defaults
    argv[-1] = "msg={{ query('hy3spark.cluster.hy3spark_content', 'rolez') }}"
    bad = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "takes no term (the digest) or 'roles', not ['rolez']" in bad.stdout + bad.stderr
