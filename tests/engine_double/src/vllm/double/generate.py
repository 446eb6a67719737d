"""Deterministic text: the same prompt always gives the same tokens, so tests can compare answers.

A "token" here is a word or a punctuation mark (``\\w+|[^\\w\\s]``); prompts are counted the same way, chat prompts
with a few tokens of template per message, as a chat template adds. The answer starts by naming the double and then
draws words from a fixed vocabulary with a seed taken from the prompt's SHA-256.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

TOKEN = re.compile(r"\w+|[^\w\s]")
WORDS = (
    "spark",
    "ray",
    "tensor",
    "parallel",
    "cache",
    "block",
    "token",
    "fabric",
    "node",
    "head",
    "worker",
    "model",
    "serve",
    "stream",
    "kernel",
    "memory",
    "unified",
    "bandwidth",
    "latency",
    "throughput",
    "batch",
    "prefill",
    "decode",
    "layer",
    "expert",
    "router",
    "shard",
    "weight",
    "quantized",
    "context",
    "window",
    "request",
)
TEMPLATE_TOKENS_PER_MESSAGE = 4
TEMPLATE_TOKENS_PER_PROMPT = 3


def count_tokens(text: str) -> int:
    return len(TOKEN.findall(text))


def chat_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    total = TEMPLATE_TOKENS_PER_PROMPT
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        total += TEMPLATE_TOKENS_PER_MESSAGE + count_tokens(str(content))
    return total


def natural_length(seed: int) -> int:
    """How many tokens the double "wants" to say before its EOS: 24 to 40."""
    return 24 + seed % 17


def answer_tokens(prompt: str) -> tuple[list[str], int]:
    """The full answer as token strings (each with its leading space) and the seed."""
    seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    tokens = [" hy3spark", " engine", " double", " says", ":"]
    step = 1 + seed % 7
    index = seed
    while len(tokens) < natural_length(seed):
        tokens.append(" " + WORDS[index % len(WORDS)])
        index += step
    tokens.append(".")
    return tokens, seed


def reasoning_tokens(prompt: str) -> list[str]:
    seed = int.from_bytes(hashlib.sha256(b"think:" + prompt.encode()).digest()[:8], "big")
    return ["The", " request", " asks", " about", *(" " + WORDS[(seed + i * 3) % len(WORDS)] for i in range(6)), "."]


def generate(prompt: str, max_tokens: int | None, budget: int) -> tuple[list[str], str]:
    """Tokens to emit and the finish reason: "length" when max_tokens (or the context budget) cuts the answer."""
    tokens, _seed = answer_tokens(prompt)
    limit = budget if max_tokens is None else min(max_tokens, budget)
    if len(tokens) > limit:
        return tokens[:limit], "length"
    return tokens, "stop"
