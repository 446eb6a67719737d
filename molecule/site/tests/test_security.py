"""site scenario, the network surface (issue 15): what a machine on the office LAN reaches, what a stranger on the
fabric reaches, what Ray asks for, and where the secrets are not. Runs before tests/test_site.py (file order), on the
cluster as converge, idempotence and check mode left it.

The LAN is `site-0-mgmt` (the nodes' eth0); a scanner container sits on it alone, as a laptop would. The stranger is a
container on the fabric network (`site-1-fabric`) with an address that is not a node's. Both are started here from
the node image (it has python3) and removed at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import scenario
from scenario import GCS_WITHOUT_TOKEN, node, playbook

SCENARIO = Path(__file__).resolve().parent.parent
HEAD, WORKER = "site-head", "site-worker"
NODES = (HEAD, WORKER)
CONTAINER = {HEAD: "hy3-head", WORKER: "hy3-worker"}
MGMT_NET, FABRIC_NET = "site-0-mgmt", "site-1-fabric"
STRANGER_IP = "10.95.0.99"
API_PORT = 8888
VLLM_PORT = 29510  # serving.internal_port's default: the engine's store, and its broadcast queue one above
API_KEY = os.environ.get("HY3SPARK_SITE_API_KEY", "")
IMAGE = os.environ.get("HY3SPARK_DNODE_IMAGE", "")

# A TCP connect scan: every port of every address given, 1000 at a time; open, refused (RST) or silent per port.
# What a LAN machine with nmap -sT would see, in the stdlib.
SCAN = """\
import asyncio, json, sys

async def probe(host, port, sem, seen):
    async with sem:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 3)
        except ConnectionRefusedError:
            return
        except (asyncio.TimeoutError, OSError):
            seen["silent"].append(port)
            return
        seen["open"].append(port)
        writer.close()

async def main(hosts, ports):
    sem = asyncio.Semaphore(1000)
    out = {}
    for host in hosts:
        seen = {"open": [], "silent": []}
        await asyncio.gather(*(probe(host, p, sem, seen) for p in ports))
        out[host] = {k: sorted(v) for k, v in seen.items()}
    print(json.dumps(out))

