"""The ansible-playbook options `up`, `down`, `check` and `status` pass through (-e/--extra-vars, --skip-tags,
--check, --diff), kolla-ansible's way.

Three things are proved, all without Docker:
- an -e that would carry a secret onto the command line is refused before anything runs: exit 2, one message naming
  the flag, no run directory, the secret's value printed nowhere;
- what a user types reaches ansible-playbook's command line (the `command` file ansible-runner writes for every run,
  from the real CLI against a spec whose nodes do not answer SSH);
- it takes effect: a real run_playbook of a tiny local playbook sees the variables (an @FILE named relative to the
  user's directory too), runs in check and diff mode and skips the skipped tag.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hy3spark.errors import EXIT_UNREACHABLE
from hy3spark.playbooks import AnsibleArgs, ansible_args
from hy3spark.runner import run_playbook
from hy3spark.spec import parse_spec

REPO = Path(__file__).resolve().parent.parent
# Nothing answers SSH on 127.0.0.2/3 here: every run ends unreachable within seconds, after ansible-runner has
# written the run's command line. The token variable is not HF_TOKEN, so the refusal must follow the spec.
SPEC = """\
name: passthrough
profile: hy3-295b-nvfp4-tp2
head:
  name: spark-a
  fabric_ip: 10.0.0.1/24
  ssh_host: 127.0.0.2
workers:
  - name: spark-b
    fabric_ip: 10.0.0.2/24
    ssh_host: 127.0.0.3
fabric:
  interfaces: [enp1s0f1np1]
  hcas: [rocep1s0f1, roceP2p1s0f1]
model:
  revision: 0c11c0ffee0c11c0ffee0c11c0ffee0c11c0ffee
  token_env: HY3SPARK_MY_HF
serving:
  api_key_env: VLLM_API_KEY
