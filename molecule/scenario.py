"""What the Molecule scenarios' verifier tests share: reaching a node, calling the endpoint, re-running playbooks
against the live nodes, and reading a play recap. `molecule/conftest.py` puts this folder on sys.path, so a
scenario's tests say `from scenario import node, playbook`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import testinfra

REPO = Path(__file__).resolve().parent.parent
# Molecule's inventory of the scenario being verified (its directory holds hosts, group_vars and host_vars links).
INVENTORY = os.environ.get("MOLECULE_INVENTORY_FILE", "")
API_PORT = 8888  # serving.port of every scenario spec that serves vLLM (TensorRT-LLM's profile: 8355)

# Run inside a Ray container: the live nodes and their GPUs as [[address, gpus], ...] on the last line.
RAY_NODES = (
    "import json, ray\n"
    "ray.init(address='auto', logging_level='ERROR', log_to_driver=False)\n"
    "alive = [n for n in ray.nodes() if n['Alive']]\n"
    "print(json.dumps([[n['NodeManagerAddress'], n['Resources'].get('GPU', 0)] for n in alive]))\n"
)

# Run inside a Ray container with the token's variables unset (and no ~/.ray/auth_token): Ray's GcsClient asks the
# GCS at argv[1] for its keys; the last line is `REFUSED <exception type>` or `ANSWERED`.
GCS_WITHOUT_TOKEN = (
    "from ray._raylet import GcsClient\n"
    "import sys\n"
    "try:\n"
    "    GcsClient(address=sys.argv[1]).internal_kv_keys(b'', None, timeout=10)\n"
    "except Exception as exc:\n"
    "    print('REFUSED', type(exc).__name__)\n"
    "else:\n"
    "    print('ANSWERED')\n"
)

_CALL = (
    "import json, sys, urllib.request, urllib.error\n"
    "auth = {'Authorization': 'Bearer ' + sys.argv[3]} if sys.argv[3] else {}\n"
    "req = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode() or None,"
    " headers={'Content-Type': 'application/json', **auth})\n"
    "try:\n"
    "    r = urllib.request.urlopen(req, timeout=60); print(r.status); print(r.read().decode())\n"
    "except urllib.error.HTTPError as e:\n"
    "    print(e.code); print(e.read().decode() or '{}')\n"
)


def node(name: str) -> testinfra.host.Host:
    """The node container itself (docker exec: much faster than testinfra's ansible backend)."""
    return testinfra.get_host(f"docker://{name}")


def ansible_node(name: str) -> testinfra.host.Host:
    """The node as Ansible reaches it (the scenario's inventory: its user, become and connection settings)."""
    return testinfra.get_host(f"ansible://{name}?ansible_inventory={INVENTORY}")


def api(host: str, path: str, body: dict | None = None, key: str = "", port: int = API_PORT) -> tuple[int, dict]:
    """Call the endpoint from `host` over its loopback, as the serving role's own readiness check does: (status,
    JSON body). `key` empty sends no Authorization header."""
    out = node(host).run("python3 -c %s %s %s %s", _CALL, f"http://127.0.0.1:{port}{path}",
                         json.dumps(body) if body else "", key)
    assert out.rc == 0, out.stderr
    status, _, text = out.stdout.partition("\n")
    return int(status), json.loads(text or "{}")


# The processes of a node's container as (pid, parent pid, argv), from its own /proc.
_PROCESSES = (
    "import json, os\n"
    "out = []\n"
    "for p in sorted(int(p) for p in os.listdir('/proc') if p.isdigit()):\n"
    "    try: argv = open(f'/proc/{p}/cmdline', 'rb').read().decode(errors='replace').split('\\0')\n"
    "    except OSError: continue\n"
    "    try: ppid = int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1])\n"
    "    except (OSError, IndexError, ValueError): ppid = 0\n"
    "    out.append([p, ppid, [a for a in argv if a]])\n"
    "print(json.dumps(out))\n"
)


def processes(host: str, container: str) -> list[tuple[int, int, list[str]]]:
    """(pid, parent pid, argv) of every process in `container` on `host`."""
    out = node(host).check_output("docker exec %s python3 -c %s", container, _PROCESSES)
    return [(pid, ppid, argv) for pid, ppid, argv in json.loads(out)]


def serving(host: str, container: str) -> dict[int, tuple[int, list[str]]]:
    """Every `vllm serve` process in the container, pid -> (parent pid, argv): the engine and the rank processes it
    forks (they keep its command line)."""
    return {pid: (ppid, argv) for pid, ppid, argv in processes(host, container)
            if any(os.path.basename(a) == "vllm" and argv[i + 1:i + 2] == ["serve"] for i, a in enumerate(argv))}


def engines(host: str, container: str) -> dict[int, list[str]]:
    """The engine itself (a `vllm serve` whose parent is not one), pid -> argv: not the serve script's shell, its
    log tee, or the ranks it forks."""
    found = serving(host, container)
    return {pid: argv for pid, (ppid, argv) in found.items() if ppid not in found}


def connects(source: str, ip: str, port: int) -> bool:
    """Whether a TCP connection from `source` (the node itself) to ip:port is accepted."""
    probe = ("import socket, sys\n"
             "s = socket.socket(); s.settimeout(3)\n"
             "sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)\n")
    return node(source).run("python3 -c %s %s %s", probe, ip, str(port)).rc == 0


def playbook(*args: str, inventory: Path | None = None) -> subprocess.CompletedProcess:
    """ansible-playbook against the scenario's nodes, with Molecule's config and inventory (and its env); another
    `inventory` directory (one from variant_inventory) replaces Molecule's."""
    cmd = ["ansible-playbook", "-i", str(inventory or Path(INVENTORY).parent), *args]
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0", "COLUMNS": "1000"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)


def recap(output: str, field: str = "changed") -> dict[str, int]:
    """One count of the PLAY RECAP per host (`ok`, `changed`, `failed`, ...) of the LAST recap in `output`."""
    counts: dict[str, int] = {}
    for match in re.finditer(rf"^(\S+)\s+: .*?\b{field}=(\d+)", output, re.M):
        counts[match.group(1)] = int(match.group(2))
    return counts


def flat(output: str) -> str:
    """The output with the YAML callback's line folding undone."""
    return " ".join(output.split())


def variant_inventory(directory: Path, rendered_inventory: Path) -> Path:
    """Molecule's inventory (how to reach the nodes) with the group_vars and host_vars of another render: a whole
    other spec deployed to the same nodes, per-node values included (`-e @file` can only override what all hosts
    share)."""
    target = directory / "molecule-inventory"
    target.mkdir(parents=True, exist_ok=True)
    hosts = Path(INVENTORY)
    shutil.copy(hosts, target / hosts.name)
    for name in ("group_vars", "host_vars"):
        link = target / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(rendered_inventory / name, target_is_directory=True)
    return target


@contextlib.contextmanager
def killed_on_start(host: testinfra.host.Host, container: str) -> Iterator[None]:
    """While in the block, every start of `container` on `host` is killed at once (SIGKILL, exit code 137), as the
    kernel's OOM killer would: a transient systemd unit follows `docker events`. The container is removed first."""
    host.check_output(f"docker rm -f {container}")
    host.run("systemctl reset-failed hy3spark-fault-killer")
    host.check_output(
        "systemd-run --unit hy3spark-fault-killer sh -c %s",
        f"docker events --filter type=container --filter event=start --filter container={container}"
        f" --format x | while read -r _; do docker kill {container}; done")
    try:
        yield
    finally:
        host.run("systemctl stop hy3spark-fault-killer")


# Every listening TCP socket of a network namespace (IPv4 and IPv6), as "address port" lines.
_LISTENERS = (
    "import ipaddress\n"
    "for f, size in (('/proc/net/tcp', 4), ('/proc/net/tcp6', 16)):\n"
    "    try: lines = open(f).readlines()[1:]\n"
    "    except OSError: continue\n"
    "    for line in lines:\n"
    "        p = line.split()\n"
    "        if p[3] == '0A':\n"
    "            a, port = p[1].split(':')\n"
    "            raw = b''.join(bytes.fromhex(a[i:i + 8])[::-1] for i in range(0, len(a), 8))\n"
    "            ip = ipaddress.ip_address(raw)\n"
    "            if size == 16: ip = ip.ipv4_mapped or ip\n"
    "            print(ip, int(port, 16))\n"
)


def listeners(host: testinfra.host.Host) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket in the host's network namespace (the Ray and engine containers
    share it: --network host)."""
    lines = host.check_output("python3 -c %s", _LISTENERS).splitlines()
    return [(addr, int(port)) for addr, port in (line.split() for line in lines)]


def stray_listeners(host: testinfra.host.Host, ports_txt: str) -> list[str]:
    """Listeners beyond loopback that the rendered port table (files/<node>/etc/hy3spark/ports.txt) does not name as
    bound: a port outside every row, or one bound elsewhere than its row says. Loopback listeners reach no one else
    (containerd's stream server takes a random one; 127.0.0.11 is Docker's DNS in a test container)."""
    ranges = []
    for line in ports_txt.splitlines():
        if line and not line.startswith("#"):
            span, _, bind, *_ = line.split()
            first, _, last = span.removesuffix("/tcp").partition("-")
            ranges.append((int(first), int(last or first), bind))
    stray = []
    for addr, port in listeners(host):
        if addr.startswith("127.") or addr == "::1":
            continue
        match = [r for r in ranges if r[0] <= port <= r[1]]
        if not match or (match[0][2] != "0.0.0.0" and addr not in {match[0][2], "127.0.0.1"}):
            stray.append(f"{addr}:{port}")
    return stray


# --- restarts (docs/restarts.md): the boot units and the head's supervisor ------------------------------------------
SUPERVISOR_STATE = "/var/lib/hy3spark/supervisor.json"
SUPERVISOR_CONFIG = "/usr/local/lib/hy3spark/supervisor/supervisor.json"
NODE_UNIT, SUPERVISOR_UNIT = "hy3spark-node.service", "hy3spark-supervisor.service"


def supervisor_state(host: str) -> dict:
    """What the head's supervisor wrote last ({} before its first write)."""
    out = node(host).run(f"cat {SUPERVISOR_STATE}")
    return json.loads(out.stdout) if out.rc == 0 and out.stdout.strip() else {}


