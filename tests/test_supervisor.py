"""roles/vllm_serve/files/supervisor.py, the engine's supervisor (docs/restarts.md), run as the real program with the
real engine.py. Its config's `exec` is [] (what it runs, it runs here, as it does for an engine on the host), the
engine is a TEST DOUBLE written below (a small HTTP server that serves /health, or exits at startup as an engine
refusing an option does, or stops answering), the serve script detaches it as the real one does, and the launcher's
gate reads a file the test writes. Timings are shrunk (polls of 0.2 s, back-offs of 0.5 s and 1 s); molecule/ray and
molecule/site run the same supervisor against the real Ray and the vLLM double, with the real timings."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FILES = REPO / "roles" / "vllm_serve" / "files"
SECRET = "s3cr3t key with $dollar and 'quotes'"

# The engine double: argv `fake-engine serve PORT DIR`; DIR/mode says how it behaves, read at startup (exit) and at
# each /health (unhealthy); it writes the secret it was given to DIR/secret-seen.
ENGINE = r'''
import http.server, os, sys
port, d = int(sys.argv[2]), sys.argv[3]
mode = lambda: open(os.path.join(d, "mode")).read().strip()
open(os.path.join(d, "secret-seen"), "w").write(os.environ.get("ENGINE_SECRET", ""))
if mode() == "exit":
    print("fake-engine: error: unrecognized arguments: --no-such-flag", flush=True)
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
setsid {python} {dir}/fake-engine serve {port} {dir} >> {dir}/serve.log 2>&1 < /dev/null &
"""
GATE = r'''
import json, sys
why = open(sys.argv[1]).read().strip()
print(json.dumps({"ok": why == "ok", "why": "" if why == "ok" else why}))
'''


@dataclass
class Rig:
    dir: Path
    config: Path
    env: dict[str, str]
    port: int
    procs: list[subprocess.Popen]

    def write(self, name: str, text: str) -> None:
        (self.dir / name).write_text(text)

    def state(self) -> dict:
        path = self.dir / "state.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def engine_pid(self) -> int | None:
        found = engine_py(self, "status", str(self.dir / "serve.sh"), f"http://127.0.0.1:{self.port}/health",
                          str(self.dir / "serve.log"))
        return found["pid"] if found["alive"] else None

    def start_engine(self) -> int:
        """Start the engine as an Ansible run would, and wait until it answers /health."""
        with open(self.dir / "secrets.env") as secrets:
            subprocess.run([str(self.dir / "serve.sh")], stdin=secrets, check=True, env=self.env)
        report, _ = wait_for("the engine healthy", lambda: (r := engine_py(
            self, "status", str(self.dir / "serve.sh"), f"http://127.0.0.1:{self.port}/health",
            str(self.dir / "serve.log"))).get("healthy") and r, 20)
        assert isinstance(report, dict)
        return int(report["pid"])

    def supervise(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(FILES / "supervisor.py"), "run", str(self.config)],
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        self.procs.append(proc)
        return proc


def engine_py(rig: Rig, *args: str) -> dict:
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    port = free_port()
    (tmp_path / "fake-engine").write_text(ENGINE)
    (tmp_path / "serve.sh").write_text(SERVE.format(python=sys.executable, dir=tmp_path, port=port))
    (tmp_path / "serve.sh").chmod(0o755)
    (tmp_path / "ready.py").write_text(GATE)
    (tmp_path / "gate").write_text("ok")
    (tmp_path / "mode").write_text("ok")
    (tmp_path / "secrets.env").write_text(f"ENGINE_SECRET={shlex.quote(SECRET)}\n")
    (tmp_path / "serve.json").write_text(json.dumps({"engine_pid": None, "stamp": "x"}))
    config = {
        "cluster": "test", "exec": [], "python": sys.executable,
        "engine_py": str(FILES / "engine.py"), "ready_py": str(tmp_path / "ready.py"),
        "ready_args": [str(tmp_path / "gate")], "script": str(tmp_path / "serve.sh"),
        "secrets": str(tmp_path / "secrets.env"), "health_url": f"http://127.0.0.1:{port}/health",
        "log": str(tmp_path / "serve.log"), "log_lines": 20, "health_timeout_s": 5, "appear_s": 2, "stable_s": 1,
        "unhealthy_s": 1, "poll_s": 0.2, "health_every_s": 0.4, "backoff_s": [0.5, 1.0], "max_failed_starts": 3,
        "window_s": 60,
        "stop_timeout_s": 5, "state_file": str(tmp_path / "state.json"), "run_record": str(tmp_path / "serve.json"),
    }
    (tmp_path / "supervisor.json").write_text(json.dumps(config))
    env = {**os.environ, "HY3SPARK_ENGINE": json.dumps({"process": {"exe": "fake-engine", "arg": "serve"},
                                                        "log_lines": {}})}
    env.pop("INVOCATION_ID", None)
    r = Rig(tmp_path, tmp_path / "supervisor.json", env, port, [])
    try:
        yield r
    finally:
        for proc in r.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        subprocess.run(["pkill", "-9", "-f", f"{tmp_path}/fake-engine"], check=False)


def serving(rig: Rig, other_than: int | None = None, timeout: float = 20) -> dict:
    state, _ = wait_for("the supervisor serving", lambda: (s := rig.state()).get("state") == "serving"
                        and s.get("pid") not in (None, other_than) and s, timeout)
    assert isinstance(state, dict)
    return state


def test_it_adopts_a_running_engine_without_restarting_it(rig: Rig) -> None:
    pid = rig.start_engine()
    rig.supervise()
    state = serving(rig)
    assert state["pid"] == pid and state["starts"] == 0 and state["restarts"] == 0
    time.sleep(1)
    assert rig.engine_pid() == pid
    assert json.loads((rig.dir / "serve.json").read_text())["engine_pid"] == pid


