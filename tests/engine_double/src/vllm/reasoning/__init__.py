"""Reasoning parsers (hy3spark TEST DOUBLE): the registry ``--reasoning-parser`` is checked against."""

from __future__ import annotations

import importlib
from typing import Any

REGISTERED = {
    "deepseek_r1": None,
    "deepseek_v3": None,
    "ernie45": None,
    "glm45": None,
    "gpt_oss": None,
    "granite": None,
    "hunyuan_a13b": None,
    "kimi_k2": None,
    "minimax_m2": None,
    "mistral": None,
    "openai_gptoss": None,
    "qwen3": None,
    "seed_oss": None,
    "step3": None,
    "hy_v3": ("vllm.reasoning.hy_v3_reasoning_parser", "HYV3ReasoningParser"),
}


def get_reasoning_parser(name: str) -> Any:
    if name not in REGISTERED:
        raise KeyError(f"invalid reasoning parser: {name} (chose from {{ {','.join(sorted(REGISTERED))} }})")
    target = REGISTERED[name]
    if target is None:
        return None
    module, cls = target
    return getattr(importlib.import_module(module), cls)
