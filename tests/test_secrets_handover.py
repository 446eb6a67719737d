"""The secrets hand-over (hy3spark/runner.py, playbooks.py, logs.py) and the hy3spark_secret lookup, without Docker.

ansible-runner writes the child's whole environment to `artifacts/<id>/command`, so for the length of a run the
spec's secret variables leave this process's environment and reach the playbook in a 0600 file, in a 0700
directory outside the run's private data dir, deleted afterwards; the lookup reads it and refuses a file others can
read.

The runs here are real: `run_playbook` starts ansible-runner on a tiny playbook (localhost, connection local) that
reads both secrets through the real lookup plugin and compares them with their SHA-256. While the playbook waits on
a file, a watcher thread looks at the run from outside: the ansible-playbook processes' environment, the hand-over
file named there (mode, directory, place, content) and every command line on the machine. Then it lets the run go
on (or interrupts it as Ctrl+C would).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ansible.errors import AnsibleError
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import lookup_loader

from hy3spark.errors import Hy3SparkError
from hy3spark.runner import RunResult, run_playbook, secrets_handover

REPO = Path(__file__).resolve().parent.parent
LOOKUPS = REPO / "plugins" / "lookup"
NAMES = ["HF_TOKEN", "VLLM_API_KEY"]

PLAYBOOK = """\
- name: Read the secrets as the roles do
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Wait until the test has looked at this run from outside
      ansible.builtin.wait_for:
        path: "{{ go_file }}"
        timeout: 60
    - name: Check that the lookup hands over both secrets
      ansible.builtin.assert:
        that:
          - lookup('hy3spark.cluster.hy3spark_secret', 'HF_TOKEN') | hash('sha256') == hf_token_sha256
          - lookup('hy3spark.cluster.hy3spark_secret', 'VLLM_API_KEY') | hash('sha256') == api_key_sha256
      no_log: true
    - name: Fail when the test asks for a failed run
      ansible.builtin.fail:
        msg: this run fails on purpose
      when: fail_run | bool
