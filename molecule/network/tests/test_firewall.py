"""network scenario, the firewall role (playbooks/firewall.yml) on the two fabric nodes: the rendered table loads and
survives as a unit, a re-run changes nothing, --check --diff shows a hand edit without touching it, a run repairs it,
a table of someone else's is never touched, a peer on the wrong interface is refused, and `firewall: off` removes all
of ours (and only ours) with a warning. (The LAN scan and the fabric stranger: molecule/site's tests/test_security.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from scenario import REPO, flat, node, playbook, recap

SCENARIO = Path(__file__).resolve().parent.parent
RENDERED = SCENARIO / ".rendered"
HEAD, WORKER = "network-head", "network-worker"
NODES = (HEAD, WORKER)
RULES, PORTS, UNIT = "/etc/hy3spark/firewall.nft", "/etc/hy3spark/ports.txt", "hy3spark-firewall.service"
FIREWALL = str(REPO / "playbooks/firewall.yml")
# Someone else's table (a site's own rules): the role must never touch it.
FOREIGN = ("nft add table inet sitepolicy && "
           "nft add chain inet sitepolicy input '{ type filter hook input priority 10; }'")


def test_the_rendered_table_loads_as_a_unit() -> None:
    for name in NODES:
        node(name).run_test(FOREIGN)
    result = playbook(FIREWALL)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in NODES:
        host = node(name)
        rendered = RENDERED / "files" / name / "etc/hy3spark"
        assert host.file(RULES).content_string == (rendered / "firewall.nft").read_text()
        assert host.file(PORTS).content_string == (rendered / "ports.txt").read_text()
        assert host.service(UNIT).is_enabled and host.service(UNIT).is_running
        # nft merges adjacent ports (6379-6381 on the head, 6380-6381 on the worker): 6381 is in both.
        listing = host.check_output("nft list table inet hy3spark")
        assert "6381" in listing and 'iifname "eth1" ip saddr { 10.92.0.11, 10.92.0.12 } accept' in listing
        assert host.run("nft list table inet sitepolicy").rc == 0


def test_a_rerun_changes_nothing() -> None:
    result = playbook(FIREWALL)
    assert result.returncode == 0 and recap(result.stdout) == {HEAD: 0, WORKER: 0}, result.stdout


def test_a_peer_on_the_wrong_interface_is_refused() -> None:
    """The worker is a peer over eth1; the same worker through the management network is anyone."""
    head = node(HEAD)
    head.run_test("systemd-run --unit fwtest-listener python3 -m http.server 6380 --bind 0.0.0.0")
    try:
        probe = ("python3 -c \"import socket,sys; s=socket.socket(); s.settimeout(5); "
                 "print(s.connect_ex((sys.argv[1], 6380)))\" %s")
        mgmt = head.check_output("ip -o -4 addr show dev eth0").split()[3].split("/")[0]
        for _ in range(20):
            if node(WORKER).check_output(probe, "10.92.0.11").strip() == "0":
                break
        assert node(WORKER).check_output(probe, "10.92.0.11").strip() == "0", "the peer over the fabric"
        assert node(WORKER).check_output(probe, mgmt).strip() == "111", "the peer through the management network"
    finally:
        head.run("systemctl stop fwtest-listener")


def test_check_diff_shows_a_hand_edit_and_a_run_repairs_it() -> None:
    worker = node(WORKER)
    worker.run_test(f"sed -i 's/6380, //' {RULES} && systemctl reload {UNIT}")
    assert "6380" not in worker.check_output("nft list table inet hy3spark")
    check = playbook(FIREWALL, "--check", "--diff")
    assert check.returncode == 0, check.stdout + check.stderr
    assert recap(check.stdout)[WORKER] >= 1 and recap(check.stdout)[HEAD] == 0, check.stdout
    assert "elements = { 6380, " in check.stdout, check.stdout
    assert "6380" not in worker.check_output("nft list table inet hy3spark"), "check mode changed nothing"
    result = playbook(FIREWALL)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6380" in worker.check_output("nft list table inet hy3spark")


@pytest.mark.parametrize("spelling", ['{"firewall_enabled": false}'])
def test_firewall_off_removes_ours_only_and_warns(spelling: str) -> None:
    result = playbook(FIREWALL, "-e", spelling)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "firewall: off (the spec's firewall.enabled is false)" in flat(result.stdout), result.stdout
    for name in NODES:
        host = node(name)
        assert host.run("nft list table inet hy3spark").rc != 0
        assert not host.file(RULES).exists and not host.file(f"/etc/systemd/system/{UNIT}").exists
        assert host.run("nft list table inet sitepolicy").rc == 0, "someone else's table stays"
    again = playbook(FIREWALL, "-e", spelling)
    assert again.returncode == 0 and recap(again.stdout) == {HEAD: 0, WORKER: 0}, again.stdout
    # And back on, for whatever runs after.
    back = playbook(FIREWALL)
    assert back.returncode == 0, back.stdout + back.stderr
    for name in NODES:
        node(name).run_test("nft list table inet hy3spark")
