"""vLLM's BaseThinkingReasoningParser, reduced to its constructor check (hy3spark TEST DOUBLE)."""

from __future__ import annotations

from typing import Any


class BaseThinkingReasoningParser:
    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        self.model_tokenizer = tokenizer
        if not self.start_token or not self.end_token:
            raise ValueError("start_token and end_token must be defined in subclasses")
        vocab = tokenizer.get_vocab()
        self.start_token_id = vocab.get(self.start_token)
        self.end_token_id = vocab.get(self.end_token)
        if self.start_token_id is None or self.end_token_id is None:
            raise RuntimeError(
                f"{self.__class__.__name__} reasoning parser could not locate think start/end tokens in the tokenizer!"
            )

    @property
    def start_token(self) -> str:
        raise NotImplementedError

    @property
    def end_token(self) -> str:
        raise NotImplementedError