"""
SECRET = "hf_PassThroughFake0123456789abcdef"
WHY = ("-e values are passed to ansible-playbook as given, where the process list and the run's artifacts would "
       "show them.")


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yml"
    path.write_text(SPEC)
    return path


# --- refused before anything runs -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("command", "value", "message"), [
    ("up", "HY3SPARK_MY_HF=s3cr3t", "'HY3SPARK_MY_HF' names a secret. {why} Export HY3SPARK_MY_HF instead"),
    # The engine's name for the token on the head, in any case, among other pairs: the spec's variable to export.
    ("down", "a=1 hf_token=s3cr3t", "'hf_token' names a secret. {why} Export HY3SPARK_MY_HF instead"),
    ("check", "VLLM_API_KEY=s3cr3t", "'VLLM_API_KEY' names a secret. {why} Export VLLM_API_KEY instead"),
    ("status", '{"__vllm_serve_api_key": "s3cr3t"}', "'__vllm_serve_api_key' is named like a credential. {why}"),
    ("up", '{"vllm_serve": {"ansible_become_password": "s3cr3t"}}',
     "'vllm_serve.ansible_become_password' is named like a credential. {why}"),
    ("up", "ansible_ssh_pass=s3cr3t", "'ansible_ssh_pass' is named like a credential. {why}"),
    ("down", f"note=copied-{SECRET}",
     "the value of 'note' holds the secret HY3SPARK_MY_HF. {why} Leave it in HY3SPARK_MY_HF"),
    ("up", f'{{"a": {{"b": ["{SECRET}"]}}}}', "the value of 'a.b[0]' holds the secret HY3SPARK_MY_HF. {why}"),
])
def test_an_extra_var_carrying_a_secret_is_refused_before_anything_runs(
        cli: Callable[..., object], spec: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str,
        value: str, message: str) -> None:
    monkeypatch.setenv("HY3SPARK_MY_HF", SECRET)
    runs = tmp_path / "runs"
    result = cli(command, str(spec), "--runs-dir", str(runs), "-e", "harmless=1", "-e", value)
    assert result.code == 2
    assert result.out == ""
    assert result.err.startswith(f"error: -e/--extra-vars: refused: {message.format(why=WHY)}"), result.err
    assert result.err.count("\n") == 1, result.err  # one message, one line
    assert SECRET not in result.err and "s3cr3t" not in result.err
    assert not runs.exists(), "nothing ran, nothing was written"


def test_an_engine_secret_the_spec_names_no_variable_for_is_still_refused(cli: Callable[..., object],
                                                                         tmp_path: Path) -> None:
    spec = tmp_path / "cluster.yml"
    spec.write_text(SPEC.replace("  api_key_env: VLLM_API_KEY\n", "  api_key_env: null\n  host: 127.0.0.1\n"))
    result = cli("up", str(spec), "--runs-dir", str(tmp_path / "runs"), "-e", "vllm_api_key=s3cr3t")
    assert result.code == 2
    assert result.err == (f"error: -e/--extra-vars: refused: 'vllm_api_key' names a secret. {WHY} Name a variable "
                          f"for it in the spec (model.token_env, serving.api_key_env) and export that; hy3spark hands "
                          f"the spec's secrets to the playbook in a 0600 file.\n")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("value", "message"), [
    ("@missing.yml", "-e/--extra-vars @missing.yml: no such file"),
    ("./vars.yml", "-e/--extra-vars ./vars.yml: a file needs an @ in front (-e @./vars.yml)"),
    ("[1, 2]", "-e/--extra-vars [1, 2]: not a mapping of variables (KEY=VALUE, YAML/JSON or @FILE)"),
    ("{unclosed", "-e/--extra-vars {unclosed: YAML parsing failed"),
])
def test_extra_vars_ansible_playbook_would_refuse_are_usage_errors(cli: Callable[..., object], spec: Path,
                                                                    tmp_path: Path, value: str, message: str) -> None:
    result = cli("up", str(spec), "--runs-dir", str(tmp_path / "runs"), "-e", value)
    assert result.code == 2
    assert result.err.startswith(f"error: {message}"), result.err
    assert not (tmp_path / "runs").exists()


def test_names_of_variables_files_and_counts_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ends otherwise than a credential is no secret: the NAME of the key's variable, a key FILE's path, a
    count of tokens. A file's contents stay off the command line, so only its path is passed (made absolute: the
    playbook runs from the content directory)."""
    monkeypatch.chdir(tmp_path)
    Path("vault.yml").write_text("ansible_become_password: s3cr3t\n")
    loaded = parse_spec(SPEC, "cluster.yml")
    given = ["vllm_serve_api_key_env=OTHER_KEY", "ansible_ssh_private_key_file=/root/.ssh/id_ed25519",
             "vllm_serve_smoke_max_tokens=4 vllm_serve_token_suffix=x", "@vault.yml", ""]
    args = ansible_args(loaded, given, "ray", check=True, diff=False)
    assert args == AnsibleArgs((*given[:3], f"@{tmp_path / 'vault.yml'}", ""), "ray", True, False)
    assert args.cmdline() == [x for v in args.extra_vars for x in ("-e", v)] + ["--skip-tags", "ray"]
    assert args.argv() == [*args.cmdline(), "--check"]
    assert args.vars_only() == AnsibleArgs(args.extra_vars)


