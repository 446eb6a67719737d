# SPDX-License-Identifier: Apache-2.0
# hy3spark TEST DOUBLE of vllm/reasoning/hy_v3_reasoning_parser.py as shipped in vLLM 0.23: <think> and </think>
# are hard-coded bare; Hy3's released tokenizer has <think:opensource> (the suffix is named in tokenizer_config.json).

from vllm.reasoning.basic_parsers import BaseThinkingReasoningParser


class HYV3ReasoningParser(BaseThinkingReasoningParser):
    """
    HYV3 parser that delegates to either HYV3ReasoningParser or
    IdentityReasoningParser based on `reasoning_effort`.

    The HYV3 model uses <think>...</think> tokens to denote reasoning text.
    This parser extracts the reasoning content from the model output.
    """

    def __init__(self, tokenizer, *args, **kwargs):
        super().__init__(tokenizer, *args, **kwargs)

        chat_kwargs = kwargs.get("chat_template_kwargs", {}) or {}
        reasoning_effort = chat_kwargs.get("reasoning_effort") or kwargs.get("reasoning_effort") or "no_think"
        self.thinking = reasoning_effort != "no_think"

    @property
    def start_token(self) -> str:
        """The token that starts reasoning content."""
        return "<think>"

    @property
    def end_token(self) -> str:
        """The token that ends reasoning content."""
        return "</think>"
