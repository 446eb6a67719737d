"""`hy3spark logs`: the engine's log on the head, its tail and then every new byte, read through ansible-runner
with the spec's SSH settings. Ctrl+C detaches; the engine keeps running.
"""

from __future__ import annotations

import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hy3spark.context import SERVE_LOG
from hy3spark.errors import EXIT_OK, Hy3SparkError
from hy3spark.playbooks import render_inventory, secret_names
from hy3spark.runner import ansible_envvars, environ_without, interruptible
from hy3spark.spec import Loaded


class ServeLog:
    """The engine's log on the head, read through ansible-runner (the spec's SSH settings) in a private data dir of
    this command's own (0700), with the secrets out of the environment ansible-runner writes to disk."""

    def __init__(self, loaded: Loaded, runs_dir: Path) -> None:
        self.loaded = loaded
        self.inventory = render_inventory(loaded, runs_dir)
        self.private = Path(tempfile.mkdtemp(prefix=time.strftime("logs-%Y%m%d-%H%M%S-"), dir=runs_dir))

    def read(self, offset: int | None, lines: int, stop: Any) -> tuple[str, int] | None:
        """From byte `offset` (or the last `lines` lines) up to the size measured first, so the next read starts
        exactly where this one ended. None when `stop` was set during the read."""
        import ansible_runner

        log = shlex.quote(SERVE_LOG)
        head = self.loaded.spec.head.name
        body = (f"tail -c +{offset + 1} {log} | head -c $((size - {offset}))" if offset is not None
                else f"head -c \"$size\" {log} | tail -n {lines}")
        script = (f"[ -f {log} ] || {{ echo 'no {SERVE_LOG} on this node: nothing has been served here yet' >&2; "
                  f"exit 1; }}; size=$(stat -c %s {log}) && echo \"$size\" && {body}")
        with environ_without(secret_names(self.loaded)):
            r = ansible_runner.run(
                private_data_dir=str(self.private), inventory=str(self.inventory), host_pattern=head,
                module="ansible.builtin.shell", module_args=script, quiet=True,
                envvars=ansible_envvars(),
                rotate_artifacts=3, cancel_callback=stop.is_set,
            )
        if r.status == "canceled":
            return None
        for ev in r.events:
            if ev.get("event") == "runner_on_ok":
                out = ev["event_data"]["res"].get("stdout", "")
                size_line, _, text = out.partition("\n")
                return text + ("\n" if text else ""), int(size_line.strip() or 0)
            if ev.get("event") in ("runner_on_failed", "runner_on_unreachable"):
                res = ev["event_data"]["res"]
                raise Hy3SparkError(f"cannot read {SERVE_LOG} on {head}: {res.get('stderr') or res.get('msg')}")
        raise Hy3SparkError(f"cannot read {SERVE_LOG} on {head}: ansible-runner {r.status} (rc {r.rc})")


def read_log(loaded: Loaded, runs_dir: Path, lines: int) -> str:
    """The last `lines` lines of the serve log on the head."""
    with interruptible() as stop:
        got = ServeLog(loaded, runs_dir).read(None, lines, stop)
    if got is None:
        raise KeyboardInterrupt
    return got[0]


def follow_log(loaded: Loaded, runs_dir: Path, lines: int, interval: float = 2.0) -> int:
    """Print the tail, then new bytes every `interval` s. Ctrl+C detaches; the engine keeps running."""
    log = ServeLog(loaded, runs_dir)
    with interruptible() as stop:
        size: int | None = None
        while not stop.is_set():
            got = log.read(size, lines, stop)
            if got is None:
                break
            text, new_size = got
            if size is not None and new_size < size:  # rotated or truncated: start over from its beginning
                got = log.read(0, lines, stop)
                if got is None:
                    break
                text, new_size = got
            sys.stdout.write(text)
            sys.stdout.flush()
            size = new_size
            stop.wait(interval)
    print("\ndetached (the engine keeps running)", file=sys.stderr)
    return EXIT_OK
