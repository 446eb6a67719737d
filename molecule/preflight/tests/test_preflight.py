"""preflight, happy path: the shipped playbook passes on a healthy pair as a user runs it (check mode is the
scenario's own check step), and the role left the nodes exactly as prepare.yml made them (it is read-only)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

PROJECT = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[3]))
SCENARIO = Path(os.environ.get("MOLECULE_SCENARIO_DIRECTORY", Path(__file__).resolve().parents[1]))
SIM_ROOT = "/srv/preflight-sysfs-SIMULATED"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_playbook(*extra: str) -> subprocess.CompletedProcess[str]:
    inventory = Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent
    cmd = ["ansible-playbook", "-i", str(inventory), str(PROJECT / "playbooks" / "preflight.yml"),
           "-e", "ansible_user=ubuntu", "-e", f"preflight_sysfs_root={SIM_ROOT}",
           "-e", f"preflight_spec_path={SCENARIO / 'cluster.yml'}", *extra]
    # The project's ansible.cfg prints results as YAML: the report is a text block.
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_STDOUT_CALLBACK": "default",
           "ANSIBLE_CALLBACK_RESULT_FORMAT": "yaml"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=PROJECT, check=False, timeout=300)
    result.stdout = ANSI.sub("", result.stdout)
    return result


@pytest.fixture(scope="module")
def playbook() -> subprocess.CompletedProcess[str]:
    return run_playbook()


def recap(out: str) -> dict[str, dict[str, int]]:
    stats = {}
    for host, fields in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", out, re.M):
        stats[host] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", fields)}
    return stats


def test_playbook_passes_and_changes_nothing(playbook):
    out = playbook.stdout
    assert playbook.returncode == 0, out[-4000:] + playbook.stderr[-2000:]
    stats = recap(out)
    assert set(stats) == {"preflight-head", "preflight-worker"}, out[-2000:]
    assert all(s["changed"] == 0 and s["failed"] == 0 for s in stats.values()), stats


def test_report_is_one_table_with_every_node(playbook):
    out = playbook.stdout
    # One report task, printed once (run_once on the head), with both nodes' rows and the controller's.
    assert out.count("TASK [preflight : Print the preflight report]") == 1
    assert re.search(r"^ +NODE +CHECK +STATUS +EXPECTED +FOUND +HOW TO FIX$", out, re.M)
    for node, check in [("preflight-head", "ssh preflight-worker"), ("preflight-worker", "ping preflight-head"),
                        ("preflight-head", "hca roceP2p1s0f1"), ("preflight-worker", "ping_mtu preflight-head"),
                        ("controller", "spec_sha256")]:
        assert re.search(rf"^ +{node} +{re.escape(check)} +PASS ", out, re.M), (node, check)
    assert re.search(r"^ +preflight-head +gpu +SKIP .*nvidia-smi not found", out, re.M)
    assert re.search(r"^ +preflight-worker +gpu_link +SKIP .*nvidia-smi not found", out, re.M)
    summary = re.search(r"^ +preflight: (\d+) pass, (\d+) fail, (\d+) warn, (\d+) skip, (\d+) info$", out, re.M)
    assert summary and summary.group(2) == "0" and int(summary.group(1)) >= 20, summary


def test_gpu_link_tag_reads_only_the_link(playbook):
    # What `hy3spark bench` runs under load: the link tasks alone, no report table, nothing failed or changed.
    del playbook  # the full run first: both share the nodes
    result = run_playbook("--tags", "gpu_link")
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-2000:]
    assert "Print the preflight report" not in out and "Ping each peer" not in out
    assert out.count("TASK [preflight : Report the GPU link readings]") == 1
    assert len(re.findall(r"status: skipped", out)) == 2 and "reason: nvidia-smi not found" in out
    assert all(s["changed"] == 0 and s["failed"] == 0 for s in recap(out).values())


def test_ssh_files_untouched(host):
    ssh_dir = host.file("/home/ubuntu/.ssh")
    if host.backend.get_hostname() == "preflight-head":
        # StrictHostKeyChecking=yes and UpdateHostKeys=no: the check added nothing to the pinned known_hosts.
        known = host.file("/home/ubuntu/.ssh/known_hosts")
        assert known.user == "ubuntu" and known.mode == 0o644
        lines = [line for line in known.content_string.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("10.91.0.12 ssh-ed25519 ")
        assert sorted(ssh_dir.listdir()) == ["id_ed25519", "id_ed25519.pub", "known_hosts"]
    else:
        # Workers never SSH anywhere: only the head's authorized key is there.
        assert ssh_dir.listdir() == ["authorized_keys"]
        keys = host.file("/home/ubuntu/.ssh/authorized_keys").content_string.splitlines()
        assert len(keys) == 1 and keys[0].startswith('from="10.91.0.11" ssh-ed25519 ')


def test_earlyoom_policy_untouched(host):
    conf = host.file("/etc/default/earlyoom").content_string
    if host.backend.get_hostname() == "preflight-head":
        assert conf.startswith("# Managed by hy3spark")
    else:
        assert conf.startswith("# Default settings for earlyoom") and 'EARLYOOM_ARGS="-r 3600"' in conf
    assert host.service("earlyoom").is_running


def test_fabric_untouched(host):
    want = {"preflight-head": "10.91.0.11/24", "preflight-worker": "10.91.0.12/24"}[host.backend.get_hostname()]
    link = host.check_output("ip -o addr show dev eth0")
    assert f"inet {want} " in link
    assert host.check_output("cat /sys/class/net/eth0/mtu") == "9000"
