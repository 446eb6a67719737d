"""hy3spark's firewall table (templates/firewall.nft.j2) loaded into a real kernel, and real TCP against it.

A container of the test node image stands for the head: its first network is the fabric (eth0, shared with a peer
container, the worker), its second the LAN (eth1, shared with a stranger, a client that is no node). The rendered
firewall.nft of a spec naming those addresses is loaded into the head's network namespace by the host's own `nft`
(`nsenter -t PID -n nft -f FILE`): the node image has no nftables until it is rebuilt with it (tests/harness/recipes.py
lists it now), and the host's nft against the container's namespace is the same kernel code path the unit's
`nft -f` takes on a node. Listeners on a cluster-internal port (Ray's GCS), the API port and a port no table lists
answer "ok"; the peer and the stranger connect to them.

Needs root, nsenter, nft and a Docker engine with the node image (.cache/images.env, scripts/build-images).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from docker_runs import docker, require_docker_as_root

from hy3spark.render import render_all
from hy3spark.spec import parse_spec

REPO = Path(__file__).resolve().parent.parent
RUN = f"fwtest-{os.getpid()}"
LABEL = "org.hy3spark.test=firewall"
GCS, API, UNLISTED = 6379, 8888, 7777
NFT = shutil.which("nft") or "/usr/sbin/nft"
LISTEN = f"""
import socket, threading
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", port)); s.listen()
    while True:
        c, _ = s.accept(); c.sendall(b"ok"); c.close()
for p in ({GCS}, {API}, {UNLISTED}):
    threading.Thread(target=serve, args=(p,)).start()
"""
CONNECT = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3); print(s.recv(2).decode())
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print(type(e).__name__)
"""


def node_image() -> str | None:
    if os.environ.get("HY3SPARK_NODE_IMAGE"):
        return os.environ["HY3SPARK_NODE_IMAGE"]
    env = REPO / ".cache" / "images.env"
    found = re.search(r"^HY3SPARK_NODE_IMAGE=(\S+)$", env.read_text(), re.M) if env.is_file() else None
    return found.group(1) if found else None


@dataclass
class Lab:
    tmp: Path
    head_fabric: str
    head_lan: str
    peer: str
    stranger: str
    pid: str

    def spec(self, **firewall: object) -> str:
        data = yaml.safe_load((REPO / "examples" / "hy3-two-spark.yml").read_text())
        data["head"] = {"name": "head", "fabric_ip": f"{self.head_fabric}/24", "mgmt_ip": self.head_lan}
        data["workers"] = [{"name": "peer", "fabric_ip": f"{self.peer}/24", "mgmt_ip": "192.168.1.11"}]
        data["fabric"] = {"interfaces": ["eth0"], "hcas": [], "mtu": 1500}
        data["serving"] = {**data["serving"], "port": API, "host": "0.0.0.0"}
        data["ray"] = {**data.get("ray", {}), "port": GCS}
        if firewall:
            data["firewall"] = firewall
        return yaml.safe_dump(data, sort_keys=False)

    def load(self, **firewall: object) -> str:
        """Render the spec, load the head's firewall.nft into its namespace; the script's text."""
        files = {o.path: o.content for o in render_all(parse_spec(self.spec(**firewall), "firewall-test.yml"))}
        text = files["files/head/etc/hy3spark/firewall.nft"]
        path = self.tmp / "firewall.nft"
        path.write_text(text)
        proc = self.nft("-f", str(path))
        assert proc.returncode == 0, proc.stderr
        return text

    def nft(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["nsenter", "-t", self.pid, "-n", NFT, *args], capture_output=True, text=True,
                              timeout=30, check=False)

    def ruleset(self) -> str:
        return self.nft("list", "ruleset").stdout

    def connect(self, client: str, address: str, port: int) -> str:
        return docker("exec", f"{RUN}-{client}", "python3", "-c", CONNECT, address, str(port)).stdout.strip()


def _network(name: str, thirds: range) -> str:
    for third in thirds:
        subnet = f"10.251.{third}.0/24"
        if docker("network", "create", "--label", LABEL, "--subnet", subnet, name, check=False).returncode == 0:
            return subnet.removesuffix(".0/24")
    pytest.fail(f"no free subnet among 10.251.{thirds[0]}-{thirds[-1]}.0/24")


