"""vLLM's log line format, process tags included.

vLLM 0.2x prints ``(APIServer pid=12) INFO 11-30 10:15:52 [api_server.py:1839] message``; the engine core's lines are
tagged ``(EngineCore pid=N)``; Ray workers print without a tag and Ray's log forwarding prepends
``(RayWorkerWrapper pid=N, ip=A.B.C.D)``. uvicorn's own lines look like ``(APIServer pid=12) INFO:     message``.
The file:line part names the vLLM source file that logs the line in the real engine (line numbers are indicative).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

_LOCK = threading.Lock()
API = "APIServer"
ENGINE = "EngineCore"


def _stamp() -> str:
    return time.strftime("%m-%d %H:%M:%S")


def _emit(text: str) -> None:
    with _LOCK:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def line(where: str, message: str, level: str = "INFO", tag: str | None = API) -> None:
    """One vLLM log record; multi-line messages repeat the prefix on every line, as vLLM's formatter does."""
    prefix = f"{level} {_stamp()} [{where}] "
    if tag:
        prefix = f"({tag} pid={os.getpid()}) " + prefix
    _emit("\n".join(prefix + part for part in message.split("\n")))


def info(where: str, message: str, tag: str | None = API) -> None:
    line(where, message, "INFO", tag)


def warning(where: str, message: str, tag: str | None = API) -> None:
    line(where, message, "WARNING", tag)


def error(where: str, message: str, tag: str | None = API) -> None:
    line(where, message, "ERROR", tag)


def exception(where: str, message: str, exc: BaseException, tag: str | None = API) -> None:
    """logger.exception: the message, then the traceback, every line with the ERROR prefix."""
    text = message + "\n" + "".join(traceback.format_exception(exc)).rstrip("\n")
    line(where, text, "ERROR", tag)


def uvicorn(message: str, level: str = "INFO") -> None:
    _emit(f"({API} pid={os.getpid()}) {level + ':':<9} {message}")


def raw(text: str, tag: str | None = API) -> None:
    """Unformatted output (tracebacks printed by Python itself), tagged like vLLM's process output."""
    prefix = f"({tag} pid={os.getpid()}) " if tag else ""
    _emit("\n".join(prefix + part for part in text.rstrip("\n").split("\n")))
