"""network scenario: what a user relies on once the network role ran on a head and a worker.

The fabric is a second Docker network (eth1, 10.92.0.0/24, MTU 9000); prepare.yml left eth1 without an address and
at MTU 1500, so the address and MTU found here were put there by `netplan apply` through systemd-networkd.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import testinfra
import yaml

SCENARIO = Path(os.environ.get("MOLECULE_SCENARIO_DIRECTORY", Path(__file__).resolve().parents[1]))
RENDERED = SCENARIO / ".rendered"
INVENTORY = os.environ.get("MOLECULE_INVENTORY_FILE", "")

HEAD, WORKER = "network-head", "network-worker"
NODES = (HEAD, WORKER)
FABRIC_IP = {HEAD: "10.92.0.11", WORKER: "10.92.0.12"}
FABRIC_IF, MGMT_IF, MGMT_NET = "eth1", "eth0", "network-0-mgmt"
USER, HOME = "ubuntu", "/home/ubuntu"
NETPLAN = "/etc/netplan/60-hy3spark-fabric.yaml"
VALIDATE = "/usr/local/lib/hy3spark/netplan-validate"
OTHER_NETPLAN = "/etc/netplan/01-hy3spark-test-other.yaml"
# What prepare.yml wrote: it stands for the installer's own netplan file.
OTHER_NETPLAN_CONTENT = (
    "# Stands for the installer's own file (the management network): the network role must not touch it.\n"
    "network:\n  version: 2\n"
)
SSH = f"runuser -u {USER} -- ssh -o BatchMode=yes -o StrictHostKeyChecking=yes -o ConnectTimeout=10"


def node(name: str) -> testinfra.host.Host:
    return testinfra.get_host(f"ansible://{name}?ansible_inventory={INVENTORY}")


def addresses(host: testinfra.host.Host, iface: str) -> tuple[list[str], int]:
    link = json.loads(host.check_output(f"ip -j addr show dev {iface}"))[0]
    return [f"{a['local']}/{a['prefixlen']}" for a in link["addr_info"] if a["family"] == "inet"], link["mtu"]


def networkd_setup(host: testinfra.host.Host) -> dict[str, str]:
    """networkctl's SETUP column per link: configured (networkd applied netplan's config) or unmanaged."""
    rows = host.check_output("networkctl list --no-legend --no-pager").splitlines()
    return {r.split()[1]: r.split()[4] for r in rows if len(r.split()) >= 5}


@pytest.mark.parametrize("name", NODES)
def test_netplan_file_is_the_rendered_one(name: str) -> None:
    deployed = node(name).file(NETPLAN)
    rendered = RENDERED / "files" / name / "etc/netplan/60-hy3spark-fabric.yaml"
    assert deployed.content == rendered.read_bytes(), "differs from `hy3spark render --only netplan`"
    fabric = yaml.safe_load(deployed.content_string)["network"]["ethernets"][FABRIC_IF]
    assert fabric["addresses"] == [f"{FABRIC_IP[name]}/24"]
    assert (deployed.user, deployed.group, deployed.mode) == ("root", "root", 0o600)


@pytest.mark.parametrize("name", NODES)
def test_netplan_generate_accepts_the_configuration(name: str) -> None:
    host = node(name)
    assert host.run("netplan generate").rc == 0
    assert host.run(f"{VALIDATE} {NETPLAN}").rc == 0
    network = host.file(f"/run/systemd/network/10-netplan-{FABRIC_IF}.network").content_string
    assert f"Address={FABRIC_IP[name]}/24" in network


def test_validation_keeps_a_broken_file_from_landing() -> None:
    """The role's validate line, on a file netplan rejects: the task fails and the deployed file stays."""
    before = node(HEAD).file(NETPLAN).content
    broken = "network:\n  version: 2\n  ethernets:\n    eth1:\n      mtu: jumbo\n"
    result = subprocess.run(
        ["ansible", HEAD, "-i", INVENTORY, "-m", "ansible.builtin.copy", "-a", json.dumps({
            "content": broken, "dest": NETPLAN, "mode": "0600",
            "validate": f"{VALIDATE} %s {Path(NETPLAN).name}",
        })],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode != 0, result.stdout
    assert "failed to validate" in result.stdout
    assert node(HEAD).file(NETPLAN).content == before


@pytest.mark.parametrize("name", NODES)
def test_fabric_interface_carries_address_and_mtu(name: str) -> None:
    host = node(name)
    assert addresses(host, FABRIC_IF) == ([f"{FABRIC_IP[name]}/24"], 9000)
    assert host.service("systemd-networkd").is_running
    assert networkd_setup(host)[FABRIC_IF] == "configured"


def test_jumbo_frames_cross_the_fabric() -> None:
    # 8972 bytes of ICMP payload + 28 of headers = 9000, with "don't fragment": fails on any 1500 hop.
    assert node(HEAD).run(f"ping -M do -s 8972 -c 1 -W 3 {FABRIC_IP[WORKER]}").rc == 0


@pytest.mark.parametrize("name", NODES)
def test_management_interface_untouched(name: str) -> None:
    inspect = subprocess.run(["docker", "inspect", name], capture_output=True, text=True, check=True)
    docker_ip = json.loads(inspect.stdout)[0]["NetworkSettings"]["Networks"][MGMT_NET]
    host = node(name)
    assert addresses(host, MGMT_IF) == ([f"{docker_ip['IPAddress']}/{docker_ip['IPPrefixLen']}"], 1500)
    assert networkd_setup(host)[MGMT_IF] == "unmanaged"
    assert host.check_output("ip route show default").startswith(f"default via {docker_ip['Gateway']} dev {MGMT_IF}")


@pytest.mark.parametrize("name", NODES)
def test_other_netplan_file_untouched(name: str) -> None:
    other = node(name).file(OTHER_NETPLAN)
    assert other.content_string == OTHER_NETPLAN_CONTENT
    assert (other.user, other.mode) == ("root", 0o600)


def test_head_has_its_own_key() -> None:
    key = node(HEAD).file(f"{HOME}/.ssh/id_ed25519")
    assert (key.user, key.mode) == (USER, 0o600)
    assert node(HEAD).file(f"{HOME}/.ssh").mode == 0o700


def test_worker_authorizes_the_head_from_the_fabric_only() -> None:
    head_key = node(HEAD).file(f"{HOME}/.ssh/id_ed25519.pub").content_string.split()[:2]
    authorized = node(WORKER).file(f"{HOME}/.ssh/authorized_keys")
    assert (authorized.user, authorized.mode) == (USER, 0o600)
    lines = [line for line in authorized.content_string.splitlines() if " ".join(head_key) in line]
    assert len(lines) == 1
    assert lines[0].startswith(f'from="{FABRIC_IP[HEAD]}" ')


def test_known_hosts_pins_the_worker_real_host_key() -> None:
    worker_key = node(WORKER).file("/etc/ssh/ssh_host_ed25519_key.pub").content_string.split()[:2]
    head_key = node(HEAD).file("/etc/ssh/ssh_host_ed25519_key.pub").content_string.split()[:2]
    assert worker_key != head_key, "nodes share host keys: the pin would prove nothing"
    known = node(HEAD).file(f"{HOME}/.ssh/known_hosts")
    assert (known.user, known.mode) == (USER, 0o600)
    entries = [line.split() for line in known.content_string.splitlines() if line.startswith(f"{FABRIC_IP[WORKER]} ")]
    assert entries == [[FABRIC_IP[WORKER], *worker_key]]


def test_head_reaches_the_worker_over_the_fabric_as_the_user() -> None:
    worker = node(WORKER)
    out = node(HEAD).check_output(f"{SSH} {FABRIC_IP[WORKER]} 'id -un; hostname; cat /etc/machine-id'")
    assert out.split() == [USER, worker.check_output("hostname"), worker.check_output("cat /etc/machine-id")]


def test_strict_host_key_checking_depends_on_the_pin() -> None:
    """Without the pinned known_hosts the same command fails: nothing else (no TOFU) trusts the worker."""
    result = node(HEAD).run(f"{SSH} -o UserKnownHostsFile=/dev/null {FABRIC_IP[WORKER]} true")
    assert result.rc != 0
    assert "Host key verification failed" in result.stderr

