"""`trtllm-serve`'s command line, read as click reads it, from the option table in flags.json.

flags.json is derived from TensorRT-LLM's own `serve` command (make_flags.py). What click does and the double
does too: `--opt value` and `--opt=value`, options before or after MODEL, the last of a repeated option wins
(`multiple` ones collect), `--` ends the options, flags take no value, no abbreviations. Errors are click's text
and exit 2, after the usage line of the command path `trtllm-serve serve` (trtllm-serve is a click group whose
default command is `serve`, so `trtllm-serve MODEL` and `trtllm-serve serve MODEL` are the same).
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

TABLE = json.loads((Path(__file__).resolve().parent / "flags.json").read_text())
OPTIONS: dict[str, dict[str, Any]] = {opt: option for option in TABLE["options"] for opt in option["opts"]}
PROG = "trtllm-serve serve"
USAGE = f"Usage: {PROG} [OPTIONS] MODEL"
# The group's other commands: the double serves only `serve` and names the rest as not imitated.
OTHER_COMMANDS = ("grpc", "disaggregated", "disaggregated_mpi_worker", "mm_embedding_serve")


class UsageError(Exception):
    """click's UsageError: printed after the usage line and a hint, exit code 2."""

    exit_code = 2

    def render(self) -> str:
        return f"{USAGE}\nTry '{PROG} --help' for help.\n\nError: {self}\n"


def _no_such_option(name: str) -> UsageError:
    close = difflib.get_close_matches(name, list(OPTIONS), n=3)
    text = f"No such option: {name}"
    if len(close) == 1:
        text += f" Did you mean {close[0]}?"
    elif close:
        text += f" (Possible options: {', '.join(sorted(close))})"
    return UsageError(text)


def _convert(option: dict[str, Any], raw: str) -> Any:
    kind = option["type"]
    label = " / ".join(f"'{opt}'" for opt in option["opts"])
    if kind == "int":
        try:
            return int(raw.strip())
        except ValueError:
            raise UsageError(f"Invalid value for {label}: {raw!r} is not a valid integer.") from None
    if kind == "float":
        try:
            return float(raw.strip())
        except ValueError:
            raise UsageError(f"Invalid value for {label}: {raw!r} is not a valid float.") from None
    if kind == "choice":
        value = option.get("aliases", {}).get(raw, raw)
        choices = option["choices"]
        if choices is not None and value not in choices:
            listed = ", ".join(repr(c) for c in choices)
            raise UsageError(f"Invalid value for {label}: {raw!r} is not one of {listed}.")
        return value
    if kind == "path":
        if option.get("exists") and not os.path.exists(raw):
            raise UsageError(f"Invalid value for {label}: Path {raw!r} does not exist.")
        return str(Path(raw).resolve())
    return raw


def help_text() -> str:
    lines = [USAGE, "", "  Running an OpenAI API compatible server", "",
             "  MODEL: model name | HF checkpoint path | TensorRT engine path", "", "Options:"]
    for option in TABLE["options"]:
        metavar = "" if option["is_flag"] else {"int": " INTEGER", "float": " FLOAT", "path": " PATH"}.get(
            option["type"], " TEXT")
        lines.append(f"  {', '.join(option['opts'])}{metavar}")
        lines.append(f"      {option['help']}")
    lines.append("  --help  Show this message and exit.")
    return "\n".join(lines) + "\n"


class HelpRequested(Exception):
    pass


def parse(argv: list[str]) -> dict[str, Any]:
    """The `serve` command's parameters by dest (defaults filled in), or UsageError / HelpRequested."""
    if argv and argv[0] == "serve":
        argv = argv[1:]
    elif argv and argv[0] in OTHER_COMMANDS:
        raise UsageError(f"the TensorRT-LLM TEST DOUBLE serves only `serve`, not `{argv[0]}`")
    values: dict[str, Any] = {}
    positionals: list[str] = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--":
            positionals += args
            break
        if arg == "--help":
            raise HelpRequested
        if not arg.startswith("-") or arg == "-":
            positionals.append(arg)
            continue
        name, eq, inline = arg.partition("=")
        option = OPTIONS.get(name)
        if option is None:
            raise _no_such_option(name)
        if option["is_flag"]:
            if eq:
                raise UsageError(f"Option '{name}' does not take a value.")
            values[option["dest"]] = True
            continue
        if eq:
            raw = inline
        elif args:
            raw = args.pop(0)
        else:
            raise UsageError(f"Option '{name}' requires an argument.")
        value = _convert(option, raw)
        if option["multiple"]:
            values.setdefault(option["dest"], []).append(value)
        else:
            values[option["dest"]] = value
    if not positionals:
        raise UsageError("Missing argument 'MODEL'.")
    if len(positionals) > 1:
        extra = positionals[1:]
        raise UsageError(f"Got unexpected extra argument{'s' if len(extra) > 1 else ''} ({' '.join(extra)})")
    parsed: dict[str, Any] = {"model": positionals[0]}
    for option in TABLE["options"]:
        default = option["default"]
        if option["multiple"]:
            default = list(default or [])
        parsed[option["dest"]] = values.get(option["dest"], default)
    return parsed
