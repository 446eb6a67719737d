"""hy3spark's engine supervisor (docs/restarts.md): keeps the engine serving after crashes and reboots, without
starving the node. Runs on the head's host as hy3spark-supervisor.service, standard library only (Python >= 3.10).

  run CONFIG      watch the engine; when it is gone, start it again once the launcher's gate says a start can succeed
  state CONFIG    print what it did last (its state file), or {"state": "none"}

CONFIG (templates/supervisor.json.j2) names where the engine lives (`exec`: the argv prefix that runs a command in
the head's container, [] to run it here), engine.py (status, pids, stop, wait: piped to `<exec> python3 -`), the
launcher's gate (ready.py: one JSON line {"ok", "why"}; null: always ready), the serve script and the secrets file it
reads on stdin (opened here, never read into an argv, a log or the state), and the budget: after `max_failed_starts`
failed starts within `window_s` it gives up, exits 0 (systemd leaves it stopped) and says why in the state file.

A failed start: not healthy within health_timeout_s (the engine exited, or was still loading), or dead within stable_s
of becoming healthy. Waiting for the gate costs no budget: a worker away for an hour is waited for.
SIGTERM/SIGINT: stop supervising and leave the engine as it is (Ansible stops engines). SIGHUP: read CONFIG again.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

EVENTS_KEPT = 20
PROBE_TIMEOUT_S = 60
# A secret's value shorter than this is no credential, and blanking it would garble every line it occurs in.
SECRET_MIN_CHARS = 8
HIDDEN = "<secret>"


class Stop(Exception):
    """SIGTERM or SIGINT: leave the loop, the engine as it is."""


class Supervisor:
    def __init__(self, config_path: str) -> None:
        self.config_path = config_path
        self.config: dict[str, Any] = {}
        self.load()
        self.state = self._carried_state()
        self.secrets = _secret_values(self.config.get("secrets"))
        # Failed starts since an engine last stayed up stable_s: what the back-off grows with.
        self.consecutive = len(self.state["failed_starts"])
        self.stopping = False
        self.reload = False
        # A signal handler runs between any two bytecodes, also while the main thread holds a lock (a threading.Event's
        # set() would then deadlock), so it only sets a flag and writes a byte here, which sleep() selects on.
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)

    # --- config, state ------------------------------------------------------------------------------------------

    def load(self) -> None:
        with open(self.config_path) as f:
            self.config = json.load(f)

    def _carried_state(self) -> dict[str, Any]:
        """The budget carries over a restart of the supervisor itself, unless it had given up or been stopped:
        then an operator (or a reboot) started it again, and it starts with a full budget."""
        state: dict[str, Any] = {"state": "starting-up", "since": _now(), "cause": "", "pid": None, "starts": 0,
                                 "restarts": 0, "failed_starts": [], "events": []}
        try:
            with open(self.config["state_file"]) as f:
                old = json.load(f)
        except (OSError, ValueError):
            return state
        if old.get("state") not in ("gave-up", "stopped"):
            for key in ("starts", "restarts", "failed_starts"):
                state[key] = old.get(key, state[key])
        state["events"] = list(old.get("events", []))[-EVENTS_KEPT:]
        return state

    def set_state(self, what: str, cause: str = "", **fields: Any) -> None:
        cause = self.hide(cause)
        changed = self.state["state"] != what or self.state.get("cause") != cause
        self.state.update(fields, state=what, cause=cause)
        if changed:
            self.state["since"] = _now()
        self.save()

    def event(self, text: str) -> None:
        text = self.hide(text)
        print(text, flush=True)
        self.state["events"] = [*self.state["events"], {"at": _now(), "event": text}][-EVENTS_KEPT:]
        self.save()

    def save(self) -> None:
        window = float(self.config["window_s"])
        self.state["failed_starts"] = [f for f in self.state["failed_starts"] if f["at"] > time.time() - window]
        _write_json(self.config["state_file"], self.state, 0o644)

    def hide(self, text: str) -> str:
        """The text without the secrets' values: an engine's last log line or a script's error may quote one."""
        for value in self.secrets:
            text = text.replace(value, HIDDEN)
        return text

    # --- signals, sleeping ----------------------------------------------------------------------------------------

    def on_signal(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGHUP:
            self.reload = True
        else:
            self.stopping = True
        with contextlib.suppress(BlockingIOError):  # the pipe is full of wake-ups already
            os.write(self.wake_w, b"!")

    def sleep(self, seconds: float) -> None:
        """Sleep, but wake at once for a signal."""
        if select.select([self.wake_r], [], [], seconds)[0]:
            os.read(self.wake_r, 4096)
        self.check_signals()

    def check_signals(self) -> None:
        if self.stopping:
            raise Stop
        if self.reload:
            self.reload = False
            try:
                self.load()
            except (OSError, ValueError) as exc:
                self.event(f"kept the config it had: cannot read {self.config_path}: {exc}")
            else:
                self.event(f"read {self.config_path} again")

    # --- what runs where the engine lives -------------------------------------------------------------------------

    def _run(self, argv: list[str], stdin: Any, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run where the engine lives; a stop signal ends the wait (and the child) within a fraction of a second."""
        cmd = [*self.config["exec"], *argv]
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace")
        deadline = time.monotonic() + timeout
        while True:
            try:
                out, err = proc.communicate(timeout=0.2)
                return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                if self.stopping or time.monotonic() >= deadline:
                    proc.kill()
                    proc.communicate()
                    if self.stopping:
                        raise Stop from None
                    raise

    def script(self, path: str, *args: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[dict[str, Any] | None, str]:
        """Pipe a script to `<exec> python3 - ARGS`: (its last JSON line, or None with why it gave none: the exec
        prefix's own error, such as a container that is not running)."""
        try:
            with open(path) as f:
                proc = self._run([self.config.get("python", "python3"), "-", *args], f, timeout)
        except subprocess.TimeoutExpired:
            return None, f"{os.path.basename(path)} {args[0] if args else ''} did not answer within {timeout:.0f} s"
        except OSError as exc:
            return None, f"cannot run {path}: {exc}"
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not lines:
            said = proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [f"exit {proc.returncode}"]
            return None, said[-1][:300]
        return json.loads(lines[-1]), ""

    def engine(self, command: str, *args: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[dict[str, Any] | None, str]:
        return self.script(self.config["engine_py"], command, self.config["script"], *args, timeout=timeout)

    def status(self) -> tuple[dict[str, Any] | None, str]:
        return self.engine("status", self.config["health_url"], self.config["log"])

    def pids(self) -> tuple[dict[str, Any] | None, str]:
        """Whether the engine's processes are there, without a /health request (the engine logs each one)."""
        return self.engine("pids")

    def stop_engine(self) -> None:
        report, why = self.engine("stop", str(self.config["stop_timeout_s"]),
                                  timeout=float(self.config["stop_timeout_s"]) + PROBE_TIMEOUT_S)
        if report and report.get("stopped"):
            self.event(f"stopped what was left of the engine: PIDs {report['stopped']}"
                       + (f" (killed {report['killed']})" if report.get("killed") else ""))
        elif report is None:
            self.event(f"could not stop what was left of the engine: {why}")

    # --- the loop -------------------------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self.set_state("starting-up", "looking for a running engine")
            report, _ = self.status()
            adopted = bool(report and report.get("alive"))
            if report and adopted:
                self.event(f"found the engine running (PID {report['pid']}): watching it")
                if report.get("healthy"):
                    self.serving(int(report["pid"]))
                else:
                    self.set_state("starting", "found it running, not answering /health yet", pid=report["pid"])
            while True:
                if not adopted and not self.start_cycle():
                    return 0
                cause = self.watch(adopted)
                adopted = False
                if cause and self.failed(cause):
                    return 0
        except Stop:
            self.set_state("stopped", "stopped by a signal (systemctl stop); the engine is left as it is")
            self.event("stopped; the engine is left as it is")
            return 0

    def serving(self, pid: int) -> None:
        # The run record first: whoever reads the state "serving" with this PID (an Ansible run, a test) finds the
        # record naming the same PID, never the one before it.
        self.record_pid(pid)
        self.set_state("serving", "", pid=pid)

    def watch(self, adopted: bool = False) -> str:
        """Until the engine is gone, or stopped for failing /health: count a restart and return why that was a failed
        start, or "" when it was not. An engine found serving counts as up for longer than stable_s; one found
        loading gets health_timeout_s, as a start of this supervisor's does."""
        poll, every = float(self.config["poll_s"]), float(self.config["health_every_s"])
        stable, unhealthy = float(self.config["stable_s"]), float(self.config["unhealthy_s"])
        timeout = float(self.config["health_timeout_s"])
        pid = self.state.get("pid")
        watched_since = time.monotonic()
        healthy_since: float | None = None
        if self.state["state"] == "serving":
            healthy_since = watched_since - stable if adopted else watched_since
        failing_since: float | None = None
        next_health = watched_since + every
        while True:
            self.sleep(poll)
            # The processes every poll_s; /health every health_every_s only, unless it is failing or not answering
            # yet: the engine logs each request, and a serve log full of health checks hides what an operator reads.
            due = healthy_since is None or failing_since is not None or time.monotonic() >= next_health
            probe = self.status if due else self.pids
            report, why = probe()
            if report is None:  # the exec prefix failed (docker, the container): once more before calling it gone
                self.sleep(poll)
                report, why = probe()
            if report is not None and "healthy" not in report:  # the processes only
                if report.get("alive"):
                    continue
                report, why = self.status()  # gone: read once more, in full, before acting on it
            now = time.monotonic()
            next_health = now + every
            if report is None or not report.get("alive"):
                self.state["restarts"] = int(self.state.get("restarts", 0)) + 1
                self.event(f"engine gone (PID {pid}): {why}" if report is None else f"engine exited (PID {pid})")
                self.set_state("waiting", why or "the engine exited", pid=None)
                said = self.last_log_line() or why or "the engine exited"
                if healthy_since is None:
                    return said
                up = now - healthy_since
                return f"died {up:.0f} s after it became healthy: {said}" if up < stable else ""
            if report.get("healthy"):
                failing_since = None
                if healthy_since is None:
                    healthy_since = now
                    self.event(f"serving (PID {report['pid']}) after {now - watched_since:.0f} s")
                if report.get("pid") != pid or self.state["state"] != "serving":
                    pid = report["pid"]  # a start of the engine's own (a second process took the lead)
                    self.serving(int(pid))
                if now - healthy_since >= stable:
                    self.consecutive = 0
                continue
            failing_since = failing_since or now
            if healthy_since is not None and now - failing_since >= unhealthy:
                cause = ""
                self.event(f"engine (PID {pid}) alive but /health failing for {unhealthy:g} s "
                           f"({report.get('health')}): stopping it")
            elif healthy_since is None and now - watched_since >= timeout:
                cause = f"did not answer /health within {timeout:g} s"
                self.event(f"engine (PID {pid}) {cause}: stopping it")
            else:
                continue
            self.state["restarts"] = int(self.state.get("restarts", 0)) + 1
            self.stop_engine()
            self.set_state("waiting", "the engine stopped answering /health", pid=None)
            return cause

    def start_cycle(self) -> bool:
        """Gate, start, wait for /health, until the engine serves (True) or the budget is spent (False)."""
        while True:
            self.wait_for_gate()
            cause = self.start()
            if not cause:
                return True
            if self.failed(cause):
                return False

    def wait_for_gate(self) -> None:
        said = None
        while True:
            self.check_signals()
            report, why = self.pids()
            if report is not None and report.get("alive"):
                # An engine process is left (a previous engine's, or one that did not die): never two at once.
                self.event(f"an engine process is still running (PIDs {report.get('pids')}): stopping it first")
                self.stop_engine()
                self.sleep(float(self.config["poll_s"]))
                continue
            if report is None:
                ok, why = False, f"cannot look for the engine: {why}"
            elif self.config.get("ready_py"):
                gate, err = self.script(self.config["ready_py"], *self.config.get("ready_args", []))
                ok, why = (bool(gate.get("ok")), str(gate.get("why") or "")) if gate else (False, err)
            else:
                ok, why = True, ""
            if ok:
                return
            if why != said:
                self.event(f"waiting: {why}")
                said = why
            self.set_state("waiting", why)
            self.sleep(float(self.config["poll_s"]))

    def start(self) -> str:
        """Start the engine and wait for /health: "" when it serves, else why the start failed (what it left is
        stopped)."""
        self.set_state("starting", "", pid=None)
        self.event("starting the engine")
        started = time.monotonic()
        cause = self.launch()
        if not cause:
            timeout = float(self.config["health_timeout_s"])
            report, why = self.engine("wait", self.config["health_url"], f"{timeout:g}", self.config["log"],
                                      str(self.config["log_lines"]), str(self.config["appear_s"]),
                                      timeout=timeout + PROBE_TIMEOUT_S)
            if report and report.get("healthy"):
                self.state["starts"] = int(self.state.get("starts", 0)) + 1
                self.event(f"serving (PID {report['pid']}) after {time.monotonic() - started:.0f} s")
                self.serving(int(report["pid"]))
                return ""
            if report is None:
                cause = why
            elif report.get("alive"):
                cause = f"did not answer /health within {timeout:g} s"
            else:
                tail = [x.strip() for x in report.get("log_tail", []) if x.strip()]
                cause = tail[-1][:300] if tail else "the engine exited"
        self.stop_engine()
        return cause

    def launch(self) -> str:
        """Run the serve script, which detaches the engine and returns: "" when it did, else why not."""
        path = self.config.get("secrets")
        self.secrets = _secret_values(path)  # Ansible may have written new ones since
        try:
            with open(path if path and os.path.exists(path) else os.devnull, "rb") as stdin:
                proc = self._run([self.config["script"]], stdin, PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"the serve script did not return within {PROBE_TIMEOUT_S} s"
        except OSError as exc:
            return f"cannot run the serve script: {exc}"
        if proc.returncode != 0:
            said = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
            return f"the serve script failed: {said[-1][:300]}"
        return ""

    def failed(self, cause: str) -> bool:
        """Count a failed start and back off. True when the budget is spent: the supervisor has given up."""
        cause = self.hide(cause)
        self.consecutive += 1
        self.state["failed_starts"] = [*self.state["failed_starts"], {"at": time.time(), "cause": cause}]
        self.save()
        count, limit = len(self.state["failed_starts"]), int(self.config["max_failed_starts"])
        window = f"{float(self.config['window_s']) / 60:g} min"
        self.event(f"failed start {count} of {limit} in {window}: {cause}")
        if count >= limit:
            self.set_state("gave-up", f"gave up after {count} starts in {window}: {cause}", pid=None)
            self.event(self.state["cause"])
            return True
        backoff = self.config["backoff_s"]
        pause = float(backoff[min(self.consecutive, len(backoff)) - 1])
        self.set_state("backoff", f"next start in {pause:g} s after: {cause}", pid=None)
        self.sleep(pause)
        return False

    def last_log_line(self) -> str:
        try:
            with open(self.config["log"], errors="replace") as f:
                lines = [x.strip() for x in f.readlines()[-int(self.config["log_lines"]):] if x.strip()]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def record_pid(self, pid: int) -> None:
        """The run record (vllm_serve's serve.json) names the engine this supervisor serves, so that the next Ansible
        run finds the engine it records and leaves it alone."""
        path = self.config.get("run_record")
        if not path:
            return
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            return
        if record.get("engine_pid") != pid:
            record["engine_pid"] = pid
            record["restarted_by"] = "hy3spark-supervisor"
            _write_json(path, record, 0o600)


def _now() -> str:
    # Not datetime.UTC: that is Python 3.11, and the node's Python may be 3.10.
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())


def _secret_values(path: str | None) -> list[str]:
    """The values in the secrets file (KEY=VALUE lines, shell-quoted), longest first so that one holding another
    is hidden whole."""
    if not path:
        return []
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    values: set[str] = set()
    for line in lines:
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote: the line as it stands
            words = [line.strip()]
        values.update(word.partition("=")[2] for word in words if "=" in word)
    return sorted((v for v in values if len(v) >= SECRET_MIN_CHARS), key=len, reverse=True)


def _write_json(path: str, data: Any, mode: int) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("run", "state"):
        print(__doc__, file=sys.stderr)
        return 2
    if sys.argv[1] == "state":
        with open(sys.argv[2]) as f:
            state_file = json.load(f)["state_file"]
        try:
            with open(state_file) as f:
                print(f.read().strip())
        except OSError:
            print(json.dumps({"state": "none"}))
        return 0
    supervisor = Supervisor(sys.argv[2])
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, supervisor.on_signal)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
