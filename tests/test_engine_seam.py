"""The serving role's engine seam (docs/engines.md, step 6): an engine-neutral lifecycle, each engine's own steps in
roles/vllm_serve/tasks/engines/<engine>/{nodes,head}.yml, chosen by `hy3spark.engine.name`.

The selection runs in a real ansible-playbook on localhost (tasks_from: engine.yml, the step main.yml and serve.yml
run); the neutral files are read for anything of an engine's own; vLLM's parser patch runs against a stand-in vllm
package, alone and as vLLM's head step hands it to the lifecycle (a restart reason, the run record's `parsers`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hy3spark.engines import ENGINES

REPO = Path(__file__).resolve().parent.parent
ROLE = REPO / "roles" / "vllm_serve"
BIN = Path(sys.executable).parent
STEPS = ("nodes", "head")

PLAY = """\
- name: Run one engine step of the serving role
  hosts: localhost
  connection: local
  gather_facts: false
  vars:
    hy3spark: {engine: {name: "%(engine)s"}}
  tasks:
    - name: Run the step
      ansible.builtin.include_role:
        name: vllm_serve
        tasks_from: engine.yml
      vars:
        __vllm_serve_engine_step: %(step)s
"""


def run_step(roles: Path, engine: str, step: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    (cwd / "play.yml").write_text(PLAY % {"engine": engine, "step": step})
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env |= {"ANSIBLE_ROLES_PATH": str(roles), "ANSIBLE_NOCOLOR": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0",
            "LC_ALL": "C.UTF-8"}
    return subprocess.run([BIN / "ansible-playbook", "-i", "localhost,", "-e",
                           f"ansible_python_interpreter={sys.executable}", str(cwd / "play.yml")],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=300, check=False)


@pytest.mark.parametrize("step", STEPS)
def test_an_engine_without_its_task_files_fails_naming_the_engine_and_the_file(step: str, tmp_path: Path) -> None:
    run = run_step(REPO / "roles", "sglang", step, tmp_path)
    out = run.stdout + run.stderr
    missing = ROLE / "tasks" / "engines" / "sglang" / f"{step}.yml"
    assert run.returncode == 2, out
    assert (f"The serving role has no {step} steps for the engine 'sglang': {missing} is missing. Each engine brings "
            "tasks/engines/<engine>/nodes.yml and head.yml in this role (docs/engines.md, step 6).") in out
    # Our message, not Ansible's: no template error, no undefined variable, no include of a missing file tried.
    assert not re.search(r"Traceback|undefined|Could not find or access|Unable to retrieve file", out, re.I), out
    assert "Run the engine's own steps" not in out and "failed=1" in out, out


def test_the_step_runs_the_named_engines_own_file_and_only_that(tmp_path: Path) -> None:
    # A copy of the role with a stand-in engine `probe` that brings nodes.yml and not head.yml.
    roles = tmp_path / "roles"
    shutil.copytree(ROLE, roles / "vllm_serve")
    probe = roles / "vllm_serve" / "tasks" / "engines" / "probe"
    probe.mkdir()
    marker = tmp_path / "ran"
    (probe / "nodes.yml").write_text(
        "- name: Leave a mark\n  ansible.builtin.copy:\n"
        f"    content: \"{{{{ hy3spark.engine.name }}}} {{{{ __vllm_serve_engine_step }}}}\"\n    dest: {marker}\n"
        "    mode: '0644'\n")
    ran = run_step(roles, "probe", "nodes", tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert marker.read_text() == "probe nodes"
    marker.unlink()
    head = run_step(roles, "probe", "head", tmp_path)
    assert head.returncode == 2 and f"{probe / 'head.yml'} is missing" in head.stdout, head.stdout + head.stderr
    assert not marker.exists(), "the head step ran nothing of the probe's nodes file"


def test_every_engine_has_its_task_files_and_nothing_else_has_any() -> None:
    engines = ROLE / "tasks" / "engines"
    assert sorted(p.name for p in engines.iterdir()) == sorted(ENGINES)
    for name in ENGINES:
        assert sorted(p.name for p in (engines / name).iterdir()) == [f"{s}.yml" for s in sorted(STEPS)]


def test_the_lifecycle_runs_the_nodes_step_on_every_node_and_the_head_step_before_each_start() -> None:
    def includes(path: Path) -> list[tuple[str, dict, str | None]]:
        tasks = yaml.safe_load(path.read_text())
        return [(t["ansible.builtin.include_tasks"], t.get("vars", {}), t.get("when")) for t in tasks
                if "ansible.builtin.include_tasks" in t]

    assert includes(ROLE / "tasks" / "main.yml") == [
        ("engine.yml", {"__vllm_serve_engine_step": "nodes"}, None),
        # Under a launcher whose other nodes start their own ranks (native), the head step runs in each of their
        # containers too: what the engine reads at startup must be the same on every node that starts it.
        ("engine.yml",
         {"__vllm_serve_engine_step": "head", "vllm_serve_container": "{{ hy3spark_node.container.name }}"},
         "inventory_hostname != hy3spark.head and hy3spark_node.serve_argv | length > 0 "
         "and (__vllm_serve_own_info.container | default({}, true)).State.Running | default(false)"),
        ("serve.yml", {}, "inventory_hostname == hy3spark.head")]
    serve = yaml.safe_load((ROLE / "tasks" / "serve.yml").read_text())
    names = [t["name"] for t in serve]
    head = names.index("Prepare the head for the engine")
    assert serve[head]["ansible.builtin.include_tasks"] == "engine.yml"
    assert serve[head]["vars"] == {"__vllm_serve_engine_step": "head"} and "when" not in serve[head]
    # Before the restart decision (an engine's head steps may give a reason to restart) and the start.
    assert head < names.index("Decide whether to (re)start the engine") < names.index(
        "Start the engine in {{ vllm_serve_container }}")


# The engine-neutral files: every task file outside tasks/engines/, the internals, the helper piped into the head
# container, and the serve script template they deploy.
NEUTRAL = sorted({*(ROLE / "tasks").glob("*.yml"), ROLE / "vars" / "main.yml", ROLE / "files" / "engine.py",
                  REPO / "templates" / "serve.sh.j2"})
# What vLLM's own steps are about (tasks/engines/vllm/): its parser patch and its Ray carry-over file in its config
# root. The other words come from the engine registry, so a new engine's name and secrets are looked for at once.
VLLM_OWN = ("hy_v3", "parser", "token_suffix", "patch", "ray_non_carry_over", "config_root")


def engine_words() -> list[str]:
    words = [*VLLM_OWN]
    for name, engine in ENGINES.items():
        words += [name, *engine.secret_names]
        words += [p.stem for p in (ROLE / "files" / "engines" / name).rglob("*") if p.is_file()]
    return words


@pytest.mark.parametrize("path", NEUTRAL, ids=lambda p: str(p.relative_to(REPO)))
def test_the_engine_neutral_files_name_nothing_of_an_engine(path: Path) -> None:
    # The role's own name (vllm_serve, the prefix of its variables) is the one exception: it names the role.
    text = re.sub(r"vllm_serve", "ROLE", path.read_text())
    # A word counts where it starts a word: "parser" finds "parsers", "patch" finds "patched".
    found = [w for w in engine_words() if re.search(rf"(?<![A-Za-z]){re.escape(w)}", text, re.I)]
    assert found == [], f"{path.relative_to(REPO)} names {found}: move it to the engine's own files"


def test_the_scan_sees_what_it_guards() -> None:
    # The words are found where they belong: vLLM's own files name them, and a neutral file that did would fail.
    own = " ".join(p.read_text() for p in (ROLE / "tasks" / "engines" / "vllm").glob("*.yml"))
    assert all(w in own for w in ("hy_v3", "token_suffix", "config_root", "ray_non_carry_over", "vLLM"))
    assert "hy_v3_parsers" in engine_words() and "VLLM_API_KEY" in engine_words()
    assert re.search(r"(?<![A-Za-z])vllm", "vLLM's config root", re.I)
    assert re.search(r"(?<![A-Za-z])parser", "the hy_v3 parsers were patched", re.I)
    assert not re.search(r"(?<![A-Za-z])vllm", re.sub("vllm_serve", "ROLE", "__vllm_serve_container"), re.I)


PARSER = '''"""hy_v3 tool parser."""
START, END = "<tool_calls>", "</tool_calls>"
THINK = '<think>'
'''


def patch(site: Path, *args: str) -> dict:
    script = ROLE / "files" / "engines" / "vllm" / "hy_v3_parsers.py"
    # Piped on stdin as the role pipes it into `docker exec -i <head> python3 -`.
    run = subprocess.run([sys.executable, "-", *args], input=script.read_text(), capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site)}, timeout=60, check=True)
    return json.loads(run.stdout.splitlines()[-1])


def test_vllms_head_step_patches_bare_hy_v3_tokens_once(tmp_path: Path) -> None:
    package = tmp_path / "vllm" / "tool_parsers"
    package.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    parser = package / "hy_v3_tool_parser.py"
    parser.write_text(PARSER)
    native = tmp_path / "vllm" / "hy_v3_reasoning_parser.py"
    native.write_text("SUFFIX = config.get('token_suffix', '')\nTHINK = f'<think{SUFFIX}>'\n")
    path, other = str(parser), str(native)

    assert patch(tmp_path, ":opensource", "--check") == {
        "files": {other: "native", path: "needs patch"}, "after": {other: "native", path: "patched"},
        "changed": True}
    assert parser.read_text() == PARSER
    assert patch(tmp_path, ":opensource")["files"][path] == "patched now"
    assert parser.read_text() == PARSER.replace("<tool_calls>", "<tool_calls:opensource>").replace(
        "</tool_calls>", "</tool_calls:opensource>").replace("<think>", "<think:opensource>")
    assert patch(tmp_path, ":opensource") == {
        "files": {other: "native", path: "patched"}, "after": {other: "native", path: "patched"}, "changed": False}


HEAD_PLAY = """\
- name: Run vLLM's head step
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Run the step
      ansible.builtin.include_role:
        name: vllm_serve
        tasks_from: engines/vllm/head.yml
      vars:
        vllm_serve_container: head
        vllm_serve_patch_hy_v3: %(patch)s
    - name: Keep what the step handed to the lifecycle
      ansible.builtin.copy:
        content: "{{ {'restart': __vllm_serve_engine_restart, 'record': __vllm_serve_engine_record} | to_json }}"
        dest: %(out)s
        mode: "0644"