"""


def fresh_secrets() -> dict[str, str]:
    # The API key ends in '=' as base64 keys do: the file's KEY=VALUE lines must keep it whole.
    return {"HF_TOKEN": f"hf_{secrets.token_hex(16)}", "VLLM_API_KEY": f"sk-{secrets.token_hex(16)}=="}


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def proc_read(pid: str, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            return fh.read()
    except OSError:  # gone in the meantime
        return b""


def pids_running(needle: str) -> list[str]:
    return [e.name for e in os.scandir("/proc") if e.name.isdigit() and needle.encode() in proc_read(e.name, "cmdline")]


@dataclass
class Seen:
    """What the watcher saw of a run while it waited."""

    environs: dict[str, dict[str, str]] = field(default_factory=dict)  # pid -> environment
    leaks: list[str] = field(default_factory=list)  # "pid N environ/cmdline: NAME"
    handover: Path | None = None
    file_mode: int | None = None
    file_uid: int | None = None
    dir_mode: int | None = None
    content: str | None = None
    error: BaseException | None = None


class Watcher(threading.Thread):
    """Finds the ansible-playbook processes of `playbook` and looks at them; then touches `go` (or sends this
    process SIGINT, as Ctrl+C in the terminal would)."""

    def __init__(self, playbook: Path, go: Path, values: dict[str, str], interrupt: bool = False) -> None:
        super().__init__(daemon=True)
        self.playbook, self.go, self.values, self.interrupt = playbook, go, values, interrupt
        self.seen = Seen()

    def run(self) -> None:
        try:
            self._look()
        except BaseException as exc:  # the test reports it (run_local asserts error is None)
            self.seen.error = exc
        finally:
            if self.interrupt and self.seen.error is None:
                os.kill(os.getpid(), signal.SIGINT)
            else:
                self.go.touch()

    def _look(self) -> None:
        deadline = time.monotonic() + 60
        pids = pids_running(str(self.playbook))
        while not pids:
            if time.monotonic() > deadline:
                raise AssertionError(f"no ansible-playbook process of {self.playbook} within 60 s")
            time.sleep(0.05)
            pids = pids_running(str(self.playbook))
        for pid in pids:
            raw = proc_read(pid, "environ")
            self.seen.environs[pid] = dict(v.partition("=")[::2] for v in raw.decode(errors="replace").split("\0") if v)
            self.seen.leaks += [f"pid {pid} environ: {n}" for n, v in self.values.items() if v.encode() in raw]
        for pid in (e.name for e in os.scandir("/proc") if e.name.isdigit()):
            cmdline = proc_read(pid, "cmdline")
            self.seen.leaks += [f"pid {pid} cmdline: {n}" for n, v in self.values.items() if v.encode() in cmdline]
        named = {env.get("HY3SPARK_SECRETS_FILE") for env in self.seen.environs.values()}
        assert len(named) == 1, f"the playbook's processes name these hand-over files: {named}"
        path = named.pop()
        if path:
            self.seen.handover = Path(path)
            st, dst = os.stat(path), os.stat(os.path.dirname(path))
            self.seen.file_mode, self.seen.file_uid = stat.S_IMODE(st.st_mode), st.st_uid
            self.seen.dir_mode = stat.S_IMODE(dst.st_mode)
            self.seen.content = Path(path).read_text()


@dataclass
class Run:
    result: RunResult | None
    seen: Seen
    values: dict[str, str]
    tmpdir: Path  # where tempfile puts the hand-over directory during the run
    environ_after: dict[str, str | None]


def run_local(tmp: Path, values: dict[str, str], *, fail_run: bool = False, interrupt: bool = False) -> Run:
    """One real run_playbook of PLAYBOOK with the secrets exported as a user exports them; tempfile's directory
    is `tmp/tmp` for the run, so whatever the hand-over leaves behind is there to find."""
    playbook, go, tmpdir = tmp / "handover.yml", tmp / "go", tmp / "tmp"
    playbook.write_text(PLAYBOOK)
    inventory = tmp / "hosts"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    tmpdir.mkdir()
    watcher = Watcher(playbook, go, values, interrupt=interrupt)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in values.items():
            mp.setenv(name, value)
        mp.setattr(tempfile, "tempdir", str(tmpdir))
        watcher.start()
        try:
            result = run_playbook(str(playbook), inventory, runs_dir=tmp / "runs", secret_names=NAMES,
                                  extravars={"go_file": str(go), "fail_run": fail_run,
                                             "hf_token_sha256": sha256(values["HF_TOKEN"]),
                                             "api_key_sha256": sha256(values["VLLM_API_KEY"])})
        finally:
            watcher.join(timeout=90)
        environ_after = {name: os.environ.get(name) for name in values}
    assert watcher.seen.error is None, watcher.seen.error
    return Run(result, watcher.seen, values, tmpdir, environ_after)


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_local(tmp_path_factory.mktemp("good"), fresh_secrets())


def artifact_files(result: RunResult) -> list[Path]:
    return [p for p in result.private_data_dir.rglob("*") if p.is_file()]


# --- a complete run --------------------------------------------------------------------------------------------------
def test_the_playbook_reads_both_secrets_through_the_lookup(good_run: Run) -> None:
    assert good_run.result is not None
    assert (good_run.result.status, good_run.result.rc, good_run.result.failures) == ("successful", 0, [])


def test_the_playbook_processes_have_no_secret_in_their_environment(good_run: Run) -> None:
    assert good_run.seen.environs, "the watcher found the ansible-playbook processes"
    for pid, env in good_run.seen.environs.items():
        assert not set(NAMES) & set(env), f"pid {pid} has {set(NAMES) & set(env)} in its environment"
        assert env["HY3SPARK_SECRETS_FILE"] == str(good_run.seen.handover)
    assert good_run.seen.leaks == []


def test_the_handover_file_is_0600_in_a_0700_directory_outside_the_run(good_run: Run) -> None:
    seen, result = good_run.seen, good_run.result
    assert result is not None and seen.handover is not None
    assert (seen.file_mode, seen.dir_mode, seen.file_uid) == (0o600, 0o700, os.getuid())
    assert seen.handover.parent.parent == good_run.tmpdir
    assert not seen.handover.is_relative_to(result.private_data_dir)
    assert seen.content == "".join(f"{name}={good_run.values[name]}\n" for name in NAMES)


def test_the_handover_file_and_its_directory_are_gone_after_the_run(good_run: Run) -> None:
    assert good_run.seen.handover is not None
    assert not good_run.seen.handover.exists()
    assert not good_run.seen.handover.parent.exists()
    assert list(good_run.tmpdir.iterdir()) == []


def test_no_artifact_of_the_run_holds_a_secret(good_run: Run) -> None:
    assert good_run.result is not None
    files = artifact_files(good_run.result)
    commands = [p for p in files if p.name == "command"]
    assert len(commands) == 1 and any(p.parent.name == "job_events" for p in files), files
    env = json.loads(commands[0].read_text())["env"]
    assert not set(NAMES) & set(env)
    assert env["HY3SPARK_SECRETS_FILE"] == str(good_run.seen.handover)
    leaks = [f"{p}: {n}" for p in files for n, v in good_run.values.items() if v.encode() in p.read_bytes()]
    assert leaks == []


def test_the_parent_environment_gets_the_secrets_back_after_the_run(good_run: Run) -> None:
    assert good_run.environ_after == good_run.values


# --- runs that end otherwise ---------------------------------------------------------------------------------------
def test_a_failed_run_deletes_the_file_and_restores_the_environment(tmp_path: Path) -> None:
    run = run_local(tmp_path, fresh_secrets(), fail_run=True)
    assert run.result is not None
    assert (run.result.status, [f.task for f in run.result.failures]) == ("failed", ["Fail when the test asks "
                                                                                     "for a failed run"])
    assert run.seen.handover is not None and run.seen.file_mode == 0o600
    assert not run.seen.handover.exists() and list(run.tmpdir.iterdir()) == []
    assert run.environ_after == run.values


def test_an_interrupted_run_deletes_the_file_and_restores_the_environment(tmp_path: Path) -> None:
    run = run_local(tmp_path, fresh_secrets(), interrupt=True)
    assert run.result is not None and run.result.status == "canceled"
    assert run.seen.handover is not None and run.seen.file_mode == 0o600
    assert not run.seen.handover.exists() and list(run.tmpdir.iterdir()) == []
    assert run.environ_after == run.values
    # ansible-runner stops reading; the ansible-playbook it signalled finishes the task under way (the wait) first.
    (tmp_path / "go").touch()
    deadline = time.monotonic() + 30
    while pids_running(str(tmp_path / "handover.yml")) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids_running(str(tmp_path / "handover.yml")):
        os.kill(int(pid), signal.SIGKILL)


def test_an_exception_during_a_run_deletes_the_file_and_restores_the_environment(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    values = fresh_secrets()
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "hosts").write_text("localhost ansible_connection=local\n")
    # ansible-runner writes the extra vars as JSON inside the hand-over: a Path there raises in the middle of it.
    with pytest.raises(TypeError, match="not JSON serializable"):
        run_playbook(str(tmp_path / "none.yml"), tmp_path / "hosts", runs_dir=tmp_path / "runs", secret_names=NAMES,
                     extravars={"where": tmp_path})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hosts", "runs"]
    assert {name: os.environ.get(name) for name in values} == values


def test_an_exception_inside_the_handover_deletes_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = fresh_secrets()
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError, match="boom"), secrets_handover(NAMES) as handover:
        path = Path(handover["HY3SPARK_SECRETS_FILE"])
        assert [n for n in NAMES if n in os.environ] == []
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        raise RuntimeError("boom")
    assert not path.exists() and list(tmp_path.iterdir()) == []
    assert {name: os.environ.get(name) for name in values} == values


def test_a_multi_line_secret_is_refused_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"HF_TOKEN": f"hf_{secrets.token_hex(16)}", "VLLM_API_KEY": f"sk-{secrets.token_hex(8)}\nsecond-line"}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "pb.yml").write_text(PLAYBOOK)
    (tmp_path / "hosts").write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    with pytest.raises(Hy3SparkError) as info:
        run_playbook(str(tmp_path / "pb.yml"), tmp_path / "hosts", runs_dir=tmp_path / "runs", secret_names=NAMES,
                     extravars={"go_file": str(tmp_path / "pb.yml"), "fail_run": False,
                                "hf_token_sha256": "", "api_key_sha256": ""})
    assert str(info.value) == "VLLM_API_KEY contains a newline; a secret must be one line"
    assert list((tmp_path / "tmp").iterdir()) == []
    assert list((tmp_path / "runs").rglob("artifacts")) == [], "no playbook ran"
    assert {name: os.environ.get(name) for name in values} == values


# --- hy3spark logs: its ad-hoc ansible-runner call --------------------------------------------------------------------
SPEC = """\
name: handover
profile: hy3-295b-nvfp4-tp2
head:
  name: spark-a
  fabric_ip: 10.0.0.1/24
  ssh_host: 127.0.0.1
