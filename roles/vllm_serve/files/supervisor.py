"""hy3spark's engine supervisor (docs/restarts.md): keeps the engine serving after crashes and reboots, without
starving the node. Runs on the head's host as hy3spark-supervisor.service, standard library only.

  run CONFIG      watch the engine; when it is gone, start it again once the launcher's gate says a start can succeed
  state CONFIG    print what it did last (its state file), or {"state": "none"}

CONFIG (templates/supervisor.json.j2) names where the engine lives (`exec`: the argv prefix that runs a command in
the head's container, [] to run it here), engine.py (status, stop, wait: piped to `<exec> python3 -`), the launcher's
gate (ready.py: one JSON line {"ok", "why"}), the serve script and the secrets file it reads on stdin (opened here,
never read into an argv, a log or the state), and the budget: after `max_failed_starts` failed starts within
`window_s` it gives up, exits 0 (systemd leaves it stopped) and says why in the state file.

A failed start: not healthy within health_timeout_s (the engine exited, or was still loading), or dead within stable_s
of becoming healthy. Waiting for the gate costs no budget: a worker away for an hour is waited for.
SIGTERM/SIGINT: stop supervising and leave the engine as it is (Ansible stops engines). SIGHUP: read CONFIG again.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

EVENTS_KEPT = 20
PROBE_TIMEOUT_S = 60


class Stop(Exception):
    """SIGTERM or SIGINT: leave the loop, the engine as it is."""


class Supervisor:
    def __init__(self, config_path: str) -> None:
        self.config_path = config_path
        self.config: dict[str, Any] = {}
        self.wake = threading.Event()
        self.stopping = False
        self.reload = False
        self.load()
        self.state = self._carried_state()

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
        changed = self.state["state"] != what or self.state.get("cause") != cause
        self.state.update(fields, state=what, cause=cause)
        if changed:
            self.state["since"] = _now()
        self.save()

    def event(self, text: str) -> None:
        print(text, flush=True)
        self.state["events"] = [*self.state["events"], {"at": _now(), "event": text}][-EVENTS_KEPT:]
        self.save()

    def save(self) -> None:
        window = float(self.config["window_s"])
        self.state["failed_starts"] = [f for f in self.state["failed_starts"] if f["at"] > time.time() - window]
        _write_json(self.config["state_file"], self.state, 0o644)

    # --- signals, sleeping ----------------------------------------------------------------------------------------

    def on_signal(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGHUP:
            self.reload = True
        else:
            self.stopping = True
        self.wake.set()

    def sleep(self, seconds: float) -> None:
        """Sleep, but wake at once for a signal."""
        self.wake.wait(seconds)
        self.wake.clear()
        self.check_signals()

    def check_signals(self) -> None:
        if self.stopping:
            raise Stop
        if self.reload:
            self.reload = False
            self.load()
            self.event(f"read {self.config_path} again")

    # --- what runs where the engine lives -------------------------------------------------------------------------

    def _run(self, argv: list[str], stdin: Any, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run where the engine lives; a stop signal ends the wait (and the child) at once."""
        cmd = [*self.config["exec"], *argv]
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                out, err = proc.communicate(timeout=1)
                return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                if self.stopping or time.monotonic() >= deadline:
                    proc.kill()
                    proc.communicate()
                    if self.stopping:
                        raise Stop from None
                    raise

    def script(self, path: str, *args: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[dict[str, Any] | None, str]:
        """Pipe a script to `<exec> python3 - ARGS`: (its last JSON line, or None with why it gave none)."""
        try:
            with open(path) as f:
                proc = self._run([self.config.get("python", "python3"), "-", *args], f, timeout)
        except subprocess.TimeoutExpired:
            return None, f"{os.path.basename(path)} {args[0] if args else ''} did not answer within {timeout:.0f} s"
        except OSError as exc:
            return None, f"cannot run {path}: {exc}"
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not lines:
            said = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [f"exit {proc.returncode}"])
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
            report, _ = self.status()
            if report and report.get("alive"):
                self.event(f"found the engine running (PID {report['pid']}): watching it")
                self.serving(int(report["pid"]))
                self.watch(adopted=True)
            while True:
                if self.start_cycle():
                    self.watch()
                else:
                    return 0
        except Stop:
            self.set_state("stopped", "stopped by a signal (systemctl stop); the engine is left as it is")
            self.event("stopped; the engine is left as it is")
            return 0

    def serving(self, pid: int) -> None:
        self.set_state("serving", "", pid=pid)
        self.record_pid(pid)

    def watch(self, adopted: bool = False) -> None:
        """Until the engine is gone: then count a restart and return. An engine this supervisor found running has
        been healthy for longer than stable_s as far as the budget goes."""
        pid = self.state.get("pid")
        became_healthy = time.monotonic() - (float(self.config["stable_s"]) if adopted else 0.0)
        unhealthy_since: float | None = None
        # The processes every poll_s; /health every health_every_s only: the engine logs each request, and a serve
        # log full of health checks hides what an operator looks for.
        next_health = time.monotonic() + float(self.config["health_every_s"])
        while True:
            self.sleep(float(self.config["poll_s"]))
            probe = self.status if time.monotonic() >= next_health else self.pids
            report, why = probe()
            if report is None:  # docker could not run the probe: once more before calling the engine gone
                self.sleep(2.0)
                report, why = probe()
            if report is not None and "healthy" not in report:  # the processes only
                if report.get("alive"):
                    continue
                report, why = self.status()  # gone: read once more, in full, before acting on it
            next_health = time.monotonic() + float(self.config["health_every_s"])
            if report is None or not report.get("alive"):
                self.state["restarts"] = int(self.state.get("restarts", 0)) + 1
                cause = why or "the engine exited"
                self.event(f"engine gone (PID {pid}): {cause}")
                if time.monotonic() - became_healthy < float(self.config["stable_s"]):
                    self.failed_start(f"died {time.monotonic() - became_healthy:.0f} s after it became healthy: "
                                      f"{self.last_log_line() or cause}")
                self.set_state("waiting", cause, pid=None)
                return
            if report.get("healthy"):
                unhealthy_since = None
                if report.get("pid") != pid:  # a start of the engine's own (a second process took the lead)
                    pid = report["pid"]
                    self.serving(int(pid))
                continue
            unhealthy_since = unhealthy_since or time.monotonic()
            if time.monotonic() - unhealthy_since >= float(self.config["unhealthy_s"]):
                self.state["restarts"] = int(self.state.get("restarts", 0)) + 1
                self.event(f"engine (PID {pid}) alive but /health failing for {self.config['unhealthy_s']} s "
                           f"({report.get('health')}): stopping it")
                self.stop_engine()
                self.set_state("waiting", "the engine stopped answering /health", pid=None)
                return

    def start_cycle(self) -> bool:
        """Gate, start, wait for /health. True: serving. False: gave up."""
        while True:
            self.wait_for_gate()
            healthy, cause = self.start()
            if healthy:
                return True
            if self.failed_start(cause):
                return False
            failures = self.consecutive_failures()
            backoff = self.config["backoff_s"][min(failures, len(self.config["backoff_s"])) - 1]
            self.set_state("backoff", f"next start in {backoff} s after: {cause}")
            self.sleep(float(backoff))

    def wait_for_gate(self) -> None:
        said = None
        while True:
            self.check_signals()
            report, why = self.status()
            if report is not None and report.get("alive"):
                # An engine process is left (a previous engine's, or one that did not die): never two at once.
                self.event(f"an engine process is still running (PIDs {report.get('pids')}): stopping it first")
                self.stop_engine()
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

    def start(self) -> tuple[bool, str]:
        self.set_state("starting", "", pid=None)
        self.event("starting the engine")
        started = time.monotonic()
        secrets = self.config.get("secrets")
        try:
            stdin = open(secrets) if secrets and os.path.exists(secrets) else subprocess.DEVNULL  # noqa: SIM115
            try:
                proc = self._run([self.config["script"]], stdin, PROBE_TIMEOUT_S)
            finally:
                if stdin is not subprocess.DEVNULL:
                    stdin.close()
        except subprocess.TimeoutExpired:
            return False, f"the serve script did not return within {PROBE_TIMEOUT_S} s"
        if proc.returncode != 0:
            said = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
            return False, f"the serve script failed: {said[-1][:300]}"
        timeout = float(self.config["health_timeout_s"])
        report, why = self.engine("wait", self.config["health_url"], str(int(timeout)), self.config["log"],
                                  str(self.config["log_lines"]), str(self.config["appear_s"]),
                                  timeout=timeout + PROBE_TIMEOUT_S)
        if report and report.get("healthy"):
            self.state["starts"] = int(self.state.get("starts", 0)) + 1
            self.event(f"serving (PID {report['pid']}) {time.monotonic() - started:.0f} s after the start")
            self.serving(int(report["pid"]))
            return True, ""
        if report is None:
            cause = why
        elif report.get("alive"):
            cause = f"did not answer /health within {int(timeout)} s"
        else:
            tail = [x.strip() for x in report.get("log_tail", []) if x.strip()]
            cause = tail[-1][:300] if tail else "the engine exited"
        self.stop_engine()
        return False, cause

    def failed_start(self, cause: str) -> bool:
        """Count a failed start. True when the budget is spent: the supervisor has given up."""
        self.state["failed_starts"] = [*self.state["failed_starts"], {"at": time.time(), "cause": cause}]
        self.save()
        count, window = len(self.state["failed_starts"]), int(self.config["window_s"])
        self.event(f"failed start {count} of {self.config['max_failed_starts']} in {window // 60} min: {cause}")
        if count >= int(self.config["max_failed_starts"]):
            self.set_state("gave-up", f"gave up after {count} starts in {window // 60} min: {cause}", pid=None)
            self.event(self.state["cause"])
            return True
        return False

    def consecutive_failures(self) -> int:
        return max(1, len(self.state["failed_starts"]))

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
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


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
