"""Run hy3spark's playbooks through ansible-runner: progress, one-screen failure summaries, no secret on disk.

Secrets: ansible-runner copies the child's whole environment into `artifacts/<id>/command` (and `env/envvars` if
given). So for the length of a run the secret variables the spec names are taken OUT of this process's
environment and handed to the playbook in a 0600 file (in a 0700 directory outside the private data dir, deleted
afterwards) that the `hy3spark_secret` lookup reads. Each run gets a fresh private data dir of mode 0700.

Signals: given no cancel_callback, ansible_runner.run installs SIGINT/SIGTERM handlers of its own and never puts
the old ones back, so after one run Ctrl+C no longer reached this program. Every run here passes a callback
instead (`interruptible`): Ctrl+C stops the child and the run ends as 'canceled', exit code 130.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import shlex
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hy3spark import content
from hy3spark.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, Hy3SparkError

EXIT_INTERRUPTED = 130  # what a shell reports for Ctrl+C; hy3spark.cli.main returns the same
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # Ray colours the lines it forwards from workers
# A report task: `debug` whose name starts so (the preflight table, teardown's memory lines).
_REPORT_PREFIXES = ("Print ", "Report ")
_MESSAGE_HEAD, _MESSAGE_TAIL = 2, 14  # a long failure message: its first lines say what, its last lines why


def ansible_envvars() -> dict[str, str]:
    """What every ansible-runner run of ours needs: hy3spark's config, roles and collection (from the wheel or the
    checkout, hy3spark.content says which; named here too, so that a user's ANSIBLE_ROLES_PATH or
    ANSIBLE_COLLECTIONS_PATH cannot swap our roles or plugins for others: the roles call the plugins by full name,
    hy3spark.cluster.*, and the other collections they use come with the `ansible` package on ansible-core's own
    sys.path), plain output, a UTF-8 locale (ansible refuses LC_ALL=C), and this interpreter's bin directory first
    on PATH, so that a `hy3spark` run from a venv that was never activated still finds that venv's
    `ansible-playbook` and `ansible`."""
    return {
        "ANSIBLE_CONFIG": str(content.path("ansible.cfg")),
        "ANSIBLE_ROLES_PATH": str(content.path("roles")),
        "ANSIBLE_COLLECTIONS_PATH": str(content.collections()),
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_NOCOLOR": "1",
        "LC_ALL": "C.UTF-8",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


@dataclass
class Failure:
    host: str
    task: str
    message: str
    tail: list[str] = field(default_factory=list)
    unreachable: bool = False
    play: str = ""


@dataclass
class Report:
    """What a report task printed (the preflight table, teardown's memory lines): shown to the user as is."""

    play: str
    host: str
    task: str
    text: str


@dataclass
class RunResult:
    playbook: str
    status: str
    rc: int
    private_data_dir: Path
    failures: list[Failure]
    stats: dict[str, Any]
    phases: dict[str, float]
    duration_s: float
    results: dict[str, dict[str, Any]]  # host -> last result of each task named "Report ..." (collected facts)
    reports: list[Report] = field(default_factory=list)
    diffs: list[str] = field(default_factory=list)  # with diff=True: one unified diff per changed result

    @property
    def exit_code(self) -> int:
        if self.rc == 0 and self.status == "successful":
            return EXIT_OK
        if self.status == "canceled":
            return EXIT_INTERRUPTED
        if any(f.unreachable for f in self.failures):
            return EXIT_UNREACHABLE
        return EXIT_FAILED


@contextlib.contextmanager
def interruptible() -> Iterator[threading.Event]:
    """SIGINT and SIGTERM set the event (ansible-runner's cancel_callback) instead of raising mid-run."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(_signum: int, _frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def environ_without(names: list[str]) -> Iterator[dict[str, str]]:
    """Take the named variables out of os.environ (ansible-runner writes it to disk); put them back afterwards."""
    saved = {n: os.environ.pop(n) for n in names if n and n in os.environ}
    try:
        yield saved
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def secrets_handover(names: list[str]) -> Iterator[dict[str, str]]:
    """Move the named variables out of os.environ into a 0600 file; restore everything afterwards."""
    with environ_without(names) as saved, _handover_file(saved) as path:
        yield {"HY3SPARK_SECRETS_FILE": str(path)}


@contextlib.contextmanager
def _handover_file(saved: dict[str, str]) -> Iterator[Path]:
    for key, value in saved.items():
        if "\n" in value:
            raise Hy3SparkError(f"{key} contains a newline; a secret must be one line")
    tmpdir = tempfile.mkdtemp(prefix="hy3spark-secrets-")  # mkdtemp makes it 0700
    path = Path(tmpdir) / "secrets.env"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.writelines(f"{key}={value}\n" for key, value in saved.items())
        yield path
    finally:
        path.unlink(missing_ok=True)
        os.rmdir(tmpdir)


class Progress:
    """Per host and task: a live rich table on a terminal, plain lines otherwise."""

    def __init__(self, title: str, stream: Any = None, live: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.live_enabled = self.stream.isatty() if live is None else live
        self.title = title
        self.hosts: dict[str, dict[str, Any]] = {}
        self.task = ""
        self._live = None

    def __enter__(self) -> Progress:
        if self.live_enabled:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._table(), console=Console(file=self.stream), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(*exc)

    def _table(self) -> Any:
        from rich.table import Table

        table = Table(title=f"{self.title}: {self.task}", expand=False)
        for col in ("host", "last task", "ok", "changed", "failed", "skipped"):
            table.add_column(col)
        for host, st in sorted(self.hosts.items()):
            table.add_row(host, st["task"], str(st["ok"]), str(st["changed"]), str(st["failed"]), str(st["skipped"]))
        return table

    def _line(self, text: str) -> None:
        if not self.live_enabled:
            print(text, file=self.stream, flush=True)

    def event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event", "")
        data = ev.get("event_data", {})
        if kind == "playbook_on_play_start":
            self._line(f"PLAY {data.get('play', '')}")
        elif kind == "playbook_on_task_start":
            self.task = data.get("task", "")
        elif kind.startswith("runner_on_") and kind != "runner_on_start":
            host = data.get("host", "?")
            st = self.hosts.setdefault(host, {"task": "", "ok": 0, "changed": 0, "failed": 0, "skipped": 0})
            st["task"] = data.get("task", "")
            res = data.get("res", {}) if isinstance(data.get("res"), dict) else {}
            if kind == "runner_on_ok":
                st["changed" if res.get("changed") else "ok"] += 1
                status = "changed" if res.get("changed") else "ok"
            elif kind == "runner_on_skipped":
                st["skipped"] += 1
                status = "skipped"
            elif kind in ("runner_on_failed", "runner_on_unreachable"):
                ignored = data.get("ignore_errors")
                unreachable = kind.endswith("unreachable")
                status = "failed (ignored)" if ignored else ("UNREACHABLE" if unreachable else "FAILED")
                if not ignored:
                    st["failed"] += 1
            else:
                return
            self._line(f"  {host:<20} {status:<9} {data.get('task', '')}")
        if self._live is not None:
            self._live.update(self._table())


def plain(text: str) -> str:
    return _ANSI.sub("", text)


def _message(res: dict[str, Any]) -> tuple[str, list[str]]:
    msg = plain(str(res.get("msg") or res.get("reason") or "")).strip()
    tail: list[str] = []
    for key in ("stderr_lines", "stdout_lines"):
        lines = res.get(key) or []
        if lines:
            tail = [plain(str(x)) for x in lines[-15:]]
            break
    if not msg and tail:
        msg = tail[-1]
    return msg or "failed (no message)", tail


def _diff_text(host: str, task: str, diff: Any) -> str:
    """A result's diff (ansible's before/after or prepared text) as one unified diff under a `host: task` line."""
    parts = [f"{host}: {task}"]
    for d in diff if isinstance(diff, list) else [diff]:
        if not isinstance(d, dict):
            continue
        if d.get("prepared"):
            parts.append(str(d["prepared"]).rstrip("\n"))
            continue
        before, after = ("".join(f"{k}: {v}\n" for k, v in x.items()) if isinstance(x, dict) else str(x or "")
                         for x in (d.get("before"), d.get("after")))
        lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                     fromfile=f"before: {d.get('before_header', '')}".rstrip(),
                                     tofile=f"after: {d.get('after_header', '')}".rstrip())
        parts.append("".join(x if x.endswith("\n") else x + "\n" for x in lines).rstrip("\n"))
    return "\n".join(x for x in parts if x) + "\n"


def run_playbook(
    playbook: str,
    inventory: Path,
    *,
    runs_dir: Path,
    secret_names: list[str],
    tags: str | None = None,
    limit: str | None = None,
    check: bool = False,
    diff: bool = False,
    extravars: dict[str, Any] | None = None,
    progress: Progress | None = None,
    extra_args: list[str] | None = None,  # to ansible-playbook as given (hy3spark.playbooks checks them first)
) -> RunResult:
    import ansible_runner

    runs_dir.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix=time.strftime("run-%Y%m%d-%H%M%S-"), dir=runs_dir))  # 0700
    cmdline = list(extra_args or [])
    if check:
        cmdline.append("--check")
    if diff:
        cmdline.append("--diff")
    failures: list[Failure] = []
    results: dict[str, dict[str, Any]] = {}
    reports: list[Report] = []
    diffs: list[str] = []
    play_starts: list[tuple[str, float]] = []
    # Plays in which a task ran on some host. A play whose every task was skipped (the launcher the spec did not
    # choose, in site.yml) is not a phase of the run; the drift check's own argument validation does not count.
    ran: set[str] = set()

    def on_event(ev: dict[str, Any]) -> bool:
        kind = ev.get("event", "")
        data = ev.get("event_data", {})
        play = data.get("play", "")
        if kind == "playbook_on_play_start":
            play_starts.append((play, time.monotonic()))
        if (kind in ("runner_on_ok", "runner_on_failed", "runner_on_unreachable")
                and not str(data.get("task", "")).startswith("Validating arguments against arg spec")):
            ran.add(play)
        res = data.get("res", {}) if isinstance(data.get("res"), dict) else {}
        if kind in ("runner_on_failed", "runner_on_unreachable") and not data.get("ignore_errors"):
            msg, tail = _message(res)
            failures.append(Failure(data.get("host", "?"), data.get("task", "?"), msg, tail,
                                    unreachable=kind == "runner_on_unreachable", play=play))
        if kind == "runner_on_ok":
            task = str(data.get("task", ""))
            if task.startswith("Report "):
                for key, value in res.items():
                    if key.startswith("hy3spark_report"):
                        results.setdefault(data.get("host", "?"), {})[key] = value
            if (task.startswith(_REPORT_PREFIXES) and str(data.get("task_action", "")).endswith("debug")
                    and isinstance(res.get("msg"), str)):
                reports.append(Report(play, data.get("host", "?"), task, plain(res["msg"]).rstrip("\n")))
            if diff and res.get("changed") and res.get("diff"):
                diffs.append(_diff_text(data.get("host", "?"), task, res["diff"]))
        if progress is not None:
            progress.event(ev)
        return True  # keep the event in the artifacts (job_events), as ansible-runner does by default

    start = time.monotonic()
    with secrets_handover(secret_names) as handover, interruptible() as stop:
        envvars = {**ansible_envvars(), **handover}
        runner = ansible_runner.run(
            private_data_dir=str(private),
            project_dir=str(content.root()),
            playbook=str(content.path(playbook)),
            inventory=str(inventory),
            envvars=envvars,
            extravars=extravars or {},
            tags=tags,
            limit=limit,
            cmdline=shlex.join(cmdline) or None,
            event_handler=on_event,
            cancel_callback=stop.is_set,
            quiet=True,
        )
    end = time.monotonic()
    phases: dict[str, float] = {}
    for i, (name, t0) in enumerate(play_starts):
        t1 = play_starts[i + 1][1] if i + 1 < len(play_starts) else end
        if name in ran:
            phases[name] = round(phases.get(name, 0.0) + (t1 - t0), 2)
    return RunResult(playbook, runner.status, runner.rc, private, failures, runner.stats or {}, phases,
                     round(end - start, 2), results, reports, diffs)


def _clip(message: str) -> list[str]:
    """A long message (a log tail under a headline) keeps its first lines and its last ones, where the cause is."""
    lines = message.splitlines()
    if len(lines) <= _MESSAGE_HEAD + _MESSAGE_TAIL + 1:
        return lines
    cut = len(lines) - _MESSAGE_HEAD - _MESSAGE_TAIL
    return [*lines[:_MESSAGE_HEAD], f"  ... {cut} lines cut (all of them are in the full log) ...",
            *lines[-_MESSAGE_TAIL:]]


def failure_summary(result: RunResult) -> str:
    """One screen: which host, which step, why, and the relevant log tail."""
    if result.status == "canceled":
        return (f"interrupted: {result.playbook} was stopped after {result.duration_s:.0f} s; tasks that had "
                f"started may have changed a node half-way (run it again to converge)\n"
                f"  full log: {result.private_data_dir}/artifacts/*/stdout")
    lines = [f"{result.playbook} failed (rc {result.rc}, status {result.status}) after {result.duration_s:.0f} s"]
    # The report a failing check refers to ("see the report above"), once per play that failed.
    failed_plays = {f.play for f in result.failures}
    shown: set[str] = set()
    for report in result.reports:
        if report.play in failed_plays and report.text not in shown:
            shown.add(report.text)
            lines.append(report.text)
    for f in result.failures[:8]:
        kind = "UNREACHABLE" if f.unreachable else "FAILED"
        lines.append(f"  {kind} host {f.host}, task '{f.task}':")
        lines.extend(f"      {line}" for line in _clip(f.message))
        if f.tail and f.tail[-1] not in f.message:
            lines.append("    log tail:")
            lines.extend(f"      {line}" for line in f.tail[-10:])
    if len(result.failures) > 8:
        lines.append(f"  ... and {len(result.failures) - 8} more failures")
    if not result.failures:
        lines.append("  no task failed: ansible-playbook itself stopped (syntax or inventory error); artifacts in "
                     f"{result.private_data_dir}/artifacts")
    lines.append(f"  full log: {result.private_data_dir}/artifacts/*/stdout")
    return "\n".join(lines)
