"""Tool-call parsers (hy3spark TEST DOUBLE): the registry the server checks ``--tool-call-parser`` against.

Only ``hy_v3`` has a module here (at vLLM's path, vllm/tool_parsers/hy_v3_tool_parser.py); the other names are
accepted so that a spec naming them starts, as it would on vLLM 0.23.
"""

from __future__ import annotations

import importlib
from typing import Any

REGISTERED = {
    "deepseek_v3": None,
    "deepseek_v31": None,
    "ernie45": None,
    "glm45": None,
    "glm47": None,
    "granite": None,
    "hermes": None,
    "hunyuan_a13b": None,
    "internlm": None,
    "jamba": None,
    "kimi_k2": None,
    "llama3_json": None,
    "llama4_json": None,
    "llama4_pythonic": None,
    "longcat": None,
    "minimax": None,
    "minimax_m2": None,
    "mistral": None,
    "openai": None,
    "phi4_mini_json": None,
    "pythonic": None,
    "qwen3_coder": None,
    "qwen3_xml": None,
    "seed_oss": None,
    "step3": None,
    "hy_v3": ("vllm.tool_parsers.hy_v3_tool_parser", "HYV3ToolParser"),
}


def get_tool_parser(name: str) -> Any:
    """The parser class, or None for a registered name the double has no module for."""
    if name not in REGISTERED:
        raise KeyError(f"invalid tool call parser: {name} (chose from {{ {','.join(sorted(REGISTERED))} }})")
    target = REGISTERED[name]
    if target is None:
        return None
    module, cls = target
    return getattr(importlib.import_module(module), cls)