# --- what reaches ansible-playbook's command line ---------------------------------------------------------------------
def hy3spark(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HY3SPARK_MY_HF", "VLLM_API_KEY")}
    return subprocess.run([str(Path(sys.executable).parent / "hy3spark"), *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def commands(runs: Path) -> list[list[str]]:
    """The command line of every ansible-runner run under `runs`, in the order they ran."""
    files = sorted(runs.glob("run-*/artifacts/*/command"), key=lambda p: p.stat().st_mtime)
    return [json.loads(p.read_text())["command"] for p in files]


def test_up_passes_every_option_to_ansible_playbook_and_records_them(spec: Path, tmp_path: Path) -> None:
    (tmp_path / "vars.yml").write_text("from_file: yes\n")
    runs = tmp_path / "runs"
    passed = ["-e", 'x=1 y="two words"', "-e", "@vars.yml", "-e", '{"z": [1, "a;b $HOME"]}', "--skip-tags", "model",
              "--check", "--diff"]
    proc = hy3spark("up", "cluster.yml", "--runs-dir", "runs", "--json", *passed, cwd=tmp_path)
    assert proc.returncode == EXIT_UNREACHABLE, proc.stderr
    expected = [*passed[:3], f"@{tmp_path / 'vars.yml'}", *passed[4:]]
    (command,) = commands(runs)  # unreachable: no status run afterwards
    assert command[0] == "ansible-playbook" and command[-1].endswith("site.yml")
    assert command[1:len(expected) + 1] == expected, command
    record = json.loads(Path(json.loads(proc.stdout)["record"]).read_text())
    assert record["ansible_args"] == expected
    assert (runs / "labbook.md").read_text().splitlines()[-1].startswith(f"| {record['started']} | up passthrough "
                                                                         f"--check | ")


@pytest.mark.parametrize(("argv", "playbook", "expected"), [
    (["down", "-e", "a=1", "--skip-tags", "head", "--check", "--diff"], "teardown.yml",
     ["-e", "a=1", "--skip-tags", "head", "--check", "--diff"]),
    # The preflight run gets -e and --skip-tags as well as the dry run (which does not start: preflight failed).
    (["check", "--dry-run", "-e", "a=1", "--skip-tags", "gpu"], "preflight.yml", ["-e", "a=1", "--skip-tags", "gpu"]),
    (["status", "-e", "a=1", "-e", "b=2"], "status.yml", ["-e", "a=1", "-e", "b=2"]),
])
def test_the_other_commands_pass_their_options_on(spec: Path, tmp_path: Path, argv: list[str], playbook: str,
                                                  expected: list[str]) -> None:
    proc = hy3spark(argv[0], "cluster.yml", "--runs-dir", "runs", *argv[1:], cwd=tmp_path)
    assert proc.returncode == EXIT_UNREACHABLE, proc.stderr
    (command,) = commands(tmp_path / "runs")
    assert command[-1].endswith(f"playbooks/{playbook}")
    assert command[1:len(expected) + 1] == expected, command


# --- what the playbook gets -------------------------------------------------------------------------------------------
PLAYBOOK = """\
- name: Show what the passthrough gave this run
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Report what arrived
      ansible.builtin.debug:
        var: hy3spark_report_given
      vars:
        hy3spark_report_given:
          words: "{{ words }}"
          odd: "{{ odd }}"
          from_file: "{{ from_file }}"
          check_mode: "{{ ansible_check_mode }}"
          diff_mode: "{{ ansible_diff_mode }}"
    - name: Write the target file
      ansible.builtin.copy:
        dest: "{{ target }}"
        content: "written by the passthrough test\\n"
        mode: "0644"
    - name: Fail when the skipped tag ran
      ansible.builtin.fail:
        msg: --skip-tags did not arrive
      tags: [skipme]
"""


def run_local(tmp_path: Path, args: AnsibleArgs) -> tuple[object, Path]:
    (tmp_path / "pb.yml").write_text(PLAYBOOK)
    inventory = tmp_path / "hosts"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    target = tmp_path / "target.txt"
    result = run_playbook(str(tmp_path / "pb.yml"), inventory, runs_dir=tmp_path / "runs", secret_names=[],
                          check=args.check, diff=args.diff, extravars={"target": str(target)},
                          extra_args=args.cmdline())
    return result, target


def test_the_playbook_gets_the_variables_check_and_diff_mode_and_skips_the_tag(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("vars.yml").write_text("from_file: read from vars.yml\n")
    loaded = parse_spec(SPEC, "cluster.yml")
    args = ansible_args(loaded, ['words="two words" odd=\'a;b $HOME `id`\'', "@vars.yml"], "skipme", True, True)
    result, target = run_local(tmp_path, args)
    assert result.status == "successful", result.failures
    assert result.results["localhost"]["hy3spark_report_given"] == {
        "words": "two words", "odd": "a;b $HOME `id`", "from_file": "read from vars.yml", "check_mode": True,
        "diff_mode": True}
    assert not target.exists(), "check mode wrote the file"
    (diff,) = result.diffs
    assert "+written by the passthrough test" in diff


def test_without_the_options_the_same_playbook_writes_and_runs_the_tag(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The contrast that makes the test above mean something: no --check writes the file, no --skip-tags fails."""
    monkeypatch.chdir(tmp_path)
    Path("vars.yml").write_text("from_file: read from vars.yml\n")
    args = ansible_args(parse_spec(SPEC, "cluster.yml"), ["words=w odd=o", "@vars.yml"])
    result, target = run_local(tmp_path, args)
    assert result.results["localhost"]["hy3spark_report_given"]["check_mode"] is False
    assert target.read_text() == "written by the passthrough test\n"
    assert [f.message for f in result.failures] == ["--skip-tags did not arrive"]
    assert result.diffs == []
