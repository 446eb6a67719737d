"""`vllm serve` argument parsing, shaped like vLLM 0.23's FlexibleArgumentParser.

Only the flags listed here exist in the double; everything else is rejected the way vLLM's argparse rejects an
unknown flag: the top-level parser prints its usage and ``vllm: error: unrecognized arguments: --foo`` and exits 2
(argparse hands a subcommand's leftovers to the top-level parser, so the message names ``vllm``, not ``vllm serve``).
Flags vLLM has removed are rejected too: ``--disable-log-requests`` is gone since 0.17 (``--no-enable-log-requests``
replaces it). Bad values (``--port abc``, ``--kv-cache-dtype fp4``) fail in the ``vllm serve`` subparser with
``vllm serve: error: argument --port: invalid int value: 'abc'``.

vLLM's preprocessing is kept: underscores in flag names become dashes (``--max_model_len``), ``--model X`` is moved to
the positional slot, and ``--config file.yaml`` expands a YAML mapping into flags.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

SERVE_USAGE = "vllm serve [model_tag] [options]"
# The top-level subcommands of vLLM 0.23 (vllm/entrypoints/cli/_utils.py CLI_COMMANDS); only `serve` is doubled.
SUBCOMMANDS = ("chat", "complete", "serve", "launch", "bench", "collect-env", "run-batch")
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_ds_mla", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
DTYPES = ("auto", "bfloat16", "float", "float16", "float32", "half")
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
UVICORN_LOG_LEVELS = ("critical", "debug", "error", "info", "trace", "warning")
EXECUTOR_BACKENDS = ("external_launcher", "mp", "ray", "uni")


def human_readable_int(value: str) -> int:
    """vLLM's human_readable_int: '1k' = 1000, '1K' = 1024, '25.6k' = 25600."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        decimal = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
        binary = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        if suffix in decimal:
            return int(float(number) * decimal[suffix])
        try:
            return int(number) * binary[suffix]
        except ValueError as err:
            raise argparse.ArgumentTypeError(
                f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to use "
                f"{number}{suffix.lower()} instead?"
            ) from err
    return int(value)


def human_readable_int_or_auto(value: str) -> int:
    if value.strip() == "-1" or value.strip().lower() == "auto":
        return -1
    return human_readable_int(value)


def json_value(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"Value {value} cannot be converted to {json.loads}.") from err


human_readable_int.__name__ = "human_readable_int"
human_readable_int_or_auto.__name__ = "human_readable_int_or_auto"
json_value.__name__ = "loads"


