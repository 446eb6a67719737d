"""earlyoom scenario: what a user relies on once the earlyoom role ran with each policy.

prepare.yml started earlyoom on every node with a config from the field: sparkrun's (protect and leave nodes, plus
sparkrun's drop-in on the protect node) or the package's default (stop node). The policy is judged on the arguments
of the earlyoom process systemd ACTUALLY runs (/proc/<MainPID>/cmdline), matched the way earlyoom matches:
a regex search on the process name as /proc/<pid>/comm holds it (15 characters).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from pathlib import Path

import pytest
import testinfra
from scenario import ansible_node as node

SCENARIO = Path(os.environ.get("MOLECULE_SCENARIO_DIRECTORY", Path(__file__).resolve().parents[1]))
RENDERED = SCENARIO / ".rendered"

PROTECT, STOP, LEAVE = "earlyoom-protect", "earlyoom-stop", "earlyoom-leave"
CONFIG = "/etc/default/earlyoom"
BACKUP_DIR = "/var/lib/hy3spark/earlyoom"
DROPIN = "/etc/systemd/system/earlyoom.service.d/override.conf"
SPARKRUN = (SCENARIO / "files" / "sparkrun-default-earlyoom").read_bytes()
SPARKRUN_PREFER = "(vllm|VLLM|sglang|llama-server|llama-cli|trtllm|tritonserver|ray|python3|python)"
COMM_LEN = 15
# The inference processes by the names the issue names, and by the titles the engines really give them.
INFERENCE = ("vllm", "ray", "python3")
REAL_TITLES = ("VLLM::EngineCore", "ray::IDLE", "ray::RayWorkerWrapper")


def running_argv(host: testinfra.host.Host) -> list[str]:
    """argv[1:] of the earlyoom process systemd runs now."""
    pid = int(host.check_output("systemctl show -p MainPID --value earlyoom.service"))
    assert pid > 0, "earlyoom.service has no main process"
    raw = host.file(f"/proc/{pid}/cmdline").content
    argv = [a.decode() for a in raw.split(b"\0")[:-1]]
    assert Path(argv[0]).name == "earlyoom", argv
    return argv[1:]


def option(argv: list[str], name: str) -> str | None:
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1 :]
    return value


def rendered_config() -> bytes:
    return (RENDERED / "files" / PROTECT / "etc/default/earlyoom").read_bytes()


def rendered_argv() -> list[str]:
    line = next(x for x in rendered_config().decode().splitlines() if x.startswith("EARLYOOM_ARGS="))
    return shlex.split(shlex.split(line.split("=", 1)[1])[0])


def unit_state(host: testinfra.host.Host) -> tuple[str, str]:
    out = host.check_output("systemctl show -p ActiveState -p UnitFileState earlyoom.service")
    values = dict(line.split("=", 1) for line in out.splitlines())
    return values["ActiveState"], values["UnitFileState"]


# ---- protect -------------------------------------------------------------------------------------------------
def test_protect_config_is_the_rendered_one() -> None:
    deployed = node(PROTECT).file(CONFIG)
    assert deployed.content == rendered_config(), "differs from `hy3spark render --only earlyoom`"
    assert (deployed.user, deployed.group, deployed.mode) == ("root", "root", 0o644)


def test_protect_earlyoom_runs_with_the_deployed_arguments() -> None:
    host = node(PROTECT)
    assert unit_state(host) == ("active", "enabled")
    assert running_argv(host) == rendered_argv()


@pytest.mark.parametrize("name", INFERENCE + REAL_TITLES)
def test_protect_running_policy_avoids_and_never_prefers(name: str) -> None:
    argv = running_argv(node(PROTECT))
    avoid, prefer = option(argv, "--avoid"), option(argv, "--prefer")
    assert avoid is not None and re.search(avoid, name[:COMM_LEN]), f"--avoid {avoid!r} does not cover {name}"
    assert prefer is None or not re.search(prefer, name[:COMM_LEN]), f"--prefer {prefer!r} picks {name} first"


def test_protect_keeps_sparkrun_config_once_with_its_provenance() -> None:
    host = node(PROTECT)
    sha1 = hashlib.sha1(SPARKRUN).hexdigest()
    backup = host.file(f"{BACKUP_DIR}/earlyoom.sparkrun.{sha1[:12]}")
    assert backup.content == SPARKRUN
    assert (backup.user, backup.mode) == ("root", 0o600)
    # Only the backups are private: the state directory above them stays readable (other roles keep files there).
    assert (host.file(BACKUP_DIR).mode, host.file(os.path.dirname(BACKUP_DIR)).mode) == (0o700, 0o755)
    # converge, idempotence and check ran: still exactly one copy and one record.
    assert sorted(host.file(BACKUP_DIR).listdir()) == sorted([f"earlyoom.sparkrun.{sha1[:12]}",
                                                               f"earlyoom.sparkrun.{sha1[:12]}.json"])
    record = json.loads(host.file(f"{BACKUP_DIR}/earlyoom.sparkrun.{sha1[:12]}.json").content_string)
    assert record["provenance"] == "sparkrun"
    assert record["sha1"] == sha1
    assert DROPIN in record["dropins"]
    # What earlyoom ran with before: systemd removes the quotes sparkrun put around the regexes.
    assert option(record["running_argv"], "--prefer") == SPARKRUN_PREFER
    reasons = {r["name"]: r["reason"] for r in record["at_risk"]}
    for name in INFERENCE:
        assert "--prefer" in reasons.get(name, ""), f"the record does not say sparkrun's policy kills {name} first"


def test_protect_leaves_sparkrun_dropin_in_place() -> None:
    """The drop-in only adds capabilities and re-states ExecStart with $EARLYOOM_ARGS: harmless, reported, kept."""
    assert node(PROTECT).file(DROPIN).exists


# ---- stop ----------------------------------------------------------------------------------------------------
def test_stop_service_inactive_disabled_package_and_config_kept() -> None:
    host = node(STOP)
    assert unit_state(host) == ("inactive", "disabled")
    assert host.run("pgrep -x earlyoom").rc == 1, "an earlyoom process still runs"
    assert host.package("earlyoom").is_installed
    conffiles = host.check_output("dpkg-query -W -f='${Conffiles}' earlyoom")
    shipped = next(line.split()[1] for line in conffiles.splitlines() if line.split()[:1] == [CONFIG])
    assert host.file(CONFIG).md5sum == shipped, "the package's config was changed"
    assert not host.file(BACKUP_DIR).exists


# ---- leave ---------------------------------------------------------------------------------------------------
def test_leave_changes_nothing() -> None:
    host = node(LEAVE)
    config = host.file(CONFIG)
    assert config.content == SPARKRUN
    assert config.mode == 0o644
    assert unit_state(host) == ("active", "enabled")
    assert option(running_argv(host), "--prefer") == SPARKRUN_PREFER
    assert not host.file(BACKUP_DIR).exists
