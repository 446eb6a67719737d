"""roles/vllm_serve/files/supervisor.py, the engine's supervisor (docs/restarts.md), run as the real program with the
real engine.py. Its config's `exec` is [] (what it runs, it runs here, as it does for an engine on the host), the
engine is a TEST DOUBLE written below (a small HTTP server that serves /health, or exits at startup as an engine
refusing an option does, or stops answering), the serve script detaches it as the real one does, and the launcher's
gate reads a file the test writes. Timings are shrunk (polls of 0.2 s, back-offs of 0.2 s and 0.8 s); molecule/ray
and molecule/site run the same supervisor against the real Ray and the vLLM double, with the real timings."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
FILES = REPO / "roles" / "vllm_serve" / "files"
SECRET = "s3cr3t key with $dollar and 'quotes'"
EXITS = "fake-engine: error: unrecognized arguments: --no-such-flag"

# The engine double: argv `fake-engine-ID serve PORT DIR`. DIR/mode says how it behaves, read at startup (exit; leak:
# exit with the secret in its last line, once) and at each /health (unhealthy). It appends its start time to
# DIR/starts and writes the secret it was given to DIR/secret-seen.
ENGINE = r'''
import http.server, os, sys, time
port, d = int(sys.argv[2]), sys.argv[3]
mode = lambda: open(os.path.join(d, "mode")).read().strip()
open(os.path.join(d, "starts"), "a").write(f"{time.time()}\n")
open(os.path.join(d, "secret-seen"), "w").write(os.environ.get("ENGINE_SECRET", ""))
if mode() == "exit":
    print("fake-engine: error: unrecognized arguments: --no-such-flag", flush=True)
    sys.exit(2)
if mode() == "leak":
    open(os.path.join(d, "mode"), "w").write("ok")
    print("fake-engine: error: bad key " + os.environ.get("ENGINE_SECRET", ""), flush=True)
    sys.exit(2)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if mode() == "unhealthy" else 200)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer.allow_reuse_address = True
print("fake-engine: serving", flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''
# The serve script: the secrets arrive on stdin (as the real one's do), the engine is detached and the script returns.
SERVE = """#!/bin/sh
secrets=$(cat)
eval "$secrets"
export ENGINE_SECRET
setsid {python} {engine} serve {port} {dir} >> {dir}/serve.log 2>&1 < /dev/null &
"""
GATE = r'''
import json, sys
why = open(sys.argv[1]).read().strip()
print(json.dumps({"ok": why == "ok", "why": "" if why == "ok" else why}))
'''


@dataclass
class Rig:
    dir: Path
    engine: Path
    config: Path
    env: dict[str, str]
    port: int
    procs: list[subprocess.Popen[str]]

    def write(self, name: str, text: str) -> None:
        (self.dir / name).write_text(text)

    def configure(self, **changes: Any) -> None:
        self.write("supervisor.json", json.dumps({**json.loads(self.config.read_text()), **changes}))

    def state(self) -> dict[str, Any]:
        path = self.dir / "state" / "supervisor.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def events(self) -> list[str]:
        return [e["event"] for e in self.state().get("events", [])]

    def engine_starts(self) -> list[float]:
        path = self.dir / "starts"
        return [float(x) for x in path.read_text().split()] if path.is_file() else []

    def engine_pid(self) -> int | None:
        found = engine_py(self, "status", str(self.dir / "serve.sh"), f"http://127.0.0.1:{self.port}/health",
                          str(self.dir / "serve.log"))
        return found["pid"] if found["alive"] else None

    def launch_engine(self) -> None:
        """Start the engine as an Ansible run would (serve.sh, the secrets on stdin)."""
        with open(self.dir / "secrets.env") as secrets:
            subprocess.run([str(self.dir / "serve.sh")], stdin=secrets, check=True, env=self.env)

    def start_engine(self) -> int:
        """Start the engine and wait until it answers /health."""
        self.launch_engine()
        report, _ = wait_for("the engine healthy", lambda: (r := engine_py(
            self, "status", str(self.dir / "serve.sh"), f"http://127.0.0.1:{self.port}/health",
            str(self.dir / "serve.log"))).get("healthy") and r, 20)
        assert isinstance(report, dict)
        return int(report["pid"])

    def supervise(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, str(FILES / "supervisor.py"), "run", str(self.config)],
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        self.procs.append(proc)
        return proc


def engine_py(rig: Rig, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, str(FILES / "engine.py"), *args], env=rig.env, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    return json.loads(out.strip().splitlines()[-1])


def wait_for(what: str, check: Callable[[], object], timeout: float) -> tuple[object, float]:
    start = time.monotonic()
    while True:
        value = check()
        if value:
            return value, time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def doubles(engine: Path) -> list[int]:
    """A rig's engine doubles: detached by setsid, so in no process group the test holds."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(engine).encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    port = free_port()
    # engine.py knows the engine by its executable's name: one of this rig's own, so that another run of these tests
    # on the machine neither sees nor stops this rig's engine.
    engine = tmp_path / f"fake-engine-{uuid.uuid4().hex[:12]}"
    engine.write_text(ENGINE)
    (tmp_path / "serve.sh").write_text(SERVE.format(python=sys.executable, engine=engine, dir=tmp_path, port=port))
    (tmp_path / "serve.sh").chmod(0o755)
    (tmp_path / "ready.py").write_text(GATE)
    (tmp_path / "gate").write_text("ok")
    (tmp_path / "mode").write_text("ok")
    (tmp_path / "secrets.env").write_text(f"ENGINE_SECRET={shlex.quote(SECRET)}\n")
    (tmp_path / "serve.json").write_text(json.dumps({"engine_pid": None, "stamp": "x"}))
    # appear_s is 1: each failed start costs appear_s plus engine.py's 1 s polls and its log settling.
    config = {
        "cluster": "test", "exec": [], "python": sys.executable,
        "engine_py": str(FILES / "engine.py"), "ready_py": str(tmp_path / "ready.py"),
        "ready_args": [str(tmp_path / "gate")], "script": str(tmp_path / "serve.sh"),
        "secrets": str(tmp_path / "secrets.env"), "health_url": f"http://127.0.0.1:{port}/health",
        "log": str(tmp_path / "serve.log"), "log_lines": 20, "health_timeout_s": 5, "appear_s": 1, "stable_s": 1,
        "unhealthy_s": 1, "poll_s": 0.2, "health_every_s": 0.4, "backoff_s": [0.2, 0.8], "max_failed_starts": 3,
        "window_s": 60, "stop_timeout_s": 5, "state_file": str(tmp_path / "state" / "supervisor.json"),
        "run_record": str(tmp_path / "serve.json"),
    }
    (tmp_path / "supervisor.json").write_text(json.dumps(config))
    env = {**os.environ, "HY3SPARK_ENGINE": json.dumps({"process": {"exe": engine.name, "arg": "serve"},
                                                        "log_lines": {}})}
    env.pop("INVOCATION_ID", None)
    r = Rig(tmp_path, engine, tmp_path / "supervisor.json", env, port, [])
    try:
        yield r
    finally:
        for proc in r.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for pid in doubles(engine):
            os.kill(pid, signal.SIGKILL)