class DoubleArgumentParser(argparse.ArgumentParser):
    """argparse with vLLM's defaults: no abbreviations (the double knows fewer flags than vLLM, so an abbreviation
    unique here could be ambiguous there)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def _bool(group: argparse._ArgumentGroup, flag: str, default: bool | None = False) -> None:
    # vLLM turns every boolean config field into --flag / --no-flag (argparse.BooleanOptionalAction).
    group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="The model tag to serve")
    parser.add_argument("--headless", action="store_true", default=False)
    parser.add_argument("--api-server-count", "-asc", type=int, default=None)
    parser.add_argument("--config", default=None, help="Read CLI options from a YAML config file")
    parser.add_argument("--grpc", action="store_true", default=False)

    frontend = parser.add_argument_group("Frontend")
    frontend.add_argument("--host", default=None)
    frontend.add_argument("--port", type=int, default=8000)
    frontend.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info")
    _bool(frontend, "--disable-uvicorn-access-log")
    frontend.add_argument("--api-key", nargs="+", default=None)
    frontend.add_argument("--root-path", default=None)
    frontend.add_argument("--chat-template", default=None)
    _bool(frontend, "--enable-auto-tool-choice")
    frontend.add_argument("--tool-call-parser", default=None)
    _bool(frontend, "--enable-log-requests")
    _bool(frontend, "--enable-log-outputs")
    _bool(frontend, "--disable-log-stats")

    model = parser.add_argument_group("ModelConfig")
    model.add_argument("--model", default=None)
    model.add_argument("--revision", default=None)
    model.add_argument("--code-revision", default=None)
    model.add_argument("--tokenizer", default=None)
    model.add_argument("--tokenizer-mode", default="auto")
    model.add_argument("--tokenizer-revision", default=None)
    _bool(model, "--trust-remote-code")
    model.add_argument("--dtype", choices=DTYPES, default="auto")
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--max-model-len", type=human_readable_int_or_auto, default=None)
    model.add_argument("--quantization", "-q", default=None)
    _bool(model, "--enforce-eager")
    model.add_argument("--max-logprobs", type=int, default=20)
    model.add_argument("--served-model-name", nargs="+", default=None)
    model.add_argument("--generation-config", default="auto")
    model.add_argument("--override-generation-config", type=json_value, default=None)
    model.add_argument("--hf-overrides", type=json_value, default=None)
    _bool(model, "--language-model-only")

    load = parser.add_argument_group("LoadConfig")
    load.add_argument("--load-format", default="auto")
    load.add_argument("--download-dir", default=None)

    parallel = parser.add_argument_group("ParallelConfig")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parallel.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parallel.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    parallel.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default=None)
    _bool(parallel, "--enable-expert-parallel")

    cache = parser.add_argument_group("CacheConfig")
    cache.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=None)
    cache.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    cache.add_argument("--swap-space", type=float, default=4)
    cache.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    cache.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None)
    _bool(cache, "--enable-prefix-caching", default=None)
    cache.add_argument("--cpu-offload-gb", type=float, default=0)

    scheduler = parser.add_argument_group("SchedulerConfig")
    scheduler.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None)
    scheduler.add_argument("--max-num-seqs", type=int, default=None)
    _bool(scheduler, "--enable-chunked-prefill", default=None)
    _bool(scheduler, "--async-scheduling", default=None)
    scheduler.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")

    other = parser.add_argument_group("VllmConfig")
    other.add_argument("--speculative-config", type=json_value, default=None)
    other.add_argument("--compilation-config", "-cc", type=json_value, default=None)
    other.add_argument("--reasoning-parser", default=None)
    other.add_argument("--limit-mm-per-prompt", type=json_value, default=None)


def build_parser() -> argparse.ArgumentParser:
    from vllm import __version__

    parser = DoubleArgumentParser(prog="vllm", description="vLLM CLI (hy3spark TEST DOUBLE)")
    parser.add_argument("-v", "--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    for name in SUBCOMMANDS:
        if name == "serve":
            serve = subparsers.add_parser(
                "serve",
                usage=SERVE_USAGE,
                description="Launch a local OpenAI-compatible API server (hy3spark TEST DOUBLE: no GPU).",
            )
            add_serve_args(serve)
        else:
            subparsers.add_parser(name, add_help=False)
    return parser


def _pull_args_from_config(args: list[str]) -> list[str]:
    import yaml

    index = args.index("--config")
    if index + 1 >= len(args):
        raise SystemExit("vllm: error: argument --config: expected one argument")
    path = args[index + 1]
    with open(path) as handle:
        config = yaml.safe_load(handle) or {}
    if not isinstance(config, dict):
        raise SystemExit(f"vllm: error: {path} must hold a YAML mapping of flag names to values")
    from_config: list[str] = []
    for key, value in config.items():
        if key == "model":
            continue
        flag = f"--{key}"
        if isinstance(value, bool):
            if value:
                from_config.append(flag)
        elif isinstance(value, list):
            from_config += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            from_config += [flag, json.dumps(value)]
        else:
            from_config += [flag, str(value)]
    rest = args[:index] + args[index + 2 :]
    if len(rest) > 1 and not rest[1].startswith("-"):
        head, tail = rest[:2], rest[2:]
    else:
        head, tail = rest[:1], rest[1:]
        if "model" in config:
            head.append(str(config["model"]))
    # Command-line flags come after the file's, so they win.
    return [*head, *from_config, *tail]


def preprocess(args: list[str]) -> list[str]:
    """FlexibleArgumentParser.parse_args' rewriting, before argparse sees the arguments."""
    if args and args[0] == "serve":
        for index, arg in enumerate(args):
            if re.match(r"^--model(=.+|$)", arg):
                if arg == "--model":
                    if index + 1 >= len(args) or args[index + 1].startswith("-"):
                        print(
                            f"usage: {SERVE_USAGE}\nvllm serve: error: argument --model: expected one argument",
                            file=sys.stderr,
                        )
                        raise SystemExit(2)
                    model, rest = args[index + 1], index + 2
                else:
                    model, rest = arg.removeprefix("--model="), index + 1
                args = ["serve", model, *args[1:index], *args[rest:]]
                break
    if "--config" in args:
        args = _pull_args_from_config(args)
    processed = []
    for arg in args:
        if arg.startswith("--") and not arg.startswith("--help="):
            key, sep, value = arg.partition("=")
            # Everything between the leading -- and the first '.': underscores become dashes.
            head, dot, tail = key[2:].partition(".")
            processed.append("--" + head.replace("_", "-") + dot + tail + sep + value)
        else:
            processed.append(arg)
    return processed


def non_default(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """What vLLM logs as ``non-default args: {...}``."""
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    defaults = {action.dest: action.default for action in serve._actions}
    found = {}
    for key, value in vars(args).items():
        if key in defaults and value != defaults[key] and key not in ("subparser",):
            found[key] = value
    if "model_tag" in found:
        found["model"] = found["model_tag"]
    return found