def _cleanup() -> None:
    for name in docker("ps", "-a", "--filter", f"label={LABEL}", "--format", "{{.Names}}").stdout.split():
        pid = name.removeprefix("fwtest-").split("-")[0]
        if name.startswith(RUN) or (pid.isdigit() and not Path(f"/proc/{pid}").exists()):
            docker("rm", "-f", name, check=False)
    for name in docker("network", "ls", "--filter", f"label={LABEL}", "--format", "{{.Name}}").stdout.split():
        pid = name.removeprefix("fwtest-").split("-")[0]
        if name.startswith(RUN) or (pid.isdigit() and not Path(f"/proc/{pid}").exists()):
            docker("network", "rm", name, check=False)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    require_docker_as_root("nsenter into the node container's network namespace")
    if shutil.which("nsenter") is None or not os.access(NFT, os.X_OK):
        pytest.skip("needs nsenter and nft on the host (scripts/ensure-docker installs nftables)")
    image = node_image()
    if image is None or docker("image", "inspect", image, check=False).returncode != 0:
        pytest.skip(f"needs the node image ({image or 'HY3SPARK_NODE_IMAGE unset'}): scripts/build-images")
    _cleanup()
    try:
        fabric, lan = _network(f"{RUN}-fabric", range(10, 60)), _network(f"{RUN}-lan", range(60, 110))
        labels = ["--label", LABEL, "--cap-add", "NET_ADMIN", "--entrypoint", "sleep"]
        docker("run", "-d", *labels, "--name", f"{RUN}-head", "--network", f"{RUN}-fabric", "--ip", f"{fabric}.11",
               image, "infinity")
        docker("network", "connect", "--ip", f"{lan}.11", f"{RUN}-lan", f"{RUN}-head")
        docker("run", "-d", *labels, "--name", f"{RUN}-peer", "--network", f"{RUN}-fabric", "--ip", f"{fabric}.12",
               image, "infinity")
        docker("run", "-d", *labels, "--name", f"{RUN}-stranger", "--network", f"{RUN}-lan", "--ip", f"{lan}.13",
               image, "infinity")
        docker("exec", "-d", f"{RUN}-head", "python3", "-c", LISTEN)
        pid = docker("inspect", "--format", "{{.State.Pid}}", f"{RUN}-head").stdout.strip()
        found = Lab(tmp_path_factory.mktemp("firewall"), f"{fabric}.11", f"{lan}.11", f"{fabric}.12", f"{lan}.13",
                    pid)
        links = docker("exec", f"{RUN}-head", "ip", "-o", "-4", "addr").stdout
        assert re.search(rf"\beth0\s+inet {re.escape(fabric)}\.11/", links), links  # the fabric is eth0
        for _ in range(50):
            if found.connect("peer", found.head_fabric, UNLISTED) == "ok":
                break
        else:
            pytest.fail("the head's listeners never answered")
        yield found
    finally:
        _cleanup()


def test_without_the_table_every_port_answers(lab: Lab) -> None:
    lab.nft("delete", "table", "inet", "hy3spark")
    assert [lab.connect("stranger", lab.head_lan, p) for p in (GCS, API, UNLISTED)] == ["ok", "ok", "ok"]


def test_the_table_fences_the_internal_ports_and_leaves_the_rest(lab: Lab) -> None:
    lab.nft("delete", "table", "inet", "hy3spark")
    before = lab.ruleset()
    lab.load()
    # The stranger on the LAN: Ray's port is refused (a reset, not a timeout), the API and an unlisted port answer.
    assert lab.connect("stranger", lab.head_lan, GCS) == "refused"
    assert lab.connect("stranger", lab.head_lan, API) == "ok"
    assert lab.connect("stranger", lab.head_lan, UNLISTED) == "ok"
    # The peer, over the fabric interface: the internal port answers.
    assert lab.connect("peer", lab.head_fabric, GCS) == "ok"
    # Every other table (Docker's, in the node's namespace) is as it was.
    ours = re.compile(r"^table inet hy3spark \{.*?^\}\n", re.S | re.M)
    assert ours.sub("", lab.ruleset()) == before


def test_a_peer_not_on_the_fabric_interface_is_refused(lab: Lab) -> None:
    """The peer's address alone is not enough: the accept names the fabric interface (eth0)."""
    text = lab.load()
    assert 'iifname "eth0" ip saddr { ' in text
    # The same script with the fabric interface renamed: the peer's packets now arrive on the "wrong" interface.
    wrong = text.replace('iifname "eth0"', 'iifname "eth9"')
    (lab.tmp / "wrong.nft").write_text(wrong)
    assert lab.nft("-f", str(lab.tmp / "wrong.nft")).returncode == 0
    assert lab.connect("peer", lab.head_fabric, GCS) == "refused"
    assert lab.connect("peer", lab.head_fabric, UNLISTED) == "refused", "the fabric address only for peers"
    lab.load()
    assert lab.connect("peer", lab.head_fabric, GCS) == "ok"


def test_api_allow_refuses_a_client_outside_it(lab: Lab) -> None:
    lab.load(api_allow=["192.0.2.0/24"])
    assert lab.connect("stranger", lab.head_lan, API) == "refused"
    assert lab.connect("stranger", lab.head_lan, UNLISTED) == "ok"
    lab.load(api_allow=[f"{lab.stranger}/32"])
    assert lab.connect("stranger", lab.head_lan, API) == "ok"
    lab.load()
    assert lab.connect("stranger", lab.head_lan, API) == "ok"


def test_reloading_leaves_exactly_one_table(lab: Lab) -> None:
    first = lab.load()
    listed = lab.nft("list", "table", "inet", "hy3spark").stdout
    assert lab.load() == first
    lab.load()
    tables = lab.nft("list", "tables").stdout.splitlines()
    assert tables.count("table inet hy3spark") == 1, tables
    assert lab.nft("list", "table", "inet", "hy3spark").stdout == listed, "a re-load adds no rule"