def serving(rig: Rig, other_than: int | None = None, timeout: float = 20) -> dict[str, Any]:
    state, _ = wait_for("the supervisor serving", lambda: (s := rig.state()).get("state") == "serving"
                        and s.get("pid") not in (None, other_than) and s, timeout)
    assert isinstance(state, dict)
    return state


def test_it_adopts_a_running_engine_without_restarting_it(rig: Rig) -> None:
    pid = rig.start_engine()
    rig.supervise()
    state = serving(rig)
    assert state["pid"] == pid and state["starts"] == 0 and state["restarts"] == 0
    time.sleep(0.6)  # three polls
    assert rig.engine_pid() == pid and len(rig.engine_starts()) == 1
    assert json.loads((rig.dir / "serve.json").read_text())["engine_pid"] == pid
    assert rig.events() == [f"found the engine running (PID {pid}): watching it"]


def test_a_killed_engine_is_restarted_with_a_new_pid_and_the_run_record_follows(rig: Rig) -> None:
    pid = rig.start_engine()
    rig.supervise()
    serving(rig)
    os.kill(pid, signal.SIGKILL)
    state = serving(rig, other_than=pid)
    assert state["restarts"] == 1 and state["starts"] == 1, state
    assert state["pid"] == rig.engine_pid() != pid
    # The engine it adopted had served long enough: its death is no failed start.
    assert state["failed_starts"] == [], state
    record = json.loads((rig.dir / "serve.json").read_text())
    assert record["engine_pid"] == state["pid"] and record["stamp"] == "x", record
    assert f"engine exited (PID {pid})" in rig.events()


