"""The operator's engine venv (hy3spark_engine_venv): the roles refuse it, before changing anything, where it cannot
work, naming why. A real ansible-playbook runs node_container and vllm_serve on localhost against example specs'
rendered inventories; the first failing task is the refusal, so nothing on this machine is touched. The venv
deployment itself runs in molecule/desktop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

PLAY = """\
- name: Run one role with the engine venv
  hosts: hy3spark_cluster
  gather_facts: false
  roles:
    - role: %s
"""


def run_role(role: str, example: str, venv: str, tmp_path: Path) -> str:
    rendered = tmp_path / "rendered"
    subprocess.run([sys.executable, "-m", "hy3spark", "render", str(REPO / "examples" / f"{example}.yml"),
                    "--out", str(rendered)], cwd=REPO, check=True, capture_output=True, text=True)
    play = tmp_path / "play.yml"
    play.write_text(PLAY % role)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env |= {"ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
            "ANSIBLE_NOCOLOR": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0", "LC_ALL": "C.UTF-8"}
    run = subprocess.run([BIN / "ansible-playbook", "-i", str(rendered / "inventory"), "-e", "ansible_connection=local",
                          "-e", f"ansible_python_interpreter={sys.executable}", "-e", f"hy3spark_engine_venv={venv}",
                          str(play)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300, check=False)
    out = " ".join((run.stdout + run.stderr).split())
    assert run.returncode == 2, out
    return out


@pytest.mark.parametrize("role", ["node_container", "vllm_serve"])
@pytest.mark.parametrize(("example", "why"), [
    ("hy3-two-spark-native", "has 2 node(s) under serving.launcher: native"),
    ("gpt-oss-single", "has 1 node(s) under serving.launcher: ray"),
])
def test_the_venv_is_refused_with_workers_or_under_ray(role: str, example: str, why: str, tmp_path: Path) -> None:
    out = run_role(role, example, "/opt/vllm", tmp_path)
    name = yaml.safe_load((REPO / "examples" / f"{example}.yml").read_text())["name"]
    assert ("The engine venv /opt/vllm (hy3spark_engine_venv) runs the engine on the host of a single-node "
            f"deployment under serving.launcher: native, but {name} {why}. Unset hy3spark_engine_venv to run the "
            "engine in the node containers.") in out, out
    assert "Check that the engine venv serves one node under the native launcher" in out and "changed=0" in out, out


@pytest.mark.parametrize("role", ["node_container", "vllm_serve"])
def test_a_relative_venv_is_refused(role: str, tmp_path: Path) -> None:
    out = run_role(role, "two-card-tp", "opt/vllm", tmp_path)
    assert "The engine venv (hy3spark_engine_venv) must be an absolute path, not 'opt/vllm'." in out, out


def test_a_venv_without_the_engine_names_the_host_and_the_path(tmp_path: Path) -> None:
    venv = tmp_path / "no-engine-venv"
    (venv / "bin").mkdir(parents=True)
    out = run_role("node_container", "two-card-tp", str(venv), tmp_path)
    assert (f"desktop: {venv}/bin/vllm does not exist, so the engine cannot run from the venv {venv} "
            "(hy3spark_engine_venv).") in out, out
    assert "Create the directories" not in out and "ok=5 changed=0 unreachable=0 failed=1" in out, (
        "it fails before the directories or the env file are written: " + out)