workers:
  - name: spark-b
    fabric_ip: 10.0.0.2/24
    ssh_host: 127.0.0.2
fabric:
  interfaces: [enp1s0f1np1]
  hcas: [rocep1s0f1, roceP2p1s0f1]
"""


def test_reading_the_serve_log_keeps_the_secrets_out_of_its_artifacts(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`hy3spark logs` runs ansible-runner itself: the secrets leave the environment for that run too. Nothing
    answers SSH on 127.0.0.1 here, so the read fails; its artifacts are written all the same."""
    from hy3spark.logs import ServeLog
    from hy3spark.playbooks import secret_names
    from hy3spark.spec import parse_spec

    values = fresh_secrets()
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    # A venv that was never activated: the run must still find this venv's `ansible` (runner.ansible_envvars).
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    loaded = parse_spec(SPEC, "cluster.yml")
    assert secret_names(loaded) == NAMES
    log = ServeLog(loaded, tmp_path)
    # It got as far as SSH: ansible itself ran (not "ansible-runner failed (rc 127)", a command not found).
    with pytest.raises(Hy3SparkError, match=re.escape("cannot read /var/log/hy3spark/serve.log on spark-a: Task "
                                                      "failed: Failed to connect to the host via ssh")):
        log.read(None, 10, threading.Event())
    files = [p for p in log.private.rglob("*") if p.is_file()]
    commands = [p for p in files if p.name == "command"]
    assert len(commands) == 1
    assert not set(NAMES) & set(json.loads(commands[0].read_text())["env"])
    assert [f"{p}: {n}" for p in files for n, v in values.items() if v.encode() in p.read_bytes()] == []
    assert {name: os.environ.get(name) for name in values} == values