def test_it_waits_for_the_gate_and_starts_when_it_opens(rig: Rig) -> None:
    closed = "10.0.0.2 has 3.20 GiB available, less than the 90.00 GiB the engine needs"
    rig.write("gate", closed)
    rig.supervise()
    wait_for("waiting", lambda: rig.state().get("state") == "waiting", 10)
    time.sleep(0.6)  # three polls of the gate
    state = rig.state()
    assert (state["state"], state["cause"], state["failed_starts"]) == ("waiting", closed, []), state
    assert rig.engine_pid() is None and rig.engine_starts() == [], "no start while the gate is closed"
    assert rig.events().count(f"waiting: {closed}") == 1, rig.events()
    rig.write("gate", "ok")
    assert serving(rig)["starts"] == 1


def test_a_leftover_engine_is_stopped_before_a_start(rig: Rig) -> None:
    """An engine process that is there while the supervisor waits to start one (a previous engine that did not die)
    is stopped first: never two engines at once."""
    rig.write("gate", "Ray shows 1 of 2 nodes and 1 of 2 GPUs (alive: 10.0.0.1)")
    rig.supervise()
    wait_for("waiting", lambda: rig.state().get("state") == "waiting", 10)
    # Not waited on until healthy: the supervisor may stop it first (it polls every 0.2 s), which is the point.
    rig.launch_engine()
    found, _ = wait_for("the leftover named", lambda: next((m for e in rig.events() if (m := re.fullmatch(
        r"an engine process is still running \(PIDs \[(\d+)\]\): stopping it first", e))), None), 20)
    assert isinstance(found, re.Match)
    left = int(found.group(1))
    wait_for("the leftover stopped", lambda: not alive(left), 15)
    assert rig.state()["starts"] == 0, "the leftover was the engine started by hand: the gate is still closed"
    rig.write("gate", "ok")
    state = serving(rig, other_than=left)
    status = engine_py(rig, "status", str(rig.dir / "serve.sh"), "http://127.0.0.1:1/health",
                       str(rig.dir / "serve.log"))
    assert status["pids"] == [state["pid"]], status


def test_an_engine_that_exits_at_every_start_backs_off_then_gives_up_after_three(rig: Rig) -> None:
    rig.write("mode", "exit")
    proc = rig.supervise()
    assert proc.wait(timeout=30) == 0
    state = rig.state()
    assert state["state"] == "gave-up", state
    assert state["cause"] == f"gave up after 3 starts in 1 min: {EXITS}", state
    assert [f["cause"] for f in state["failed_starts"]] == [EXITS] * 3, state
    assert state["starts"] == 0 and state["pid"] is None, state
    # Each start after a failed one waits its back-off first: 0.2 s after the first, 0.8 s after the second.
    failed, started = [f["at"] for f in state["failed_starts"]], rig.engine_starts()
    assert len(started) == 3, started
    assert started[1] - failed[0] >= 0.2 and started[2] - failed[1] >= 0.8, (failed, started)
    assert rig.engine_pid() is None
    out = proc.stdout.read() if proc.stdout else ""
    assert f"failed start 3 of 3 in 1 min: {EXITS}" in out and "gave up after 3 starts" in out, out


