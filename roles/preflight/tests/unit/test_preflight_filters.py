"""Unit tests of the preflight role's judgements (filter_plugins/preflight.py), from probe outputs as Ansible
registers them. Run: pytest roles/preflight/tests/unit"""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path

import pytest

_PLUGIN = Path(__file__).resolve().parents[2] / "filter_plugins" / "preflight.py"
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