"""


@pytest.mark.parametrize("patch_hy_v3", [True, False])
def test_vllms_head_step_hands_the_patch_to_the_lifecycle(patch_hy_v3: bool, tmp_path: Path) -> None:
    # `docker exec -i head python3 - SUFFIX` runs here: a stand-in docker drops `exec -i head`.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text('#!/bin/sh\nshift 3\nexec "$@"\n')
    (bin_dir / "docker").chmod(0o755)
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
    parser = tmp_path / "site" / "vllm" / "hy_v3_tool_parser.py"
    parser.write_text(PARSER)
    out = tmp_path / "handed.json"
    (tmp_path / "play.yml").write_text(HEAD_PLAY % {"patch": patch_hy_v3, "out": out})
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env |= {"ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_NOCOLOR": "1", "LC_ALL": "C.UTF-8",
            "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(tmp_path / "site")}

    def run() -> dict:
        proc = subprocess.run([BIN / "ansible-playbook", "-i", "localhost,", "-e",
                               f"ansible_python_interpreter={sys.executable}", str(tmp_path / "play.yml")],
                              capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads(out.read_text())

    if not patch_hy_v3:
        assert run() == {"restart": "", "record": {"parsers": {}}}
        assert parser.read_text() == PARSER
        return
    assert run() == {"restart": "the hy_v3 parsers were patched", "record": {"parsers": {str(parser): "patched"}}}
    assert "<tool_calls:opensource>" in parser.read_text()
    # Patched once: the next run has no reason to restart and records the same.
    assert run() == {"restart": "", "record": {"parsers": {str(parser): "patched"}}}