def test_an_engine_that_dies_soon_after_it_became_healthy_is_a_failed_start(rig: Rig) -> None:
    rig.configure(stable_s=5)
    rig.supervise()
    first = serving(rig)["pid"]
    os.kill(first, signal.SIGKILL)
    state = serving(rig, other_than=first)
    assert state["restarts"] == 1 and state["starts"] == 2, state
    [failed] = state["failed_starts"]
    assert re.fullmatch(r"died \d+ s after it became healthy: fake-engine: serving", failed["cause"]), failed


def test_an_unhealthy_engine_is_stopped_and_started_again(rig: Rig) -> None:
    pid = rig.start_engine()
    rig.supervise()
    serving(rig)
    rig.write("mode", "unhealthy")
    wait_for("the unhealthy engine stopped", lambda: not alive(pid), 10)
    rig.write("mode", "ok")
    state = serving(rig, other_than=pid)
    assert state["restarts"] == 1 and state["failed_starts"] == [], state
    assert f"engine (PID {pid}) alive but /health failing for 1 s (Service Unavailable): stopping it" in rig.events()


@pytest.mark.parametrize("during", ["serving", "starting"])
def test_sigterm_stops_supervising_at_once_and_leaves_the_engine(rig: Rig, during: str) -> None:
    if during == "starting":  # SIGTERM while engine.py wait polls an engine that does not answer yet
        rig.write("mode", "unhealthy")
    proc = rig.supervise()
    pid, _ = wait_for(during, lambda: rig.state().get("state") == during and rig.engine_pid(), 10)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0
    assert time.monotonic() - start < 2
    assert rig.state()["state"] == "stopped"
    assert rig.engine_pid() == pid


def test_the_budget_carries_over_a_restart_of_the_supervisor_but_not_a_give_up(rig: Rig) -> None:
    rig.write("mode", "exit")
    now = time.time()
    earlier = {"state": "backoff", "starts": 4, "restarts": 2, "events": [],
               "failed_starts": [{"at": now - 5, "cause": "x"}, {"at": now - 4, "cause": "y"}]}
    (rig.dir / "state").mkdir()
    rig.write("state/supervisor.json", json.dumps(earlier))
    proc = rig.supervise()
    assert proc.wait(timeout=30) == 0
    state = rig.state()
    assert state["state"] == "gave-up" and [f["cause"] for f in state["failed_starts"]] == ["x", "y", EXITS], state
    assert (state["starts"], state["restarts"]) == (4, 2), state
    # After a give-up (or a stop) a new supervisor has its whole budget again.
    rig.write("mode", "ok")
    rig.supervise()
    state = serving(rig)
    assert (state["starts"], state["restarts"], state["failed_starts"]) == (1, 0, []), state


def test_the_secrets_reach_the_engine_on_stdin_and_nothing_else(rig: Rig) -> None:
    # The first engine exits with the secret in its last log line, which becomes the failed start's cause.
    rig.write("mode", "leak")
    proc = rig.supervise()
    state = serving(rig)
    assert (rig.dir / "secret-seen").read_text() == SECRET
    assert [f["cause"] for f in state["failed_starts"]] == ["fake-engine: error: bad key <secret>"], state
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=10)[0]
    assert "s3cr3t" not in out and "s3cr3t" not in (rig.dir / "state" / "supervisor.json").read_text()
    assert "bad key <secret>" in out
    assert oct((rig.dir / "state" / "supervisor.json").stat().st_mode & 0o777) == "0o644"


def test_state_prints_the_state_file_or_none(rig: Rig) -> None:
    def state() -> dict[str, Any]:
        out = subprocess.run([sys.executable, str(FILES / "supervisor.py"), "state", str(rig.config)],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    assert state() == {"state": "none"}
    (rig.dir / "state").mkdir()
    rig.write("state/supervisor.json", json.dumps({"state": "serving", "pid": 7}))
    assert state() == {"state": "serving", "pid": 7}
    bad = subprocess.run([sys.executable, str(FILES / "supervisor.py"), "nonsense"], capture_output=True, text=True,
                         check=False)
    assert bad.returncode == 2 and "run CONFIG" in bad.stderr