def test_a_killed_engine_is_restarted_and_the_run_record_follows(rig: Rig) -> None:
    pid = rig.start_engine()
    rig.supervise()
    serving(rig)
    os.kill(pid, signal.SIGKILL)
    state = serving(rig, other_than=pid)
    assert state["restarts"] == 1 and state["starts"] == 1, state
    assert state["pid"] == rig.engine_pid() != pid
    record = json.loads((rig.dir / "serve.json").read_text())
    assert record["engine_pid"] == state["pid"] and record["stamp"] == "x", record
    assert [e["event"] for e in state["events"] if e["event"].startswith("engine gone")] == [
        f"engine gone (PID {pid}): the engine exited"]


def test_it_waits_for_the_gate_and_starts_when_it_opens(rig: Rig) -> None:
    pid = rig.start_engine()
    rig.supervise()
    serving(rig)
    rig.write("gate", "10.0.0.2 has 3.20 GiB available, less than the 90.00 GiB the engine needs")
    os.kill(pid, signal.SIGKILL)
    wait_for("waiting", lambda: rig.state().get("state") == "waiting" and "GiB available" in rig.state()["cause"], 10)
    time.sleep(1.5)
    assert rig.engine_pid() is None, "no start while the gate is closed"
    assert rig.state()["failed_starts"] == [], "waiting costs no budget"
    rig.write("gate", "ok")
    serving(rig, other_than=pid)


def test_a_leftover_engine_is_stopped_before_a_start(rig: Rig) -> None:
    """An engine process that is there while the supervisor waits to start one (a previous engine that did not die)
    is stopped first: never two engines at once."""
    rig.write("gate", "Ray shows 1 of 2 nodes and 1 of 2 GPUs (alive: 10.0.0.1)")
    rig.supervise()
    wait_for("waiting", lambda: rig.state().get("state") == "waiting", 10)
    left = rig.start_engine()
    wait_for("the leftover stopped", lambda: rig.engine_pid() is None, 15)
    assert any(e["event"].startswith(f"an engine process is still running (PIDs [{left}]): stopping it first")
               for e in rig.state()["events"]), rig.state()["events"]
    rig.write("gate", "ok")
    state = serving(rig, other_than=left)
    status = engine_py(rig, "status", str(rig.dir / "serve.sh"), "http://127.0.0.1:1/health",
                       str(rig.dir / "serve.log"))
    assert status["pids"] == [state["pid"]], status


def test_an_engine_that_exits_at_every_start_gives_up_after_three_with_back_off(rig: Rig) -> None:
    pid = rig.start_engine()
    proc = rig.supervise()
    serving(rig)
    rig.write("mode", "exit")
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == 0
    state = rig.state()
    assert state["state"] == "gave-up", state
    assert state["cause"] == ("gave up after 3 starts in 1 min: fake-engine: error: unrecognized arguments: "
                              "--no-such-flag"), state
    starts = [f["at"] for f in state["failed_starts"]]
    assert len(starts) == 3
    # 0.5 s after the first failed start, 1 s after the second (plus the start itself)
    assert starts[1] - starts[0] >= 0.5 and starts[2] - starts[1] >= 1.0, starts
    assert rig.engine_pid() is None
    out = proc.stdout.read() if proc.stdout else ""
    assert "failed start 3 of 3" in out and "gave up after 3 starts" in out, out


def test_an_unhealthy_engine_is_stopped_and_started_again(rig: Rig) -> None:
    pid = rig.start_engine()
    rig.supervise()
    serving(rig)
    rig.write("mode", "unhealthy")
    wait_for("the unhealthy engine stopped", lambda: rig.state().get("state") != "serving", 10)
    rig.write("mode", "ok")
    state = serving(rig, other_than=pid)
    assert state["restarts"] == 1
    assert any("/health failing" in e["event"] for e in state["events"]), state["events"]


def test_sigterm_stops_supervising_at_once_and_leaves_the_engine(rig: Rig) -> None:
    pid = rig.start_engine()
    proc = rig.supervise()
    serving(rig)
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
    rig.write("state.json", json.dumps(earlier))
    proc = rig.supervise()
    assert proc.wait(timeout=30) == 0
    state = rig.state()
    assert state["state"] == "gave-up" and len(state["failed_starts"]) == 3 and state["restarts"] == 2, state
    # After a give-up (or a stop) a new supervisor has its whole budget again: three more starts.
    proc = rig.supervise()
    assert proc.wait(timeout=60) == 0
    state = rig.state()
    assert state["state"] == "gave-up" and [f["cause"] for f in state["failed_starts"]] == [
        "fake-engine: error: unrecognized arguments: --no-such-flag"] * 3, state


def test_the_secrets_reach_the_engine_on_stdin_and_nothing_else(rig: Rig) -> None:
    rig.write("mode", "ok")
    proc = rig.supervise()  # no engine: it starts one
    serving(rig)
    assert (rig.dir / "secret-seen").read_text() == SECRET
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=10)[0]
    assert "s3cr3t" not in out and "s3cr3t" not in (rig.dir / "state.json").read_text()


def test_state_prints_the_state_file_or_none(rig: Rig) -> None:
    def state() -> dict:
        out = subprocess.run([sys.executable, str(FILES / "supervisor.py"), "state", str(rig.config)],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    assert state() == {"state": "none"}
    rig.write("state.json", json.dumps({"state": "serving", "pid": 7}))
    assert state() == {"state": "serving", "pid": 7}
    bad = subprocess.run([sys.executable, str(FILES / "supervisor.py"), "nonsense"], capture_output=True, text=True,
                         check=False)
    assert bad.returncode == 2 and "run CONFIG" in bad.stderr
