"""Unit tests of the preflight role's judgements (plugins/filter/preflight.py), from probe outputs as Ansible
registers them. Run: pytest roles/preflight/tests/unit"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.util
import json
import random
import sys
import textwrap
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[4]
# The filter imports the earlyoom argument parser it shares with the module hy3spark_earlyoom_info by its full name
# (ansible_collections.hy3spark.cluster.plugins.module_utils.earlyoom), as Ansible resolves it: the checkout's link
# collections/ansible_collections/hy3spark/cluster -> the repo makes that name importable here too.
sys.path.insert(0, str(_REPO / "collections"))
eo = importlib.import_module("ansible_collections.hy3spark.cluster.plugins.module_utils.earlyoom")
_PLUGIN = _REPO / "plugins" / "filter" / "preflight.py"
_spec = importlib.util.spec_from_file_location("preflight_filters", _PLUGIN)
assert _spec and _spec.loader
pf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pf)

HEAD = {"name": "spark-a", "fabric_ip": "10.0.0.1", "ssh_user": "ubuntu"}
WORKER = {"name": "spark-b", "fabric_ip": "10.0.0.2", "ssh_user": "ubuntu"}
SPARKRUN = """# Configured by: sparkrun setup earlyoom
# -m 3    : trigger at 3% available memory
EARLYOOM_ARGS="-m 3 -s 10 --prefer '(vllm|VLLM|sglang|llama-server|llama-cli|trtllm|tritonserver|ray|python3|python)' \
--avoid '(systemd|sshd|dockerd|containerd|dbus-daemon|NetworkManager)'"
"""
MANAGED = "Managed by hy3spark from the cluster spec; edit the spec and re-render instead of this file."
OURS = f"""# {MANAGED}
# Policy: protect.
EARLYOOM_ARGS="-r 3600 -m 4 -s 100 --avoid ^(vllm|VLLM|ray|raylet|gcs_server|python3|python)$ --prefer ^(chrome|code)$"
"""
NAMES = ["vllm", "VLLM::EngineCor", "raylet", "ray::IDLE", "gcs_server", "python3", "python"]


def by(rows, check, target=""):
    found = [r for r in rows if r["check"] == check and r["target"] == target]
    assert len(found) == 1, rows
    return found[0]


def slurp(text):
    return {"content": base64.b64encode(text.encode()).decode(), "encoding": "base64"}


def iplink(name="eth1", addrs=("10.0.0.1/24",), mtu=9000, flags=("BROADCAST", "UP", "LOWER_UP"), oper="UP"):
    return {"ifname": name, "flags": list(flags), "mtu": mtu, "operstate": oper,
            "addr_info": [{"family": "inet", "local": a.split("/")[0], "prefixlen": int(a.split("/")[1])}
                          for a in addrs]}


def ip_probe(*links):
    return {"rc": 0, "stdout": json.dumps([iplink("lo", ("127.0.0.1/8",), 65536, oper="UNKNOWN"), *links])}


# --- fabric ---------------------------------------------------------------------------------------------------
def test_fabric_all_pass():
    rows = pf.fabric(ip_probe(iplink()), "spark-a", "eth1", "10.0.0.1/24", 9000)
    assert [r["status"] for r in rows] == ["pass", "pass", "pass"]
    assert by(rows, "address")["found"] == "10.0.0.1/24"


def test_no_fabric_skips_the_fabric_checks_and_never_passes_them():
    rows = pf.no_fabric("desk")
    assert [r["check"] for r in rows] == ["interface", "address", "mtu", "hca"]
    assert {r["status"] for r in rows} == {"skip"} and {r["found"] for r in rows} == {"no fabric in the spec"}
    assert pf.FilterModule().filters()["preflight_no_fabric"] is pf.no_fabric


def test_fabric_missing_interface_names_where_the_address_is():
    rows = pf.fabric(ip_probe(iplink("eth0")), "spark-a", "eth1", "10.0.0.1/24", 9000)
    iface = by(rows, "interface")
    assert iface["status"] == "fail"
    assert "no interface eth1" in iface["found"] and "10.0.0.1 is on eth0" in iface["found"]
    assert by(rows, "address")["status"] == "skip" and by(rows, "mtu")["status"] == "skip"


def test_fabric_admin_down_and_no_carrier():
    down = pf.fabric(ip_probe(iplink(flags=("BROADCAST",), oper="DOWN")), "n", "eth1", "10.0.0.1/24", 9000)
    assert by(down, "interface")["status"] == "fail" and "administratively down" in by(down, "interface")["found"]
    nocarrier = pf.fabric(ip_probe(iplink(flags=("UP", "NO-CARRIER"), oper="DOWN")), "n", "eth1", "10.0.0.1/24", 9000)
    assert "no carrier" in by(nocarrier, "interface")["found"]


def test_fabric_wrong_address_prefix_and_mtu():
    rows = pf.fabric(ip_probe(iplink(addrs=("10.0.0.9/24",), mtu=1500)), "n", "eth1", "10.0.0.1/24", 9000)
    assert by(rows, "address")["status"] == "fail" and by(rows, "address")["found"] == "10.0.0.9/24"
    assert by(rows, "mtu")["status"] == "fail" and by(rows, "mtu")["found"] == "1500"
    prefix = pf.fabric(ip_probe(iplink(addrs=("10.0.0.1/16",))), "n", "eth1", "10.0.0.1/24", 9000)
    assert "prefix differs" in by(prefix, "address")["found"]
    ll = pf.fabric(ip_probe(iplink(addrs=("169.254.3.4/16",))), "n", "eth1", "10.0.0.1/24", 9000)
    assert "link-local" in by(ll, "address")["found"]


def test_fabric_ip_failure_fails_every_row():
    rows = pf.fabric({"rc": 1, "stderr": "Object \"addr\" is unknown"}, "n", "eth1", "10.0.0.1/24", 9000)
    assert {r["status"] for r in rows} == {"fail"} and len(rows) == 3


# --- ping -----------------------------------------------------------------------------------------------------
def test_ping_pass_and_failures():
    res = {"results": [
        {"item": WORKER, "rc": 0, "stdout": "3 packets transmitted, 3 received, 0% packet loss"},
        {"item": {**WORKER, "name": "spark-c"}, "rc": 1, "stdout": "3 packets transmitted, 0 received",
         "msg": "non-zero return code"},
        {"item": {**WORKER, "name": "spark-d"}, "rc": 2, "stderr": "ping: bind: Cannot assign requested address"},
    ]}
    rows = pf.ping(res, "spark-a", "10.0.0.1", 9000)
    assert by(rows, "ping", "spark-b")["status"] == "pass" and by(rows, "ping", "spark-b")["found"] == "3/3 replies"
    assert by(rows, "ping", "spark-c")["found"] == "no reply (0/3)"
    assert "this node's fabric interface" in by(rows, "ping", "spark-c")["fix"]
    assert "not on this node" in by(rows, "ping", "spark-d")["found"]


def test_ping_jumbo_too_long_and_dropped_and_skipped():
    res = {"results": [
        {"item": WORKER, "rc": 1, "stderr": "ping: local error: message too long, mtu=1500"},
        {"item": {**WORKER, "name": "spark-c"}, "rc": 1, "stdout": "3 packets transmitted, 0 received"},
    ]}
    rows = pf.ping(res, "spark-a", "10.0.0.1", 9000, jumbo=True)
    assert by(rows, "ping_mtu", "spark-b")["found"] == "message too long: a local hop has MTU 1500"
    assert "8972-byte" in by(rows, "ping_mtu", "spark-b")["expected"]
    assert by(rows, "ping_mtu", "spark-c")["found"].startswith("no reply to 8972-byte frames")
    skipped = pf.ping({"results": [{"item": WORKER, "skipped": True}]}, "spark-a", "10.0.0.1", 1500, jumbo=True)
    assert by(skipped, "ping_mtu", "spark-b")["status"] == "skip"


# --- ssh ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("stderr", "found"), [
    ("No ED25519 host key is known for 10.0.0.2 and you have requested strict checking.\n"
     "Host key verification failed.", "host key unknown"),
    ("@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\nHost key verification failed.", "host key mismatch"),
    ("ubuntu@10.0.0.2: Permission denied (publickey,password).", "permission denied"),
    ("ssh: connect to host 10.0.0.2 port 22: Connection refused", "connection refused"),
    ("ssh: connect to host 10.0.0.2 port 22: Connection timed out", "unreachable"),
    ("ssh: connect to host 10.0.0.2 port 22: No route to host", "unreachable"),
])
def test_ssh_failures_are_told_apart(stderr, found):
    rows = pf.ssh({"results": [{"item": WORKER, "rc": 255, "stderr": stderr}]}, "spark-a", "")
    r = by(rows, "ssh", "spark-b")
    assert r["status"] == "fail" and r["found"].startswith(found), r


def test_ssh_pass():
    rows = pf.ssh({"results": [{"item": WORKER, "rc": 0, "stderr": ""}]}, "spark-a", "/x/known_hosts")
    assert by(rows, "ssh", "spark-b")["status"] == "pass"


# --- docker and image -----------------------------------------------------------------------------------------
def test_docker_outcomes():
    ok = pf.docker({"rc": 0, "stdout": "Client:\n Version: 26.1\nServer:\n Engine:\n  Version: 20.10.24\n"}, "n", "u")
    assert by(ok, "docker")["status"] == "pass" and by(ok, "docker")["found"] == "engine 20.10.24"
    denied = pf.docker({"rc": 1, "stderr": "permission denied while trying to connect to the Docker daemon socket"},
                       "n", "ubuntu")
    assert "not in the docker group" in by(denied, "docker")["found"] and "usermod -aG docker ubuntu" in \
        by(denied, "docker")["fix"]
    missing = pf.docker({"rc": 2, "failed": True, "msg": "[Errno 2] No such file or directory: b'docker'"}, "n", "u")
    assert by(missing, "docker")["found"] == "docker not installed"
    missing = pf.docker({"rc": 2, "msg": "Error executing command.", "stdout": "", "stderr": ""}, "n", "u")
    assert by(missing, "docker")["found"] == "docker not installed"
    down = pf.docker({"rc": 1, "stderr": "Cannot connect to the Docker daemon at unix:///var/run/docker.sock."},
                     "n", "u")
    assert "not running" in by(down, "docker")["found"]


def test_image_arch():
    inspect = {"rc": 0, "stdout": json.dumps([{"Architecture": "amd64"}])}
    assert by(pf.image_arch(inspect, "n", "img", "x86_64"), "image_arch")["status"] == "pass"
    wrong = by(pf.image_arch(inspect, "n", "img", "aarch64"), "image_arch")
    assert wrong["status"] == "fail" and "arm64" in wrong["expected"] and wrong["found"].startswith("amd64")
    absent = {"rc": 1, "stderr": "Error: No such image: img"}
    assert by(pf.image_arch(absent, "n", "img", "aarch64"), "image_arch")["status"] == "skip"
    assert by(pf.image_arch({"skipped": True}, "n", "img", "aarch64"), "image_arch")["status"] == "skip"


# --- disk -----------------------------------------------------------------------------------------------------
DF = "Filesystem 1-blocks Used Available Capacity Mounted on\noverlay 100000000000 1 {avail} 50% /\n"


def test_disk_nearest_parent_and_rule():
    probe = {"rc": 0, "stdout": "path=/var/lib\n" + DF.format(avail=5 * 2**30)}
    r = by(pf.disk(probe, "n", "/var/lib/hy3spark/hub", 4 * 2**30), "disk")
    assert r["status"] == "pass" and "nearest existing parent" in r["found"]
    r = by(pf.disk(probe, "n", "/var/lib/hy3spark/hub", 6 * 2**30), "disk")
    assert r["status"] == "fail" and "1.0 GiB" in r["fix"]


def test_disk_counts_what_is_already_there():
    probe = {"rc": 0, "stdout": "path=/hub\n" + DF.format(avail=2 * 2**30) + f"{5 * 2**30}\t/hub/models--a--b\n"}
    r = by(pf.disk(probe, "n", "/hub", 6 * 2**30), "disk")
    assert r["status"] == "pass" and "5.0 GiB already there" in r["expected"]


def test_disk_probe_failure():
    assert by(pf.disk({"rc": 1, "stderr": "df: boom"}, "n", "/hub", 1), "disk")["status"] == "fail"


# --- hca ------------------------------------------------------------------------------------------------------
ROOT = "/srv/sim"


def find(*pairs, extra_hcas=()):
    files = [{"path": f"{ROOT}/class/infiniband/{h}"} for h, _ in pairs] + \
            [{"path": f"{ROOT}/class/infiniband/{h}"} for h in extra_hcas]
    files += [{"path": f"{ROOT}/class/infiniband/{h}/device/net/{n}"} for h, n in pairs]
    return {"files": files}


def attrs(ports, states):
    lines = [f"{ROOT}/class/net/{n}/phys_port_name:{p}" for n, p in ports.items()]
    lines += [f"{ROOT}/class/infiniband/{h}/ports/1/state:{s}" for h, s in states.items()]
    return {"rc": 0, "stdout": "\n".join(lines)}


EXISTS = {"stat": {"exists": True}}
ACTIVE = "4: ACTIVE"


def test_hca_absent_is_skipped_not_passed():
    rows = pf.hca({"stat": {"exists": False}}, {"skipped": True}, {"skipped": True}, {"skipped": True}, "n",
                  ["rocep1s0f1"], ["eth1"], "/sys")
    r = by(rows, "hca")
    assert r["status"] == "skip" and r["found"] == "no RDMA devices (/sys/class/infiniband absent)"


def test_hca_twins_on_the_fabric_port_pass():
    rows = pf.hca(EXISTS, find(("rocep1s0f1", "eth1"), ("roceP2p1s0f1", "enP2p1s0f1np1")), {"skipped": True},
                  attrs({"eth1": "p1", "enP2p1s0f1np1": "p1"}, {"rocep1s0f1": ACTIVE, "roceP2p1s0f1": ACTIVE}),
                  "n", ["rocep1s0f1", "roceP2p1s0f1"], ["eth1"], ROOT)
    assert {r["status"] for r in rows} == {"pass"}
    assert "[sysfs root /srv/sim]" in by(rows, "hca", "roceP2p1s0f1")["found"]


def test_hca_on_the_other_port_fails():
    rows = pf.hca(EXISTS, find(("rocep1s0f1", "eth1"), ("roceP2p1s0f0", "enP2p1s0f0np0")), {"skipped": True},
                  attrs({"eth1": "p1", "enP2p1s0f0np0": "p0"}, {"rocep1s0f1": ACTIVE, "roceP2p1s0f0": ACTIVE}),
                  "n", ["rocep1s0f1", "roceP2p1s0f0"], ["eth1"], ROOT)
    assert by(rows, "hca", "rocep1s0f1")["status"] == "pass"
    bad = by(rows, "hca", "roceP2p1s0f0")
    assert bad["status"] == "fail" and "enP2p1s0f0np0 (p0)" in bad["found"] and "not to eth1" in bad["fix"]


def test_hca_missing_and_inactive():
    rows = pf.hca(EXISTS, find(("rocep1s0f1", "eth1")), {"skipped": True},
                  attrs({"eth1": "p1"}, {"rocep1s0f1": "1: DOWN"}), "n", ["rocep1s0f1", "mlx5_9"], ["eth1"], ROOT)
    assert "not ACTIVE" in by(rows, "hca", "rocep1s0f1")["fix"]
    assert by(rows, "hca", "mlx5_9")["found"].startswith("no HCA mlx5_9 (present: rocep1s0f1)")


def test_hca_from_ibdev2netdev():
    ibdev = {"rc": 0, "stdout": "rocep1s0f0 port 1 ==> enp1s0f0np0 (Up)\nrocep1s0f1 port 1 ==> enp1s0f1np1 (Up)\n"}
    rows = pf.hca({"stat": {"exists": True}}, {"skipped": True}, ibdev, {"rc": 0, "stdout": ""}, "n",
                  ["rocep1s0f1", "rocep1s0f0"], ["enp1s0f1np1"], "/sys")
    assert by(rows, "hca", "rocep1s0f1")["status"] == "pass"
    assert by(rows, "hca", "rocep1s0f0")["status"] == "fail"


def test_hca_paths():
    assert pf.hca_find_paths("/sys", ["a"]) == ["/sys/class/infiniband", "/sys/class/infiniband/a/device/net"]
    paths = pf.hca_attr_paths(find(("h1", "x1")), {"skipped": True}, ROOT, ["eth1"], ["h1"])
    assert paths == [f"{ROOT}/class/net/eth1/phys_port_name", f"{ROOT}/class/net/x1/phys_port_name",
                     f"{ROOT}/class/infiniband/h1/ports/1/state"]


def test_hca_none_listed_but_present_warns():
    rows = pf.hca(EXISTS, find(("rocep1s0f1", "eth1")), {"skipped": True}, attrs({}, {}), "n", [], ["eth1"], ROOT)
    assert by(rows, "hca")["status"] == "warn"


# --- earlyoom -------------------------------------------------------------------------------------------------
NOT_RUNNING = {"rc": 3, "stdout": "earlyoom.service - Early OOM Daemon\n   Active: inactive (dead)"}


def cmdline(args):
    return slurp("\0".join(["/usr/bin/earlyoom", *args]) + "\0")


def test_earlyoom_sparkrun_policy_kills_the_engine():
    status = {"rc": 0, "stdout": "Main PID: 42 (earlyoom)"}
    assert pf.main_pid(status) == 42
    args = ["-m", "3", "-s", "10", "--prefer", "(vllm|VLLM|ray|python3|python)", "--avoid", "(systemd|sshd)"]
    rows = pf.earlyoom(slurp(SPARKRUN), status, cmdline(args), "n", "leave", MANAGED, NAMES)
    r = by(rows, "earlyoom")
    assert r["status"] == "fail"
    assert "config from: sparkrun setup earlyoom" in r["found"]
    assert "would kill first: vllm, VLLM::EngineCor, raylet, ray::IDLE, python3, python" in r["found"]
    assert "--avoid protects: none of them" in r["found"]
    assert by(pf.earlyoom(slurp(SPARKRUN), status, cmdline(args), "n", "protect", MANAGED, NAMES),
              "earlyoom")["status"] == "warn"


def test_earlyoom_file_is_parsed_like_systemd_does():
    # Not running: the file's args, quotes removed as systemd's $EARLYOOM_ARGS expansion removes them.
    r = by(pf.earlyoom(slurp(SPARKRUN), NOT_RUNNING, {"skipped": True}, "n", "leave", MANAGED, NAMES), "earlyoom")
    assert r["status"] == "fail" and "not running" in r["found"] and "python3" in r["found"]


def test_earlyoom_anchored_avoid_misses_process_titles():
    # comm of vLLM's engine core and of Ray workers is their process title (15 chars): ^(vllm|ray)$ misses them.
    r = by(pf.earlyoom(slurp(OURS), NOT_RUNNING, {"skipped": True}, "n", "protect", MANAGED, NAMES), "earlyoom")
    assert r["status"] == "warn" and "hy3spark (managed header)" in r["found"]
    assert r["fix"].startswith("add VLLM::EngineCor, ray::IDLE to earlyoom.avoid in the spec")


def test_earlyoom_policy_that_protects_every_name_passes():
    good = OURS.replace("--avoid ^(vllm|VLLM|", "--avoid ^(vllm|VLLM|VLLM::.*|ray::.*|")
    r = by(pf.earlyoom(slurp(good), NOT_RUNNING, {"skipped": True}, "n", "protect", MANAGED, NAMES), "earlyoom")
    assert r["status"] == "pass", r


def test_earlyoom_restart_pending_is_told():
    old = cmdline(["-r", "3600"])
    r = by(pf.earlyoom(slurp(OURS), {"rc": 0, "stdout": "Main PID: 7"}, old, "n", "protect", MANAGED, NAMES),
           "earlyoom")
    assert "restart pending" in r["found"] and r["status"] == "warn"


def test_earlyoom_absent_is_info():
    r = by(pf.earlyoom({"failed": True, "msg": "file not found"}, {"rc": 4}, {"skipped": True}, "n", "protect",
                       MANAGED, NAMES), "earlyoom")
    assert r["status"] == "info" and "not installed" in r["found"]


# --- gpu, security, spec --------------------------------------------------------------------------------------
def test_gpu():
    missing = {"rc": 2, "failed": True, "msg": "[Errno 2] No such file or directory: b'nvidia-smi'"}
    r = by(pf.gpu(missing, "n", 1), "gpu")
    assert r["status"] == "skip" and r["found"] == "nvidia-smi not found"
    # ansible-core 2.19: the OSError text is gone from msg, rc is the errno.
    missing = {"rc": 2, "msg": "Error executing command.", "stdout": "", "stderr": ""}
    assert by(pf.gpu(missing, "n", 1), "gpu")["status"] == "skip"
    ok = {"rc": 0, "stdout": "GPU 0: NVIDIA GB10 (UUID: GPU-1234)\n"}
    assert by(pf.gpu(ok, "n", 1), "gpu")["status"] == "pass"
    assert by(pf.gpu(ok, "n", 2), "gpu")["status"] == "fail"
    broken = {"rc": 9, "stdout": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."}
    assert by(pf.gpu(broken, "n", 1), "gpu")["found"].startswith("NVIDIA-SMI has failed")


def test_security_rows():
    cluster = {"ray": {"dashboard": "off"}, "serving": {"api_key_env": None, "host": "0.0.0.0", "port": 8888}}
    rows = pf.security(cluster, "spark-a")
    assert by(rows, "ray_dashboard")["status"] == "info"
    assert by(rows, "api_key")["status"] == "warn" and "open endpoint on 0.0.0.0:8888" in by(rows, "api_key")["found"]
    cluster["serving"]["api_key_env"] = "VLLM_API_KEY"
    assert "$VLLM_API_KEY" in by(pf.security(cluster, "spark-a"), "api_key")["found"]


def test_spec_sha256():
    assert by(pf.spec_sha256({"skipped": True}, "", "ab" * 32), "spec_sha256")["status"] == "skip"
    st = {"stat": {"exists": True, "checksum": "ab" * 32}}
    assert by(pf.spec_sha256(st, "c.yml", "ab" * 32), "spec_sha256")["status"] == "pass"
    stale = by(pf.spec_sha256(st, "c.yml", "cd" * 32), "spec_sha256")
    assert stale["status"] == "fail" and stale["node"] == "controller" and "changed after" in stale["found"]
    assert by(pf.spec_sha256({"stat": {"exists": False}}, "c.yml", "x"), "spec_sha256")["status"] == "skip"


# --- gathering and the table ----------------------------------------------------------------------------------
def test_collect_orders_by_spec_and_flags_missing_nodes():
    a = [pf.row("a", "mtu", "pass", "9000", "9000")]
    rows = pf.collect({"a": {"__preflight_node_results": a}, "b": {}}, ["a", "b", "c"], ["a", "b"],
                      [pf.row("controller", "spec_sha256", "skip", "x", "y")])
    assert [(r["node"], r["check"], r["status"]) for r in rows] == [
        ("a", "mtu", "pass"), ("b", "reachable", "fail"), ("c", "reachable", "skip"),
        ("controller", "spec_sha256", "skip")]
    assert pf.failures(rows) == ["b/reachable"]


def test_table_has_every_row_and_a_summary():
    rows = [pf.row("spark-a", "mtu", "fail", "9000", "1500", "set mtu 9000 " * 10),
            pf.row("spark-b", "ssh", "pass", "x", "y", target="spark-c")]
    lines = pf.table(rows).splitlines()
    assert lines[0].split() == ["NODE", "CHECK", "STATUS", "EXPECTED", "FOUND", "HOW", "TO", "FIX"]
    assert any(line.startswith("spark-a") and "FAIL" in line for line in lines)
    assert any("ssh spark-c" in line for line in lines)
    assert lines[-1] == "preflight: 1 pass, 1 fail, 0 warn, 0 skip, 0 info"
    assert max(len(line) for line in lines) <= 24 + 32 + 6 + 36 + 44 + 56 + 10
    assert pf.failures(rows) == ["spark-a/mtu"]
    assert set(pf.by_key(rows)) == {"spark-a/mtu", "spark-b/ssh/spark-c"}


def test_filters_are_registered():
    names = pf.FilterModule().filters()
    assert {"preflight_fabric", "preflight_table", "preflight_collect", "preflight_failures"} <= set(names)


def test_network_pending_turns_only_network_failures_into_warnings() -> None:
    rows = [
        pf.row("a", "address", "fail", "10.0.0.1/24", "no address"),
        pf.row("a", "ping", "fail", "reply", "no reply", target="b"),
        pf.row("a", "interface", "fail", "up", "absent"),
        pf.row("a", "docker", "fail", "usable", "not installed"),
        pf.row("a", "mtu", "pass", "9000", "9000"),
    ]
    pending = pf.network_pending(rows, True)
    assert [r["status"] for r in pending] == ["warn", "warn", "fail", "fail", "pass"]
    assert pending[0]["found"] == "no address (the network role configures this next)"
    assert pf.failures(pending) == ["a/interface", "a/docker"]
    assert pf.network_pending(rows, False) == rows


# --- Judgements the mutation run (scripts/mutation preflight) found untested ------------------------------------
def test_fabric_rows_say_what_was_expected_and_how_to_fix():
    rows = pf.fabric(ip_probe(iplink(addrs=("10.0.0.9/24",), mtu=1500)), "spark-a", "eth1", "10.0.0.1/24", "9000")
    assert [(r["node"], r["check"], r["expected"]) for r in rows] == [
        ("spark-a", "interface", "eth1 present and up"), ("spark-a", "address", "10.0.0.1/24 on eth1"),
        ("spark-a", "mtu", "9000")]
    assert by(rows, "address")["fix"].startswith("give eth1 its own address 10.0.0.1/24: run the network role")
    assert by(rows, "mtu")["fix"].startswith("set mtu: 9000 for eth1 (network role / netplan) on every node")
    assert by(rows, "interface") == pf.row("spark-a", "interface", "pass", "eth1 present and up", "eth1 UP")


def test_fabric_ip_failure_names_the_error_and_the_package():
    rows = pf.fabric({"rc": 1, "stderr": "\nip: command failed\nmore"}, "n", "eth1", "10.0.0.1/24", 9000)
    assert [r["found"] for r in rows] == ["cannot list interfaces: ip: command failed"] * 3
    assert [r["expected"] for r in rows] == ["eth1 present and up", "10.0.0.1/24", "9000"]
    assert {r["fix"] for r in rows} == {"install iproute2 (ip) on the node"}
    no_text = pf.fabric({"rc": 2}, "n", "eth1", "10.0.0.1/24", 9000)
    assert by(no_text, "mtu")["found"] == "cannot list interfaces: ip failed"


def test_fabric_link_without_operstate_but_with_carrier_passes():
    # Some drivers report operstate UNKNOWN for a working link; LOWER_UP is the carrier.
    rows = pf.fabric(ip_probe(iplink(oper="UNKNOWN")), "n", "eth1", "10.0.0.1/24", 9000)
    assert by(rows, "interface")["status"] == "pass" and by(rows, "interface")["found"] == "eth1 UNKNOWN"
    rows = pf.fabric(ip_probe(iplink(oper="UNKNOWN", flags=("UP",))), "n", "eth1", "10.0.0.1/24", 9000)
    assert by(rows, "interface")["found"] == "eth1 UNKNOWN, no carrier"
    assert by(rows, "interface")["fix"] == "check the cable and that the peer's port is up"


def test_fabric_missing_interface_lists_what_is_there():
    only_lo = pf.fabric(ip_probe(), "n", "eth1", "10.0.0.1/24", 9000)
    assert by(only_lo, "interface")["found"] == "no interface eth1 (present: none)"
    assert [r["found"] for r in only_lo[1:]] == ["interface eth1 absent"] * 2
    others = pf.fabric(ip_probe(iplink("eth2", ("10.9.9.9/24",)), iplink("eth0", ("10.0.0.7/24",))), "n", "eth1",
                       "10.0.0.1/24", 9000)
    assert by(others, "interface")["found"] == "no interface eth1 (present: eth0, eth2)"


def test_fabric_address_on_another_port_is_named():
    rows = pf.fabric(ip_probe(iplink(addrs=()), iplink("eth0", ("10.0.0.1/24",))), "n", "eth1", "10.0.0.1/24", 9000)
    assert by(rows, "address")["found"] == "no IPv4 address; 10.0.0.1 is on eth0"
    rows = pf.fabric(ip_probe(iplink(addrs=("10.0.0.1/16",)), iplink("eth0", ("10.0.0.1/24",))), "n", "eth1",
                     "10.0.0.1/24", 9000)
    assert by(rows, "address")["found"] == "10.0.0.1/16 (prefix differs)"
    both = pf.fabric(ip_probe(iplink(addrs=("10.0.0.1/24", "10.0.0.5/24"))), "n", "eth1", "10.0.0.1/24", 9000)
    assert by(both, "address") == pf.row("n", "address", "pass", "10.0.0.1/24", "10.0.0.1/24, 10.0.0.5/24")


def test_fabric_ignores_ipv6_addresses():
    link = iplink(addrs=())
    link["addr_info"] = [{"family": "inet6", "local": "10.0.0.1", "prefixlen": 24}]
    assert by(pf.fabric(ip_probe(link), "n", "eth1", "10.0.0.1/24", 9000), "address")["found"] == "no IPv4 address"


def test_ping_accepts_a_plain_list_and_reports_each_peer():
    res = [{"item": WORKER, "rc": 0, "stdout": ""},
           {"item": {**WORKER, "name": "spark-c"}, "rc": 2, "failed": True,
            "msg": "[Errno 2] No such file or directory: b'ping'"},
           {"item": {**WORKER, "name": "spark-d"}, "rc": 1, "stdout": "", "stderr": "\nconnect: Network is down\n"}]
    rows = pf.ping(res, "spark-a", "10.0.0.1", "9000")
    assert by(rows, "ping", "spark-b") == pf.row("spark-a", "ping", "pass", "10.0.0.2 answers from 10.0.0.1",
                                                 "replies", target="spark-b")
    assert by(rows, "ping", "spark-c")["found"] == "ping not installed"
    assert by(rows, "ping", "spark-c")["fix"] == "install iputils-ping"
    assert by(rows, "ping", "spark-d")["found"] == "no reply: connect: Network is down"
    assert by(rows, "ping", "spark-d")["fix"] == (
        "check both ends (their interface and address rows): this node's fabric interface, and that spark-d is up, "
        "cabled and carries 10.0.0.2")


def test_ping_jumbo_details():
    res = {"results": [
        {"item": WORKER, "rc": 1, "stderr": "ping: sendmsg: Message too long"},
        {"item": {**WORKER, "name": "spark-c"}, "rc": 1, "stdout": "3 packets transmitted, 1 received"},
        {"item": {**WORKER, "name": "spark-d"}, "rc": 0, "stdout": "2 packets transmitted, 2 received"},
    ]}
    rows = pf.ping(res, "spark-a", "10.0.0.1", 9000, jumbo=True)
    too_long = by(rows, "ping_mtu", "spark-b")
    assert too_long["found"] == "message too long: a local hop has MTU < 9000"
    assert too_long["fix"] == "set mtu 9000 on the fabric interface of both nodes (network role)"
    dropped = by(rows, "ping_mtu", "spark-c")
    assert dropped["found"] == "no reply to 8972-byte frames (1/3)"
    assert dropped["fix"].startswith("a hop on the path drops frames above its MTU: set mtu 9000 on spark-c's fabric")
    ok = by(rows, "ping_mtu", "spark-d")
    assert ok["status"] == "pass" and ok["found"] == "2/2 replies"
    assert ok["expected"] == "8972-byte don't-fragment ping 10.0.0.1 -> 10.0.0.2 answered"
    skipped = pf.ping({"results": [{"item": WORKER, "skipped": True}]}, "spark-a", "10.0.0.1", 1500, jumbo=True)
    assert by(skipped, "ping_mtu", "spark-b")["found"] == "MTU 1500: no jumbo frames to test"


def test_ssh_other_failures_and_the_pinned_file():
    res = {"results": [
        {"item": WORKER, "rc": 255, "stderr": "Host key verification failed."},
        {"item": {**WORKER, "name": "spark-c"}, "rc": 255, "stderr": "bind: Cannot assign requested address"},
        {"item": {**WORKER, "name": "spark-d"}, "rc": 2, "failed": True,
         "msg": "[Errno 2] No such file or directory: b'ssh'"},
        {"item": {**WORKER, "name": "spark-e"}, "rc": 255, "stderr": "kex_exchange_identification: read: reset"},
        {"item": {**WORKER, "name": "spark-f"}, "rc": 255, "stderr": ""},
        {"item": {**WORKER, "name": "spark-g"}, "rc": 255, "stderr": "connect to host: Network is unreachable"},
    ]}
    rows = pf.ssh(res, "spark-a", "/etc/hy3spark/known_hosts")
    unknown = by(rows, "ssh", "spark-b")
    assert unknown["found"] == "host key unknown: 10.0.0.2 is not pinned in /etc/hy3spark/known_hosts"
    assert unknown["fix"].startswith("pin spark-b's host key for 10.0.0.2 in /etc/hy3spark/known_hosts on the head")
    assert by(rows, "ssh", "spark-c")["found"] == ("cannot connect from this node's fabric address: it is not on "
                                                   "this node")
    assert by(rows, "ssh", "spark-d")["found"] == "ssh client not installed"
    assert by(rows, "ssh", "spark-e")["found"] == "kex_exchange_identification: read: reset"
    assert by(rows, "ssh", "spark-e")["fix"] == "run `ssh -o BatchMode=yes ubuntu@10.0.0.2 true` on the head and fix " \
                                                "what it reports"
    assert by(rows, "ssh", "spark-f")["found"] == "ssh exited 255"
    assert by(rows, "ssh", "spark-g")["found"] == "unreachable: connect to host: Network is unreachable"
    assert by(rows, "ssh", "spark-g")["fix"] == "fix the fabric path to spark-g first (see the ping rows)"
    default = pf.ssh({"results": [{"item": WORKER, "rc": 255, "stderr": "Host key verification failed."}]}, "a", "")
    assert by(default, "ssh", "spark-b")["found"].endswith("is not pinned in ~/.ssh/known_hosts")


def test_ssh_rows_expect_the_user_at_the_fabric_address():
    rows = pf.ssh([{"item": {**WORKER, "ssh_user": "ops"}, "rc": 255, "stderr": "ops@10.0.0.2: Permission denied"}],
                  "spark-a", "")
    r = by(rows, "ssh", "spark-b")
    assert r["expected"] == "ops@10.0.0.2 without a password, host key pinned"
    assert r["found"] == "permission denied: ops@10.0.0.2 does not accept the head's key"
    assert r["fix"].startswith("add ops's public key on the head to ops@spark-b:~/.ssh/authorized_keys")


def test_docker_other_failure_and_an_engine_without_version():
    assert pf.docker_usable({"rc": 0}) and not pf.docker_usable({"rc": 1})
    ok = pf.docker({"rc": 0, "stdout": "Client:\n Version: 26.1\n"}, "n", "u")
    assert by(ok, "docker")["found"] == "engine answers"
    assert by(ok, "docker")["expected"] == "docker usable by u without sudo"
    odd = by(pf.docker({"rc": 1, "stderr": "\nsomething odd\n"}, "n", "u"), "docker")
    assert (odd["status"], odd["found"], odd["fix"]) == ("fail", "something odd", "run `docker version` as the user")
    assert by(pf.docker({"rc": 3}, "n", "u"), "docker")["found"] == "docker exited 3"
    down = by(pf.docker({"rc": 1, "stderr": "Is the docker daemon running?"}, "n", "u"), "docker")
    assert down["fix"] == "sudo systemctl enable --now docker"


def test_image_arch_details():
    arm = {"rc": 0, "stdout": json.dumps([{"Architecture": "arm64", "Variant": "v8"}])}
    r = by(pf.image_arch(arm, "n", "img:1", "aarch64"), "image_arch")
    assert (r["status"], r["expected"], r["found"]) == ("pass", "img:1 built for arm64 (aarch64)", "arm64/v8")
    wrong = by(pf.image_arch(arm, "n", "img:1", "x86_64"), "image_arch")
    assert wrong["found"] == "arm64/v8: it cannot run on this x86_64 node"
    assert wrong["fix"] == ("use an image built for linux/amd64 (a multi-arch tag or one built on a Spark), then "
                            "remove this one: docker image rm img:1")
    # An architecture the table does not know is compared as docker would name it.
    assert by(pf.image_arch({"rc": 0, "stdout": json.dumps([{"Architecture": "mips64le"}])}, "n", "i", "mips64le"),
              "image_arch")["status"] == "pass"
    empty = by(pf.image_arch({"rc": 0, "stdout": "[]"}, "n", "i", "aarch64"), "image_arch")
    assert (empty["status"], empty["found"]) == ("fail", "unknown: it cannot run on this aarch64 node")
    broken = by(pf.image_arch({"rc": 1, "stderr": "\ndenied\n"}, "n", "img:1", "aarch64"), "image_arch")
    assert (broken["status"], broken["found"], broken["fix"]) == (
        "fail", "denied", "run `docker image inspect img:1` and fix what it reports")
    assert by(pf.image_arch({"rc": 1}, "n", "i", "aarch64"), "image_arch")["found"] == "docker image inspect failed"
    gone = by(pf.image_arch({"rc": 1, "stderr": "Error: No such object: i"}, "n", "i", "aarch64"), "image_arch")
    assert gone["status"] == "skip" and gone["found"] == "image absent (the image role pulls or streams it)"
    assert by(pf.image_arch({"skipped": True}, "n", "i", "aarch64"), "image_arch")["found"] == \
        "docker not usable (see the docker row)"


def test_disk_sizes_are_human():
    assert [pf._human_bytes(n) for n in (0, 1023, 1024, 1536, 2**20, 5 * 2**30, 3 * 2**40, -2048)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "1.0 MiB", "5.0 GiB", "3.0 TiB", "-2.0 KiB"]
    assert pf._human_bytes(1023 * 2**30) == "1023.0 GiB"
    assert pf._human_bytes(1000 * 2**40) == "1000.0 TiB"


def test_disk_at_the_cache_dir_itself_on_a_mount_with_spaces():
    probe = {"rc": 0, "stdout": "path=/hub\nFilesystem 1-blocks Used Available Capacity Mounted on\n"
                                f"/dev/sda1 100 1 {3 * 2**30} 1% /mnt/big disk\n"}
    r = by(pf.disk(probe, "n", "/hub", 2 * 2**30), "disk")
    assert r == pf.row("n", "disk", "pass", ">= 2.0 GiB free for /hub", "3.0 GiB free on /mnt/big disk at /hub")
    short = by(pf.disk(probe, "n", "/hub", 7 * 2**30), "disk")
    assert short["fix"] == ("free 4.0 GiB on /mnt/big disk, or point model.cache_dir at a larger disk (the same path "
                            "on every node)")
    exact = by(pf.disk(probe, "n", "/hub", 3 * 2**30), "disk")
    assert exact["status"] == "pass"


def test_disk_with_the_whole_model_already_there_needs_nothing():
    probe = {"rc": 0, "stdout": "path=/hub\n" + DF.format(avail=0) + f"{7 * 2**30}\t/hub/models--a--b\n"}
    r = by(pf.disk(probe, "n", "/hub", 6 * 2**30), "disk")
    assert r["status"] == "pass"
    assert r["expected"] == ">= 0 B free for /hub (model 6.0 GiB, 7.0 GiB already there)"


def test_disk_without_a_df_answer_fails_with_the_reason():
    for probe, why in (({"rc": 0, "stdout": "path=/hub\n"}, "df gave no answer"),
                       ({"rc": 1, "stderr": "df: /hub: Permission denied"}, "df: /hub: Permission denied"),
                       ({"rc": 0, "stdout": "path=/\nFilesystem 1-blocks Used Available Capacity Mounted on\n"
                                            "overlay 1 1 lots 1% /\n"}, "df gave no answer")):
        r = by(pf.disk(probe, "n", "/hub", 10), "disk")
        assert r["status"] == "fail" and r["found"] == f"cannot measure free space: {why}"
        assert r["fix"] == "check that /hub (or a parent) is readable by the deploying user"


def test_gpu_details():
    two = {"rc": 0, "stdout": "GPU 0: NVIDIA GB10 (UUID: GPU-1)\nGPU 1: NVIDIA GB10 (UUID: GPU-2)\nnoise\n"}
    r = by(pf.gpu(two, "n", "2"), "gpu")
    assert (r["status"], r["expected"], r["found"]) == ("pass", "nvidia-smi -L lists 2 GPU(s)",
                                                        "2 GPU(s): GPU 0: NVIDIA GB10")
    none = by(pf.gpu({"rc": 0, "stdout": "No devices found.\n"}, "n", 1), "gpu")
    assert (none["status"], none["found"]) == ("fail", "0 GPU(s)")
    assert none["fix"] == "check the driver and `nvidia-smi -L`; fix gpus: in the spec"
    silent = by(pf.gpu({"rc": 9, "stdout": "", "stderr": ""}, "n", 1), "gpu")
    assert silent["found"] == "nvidia-smi failed" and silent["fix"].startswith("the driver does not answer")
    # A GPU listed on a failing nvidia-smi is still a failure.
    assert by(pf.gpu({"rc": 9, "stdout": two["stdout"]}, "n", 1), "gpu")["status"] == "fail"


def test_security_rows_for_every_dashboard_and_host():
    cluster = {"ray": {"dashboard": "localhost"}, "serving": {"api_key_env": None, "host": "127.0.0.1", "port": 8}}
    rows = pf.security(cluster, "spark-a")
    assert by(rows, "ray_dashboard")["found"] == "on, bound to 127.0.0.1:8265 (reach it through an SSH tunnel)"
    assert by(rows, "ray_dashboard")["status"] == "info"
    assert by(rows, "api_key") == pf.row("spark-a", "api_key", "info",
                                         "an API key on an endpoint reachable beyond the head",
                                         "no key; the endpoint listens on 127.0.0.1:8 only")
    cluster["ray"]["dashboard"] = "0.0.0.0"
    dash = by(pf.security(cluster, "spark-a"), "ray_dashboard")
    assert (dash["status"], dash["fix"]) == ("warn", "set ray.dashboard: off")
    assert dash["found"].startswith("0.0.0.0: the Jobs API runs code for anyone")
    open_ = by(pf.security({"ray": {"dashboard": "off"}, "serving": {"host": "0.0.0.0", "port": 1}}, "a"), "api_key")
    assert open_["fix"] == "set serving.api_key_env to the name of an env var holding a key"


def test_spec_sha256_details():
    st = {"stat": {"exists": True, "checksum": "cd" * 32}}
    stale = by(pf.spec_sha256(st, "c.yml", "ab" * 32), "spec_sha256")
    assert stale["expected"] == "the spec file hashes to abababababab, as at render time"
    assert stale["found"] == "c.yml: cdcdcdcdcdcd: the spec changed after the inventory was rendered"
    assert stale["fix"] == "re-render (hy3spark render c.yml), then run the play again"
    assert by(pf.spec_sha256(None, "c.yml", "ab" * 32), "spec_sha256")["found"] == "c.yml not found on the controller"
    ok = by(pf.spec_sha256({"stat": {"exists": True, "checksum": "ab" * 32}}, "c.yml", "ab" * 32), "spec_sha256")
    assert ok["found"] == "c.yml: abababababab"


def test_collect_a_node_without_hostvars_is_a_failure():
    rows = pf.collect({}, ["a"], ["a"], [])
    assert rows == [pf.row("a", "reachable", "fail", "Ansible reaches the node",
                           "no results: unreachable, or a probe failed before the report",
                           "check the connection (ansible -m ping) and the earlier error for this node")]


def test_collect_with_a_custom_key():
    rows = pf.collect({"a": {"k": [pf.row("a", "gpu", "pass", "1", "1")]}}, ["a"], ["a"], [], key="k")
    assert [r["check"] for r in rows] == ["gpu"]


def test_row_refuses_an_unknown_status():
    with pytest.raises(ValueError, match="unknown status 'ok'"):
        pf.row("n", "gpu", "ok", "", "")


def test_key_names_rows_with_and_without_a_target():
    assert pf.key(pf.row("a", "ssh", "fail", "", "", target="b")) == "a/ssh/b"
    assert pf.key(pf.row("a", "gpu", "fail", "", "")) == "a/gpu"


def test_table_wraps_long_cells_and_cuts_long_words():
    rows = [pf.row("n", "disk", "fail", "x", "y", "w" * 130 + " short words here")]
    lines = pf.table(rows).splitlines()
    fix_col = lines[0].index("HOW TO FIX")
    body = [line[fix_col:] for line in lines[2:-2]]
    assert body == ["w" * 56, "w" * 56, "w" * 18 + " short words here"]
    assert all(len(line) <= fix_col + 56 for line in lines)


def test_table_columns_are_as_wide_as_their_longest_cell_up_to_the_cap():
    rows = [pf.row("spark-a", "gpu", "pass", "1", "1"), pf.row("b", "ssh", "warn", "2", "2", target="spark-c")]
    lines = pf.table(rows).splitlines()
    assert lines[0] == "NODE     CHECK        STATUS  EXPECTED  FOUND  HOW TO FIX"
    assert lines[1] == "-------  -----------  ------  --------  -----  ----------"
    assert lines[2] == "spark-a  gpu          PASS    1         1"
    assert lines[3] == "b        ssh spark-c  WARN    2         2"
    assert lines[-1] == "preflight: 1 pass, 0 fail, 1 warn, 0 skip, 0 info"


def test_hca_netdevs_from_sysfs_ignore_other_paths_and_sort():
    files = find(("rocep1s0f1", "eth9"), ("rocep1s0f1", "eth1"), extra_hcas=("mlx5_0",))
    # Stray paths first: they are skipped, and what follows them still counts.
    stray = ["/elsewhere/class/infiniband/x", f"{ROOT}/class/infiniband/y/ports/1",
             f"{ROOT}/class/infiniband/rocep1s0f1/ports/1/state", f"{ROOT}/class/infiniband/rocep1s0f1/board/net/x0"]
    files["files"] = [{"path": path} for path in stray] + files["files"]
    assert pf.hca_netdevs(files, {"skipped": True}, ROOT + "/") == {"rocep1s0f1": ["eth1", "eth9"], "mlx5_0": []}
    ibdev = {"rc": 0, "stdout": "rocep1s0f1 port 1 ==> eth1 (Up)\nnoise\nrocep1s0f1 port 2 ==> eth2 (Down)\n"}
    assert pf.hca_netdevs(files, ibdev, ROOT) == {"rocep1s0f1": ["eth1", "eth2"]}
    # ibdev2netdev that failed falls back to sysfs.
    assert pf.hca_netdevs(find(("h1", "x1")), {"rc": 1, "stdout": "h9 port 1 ==> x9 (Up)"}, ROOT) == {"h1": ["x1"]}


def test_hca_attr_paths_list_each_netdev_once():
    paths = pf.hca_attr_paths(find(("h1", "eth1"), ("h2", "x2")), {"skipped": True}, ROOT + "/", ["eth1"], ["h1", "h2"])
    assert paths == [f"{ROOT}/class/net/eth1/phys_port_name", f"{ROOT}/class/net/x2/phys_port_name",
                     f"{ROOT}/class/infiniband/h1/ports/1/state", f"{ROOT}/class/infiniband/h2/ports/1/state"]
    assert pf.hca_find_paths("/sys/", []) == ["/sys/class/infiniband"]


def test_hca_skip_and_warn_rows_say_what_was_listed_and_found():
    absent = pf.hca({"stat": {"exists": False}}, {}, {"rc": 1}, {}, "n", [], ["eth1"], "/sys")
    assert absent == [pf.row("n", "hca", "skip", "no HCAs listed", "no RDMA devices (/sys/class/infiniband absent)")]
    listed = pf.hca({}, {}, {"skipped": True}, {}, "n", ["h1", "h2"], ["eth1"], "/sys")
    assert by(listed, "hca")["expected"] == "h1, h2"
    # ibdev2netdev answered: the devices exist even when the sysfs probe did not run.
    ibdev = {"rc": 0, "stdout": "rocep1s0f1 port 1 ==> eth1 (Up)\n"}
    rows = pf.hca({}, {}, ibdev, {"rc": 0, "stdout": ""}, "n", [], ["eth1"], "/sys")
    warn = by(rows, "hca")
    assert (warn["status"], warn["found"]) == ("warn", "rocep1s0f1 -> eth1")
    assert warn["fix"].startswith("list both twins of the cabled port in fabric.hcas (ibdev2netdev)")
    empty = pf.hca(EXISTS, {"files": []}, {"skipped": True}, attrs({}, {}), "n", [], ["eth1"], ROOT)
    assert by(empty, "hca")["found"] == "none [sysfs root /srv/sim]"
    bare = pf.hca(EXISTS, find(extra_hcas=("mlx5_0",)), {"skipped": True}, attrs({}, {}), "n", [], ["eth1"], ROOT)
    assert by(bare, "hca")["found"] == "mlx5_0 -> ? [sysfs root /srv/sim]"


def test_hca_twin_on_the_same_port_through_its_own_netdev_passes():
    # The second twin's netdev is not the fabric interface but sits on the same physical port (p1).
    rows = pf.hca(EXISTS, find(("rocep1s0f1", "eth1"), ("roceP2p1s0f1", "enP2p1s0f1np1")), {"skipped": True},
                  attrs({"eth1": "p1", "enP2p1s0f1np1": "p1"}, {"rocep1s0f1": ACTIVE, "roceP2p1s0f1": ACTIVE}),
                  "n", ["rocep1s0f1", "roceP2p1s0f1"], ["eth1"], ROOT)
    twin = by(rows, "hca", "roceP2p1s0f1")
    assert twin == pf.row("n", "hca", "pass", "roceP2p1s0f1 on eth1 (port p1), the port carrying the fabric address",
                          "roceP2p1s0f1 -> enP2p1s0f1np1 (p1), 4: ACTIVE [sysfs root /srv/sim]", target="roceP2p1s0f1")


def test_hca_without_port_names_is_judged_by_netdev_only():
    rows = pf.hca(EXISTS, find(("h1", "eth1"), ("h2", "eth2")), {"skipped": True}, attrs({}, {}), "n", ["h1", "h2"],
                  ["eth1"], ROOT)
    assert by(rows, "hca", "h1") == pf.row("n", "hca", "pass", "h1 on eth1, the port carrying the fabric address",
                                           "h1 -> eth1 [sysfs root /srv/sim]", target="h1")
    other = by(rows, "hca", "h2")
    assert (other["status"], other["found"]) == ("fail", "h2 -> eth2 [sysfs root /srv/sim]")
    assert other["fix"] == ("h2 belongs to eth2, not to eth1: list the HCAs that ibdev2netdev maps to eth1 (both "
                            "twins) in fabric.hcas")


def test_hca_without_netdev_and_a_missing_one():
    rows = pf.hca(EXISTS, find(extra_hcas=("h1",)), {"skipped": True}, attrs({}, {}), "n", ["h9", "h1"], ["eth1"],
                  ROOT)
    lone = by(rows, "hca", "h1")
    assert (lone["status"], lone["found"]) == ("fail", "h1 -> no netdev [sysfs root /srv/sim]")
    assert lone["fix"].startswith("h1 belongs to no netdev, not to eth1")
    missing = by(rows, "hca", "h9")
    assert missing["found"] == "no HCA h9 (present: h1) [sysfs root /srv/sim]"
    assert missing["fix"] == "copy the names ibdev2netdev maps to the fabric interface into fabric.hcas"
    nothing = pf.hca(EXISTS, {"files": []}, {"skipped": True}, attrs({}, {}), "n", ["h9"], ["eth1"], "/sys")
    assert by(nothing, "hca", "h9")["found"] == "no HCA h9 (present: none)"


def test_hca_inactive_port_fix_names_the_netdevs():
    rows = pf.hca(EXISTS, find(("h1", "eth1")), {"skipped": True}, attrs({"eth1": "p1"}, {"h1": "1: DOWN"}), "n",
                  ["h1"], ["eth1"], ROOT)
    r = by(rows, "hca", "h1")
    assert (r["status"], r["found"]) == ("fail", "h1 -> eth1 (p1), 1: DOWN [sysfs root /srv/sim]")
    assert r["fix"] == "h1's port is not ACTIVE: check the cable and the link of eth1"


def test_files_by_path_keeps_the_first_value():
    grep = {"stdout": "/a:1\n/b: x \n/a:2\nno separator\n"}
    assert pf._files_by_path(grep) == {"/a": "1", "/b": "x"}


# --- earlyoom in detail ---------------------------------------------------------------------------------------
def test_earlyoom_args_file_parsing():
    assert eo.file_args('EARLYOOM_ARGS="-m 3 --prefer \'(a|b)\'"\n') == ["-m", "3", "--prefer", "(a|b)"]
    # systemd keeps what follows the closing quote, a `#` included (it is no comment there), as earlyoom gets it.
    assert eo.file_args('export EARLYOOM_ARGS="-r 60"  # a comment\n') == ["-r", "60", "#", "a", "comment"]
    assert eo.file_args('EARLYOOM_ARGS="-r 60"#c\n') == ["-r", "60#c"]
    # In double quotes \" is a quote; after them, \# is a plain #.
    assert eo.env_file_value(r'"-m \"3\" \d" x\#y  ') == r'-m "3" \d x#y'
    assert eo.env_file_value(r"'-m \"3\"'") == r'-m \"3\"'
    assert eo.file_args("  EARLYOOM_ARGS=-m\n") == ["-m"]
    # The last assignment wins, as in a shell.
    assert eo.file_args('EARLYOOM_ARGS="-m 1"\nEARLYOOM_ARGS="-m 2"\n') == ["-m", "2"]
    assert eo.file_args("# EARLYOOM_ARGS=-m 5\nOTHER=1\n") is None
    assert eo.file_args("EARLYOOM_ARGS=\n") == []
    # Unbalanced quotes: earlyoom would get the raw words.
    assert eo.file_args('EARLYOOM_ARGS="-m 3 --prefer \'(a"\n') == ["-m", "3", "--prefer", "'(a"]
    assert eo.file_args("EARLYOOM_ARGS='-m 3\n") == ["-m", "3"]


def test_earlyoom_option_forms():
    assert eo.option(["--prefer", "a", "--prefer=b"], "--prefer") == "b"
    assert eo.option(["--prefer=x=y"], "--prefer") == "x=y"
    assert eo.option(["-m", "3", "--prefer"], "--prefer") is None
    assert eo.option(["--preferred", "a"], "--prefer") is None


def test_earlyoom_provenance():
    assert pf._provenance("# Default settings for earlyoom. This file is sourced by /bin/sh\n", MANAGED) == \
        "the earlyoom package's default file"
    assert pf._provenance("EARLYOOM_ARGS=-m 3\n", MANAGED) == "unknown (no provenance header)"
    assert pf._provenance("#Configured by:  me \n", "") == "me"
    late = "\n" * 12 + f"# {MANAGED}\n"
    assert pf._provenance(late, MANAGED) == "unknown (no provenance header)"


def test_earlyoom_matches_ignores_a_broken_regex():
    assert pf._matches("(vllm", NAMES) == []
    assert pf._matches("", NAMES) == []
    assert pf._matches("^ray", NAMES) == ["raylet", "ray::IDLE"]


def test_main_pid_of_a_stopped_unit_is_zero():
    assert pf.main_pid({"rc": 3, "stdout": "Main PID: 42 (code=exited)"}) == 0
    assert pf.main_pid({"rc": 0, "stdout": "Active: active"}) == 0


def test_earlyoom_policy_stop_with_a_killing_prefer_is_a_warning_that_says_so():
    args = ["--prefer", "(vllm|python)"]
    r = by(pf.earlyoom(None, {"rc": 0}, cmdline(args), "n", "stop", MANAGED, NAMES), "earlyoom")
    assert r["status"] == "warn"
    assert r["fix"] == "policy stop: the earlyoom role stops earlyoom; run it before serving"
    assert r["found"] == ("running; config from: no config file; --prefer (vllm|python) would kill first: vllm, "
                          "python3, python; no --avoid")


def test_earlyoom_unprotected_names_under_policy_leave_point_at_the_file():
    text = 'EARLYOOM_ARGS="--avoid ^(vllm|python3|python)$"\n'
    r = by(pf.earlyoom(slurp(text), NOT_RUNNING, {"skipped": True}, "n", "leave", MANAGED, NAMES,
                       conf_path="/etc/x"), "earlyoom")
    assert r["status"] == "warn"
    assert r["fix"] == "add VLLM::EngineCor, raylet, ray::IDLE, gcs_server to --avoid in /etc/x"
    assert r["found"] == ("not running; config from: unknown (no provenance header); no --prefer; --avoid protects: "
                          "vllm, python3, python")
    assert r["expected"] == ("--prefer matches none of vllm, VLLM::EngineCor, raylet, ray::IDLE, gcs_server, python3, "
                             "python; --avoid protects them")
    # Under policy stop earlyoom will not run at all: nothing to protect.
    assert by(pf.earlyoom(slurp(text), NOT_RUNNING, {"skipped": True}, "n", "stop", MANAGED, NAMES),
              "earlyoom")["status"] == "pass"


def test_earlyoom_running_without_a_file_and_with_a_file_without_args():
    absent = pf.earlyoom({"skipped": True}, {"rc": 4}, None, "n", "leave", MANAGED, NAMES, conf_path="/etc/x")
    assert by(absent, "earlyoom")["found"] == "earlyoom not installed/running (/etc/x absent); spec policy: leave"
    no_args = by(pf.earlyoom(slurp("# nothing here\n"), NOT_RUNNING, {"skipped": True}, "n", "protect", MANAGED,
                             NAMES), "earlyoom")
    assert no_args["found"] == ("not running; config from: unknown (no provenance header); no --prefer; no --avoid")
    assert no_args["fix"].startswith("add vllm, VLLM::EngineCor, raylet, ray::IDLE, gcs_server, python3, python to "
                                     "earlyoom.avoid in the spec")
    same = cmdline(["-r", "3600", "-m", "4", "-s", "100", "--avoid", "^(vllm|VLLM|ray|raylet|gcs_server|python3|"
                    "python)$", "--prefer", "^(chrome|code)$"])
    r = by(pf.earlyoom(slurp(OURS), {"rc": 0}, same, "n", "protect", MANAGED, NAMES), "earlyoom")
    assert r["found"].startswith("running; config from: hy3spark (managed header)")
    assert "restart pending" not in r["found"]


# --- Second pass of the mutation run ------------------------------------------------------------------------------
def as_ansible_returns(value):
    """A value as Ansible hands it back to the next filter: through JSON, so its strings are built at run time."""
    return json.loads(json.dumps(value))


def test_a_command_the_shell_cannot_find_is_missing():
    assert by(pf.gpu({"rc": 127, "stdout": "", "stderr": "sh: nvidia-smi: not found"}, "n", 1), "gpu")["status"] == \
        "skip"
    # rc 127 with output is the command's own exit code, not a missing command.
    assert by(pf.gpu({"rc": 127, "stdout": "GPU 0: x\n"}, "n", 1), "gpu")["status"] == "fail"


def test_fabric_address_on_a_port_that_sorts_after_the_fabric_interface():
    rows = pf.fabric(ip_probe(iplink(addrs=()), iplink("wlan0", ("10.0.0.1/24",))), "n", "eth1", "10.0.0.1/24", 9000)
    assert by(rows, "address")["found"] == "no IPv4 address; 10.0.0.1 is on wlan0"


@pytest.mark.parametrize("oper", ["DOWN", "DORMANT", "LOWERLAYERDOWN"])
def test_fabric_only_up_or_unknown_with_carrier_passes(oper):
    rows = pf.fabric(ip_probe(iplink(oper=oper)), "n", "eth1", "10.0.0.1/24", 9000)
    assert by(rows, "interface")["found"] == f"eth1 {oper}, no carrier"


def test_fabric_mtu_above_the_spec_is_a_mismatch_too():
    rows = pf.fabric(ip_probe(iplink(mtu=9216)), "n", "eth1", "10.0.0.1/24", 9000)
    assert (by(rows, "mtu")["status"], by(rows, "mtu")["found"]) == ("fail", "9216")
    link = iplink()
    del link["mtu"]
    assert by(pf.fabric(ip_probe(link), "n", "eth1", "10.0.0.1/24", 9000), "mtu")["found"] == "0"


def test_ping_every_result_is_judged_after_a_skipped_or_passed_one():
    res = [{"item": WORKER, "skipped": True},
           {"item": {**WORKER, "name": "spark-c"}, "rc": 0, "stdout": "3 packets transmitted, 2 received"},
           {"item": {**WORKER, "name": "spark-d"}, "rc": -9, "stderr": "connect: Cannot assign requested address"}]
    rows = pf.ping(res, "spark-a", "10.0.0.1", 9000, jumbo=True)
    assert [(r["target"], r["status"]) for r in rows] == [("spark-b", "skip"), ("spark-c", "pass"),
                                                          ("spark-d", "fail")]
    assert by(rows, "ping_mtu", "spark-c")["found"] == "2/3 replies"
    assert by(rows, "ping_mtu", "spark-d")["found"] == "cannot send from 10.0.0.1: the address is not on this node"


def test_ssh_every_result_is_judged_after_a_passed_one():
    res = [{"item": WORKER, "rc": 0}, {"item": {**WORKER, "name": "spark-c"}, "rc": 255, "stderr": "x"}]
    assert [r["status"] for r in pf.ssh(res, "spark-a", "")] == ["pass", "fail"]


def test_probes_killed_by_a_signal_fail():
    # Ansible reports a command killed by a signal with a negative rc: not a success.
    killed = {"rc": -9, "stdout": "", "stderr": "Killed"}
    assert by(pf.docker(killed, "n", "u"), "docker")["found"] == "Killed"
    assert by(pf.image_arch(killed, "n", "img", "aarch64"), "image_arch")["found"] == "Killed"
    assert by(pf.gpu({**killed, "stdout": "GPU 0: NVIDIA GB10 (UUID: GPU-1)\n"}, "n", 1), "gpu")["status"] == "fail"
    assert pf.main_pid({"rc": -9, "stdout": "Main PID: 42"}) == 0


def test_more_gpus_than_the_spec_asks_pass():
    three = {"rc": 0, "stdout": "".join(f"GPU {i}: NVIDIA GB10 (UUID: GPU-{i})\n" for i in range(3))}
    assert by(pf.gpu(three, "n", 2), "gpu")["status"] == "pass"


def test_disk_edge_answers():
    header = "path=/hub\nFilesystem 1-blocks Used Available Capacity Mounted on\n"
    assert by(pf.disk({"rc": 0, "stdout": header}, "n", "/hub", 1), "disk")["found"] == \
        "cannot measure free space: df gave no answer"
    truncated = {"rc": 0, "stdout": header + "overlay 100 1 50 1%\n"}
    assert by(pf.disk(truncated, "n", "/hub", 1), "disk")["found"] == "cannot measure free space: df gave no answer"
    du_failed = {"rc": 1, "stderr": "du: cannot read directory '/hub/x': Permission denied",
                 "stdout": header + "overlay 100 1 50 1% /\n"}
    assert by(pf.disk(du_failed, "n", "/hub", 1), "disk")["found"] == (
        "cannot measure free space: du: cannot read directory '/hub/x': Permission denied")


def test_hca_outside_sys_says_where_it_looked():
    rows = pf.hca(EXISTS, {"files": []}, {"skipped": True}, attrs({}, {}), "n", ["h9"], ["eth1"], "/tmp/sim")
    assert by(rows, "hca", "h9")["found"] == "no HCA h9 (present: none) [sysfs root /tmp/sim]"


def test_hca_whose_netdev_sits_on_a_higher_port_is_not_on_the_fabric_port():
    rows = pf.hca(EXISTS, find(("h1", "eth1"), ("h2", "eth2")), {"skipped": True},
                  attrs({"eth1": "p1", "eth2": "p2"}, {}), "n", ["h1", "h2"], ["eth1"], ROOT)
    assert by(rows, "hca", "h2")["status"] == "fail"


def test_earlyoom_unquoted_args_are_one_value_as_systemd_reads_them():
    assert eo.file_args("EARLYOOM_ARGS=-m 3 --prefer (vllm|python)\n") == ["-m", "3", "--prefer", "(vllm|python)"]
    # The file's unquoted --prefer is what a stopped earlyoom would start with.
    text = "EARLYOOM_ARGS=-m 3 --prefer (vllm|python)\n"
    r = by(pf.earlyoom(slurp(text), NOT_RUNNING, {"skipped": True}, "n", "leave", MANAGED, NAMES), "earlyoom")
    assert r["status"] == "fail" and "would kill first: vllm, python3, python" in r["found"]


def test_earlyoom_option_value_at_an_odd_position():
    assert eo.option(["-m", "--prefer", "a"], "--prefer") == "a"


def test_earlyoom_running_with_more_args_than_the_file_is_a_pending_restart():
    running = cmdline(["-r", "3600", "-m", "4", "-s", "100", "--avoid", "^(vllm|VLLM|ray|raylet|gcs_server|python3|"
                       "python)$", "--prefer", "^(chrome|code)$", "-n"])
    r = by(pf.earlyoom(slurp(OURS), {"rc": 0}, running, "n", "protect", MANAGED, NAMES), "earlyoom")
    assert "the running earlyoom's args differ from /etc/default/earlyoom (restart pending)" in r["found"]


@pytest.mark.parametrize(("policy", "status", "fix"), [
    ("leave", "fail", "set earlyoom.policy: protect"),
    ("protect", "warn", "policy protect: the earlyoom role replaces this policy; run it before serving"),
    ("stop", "warn", "policy stop: the earlyoom role stops earlyoom; run it before serving"),
])
def test_earlyoom_policy_from_the_inventory(policy, status, fix):
    # The policy arrives from the inventory, a string built at run time, not this file's literal.
    args = ["--prefer", "(vllm|python)"]
    r = by(pf.earlyoom(None, {"rc": 0}, cmdline(args), "n", as_ansible_returns(policy), MANAGED, NAMES), "earlyoom")
    assert r["status"] == status and r["fix"].startswith(fix)


@pytest.mark.parametrize(("policy", "status", "where"), [
    ("protect", "warn", "earlyoom.avoid in the spec"), ("leave", "warn", "--avoid in /etc/default/earlyoom"),
    ("stop", "pass", None)])
def test_earlyoom_unprotected_policy_from_the_inventory(policy, status, where):
    text = 'EARLYOOM_ARGS="--avoid ^(vllm)$"\n'
    r = by(pf.earlyoom(slurp(text), NOT_RUNNING, {"skipped": True}, "n", as_ansible_returns(policy), MANAGED, NAMES),
           "earlyoom")
    assert r["status"] == status
    if where:
        assert r["fix"].startswith(f"add VLLM::EngineCor, raylet, ray::IDLE, gcs_server, python3, python to {where}")


def test_security_with_values_from_the_inventory():
    cluster = as_ansible_returns({"ray": {"dashboard": "off"}, "serving": {"api_key_env": None, "host": "127.0.0.1",
                                                                           "port": 8}})
    assert by(pf.security(cluster, "a"), "ray_dashboard")["found"] == "off (--include-dashboard=false)"
    cluster["ray"]["dashboard"] = as_ansible_returns("localhost")
    assert by(pf.security(cluster, "a"), "ray_dashboard")["found"].startswith("on, bound to 127.0.0.1:8265")
    # An inventory override outside the spec's choices is a warning, whatever it sorts like.
    for value in ("true", "0.0.0.0", "public"):
        cluster["ray"]["dashboard"] = value
        assert by(pf.security(cluster, "a"), "ray_dashboard")["status"] == "warn"


def test_spec_sha256_with_the_checksum_ansible_returns():
    digest = hashlib.sha256(b"spec").hexdigest()
    st = as_ansible_returns({"stat": {"exists": True, "checksum": digest}})
    assert by(pf.spec_sha256(st, "c.yml", as_ansible_returns(digest)), "spec_sha256")["status"] == "pass"


def test_network_pending_on_rows_that_went_through_ansible():
    rows = as_ansible_returns([pf.row("a", "mtu", "fail", "9000", "1500"), pf.row("a", "gpu", "fail", "1", "0")])
    assert [r["status"] for r in pf.network_pending(rows, True)] == ["warn", "fail"]


def test_collect_goes_on_after_a_node_outside_the_run():
    rows = pf.collect({"b": {"__preflight_node_results": [pf.row("b", "gpu", "pass", "1", "1")]}}, ["a", "b"], ["b"],
                      [])
    assert [(r["node"], r["check"], r["status"]) for r in rows] == [("a", "reachable", "skip"), ("b", "gpu", "pass")]


def test_table_columns_stop_at_their_caps():
    rows = [pf.row("n" * 30, "c" * 40, "pass", "e" * 50, "f" * 50, "x" * 60)]
    lines = pf.table(rows).splitlines()
    assert lines[1] == "  ".join("-" * w for w in (24, 32, 6, 36, 44, 56))
    narrow = pf.table(rows, widths=(5, 5, 6, 5, 5, 5)).splitlines()
    # The headers wrap too ("EXPEC" / "TED"); the rule under them shows the widths.
    assert narrow[:3] == ["NODE   CHECK  STATUS  EXPEC  FOUND  HOW", "                      TED           TO",
                          "                                    FIX"]
    assert narrow[3] == "  ".join("-" * w for w in (5, 5, 6, 5, 5, 5))


def test_table_wraps_like_a_greedy_word_wrap():
    # Words never longer than the column: the table's wrapping must be textwrap's greedy one.
    rng = random.Random(7)
    for _ in range(40):
        text = " ".join("w" * rng.randint(1, 30) for _ in range(rng.randint(1, 12)))
        lines = pf.table([pf.row("n", "c", "fail", "e", "f", text)]).splitlines()
        column = lines[0].index("HOW TO FIX")
        assert [line[column:] for line in lines[2:-2]] == textwrap.wrap(text, 56), text


def test_table_word_exactly_as_wide_as_the_column_is_one_line():
    lines = pf.table([pf.row("n", "c", "fail", "e", "f", "w" * 56)]).splitlines()
    assert len(lines) == 5 and lines[2].endswith("w" * 56)


# --- Third pass ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("errno", [1, 13])
def test_a_command_that_could_not_execute_for_another_reason_is_not_missing(errno):
    # ansible-core 2.19: rc is the errno of the failed exec; only ENOENT (2) means "not installed".
    probe = {"rc": errno, "msg": "Error executing command.", "stdout": "", "stderr": ""}
    r = by(pf.gpu(probe, "n", 1), "gpu")
    assert (r["status"], r["found"]) == ("fail", "nvidia-smi failed")


def test_more_human_sizes():
    assert pf._human_bytes(1536 * 2**30) == "1.5 TiB"


def test_probes_killed_by_a_signal_fail_everywhere():
    killed = {"rc": -9, "stdout": "", "stderr": "Killed"}
    assert {r["status"] for r in pf.fabric(killed, "n", "eth1", "10.0.0.1/24", 9000)} == {"fail"}
    assert by(pf.ssh([{"item": WORKER, **killed}], "a", ""), "ssh", "spark-b")["status"] == "fail"
    assert not pf.docker_usable(killed)
    df = "path=/hub\nFilesystem 1-blocks Used Available Capacity Mounted on\noverlay 100 1 50 1% /\n"
    assert by(pf.disk({**killed, "stdout": df}, "n", "/hub", 1), "disk")["status"] == "fail"


def test_fabric_hint_and_list_name_only_the_right_ports():
    links = (iplink("eth3", ("1.1.1.1/32",)), iplink("wlan0", ("10.0.0.7/24",)), iplink("eth0", ("10.0.0.7/24",)))
    rows = pf.fabric(ip_probe(*links), "n", "eth1", "10.0.0.1/24", 9000)
    assert by(rows, "interface")["found"] == "no interface eth1 (present: eth0, eth3, wlan0)"
    rows = pf.fabric(ip_probe(iplink(addrs=("1.2.3.4/8",))), "n", "eth1", "10.0.0.1/24", 9000)
    assert by(rows, "address")["found"] == "1.2.3.4/8"


def test_disk_with_a_warning_before_the_df_header():
    probe = {"rc": 0, "stdout": "path=/hub\ndf: /proc/x: warning\nFilesystem 1-blocks Used Available Capacity "
                                f"Mounted on\noverlay 100 1 {2**30} 1% /\n"}
    assert by(pf.disk(probe, "n", "/hub", 1), "disk")["found"] == "1.0 GiB free on / at /hub"


def test_disk_needs_only_what_is_missing_and_says_how_much_to_free():
    probe = {"rc": 0, "stdout": "path=/hub\n" + DF.format(avail=3 * 2**30) + f"{5 * 2**30}\t/hub/models--a--b\n"}
    r = by(pf.disk(probe, "n", "/hub", 6 * 2**30), "disk")
    assert r["expected"] == ">= 1.0 GiB free for /hub (model 6.0 GiB, 5.0 GiB already there)"
    r = by(pf.disk(probe, "n", "/hub", 12 * 2**30), "disk")
    assert r["status"] == "fail" and r["fix"].startswith("free 4.0 GiB on /,")


def test_hca_netdevs_ignore_paths_of_other_depths():
    files = find(("h1", "eth1"))
    files["files"] = [{"path": f"{ROOT}/class/infiniband/h1/device/net"},
                      {"path": f"{ROOT}/class/infiniband/h1/device/net/eth1/x"}] + files["files"]
    assert pf.hca_netdevs(files, {"skipped": True}, ROOT) == {"h1": ["eth1"]}


def test_hca_is_judged_against_the_first_fabric_interface():
    rows = pf.hca(EXISTS, find(("h1", "eth1")), {"skipped": True}, attrs({}, {}), "n", ["h1"], ["eth1", "eth2"],
                  "/sys")
    assert by(rows, "hca", "h1")["expected"] == "h1 on eth1, the port carrying the fabric address"


def test_earlyoom_the_last_assignment_wins_after_an_unquoted_one():
    assert eo.file_args('EARLYOOM_ARGS=-m 1\nEARLYOOM_ARGS="-m 2"\n') == ["-m", "2"]


def test_earlyoom_option_without_a_value_at_an_odd_position():
    assert eo.option(["-m", "--prefer"], "--prefer") is None


def test_earlyoom_provenance_header_on_the_twelfth_line_counts():
    assert pf._provenance("\n" * 11 + f"# {MANAGED}\n", MANAGED) == "hy3spark (managed header)"


def test_failures_and_the_summary_of_rows_that_went_through_ansible():
    rows = as_ansible_returns([pf.row("a", "mtu", "fail", "9000", "1500"), pf.row("a", "gpu", "pass", "1", "1"),
                               pf.row("b", "ssh", "warn", "x", "y", target="c")])
    assert pf.failures(rows) == ["a/mtu"]
    assert pf.table(rows).splitlines()[-1] == "preflight: 1 pass, 1 fail, 1 warn, 0 skip, 0 info"


def test_earlyoom_long_quoted_value_without_its_closing_quote_on_the_line():
    # A quoted value continued on the next line (systemd allows it) has no closing quote on its first line; a long
    # --avoid list makes such a line longer than 256 characters.
    words = " ".join(f"proc{i}" for i in range(60))
    assert eo.env_file_value(f'"-m 3 --avoid {words}') == f"-m 3 --avoid {words}"
    assert eo.file_args(f'EARLYOOM_ARGS="-m 3 --avoid {words}\n')[-1] == "proc59"


# --- gpu_link ------------------------------------------------------------------------------------------------------
# No real nvidia-smi output of these queries is in ../shared/fixtures: the samples below are HAND-MADE from
# nvidia-smi's documented formats (--format=csv,noheader,nounits: ", " between fields, absent values in brackets;
# `topo -m`: a tab-separated matrix under a header that starts with a tab, then the legend).
QUERY_TWO_CARDS = """\
0, NVIDIA GeForce RTX 4090, 24564, 1, 16, 4, 16
1, NVIDIA GeForce RTX 4090, 24564, 4, 8, 4, 16
"""
QUERY_GB10 = "0, NVIDIA GB10, [N/A], [N/A], [N/A], [N/A], [N/A]\n"
QUERY_MIXED = "0, NVIDIA RTX A5000, 24564, [Not Supported], 16, 4, [Not Supported]\n"
TOPO_TWO_CARDS = (
    "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tPHB\t0-31\t0\t\tN/A\n"
    "GPU1\tPHB\t X \t0-31\t0\t\tN/A\n"
    "\n"
    "Legend:\n"
    "\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
    "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
)
# A Spark: one GPU and the ConnectX-7 ports as NICs; on a terminal the header is underlined.
TOPO_SPARK = (
    "\t\x1b[4mGPU0\tNIC0\tNIC1\tNIC2\tNIC3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNODE\tNODE\tNODE\tNODE\t0-19\t0\t\tN/A\n"
    "NIC0\tNODE\t X \tPIX\tNODE\tNODE\t\t\t\t\n"
    "\n"
    "Legend:\n\n  X    = Self\n\nNIC Legend:\n\n  NIC0: rocep1s0f0\n"
)


def test_gpu_link_query_parses_every_field_and_the_absent_ones():
    gpus = pf.parse_gpu_query(QUERY_TWO_CARDS)
    assert gpus[1] == {"index": 1, "name": "NVIDIA GeForce RTX 4090", "memory_total_mib": 24564,
                       "pcie_gen_current": 4, "pcie_width_current": 8, "pcie_gen_max": 4, "pcie_width_max": 16}
    (gb10,) = pf.parse_gpu_query(QUERY_GB10)
    assert gb10["name"] == "NVIDIA GB10"
    assert all(gb10[k] is None for k in ("memory_total_mib", "pcie_gen_current", "pcie_width_current",
                                         "pcie_gen_max", "pcie_width_max"))
    (mixed,) = pf.parse_gpu_query(QUERY_MIXED)
    assert (mixed["pcie_gen_current"], mixed["pcie_width_current"], mixed["pcie_width_max"]) == (None, 16, None)
    # A name with a comma, units left on, and lines that are not GPUs.
    (odd,) = pf.parse_gpu_query("No devices were found\n3, Card, Rev B, 8192 MiB, 3, 4, 3, 4\n")
    assert (odd["index"], odd["name"], odd["memory_total_mib"], odd["pcie_width_max"]) == (3, "Card, Rev B", 8192, 4)


def test_gpu_link_query_matches_the_roles_field_order():
    import yaml

    variables = yaml.safe_load((_REPO / "roles" / "preflight" / "vars" / "main.yml").read_text())
    fields = variables["__preflight_gpu_link_query"].split(",")
    assert fields[:2] == ["index", "name"]
    assert [f.replace(".", "_") for f in fields[2:]] == ["memory_total", "pcie_link_gen_current",
                                                          "pcie_link_width_current", "pcie_link_gen_max",
                                                          "pcie_link_width_max"]
    assert len(fields) - 2 == len(pf._GPU_LINK_FIELDS)


def test_topo_matrix_gives_each_gpu_pair_once():
    assert pf.parse_topo(TOPO_TWO_CARDS) == {"GPU0-GPU1": "PHB"}
    assert pf.parse_topo(TOPO_SPARK) == {}  # one GPU: no pair (NICs are not GPUs)
    four = ("\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\n" + "GPU0\t X \tNV4\tSYS\tSYS\t0-7\n"
            "GPU1\tNV4\t X \tSYS\tSYS\t0-7\n" + "GPU2\tSYS\tSYS\t X \tNV4\t8-15\n" + "GPU3\tSYS\tSYS\tNV4\t X \t8-15\n")
    assert pf.parse_topo(four) == {"GPU0-GPU1": "NV4", "GPU0-GPU2": "SYS", "GPU0-GPU3": "SYS", "GPU1-GPU2": "SYS",
                                   "GPU1-GPU3": "SYS", "GPU2-GPU3": "NV4"}
    assert pf.parse_topo("") == {}


def test_gpu_link_reading_and_row():
    missing = {"rc": 2, "msg": "Error executing command.", "stdout": "", "stderr": ""}
    reading = pf.gpu_link_reading(missing, {"skipped": True})
    assert reading == {"status": "skipped", "reason": "nvidia-smi not found", "gpus": [], "topo": None}
    r = by(pf.gpu_link(reading, "n"), "gpu_link")
    assert (r["status"], r["found"]) == ("skip", "nvidia-smi not found")  # never a pass without a GPU

    ok = {"rc": 0, "stdout": QUERY_TWO_CARDS, "start": "2026-03-01 10:00:00.000001"}
    reading = pf.gpu_link_reading(ok, {"rc": 0, "stdout": TOPO_TWO_CARDS})
    assert reading["status"] == "read" and "read_at" not in reading  # no timestamp: the run record stays put
    assert reading["topo"] == {"GPU0-GPU1": "PHB"} and len(reading["gpus"]) == 2
    r = by(pf.gpu_link(reading, "desk"), "gpu_link")
    # GPU1 runs x8 in an x16 slot: a warning that says what a tensor split pays for it. GPU0's gen1 is idle.
    assert r["status"] == "warn"
    assert r["found"] == "GPU0 gen1 x16 of gen4 x16; GPU1 gen4 x8 of gen4 x16; GPU0-GPU1 PHB"
    assert r["fix"].startswith("GPU1 x8 of x16: seat the card in a full-width slot")

    full = pf.gpu_link_reading({"rc": 0, "stdout": QUERY_TWO_CARDS.replace("4, 8, 4", "4, 16, 4")},
                               {"rc": 127, "stdout": ""})
    assert full["topo"] is None
    assert by(pf.gpu_link(full, "desk"), "gpu_link")["status"] == "pass"

    gb10 = pf.gpu_link_reading({"rc": 0, "stdout": QUERY_GB10}, {"rc": 0, "stdout": TOPO_SPARK})
    r = by(pf.gpu_link(gb10, "spark-a"), "gpu_link")
    assert (r["status"], r["found"]) == ("info", "GPU0 no PCIe link reported ([N/A])")

    unknown = {"rc": 2, "stdout": 'Field "pcie.link.gen.max" is not a valid field to query.\n\n', "stderr": ""}
    reading = pf.gpu_link_reading(unknown)
    assert reading["status"] == "failed" and reading["reason"].startswith('Field "pcie.link.gen.max"')
    r = by(pf.gpu_link(reading, "n"), "gpu_link")
    assert r["status"] == "warn" and "nvidia-smi -q -d PCI" in r["fix"]
    none = by(pf.gpu_link(pf.gpu_link_reading({"rc": 0, "stdout": "No devices were found\n"}), "n"), "gpu_link")
    assert (none["status"], none["found"]) == ("warn", "nvidia-smi lists no GPU")


def test_gpu_links_in_spec_order_with_none_for_nodes_not_read():
    read = {"status": "read", "gpus": [], "topo": None}
    hostvars = {"spark-b": {"preflight_gpu_link": read}, "spark-a": {}}
    assert pf.gpu_links(hostvars, ["spark-a", "spark-b", "spark-c"], ["spark-a", "spark-b"]) == {
        "spark-a": None, "spark-b": read, "spark-c": None}
    assert {"preflight_gpu_link_reading", "preflight_gpu_link", "preflight_gpu_links"} <= set(
        pf.FilterModule().filters())
