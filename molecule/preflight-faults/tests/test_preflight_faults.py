"""preflight, fault injection: the shipped playbook, run as a user runs it against the broken nodes, prints the
whole table first and then fails once, naming every failed check (node/check/target) in its message."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

PROJECT = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[3]))
SIM_ROOT = "/srv/preflight-sysfs-SIMULATED"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
HEAD = "preflight-faults-head"
FAULTS = [
    # (node, check, target, what the FOUND column starts with)
    (HEAD, "hca", "roceP2p1s0f1", "roceP2p1s0f1 -> enP2p1s0f0np0 (p0)"),
    (HEAD, "docker", "", "permission denied on the docker socket"),
    (HEAD, "ssh", "preflight-faults-w1", "permission denied"),
    (HEAD, "ssh", "preflight-faults-w2", "host key unknown"),
    (HEAD, "ssh", "preflight-faults-w3", "unreachable"),
    (HEAD, "ping", "preflight-faults-w4", "no reply"),
    (HEAD, "ping_mtu", "preflight-faults-w1", "no reply to 8972-byte frames"),
    ("preflight-faults-w1", "mtu", "", "1500"),
    ("preflight-faults-w1", "earlyoom", "", "running; config from: sparkrun setup earlyoom"),
    ("preflight-faults-w2", "image_arch", "", "arm64"),
    ("preflight-faults-w3", "address", "", "10.91.1.34/24"),
    ("preflight-faults-w4", "interface", "", "eth0 administratively down"),
    ("controller", "spec_sha256", "", None),
]


@pytest.fixture(scope="module")
def playbook() -> subprocess.CompletedProcess[str]:
    inventory = Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent
    edited = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "cluster-edited.yml"
    cmd = ["ansible-playbook", "-i", str(inventory), str(PROJECT / "playbooks" / "preflight.yml"),
           "-e", "ansible_user=ubuntu", "-e", f"preflight_sysfs_root={SIM_ROOT}", "-e", f"preflight_spec_path={edited}"]
    # The project's ansible.cfg prints results as YAML: the report is a text block.
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_STDOUT_CALLBACK": "default",
           "ANSIBLE_CALLBACK_RESULT_FORMAT": "yaml"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=PROJECT, check=False, timeout=400)
    # ansible-core 2.19 prints the failed task (fatal: ..., [ERROR]: ...) on stderr, the rest on stdout.
    result.stdout, result.stderr = ANSI.sub("", result.stdout), ANSI.sub("", result.stderr)
    return result


def test_play_fails_once_after_the_report(playbook):
    out = playbook.stdout
    assert playbook.returncode == 2, out[-3000:] + playbook.stderr[-2000:]
    report = out.index("TASK [preflight : Print the preflight report]")
    failure = out.index("TASK [preflight : Fail when a check failed]")
    assert report < failure
    # Every probe ran on every node before that: no task failed on its own; the one failure is the report's.
    both = out + playbook.stderr
    assert both.count("fatal: [") == 1 and both.count("FAILED!") == 1
    assert re.search(r"fatal: \[preflight-faults-head\]: FAILED!", both)
    stats = re.findall(r"^(\S+) +: ok=\d+ +changed=(\d+) +unreachable=(\d+) +failed=(\d+)", out, re.M)
    assert sorted(stats) == sorted([(HEAD, "0", "0", "1")] + [(f"preflight-faults-w{i}", "0", "0", "0")
                                                              for i in range(1, 5)])


@pytest.mark.parametrize(("node", "check", "target", "found"), FAULTS, ids=lambda v: v if isinstance(v, str) else "")
def test_table_row_and_failure_message_name_the_fault(playbook, node, check, target, found):
    out = playbook.stdout
    label = f"{check} {target}" if target else check
    line = re.search(rf"^ +{node} +{re.escape(label)} +FAIL +.*$", out, re.M)
    assert line, f"no FAIL row for {node} {label}"
    if found:
        # FOUND is the fifth column; its start sits on the row's first line.
        assert found[:20] in line.group(0), line.group(0)
    both = (out + playbook.stderr).replace("\n", " ")
    message = re.search(r"preflight: (\d+) check\(s\) failed \(([^)]*)\)", both)
    assert message, playbook.stderr[-2000:]
    key = "/".join(p for p in (node, check, target) if p)
    assert key in [k.strip() for k in message.group(2).split(",")]


def test_summary_counts_every_failure(playbook):
    out = playbook.stdout
    summary = re.search(r"^ +preflight: \d+ pass, (\d+) fail, ", out, re.M)
    message = re.search(r"preflight: (\d+) check\(s\) failed", out + playbook.stderr)
    assert summary and message and summary.group(1) == message.group(1) == "25"