spec = sys.argv[1]
first, _, last = spec.partition("-")
ports = range(int(first), int(last or first) + 1) if "-" in spec else [int(p) for p in spec.split(",")]
asyncio.run(main(sys.argv[2:], ports))
"""

# The API as a LAN client calls it: the status of GET /v1/models with the key given on stdin (never in an argv).
API_FROM_OUTSIDE = """\
import sys, urllib.request, urllib.error
key = sys.stdin.read().strip()
req = urllib.request.Request(sys.argv[1], headers={"Authorization": f"Bearer {key}"} if key else {})
try:
    print(urllib.request.urlopen(req, timeout=10).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""



def mgmt_ip(name: str) -> str:
    info = json.loads(subprocess.run(["docker", "inspect", name], capture_output=True, text=True, check=True).stdout)
    return info[0]["NetworkSettings"]["Networks"][MGMT_NET]["IPAddress"]


def outsider(network: str, code: str, *args: str, ip: str | None = None, stdin: str = "") -> str:
    """Run `python3 -c code args` in a throwaway container on `network` only (a LAN machine, a fabric stranger)."""
    assert IMAGE, "HY3SPARK_DNODE_IMAGE is not set (scripts/test exports it)"
    cmd = ["docker", "run", "--rm", "-i", "--network", network, *(["--ip", ip] if ip else []), "--entrypoint",
           "python3", IMAGE, "-c", code, *args]
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def scan_from_the_lan(ports: str = "1-65535") -> dict[str, dict[str, list[int]]]:
    started = time.monotonic()
    found = json.loads(outsider(MGMT_NET, SCAN, ports, *(mgmt_ip(n) for n in NODES)))
    print(f"scan of {ports} on {len(NODES)} nodes from {MGMT_NET}: {time.monotonic() - started:.1f} s")
    return {name: found[mgmt_ip(name)] for name in NODES}


def ray_token() -> str:
    return node(HEAD).check_output("cat /etc/hy3spark/ray-token").strip()


def test_the_lan_reaches_only_ssh_and_the_api() -> None:
    found = scan_from_the_lan()
    assert found[HEAD] == {"open": [22, API_PORT], "silent": []}, found
    assert found[WORKER] == {"open": [22], "silent": []}, found


def test_the_api_from_the_lan_wants_the_key() -> None:
    url = f"http://{mgmt_ip(HEAD)}:{API_PORT}/v1/models"
    assert outsider(MGMT_NET, API_FROM_OUTSIDE, url) == "401"
    assert outsider(MGMT_NET, API_FROM_OUTSIDE, url, stdin="not-the-key") == "401"
    assert outsider(MGMT_NET, API_FROM_OUTSIDE, url, stdin=API_KEY) == "200"


def ray_ports(name: str) -> list[int]:
    """Every cluster-internal port of the node's rendered table (one port of the worker range stands for it)."""
    table = (SCENARIO / ".rendered" / "files" / name / "etc/hy3spark/ports.txt").read_text()
    ports = []
    for line in table.splitlines():
        if line and not line.startswith("#") and " from fabric: " in line:
            ports.append(int(line.split("/", 1)[0].split("-")[0]))
    return ports


@pytest.mark.parametrize("name", NODES)
def test_a_stranger_on_the_fabric_is_refused_every_ray_port(name: str) -> None:
    ports = ray_ports(name)
    assert 6380 in ports and 20000 in ports, ports
    fabric = {HEAD: "10.95.0.11", WORKER: "10.95.0.12"}[name]
    found = json.loads(outsider(FABRIC_NET, SCAN, ",".join(map(str, ports)), fabric, ip=STRANGER_IP))[fabric]
    assert found == {"open": [], "silent": []}, f"{name}: a fabric address outside the cluster reached {found}"
    # The same ports answer the cluster's own fabric peer (the other node): the firewall admits peers only.
    peer = WORKER if name == HEAD else HEAD
    # A range's first port stands for it: the worker range has no listener until a worker process takes a port, and
    # vLLM's internal range only on the node of rank 0 (the head), where its store holds VLLM_PORT itself.
    listening = [p for p in ports if p != 20000 and (p != VLLM_PORT or name == HEAD)]
    probe = node(peer).run("python3 -c %s %s %s", SCAN, ",".join(map(str, listening)), fabric)
    assert probe.rc == 0, probe.stderr
    assert json.loads(probe.stdout.strip().splitlines()[-1])[fabric]["open"] == sorted(listening)


@pytest.mark.parametrize("name", NODES)
def test_every_listener_of_the_serving_cluster_is_in_the_port_table(name: str) -> None:
    """While the engine serves: what each node listens on beyond loopback (Ray, the engine and vLLM's internal
    listeners share the node's network) is in its rendered port table as bound. On the head that includes vLLM's
    store on VLLM_PORT (serving.internal_port, all addresses) and the cross-node broadcast queue above it on the
    fabric address: pinned, so the firewall's fabric set covers them."""
    table = (SCENARIO / ".rendered" / "files" / name / "etc/hy3spark/ports.txt").read_text()
    stray = scenario.stray_listeners(node(name), table)
    assert not stray, f"{name}: listening but not in ports.txt as bound: {stray}\n{table}"
    found = set(scenario.listeners(node(name)))
    if name == HEAD:
        assert {("0.0.0.0", VLLM_PORT), ("10.95.0.11", VLLM_PORT + 1)} <= found, sorted(found)
    else:
        assert not [p for _, p in found if VLLM_PORT <= p < VLLM_PORT + 8], sorted(found)


def test_ray_refuses_a_client_without_the_token_on_the_fabric() -> None:
    out = node(WORKER).check_output("docker exec %s env -u RAY_AUTH_TOKEN_PATH -u RAY_AUTH_MODE python3 -c %s %s",
                                    CONTAINER[WORKER], GCS_WITHOUT_TOKEN, "10.95.0.11:6379")
    assert out.strip().splitlines()[-1] == "REFUSED AuthenticationError", out


@pytest.mark.parametrize("name", NODES)
def test_no_secret_is_in_inspect_argv_env_logs_or_records(name: str) -> None:
    """The API key, the Ray token (and the Hub token when the run has one) nowhere but where they belong: the key in
    the engine's own environment on the head, the token in its 0600 file. Patterns go to grep on stdin, never argv."""
    secrets = {"API key": API_KEY, "Ray token": ray_token()}
    if os.environ.get("HF_TOKEN"):
        secrets["HF token"] = os.environ["HF_TOKEN"]
    patterns = "\n".join(secrets.values()) + "\n"

    def holders(*command: str) -> str:
        proc = subprocess.run(["docker", "exec", "-i", name, *command], input=patterns, capture_output=True,
                              text=True, timeout=120, check=False)
        return proc.stdout.strip()

    inspect = subprocess.run(["docker", "exec", name, "docker", "inspect", CONTAINER[name]], capture_output=True,
                             text=True, check=True).stdout
    argv = node(name).check_output("ps -eo args")
    for what, value in secrets.items():
        assert value not in inspect, f"{name}: the {what} is in docker inspect"
        assert value not in argv, f"{name}: the {what} is in a command line"
    # The node's own processes (outside the container: systemd, dockerd, sshd, the Ray container's PID 1 and below
    # as the host sees them): only the engine's processes may hold the key.
    found = holders("sh", "-c", "grep -lsFf - /proc/[0-9]*/environ || true").split()
    pids = {int(path.split("/")[2]) for path in found}
    engine = engine_family(name)
    assert pids <= engine, f"{name}: processes other than the engine hold a secret in their environment: " \
                           f"{sorted(pids - engine)}"
    # Ray's logs in the container, hy3spark's logs and records on the node.
    logs = holders("sh", "-c", f"docker exec -i {CONTAINER[name]} sh -c 'grep -rlsFf - /tmp/ray || true'")
    assert logs == "", f"{name}: a secret in Ray's logs: {logs}"
    records = holders("sh", "-c", "grep -rlsFf - /var/lib/hy3spark /var/log/hy3spark "
                                  "--exclude-dir=hub || true")
    assert records == "", f"{name}: a secret in hy3spark's records or logs: {records}"
    # No file in the node's container holds the API key or the Hub token: the secrets file is the node's, in a
    # directory no container mounts, and the serve script got it on stdin (the Ray token's 0600 file is in the
    # /etc/hy3spark mount by design: every Ray process reads it).
    engine_only = "\n".join(v for k, v in secrets.items() if k != "Ray token") + "\n"
    inside = subprocess.run(
        ["docker", "exec", "-i", name, "docker", "exec", "-i", CONTAINER[name], "sh", "-c",
         "grep -rlsFf - / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev --exclude-dir=hub || true"],
        input=engine_only, capture_output=True, text=True, timeout=300, check=False)
    assert inside.stdout.strip() == "", f"{name}: a secret in a file of {CONTAINER[name]}: {inside.stdout}"
    mounts = node(name).check_output("docker inspect -f '{{range .Mounts}}{{.Source}} {{end}}' %s", CONTAINER[name])
    assert "/etc/hy3spark-secrets" not in mounts.split(), mounts


def engine_family(name: str) -> set[int]:
    """PIDs (as the node sees them) of the engine's `vllm serve` processes and their descendants; none on a Ray
    worker node, where Ray's worker processes are started by raylet and get no secret (non-carry-over list)."""
    code = (
        "import os\n"
        "parent = {}\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit():\n"
        "        try: parent[int(p)] = int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1])\n"
        "        except OSError: pass\n"
        "roots = set()\n"
        "for p in parent:\n"
        "    try: argv = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')\n"
        "    except OSError: continue\n"
        "    if any(os.path.basename(a) == b'vllm' and argv[i + 1:i + 2] == [b'serve'] for i, a in enumerate(argv)):\n"
        "        roots.add(p)\n"
        "family = set(roots)\n"
        "grew = True\n"
        "while grew:\n"
        "    more = {p for p, pp in parent.items() if pp in family} - family\n"
        "    family |= more\n"
        "    grew = bool(more)\n"
        "print(' '.join(map(str, sorted(family))))\n"
    )
    return {int(p) for p in node(name).check_output("python3 -c %s", code).split()}


def test_the_firewall_table_comes_back_with_a_rebooted_node() -> None:
    """The worker's node container restarted (systemd, Docker and the fabric come back): the firewall unit reloads
    hy3spark's table at boot, and the LAN still reaches only SSH. The boot units and the head's supervisor bring the
    cluster back by themselves (docs/restarts.md)."""
    started = time.monotonic()
    old = scenario.supervisor_state(HEAD).get("pid")
    scenario.reboot(WORKER)
    for _ in range(60):
        if node(WORKER).run("systemctl is-active hy3spark-firewall.service").stdout.strip() == "active":
            break
        time.sleep(1)
    assert node(WORKER).run("nft list table inet hy3spark").rc == 0
    found = scan_from_the_lan()
    assert found[WORKER] == {"open": [22], "silent": []}, found
    scenario.wait_for("the endpoint serving again", lambda: (s := scenario.supervisor_state(HEAD)).get("state")
                      == "serving" and s.get("pid") != old and scenario.answers(HEAD, "hy3", API_KEY), 600, every=2)
    print(f"worker rebooted, scanned and serving again in {time.monotonic() - started:.0f} s")
    # The record the converge below writes holds the engine's processes (drift: PIDs and start times of the command
    # lines that hold the serve command). Right after a recovery that set can still be settling (a process of the
    # previous engine going, a child of the new one starting), and a record of it would make the in-sync re-runs
    # after this file see "processes hy3-head" differ. So the converge waits for the same set 3 times, 10 s apart.
    engine_rows = []

    def settled() -> bool:
        out = node(HEAD).run(f"docker top {CONTAINER[HEAD]} -eo pid,lstart,args")
        rows = sorted(line for line in out.stdout.splitlines()[1:] if "vllm serve" in line) if out.rc == 0 else []
        engine_rows.append(rows)
        return len(engine_rows) >= 3 and bool(rows) and engine_rows[-3] == engine_rows[-2] == rows

    scenario.wait_for("the engine's processes settled", settled, 240, every=10)
    # A clean run records the recovered nodes (the drift check's record), for the in-sync re-runs after this file;
    # it leaves the supervisor's engine alone.
    result = playbook(str(SCENARIO / "converge.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "leaving the engine alone" in result.stdout, result.stdout
    found = scan_from_the_lan()
    assert found[HEAD] == {"open": [22, API_PORT], "silent": []} and found[WORKER]["open"] == [22], found
