"""vLLM's hy_v3 parsers in the head container (piped to `docker exec -i <head> python3 - SUFFIX [--check]`).

vLLM 0.23's hy_v3 tool and reasoning parsers hard-code the bare special tokens (`"<tool_calls>"`, `"<think>"`, ...);
Hy3's tokenizer suffixes them (`<tool_calls:opensource>`). A parser that reads `token_suffix` (newer vLLM) is left
alone ("native"), one with bare tokens gets SUFFIX, one already patched is left alone, so a second run changes
nothing. With --check nothing is written. Prints one JSON line: `files` (what was found or done), `after` (each
file's state once patched, the same on every run) and `changed`.
"""

import ast
import glob
import importlib.util
import json
import os
import re
import sys

# The structural tokens vLLM's hy_v3 tool and reasoning parsers hard-code.
HY_V3_TOKENS = ("think", "tool_calls", "tool_call", "tool_sep", "arg_key", "arg_value")


def _parser_files() -> list[str]:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return []
    root = next(iter(spec.submodule_search_locations))
    return sorted(glob.glob(os.path.join(root, "**", "hy_v3*parser*.py"), recursive=True))


def _reads_token_suffix(text: str) -> bool:
    """True when the code (not a comment or docstring) uses token_suffix: a name, an attribute or a "key"."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    for n in ast.walk(tree):
        if (isinstance(n, ast.Name) and n.id == "token_suffix") or (
                isinstance(n, ast.Attribute) and n.attr == "token_suffix") or (
                isinstance(n, ast.Constant) and n.value == "token_suffix"):
            return True
    return False


def patch(suffix: str, check: bool) -> dict:
    """`files`: what was found (or done); `after`: each file's state once patched, the same on every run."""
    report = {"files": {}, "after": {}, "changed": False}
    bare = re.compile(r"""(["'])<(/?)(""" + "|".join(HY_V3_TOKENS) + r""")>\1""")
    for path in _parser_files():
        with open(path) as f:
            text = f.read()
        if _reads_token_suffix(text):
            report["files"][path] = report["after"][path] = "native"  # this vLLM reads tokenizer_config.json
            continue
        patched = bare.sub(lambda m: f"{m.group(1)}<{m.group(2)}{m.group(3)}{suffix}>{m.group(1)}", text)
        if patched == text:
            report["files"][path] = report["after"][path] = "patched" if suffix in text else "no bare tokens"
            continue
        report["files"][path] = "needs patch" if check else "patched now"
        report["after"][path] = "patched"
        report["changed"] = True
        if not check:
            tmp = f"{path}.hy3spark-tmp"
            with open(tmp, "w") as f:
                f.write(patched)
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
            os.replace(tmp, path)
    return report


print(json.dumps(patch(sys.argv[1], "--check" in sys.argv[2:])))