# --- the lookup ------------------------------------------------------------------------------------------------------
@pytest.fixture
def lookup(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The plugin as Ansible's plugin loader loads it (its options defined from its DOCUMENTATION), with no secret
    in the environment."""
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    lookup_loader.add_directory(str(LOOKUPS))
    plugin = lookup_loader.get("hy3spark_secret", loader=DataLoader(), templar=None)
    assert plugin is not None and Path(plugin._original_path).parent == LOOKUPS
    yield plugin


def secrets_file(tmp_path: Path, mode: int, monkeypatch: pytest.MonkeyPatch, values: dict[str, str]) -> Path:
    path = tmp_path / "secrets.env"
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    path.chmod(mode)
    monkeypatch.setenv("HY3SPARK_SECRETS_FILE", str(path))
    return path


def test_the_lookup_reads_a_0600_file(lookup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = fresh_secrets()
    secrets_file(tmp_path, 0o600, monkeypatch, values)
    assert lookup.run(["VLLM_API_KEY", "HF_TOKEN"], variables={}) == [values["VLLM_API_KEY"], values["HF_TOKEN"]]
    assert lookup.run(["NOT_THERE"], variables={}) == [""]
    with pytest.raises(AnsibleError, match=re.escape("the secret NOT_THERE is not set: export NOT_THERE=...")):
        lookup.run(["NOT_THERE"], variables={}, required=True)


def test_the_exported_variable_wins_over_the_file(lookup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secrets_file(tmp_path, 0o600, monkeypatch, {"HF_TOKEN": "from-the-file"})
    monkeypatch.setenv("HF_TOKEN", "exported")
    assert lookup.run(["HF_TOKEN"], variables={}) == ["exported"]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o620], ids=lambda mode: f"{mode:04o}")
def test_the_lookup_refuses_a_file_others_can_read_or_write(lookup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            mode: int) -> None:
    values = fresh_secrets()
    path = secrets_file(tmp_path, mode, monkeypatch, values)
    with pytest.raises(AnsibleError) as info:
        lookup.run(["HF_TOKEN"], variables={})
    assert f"{path} is readable by others (mode {mode:04o}); it must be 0600" in str(info.value)
    assert values["HF_TOKEN"] not in str(info.value)


def test_a_playbook_run_stops_at_a_readable_file_naming_its_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """The same refusal as a user meets it: `ansible` on localhost, the lookup by its full name from the checkout's
    collection."""
    values = fresh_secrets()
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    path = secrets_file(tmp_path, 0o644, monkeypatch, values)
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "ANSIBLE_NOCOLOR": "1"}
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible"), "localhost", "-i", "localhost,", "-c", "local",
                           "-e", f"ansible_python_interpreter={sys.executable}",
                           "-m", "ansible.builtin.debug",
                           "-a", "msg={{ lookup('hy3spark.cluster.hy3spark_secret', 'HF_TOKEN') }}"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert f"{path} is readable by others (mode 0644); it must be 0600" in proc.stdout + proc.stderr
    assert values["HF_TOKEN"] not in proc.stdout + proc.stderr


# --- what the hand-over and the lookup do at their edges -------------------------------------------------------------
def test_a_secret_the_user_did_not_export_is_left_out_of_the_file(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster without an API key: only HF_TOKEN is handed over, and VLLM_API_KEY stays unset afterwards."""
    token = f"hf_{secrets.token_hex(16)}"
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with secrets_handover(NAMES) as handover:
        path = Path(handover["HY3SPARK_SECRETS_FILE"])
        assert [n for n in NAMES if n in os.environ] == []
        assert path.read_text() == f"HF_TOKEN={token}\n"
    assert (os.environ.get("HF_TOKEN"), os.environ.get("VLLM_API_KEY")) == (token, None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", [0o601, 0o610, 0o602, 0o606], ids=lambda mode: f"{mode:04o}")
def test_the_lookup_refuses_any_permission_for_group_or_others(lookup, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch, mode: int) -> None:
    values = fresh_secrets()
    path = secrets_file(tmp_path, mode, monkeypatch, values)
    with pytest.raises(AnsibleError) as info:
        lookup.run(["HF_TOKEN"], variables={})
    assert f"{path} is readable by others (mode {mode:04o}); it must be 0600" in str(info.value)



def test_a_handover_file_that_cannot_be_created_reports_why_and_leaves_nothing(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    """The file's creation fails (here: no file descriptor left): that error reaches the user, the directory goes,
    and the secrets are back in the environment."""
    values = fresh_secrets()
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real_open = os.open

    def no_descriptor_left(path: str | os.PathLike[str], flags: int, mode: int = 0o777) -> int:
        if Path(path).name == "secrets.env":
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_descriptor_left)
    with pytest.raises(OSError) as info, secrets_handover(NAMES):
        pass
    assert info.value.errno == errno.EMFILE
    assert list(tmp_path.iterdir()) == []
    assert {name: os.environ.get(name) for name in values} == values
