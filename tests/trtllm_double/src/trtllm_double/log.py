"""TensorRT-LLM's Python logger line shape: ``[MM/DD/YYYY-HH:MM:SS] [TRT-LLM] [RANK n] [I] message``."""

from __future__ import annotations

import sys
import time

LEVELS = {"internal_error": 0, "error": 1, "warning": 2, "info": 3, "verbose": 4, "debug": 5, "trace": 6}
_TAGS = {"E": "error", "W": "warning", "I": "info", "V": "verbose", "D": "debug"}
_level = LEVELS["info"]


def set_level(name: str) -> None:
    global _level
    _level = LEVELS[name]


def log(tag: str, message: str, rank: int | None = None) -> None:
    if LEVELS[_TAGS[tag]] > _level:
        return
    stamp = time.strftime("%m/%d/%Y-%H:%M:%S")
    where = f" [RANK {rank}]" if rank is not None else ""
    stream = sys.stderr if tag in ("E", "W") else sys.stdout
    print(f"[{stamp}] [TRT-LLM]{where} [{tag}] {message}", file=stream, flush=True)


def cpp(level: str, message: str) -> None:
    """The C++ runtime's lines: ``[TensorRT-LLM][INFO] message``."""
    print(f"[TensorRT-LLM][{level}] {message}", flush=True)
