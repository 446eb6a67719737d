"""The part of vLLM's ToolParser base class the hy_v3 parser uses (hy3spark TEST DOUBLE)."""

from __future__ import annotations

from typing import Any


class ToolParser:
    def __init__(self, tokenizer: Any) -> None:
        self.model_tokenizer = tokenizer
        self.prev_tool_call_arr: list[dict] = []
        self.current_tool_id = -1
        self.current_tool_name_sent = False
        self.streamed_args_for_tool: list[str] = []

    @property
    def vocab(self) -> dict[str, int]:
        return self.model_tokenizer.get_vocab()