def unit(host: str, name: str) -> dict[str, str]:
    """ActiveState, SubState, UnitFileState and NRestarts of a systemd unit on the node."""
    out = node(host).check_output(f"systemctl show {name} --property ActiveState,SubState,UnitFileState,NRestarts")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_for(what: str, check: Callable[[], object], timeout: float, every: float = 1.0) -> tuple[object, float]:
    """Poll `check` until it returns something true: (that value, seconds waited). Fails naming `what` and the last
    value or exception after `timeout` seconds."""
    start = time.monotonic()
    last: object = None
    while True:
        try:
            last = check()
            if last:
                return last, round(time.monotonic() - start, 1)
        except Exception as exc:  # the node is rebooting, the endpoint is not up yet
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() - start >= timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {str(last)[:2000]})")
        time.sleep(every)


def reboot(*names: str) -> None:
    """Restart the node containers themselves, as a reboot would: their systemd stops every unit (our containers
    with them), then boots again; Docker's state survives (/var/lib/docker is a volume), /run and /tmp do not."""
    subprocess.run(["docker", "restart", "--time", "60", *names], check=True, capture_output=True, timeout=300)


def answers(host: str, served: str, key: str) -> bool:
    """Whether the endpoint on `host` answers a completion now."""
    status, body = api(host, "/v1/completions", {"model": served, "prompt": "Hello", "max_tokens": 4}, key)
    return status == 200 and bool(body["choices"][0]["text"].strip())


def report_recovery(case: str, seconds: float) -> None:
    """The measured time to recover, on the test's output (`pytest -s`) and in the scenario's log."""
    print(f"\nRECOVERY {case}: {seconds:.1f} s to a served completion, no Ansible run", flush=True)
