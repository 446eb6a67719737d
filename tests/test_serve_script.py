"""The rendered serve script, run: the secrets it is handed on stdin reach the engine's environment and nothing else.

The vllm_serve role starts it as `docker exec -i <container> serve.sh < /etc/hy3spark-secrets/secrets.env` (the
node's shell reads the file; no container mounts it), or on the host in a transient unit whose StandardInput= is
that file. Here bash runs the script of the two-Spark example as rendered, with two of its absolute paths moved into
a temporary directory (the serve log, and PID 1's stdout, which in the container is `docker logs`). The engine is a
test double: a `vllm` first on PATH that writes its environment and argv to files and exits.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from hy3spark.render import render_all
from hy3spark.spec import parse_spec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "hy3-two-spark.yml"
# A key with the characters a shell would trip over: quotes, $, backslash, spaces.
KEY = "sk-'quoted' $HOME \\n; `id` \"x\""
TOKEN = "hf_serve_script_token"
FAKE_ENGINE = """#!/bin/sh
env > "$DUMP.env"
grep '^SigIgn:' /proc/$$/status > "$DUMP.sig"
printf '%s\\n' "$@" > "$DUMP.argv"
echo engine-double-up
"""


def _secrets_file() -> str:
    """The secrets file as the role writes it (roles/vllm_serve/vars/main.yml): a comment, NAME=shell-quoted value."""
    return f"# Managed by hy3spark\nVLLM_API_KEY={shlex.quote(KEY)}\nHF_TOKEN={shlex.quote(TOKEN)}\n"


@pytest.fixture(scope="module")
def serve_text() -> str:
    outputs = {o.path: o.content for o in render_all(parse_spec(EXAMPLE.read_text(), EXAMPLE.name))}
    return outputs["files/spark-a/etc/hy3spark/serve.sh"]


def _setup(tmp_path: Path, text: str) -> tuple[Path, dict[str, str]]:
    log, pid1 = tmp_path / "serve.log", tmp_path / "pid1.out"
    assert "/var/log/hy3spark/serve.log" in text and "/proc/1/fd/1" in text
    script = tmp_path / "serve.sh"
    script.write_text(text.replace("/var/log/hy3spark/serve.log", str(log)).replace("/proc/1/fd/1", str(pid1)))
    script.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(FAKE_ENGINE)
    (bin_dir / "vllm").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "DUMP": str(tmp_path / "engine"), "HOME": str(tmp_path)}
    return script, env


def _sig_ignored(status_line: str) -> int:
    """The mask of a `SigIgn:\t<hex>` line of /proc/<pid>/status."""
    return int(status_line.split()[1], 16)


def _inherited_sigign(env: dict[str, str]) -> str:
    """The signals a plain child of this test starts with ignored (the baseline the script must not add to)."""
    return subprocess.run(["/bin/sh", "-c", "grep '^SigIgn:' /proc/$$/status"], env=env, capture_output=True,
                          text=True, check=True).stdout


def _engine_env(tmp_path: Path) -> dict[str, str]:
    deadline = time.monotonic() + 15
    dump, argv = tmp_path / "engine.env", tmp_path / "engine.argv"
    while not (argv.exists() and argv.read_text()):
        assert time.monotonic() < deadline, "the engine never started"
        time.sleep(0.05)
    return dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)


def _wait_for(path: Path, text: str) -> str:
    deadline = time.monotonic() + 15
    while text not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} never reached {path}"
        time.sleep(0.05)
    return path.read_text()


def test_in_the_container_the_script_detaches_and_the_engine_gets_the_secrets(tmp_path: Path, serve_text: str) -> None:
    script, env = _setup(tmp_path, serve_text)
    proc = subprocess.run([str(script)], input=_secrets_file(), capture_output=True, text=True, env=env, timeout=15)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc
    engine = _engine_env(tmp_path)
    assert engine["VLLM_API_KEY"] == KEY and engine["HF_TOKEN"] == TOKEN
    assert "secrets" not in engine, "the script's own variable stays behind"
    # Detached without a shell's `&`, which would have the engine ignore SIGINT and SIGQUIT: the engine ignores
    # exactly what any child of this test inherits (nothing, unless the suite itself was started under nohup or
    # in a background job; those dispositions cannot be undone by a script).
    assert _sig_ignored((tmp_path / "engine.sig").read_text()) == _sig_ignored(_inherited_sigign(env))
    argv = (tmp_path / "engine.argv").read_text().splitlines()
    assert argv[:2] == ["serve", "kodelow/Hy3-NVFP4-W4A16"] and KEY not in argv and TOKEN not in argv
    # The start marker and the engine's output reach the serve log and PID 1's stdout alike; no secret does.
    for out in (tmp_path / "serve.log", tmp_path / "pid1.out"):
        text = _wait_for(out, "engine-double-up")
        assert text.startswith("hy3spark: starting vllm for hy3-pair") and KEY not in text and TOKEN not in text
    # Nothing the script left in its directory holds a secret but the engine double's own dump.
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.name != "engine.env":
            assert TOKEN not in path.read_text(errors="replace"), path


def test_on_the_host_a_unit_runs_it_attached(tmp_path: Path, serve_text: str) -> None:
    """Under systemd (INVOCATION_ID) the script is the unit's main process: it execs the engine itself."""
    script, env = _setup(tmp_path, serve_text)
    secrets = tmp_path / "secrets.env"
    secrets.write_text(_secrets_file())
    with secrets.open() as stdin:  # what StandardInput=file: gives the unit
        proc = subprocess.run([str(script)], stdin=stdin, capture_output=True, text=True,
                              env={**env, "INVOCATION_ID": "0" * 32}, timeout=15)
    assert proc.returncode == 0, proc
    assert "engine-double-up" in proc.stdout + (tmp_path / "serve.log").read_text()
    engine = _engine_env(tmp_path)
    assert engine["VLLM_API_KEY"] == KEY and engine["INVOCATION_ID"] == "0" * 32
    assert not (tmp_path / "pid1.out").exists(), "on the host the unit's journal is its stdout"


@pytest.mark.parametrize("stdin", ["empty", "devnull"])
def test_without_secrets_the_engine_starts_without_them(tmp_path: Path, serve_text: str, stdin: str) -> None:
    """A rank node (docker exec -d: nothing on stdin) or a spec without an API key: no secret variable is set."""
    script, env = _setup(tmp_path, serve_text)
    kwargs = {"input": ""} if stdin == "empty" else {"stdin": subprocess.DEVNULL}
    proc = subprocess.run([str(script)], capture_output=True, text=True, env=env, timeout=15, **kwargs)
    assert proc.returncode == 0, proc
    engine = _engine_env(tmp_path)
    assert "VLLM_API_KEY" not in engine and "HF_TOKEN" not in engine


def test_a_terminal_on_stdin_is_not_read(tmp_path: Path, serve_text: str) -> None:
    """Run by hand from a shell, the script does not wait for a secret to be typed, and stays in the foreground."""
    script, env = _setup(tmp_path, serve_text)
    pid, fd = os.forkpty()
    if pid == 0:  # the child: the script with a terminal on stdin
        os.execve(str(script), [str(script)], env)
    try:
        engine = _engine_env(tmp_path)
        assert "VLLM_API_KEY" not in engine
    finally:
        os.close(fd)
        os.waitpid(pid, 0)
