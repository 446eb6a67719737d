"""Derive the double's `trtllm-serve` option table from TensorRT-LLM's own source.

    python tests/trtllm_double/make_flags.py PATH/TO/tensorrt_llm/commands/serve.py --commit SHA [--check]

Reads the `serve` click command's decorators with `ast` (nothing of TensorRT-LLM is imported: it needs CUDA) and
writes src/trtllm_double/flags.json: every option's strings, dest, type, choices, flag/multiple and default, plus
where it came from. Values the decorators compute from TensorRT-LLM objects are resolved by RESOLVED below, read
by hand from the same source tree; a decorator expression this script does not know fails the run, so a new
version's table cannot be silently incomplete. Choice lists drawn from parser registries (reasoning and tool
parsers) are recorded as open: the double accepts any value there.

No TensorRT-LLM wheel can be fetched here (PyPI carries only placeholder sdists that download from
pypi.nvidia.com), so the table was made from the file at the commit recorded in flags.json.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "src" / "trtllm_double" / "flags.json"

# Decorator expressions that name TensorRT-LLM objects, resolved from the same tree:
# BuildConfig's fields (tensorrt_llm/builder.py) and the logger's severity_map (tensorrt_llm/logger.py).
RESOLVED: dict[str, Any] = {
    "BuildConfig.model_fields['max_beam_width'].default": 1,
    "BuildConfig.model_fields['max_batch_size'].default": 2048,
    "BuildConfig.model_fields['max_num_tokens'].default": 8192,
    "BuildConfig.model_fields['max_seq_len'].default": None,
    "severity_map.keys()": ["internal_error", "error", "warning", "info", "verbose", "debug", "trace"],
}
OPEN_CHOICES = ("ReasoningParserFactory.parsers.keys()", "ToolParserFactory.parsers.keys()")


def _value(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        text = ast.unparse(node)
        if text in RESOLVED:
            return RESOLVED[text]
        raise SystemExit(f"make_flags: unknown expression {text!r}: resolve it in RESOLVED") from None


def _type(node: ast.expr | None) -> dict[str, Any]:
    if node is None:
        return {"type": "str"}
    if isinstance(node, ast.Name) and node.id in ("str", "int", "float"):
        return {"type": node.id}
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        if name in ("click.Choice", "ChoiceWithAlias"):
            text = ast.unparse(node.args[0])
            if text in OPEN_CHOICES:
                return {"type": "choice", "choices": None, "choices_from": text}
            out: dict[str, Any] = {"type": "choice", "choices": list(_value(node.args[0]))}
            if name == "ChoiceWithAlias":
                out["aliases"] = _value(node.args[1])
            return out
        if name == "click.Path":
            exists = any(k.arg == "exists" and _value(k.value) for k in node.keywords)
            return {"type": "path", "exists": exists}
    raise SystemExit(f"make_flags: unknown option type {ast.unparse(node)!r}")


def _help(node: ast.expr | None) -> str:
    if isinstance(node, ast.Call) and node.args:  # help_info_with_stability_tag("text", "tag")
        node = node.args[0]
    return str(ast.literal_eval(node)) if node is not None else ""


def extract(source: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "serve":
            break
    else:
        raise SystemExit("make_flags: no `def serve` in the file")
    arguments, options = [], []
    for deco in reversed(node.decorator_list):  # click applies them bottom-up; --help lists them top-down
        if not isinstance(deco, ast.Call):
            continue
        kind, kw = ast.unparse(deco.func), {k.arg: k.value for k in deco.keywords}
        names = [ast.literal_eval(a) for a in deco.args]
        if kind == "click.argument":
            arguments.append({"name": names[0], **_type(kw.get("type"))})
        elif kind == "click.option":
            opts = [n for n in names if n.startswith("-")]
            dests = [n for n in names if not n.startswith("-")]
            # click's rule: the first declaration with the longest prefix ("--" over "-") names the parameter.
            first = sorted(opts, key=lambda o: len(o.lstrip("-")) - len(o))[0]
            dest = dests[0] if dests else first.lstrip("-").replace("-", "_")
            options.append({
                "opts": opts,
                "dest": dest,
                **({"type": "bool"} if "is_flag" in kw else _type(kw.get("type"))),
                "is_flag": bool("is_flag" in kw and _value(kw["is_flag"])),
                "multiple": bool("multiple" in kw and _value(kw["multiple"])),
                "default": _value(kw["default"]) if "default" in kw else None,
                "help": _help(kw.get("help")),
            })
    return list(reversed(arguments)), list(reversed(options))


def render(source: str, commit: str) -> str:
    arguments, options = extract(source)
    table = {
        "source": {
            "repository": "NVIDIA/TensorRT-LLM",
            "path": "tensorrt_llm/commands/serve.py",
            "commit": commit,
            "sha256": hashlib.sha256(source.encode()).hexdigest(),
            "made_by": "tests/trtllm_double/make_flags.py",
        },
        "command": "serve",
        "usage": "trtllm-serve [OPTIONS] MODEL",
        "arguments": arguments,
        "options": options,
    }
    return json.dumps(table, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("serve_py", type=Path)
    parser.add_argument("--commit", required=True, help="the TensorRT-LLM commit the file was read at")
    parser.add_argument("--check", action="store_true", help="fail when flags.json differs instead of writing it")
    args = parser.parse_args(argv)
    text = render(args.serve_py.read_text(), args.commit)
    if args.check:
        if OUT.read_text() != text:
            print(f"make_flags: {OUT} is not what {args.serve_py} gives", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
