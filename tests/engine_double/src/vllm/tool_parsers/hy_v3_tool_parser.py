# SPDX-License-Identifier: Apache-2.0
# hy3spark TEST DOUBLE of vllm/tool_parsers/hy_v3_tool_parser.py as shipped in vLLM 0.23: the special tokens are
# hard-coded bare (<tool_calls>, ...). Hy3's released tokenizer suffixes them (<tool_calls:opensource>) and names the
# suffix in tokenizer_config.json, which newer vLLM reads; this version does not, so it cannot find its tokens in that
# tokenizer. hy3spark's vllm_serve role patches this file, as the Hy3 recipe does.

import json
import re  # vLLM imports the `regex` package as re; the stdlib module does the same here

from vllm.tool_parsers.abstract_tool_parser import ToolParser


class HYV3ToolParser(ToolParser):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)

        self.current_tool_name_sent: bool = False
        self.prev_tool_call_arr: list[dict] = []
        self.current_tool_id: int = -1
        self.streamed_args_for_tool: list[str] = []  # map what has been streamed for each tool so far to a list

        self.tool_calls_start_token: str = "<tool_calls>"
        self.tool_calls_end_token: str = "</tool_calls>"

        self.tool_call_start_token: str = "<tool_call>"
        self.tool_call_end_token: str = "</tool_call>"

        self.tool_sep_token: str = "<tool_sep>"

        self.arg_key_start_token: str = "<arg_key>"
        self.arg_key_end_token: str = "</arg_key>"

        self.arg_value_start_token: str = "<arg_value>"
        self.arg_value_end_token: str = "</arg_value>"

        self.tool_call_regex = re.compile(
            rf"{self.tool_call_start_token}(.*?){self.tool_sep_token}"
            rf"(.*?){self.tool_call_end_token}",
            re.DOTALL,
        )

        self.func_args_regex = re.compile(
            rf"{self.arg_key_start_token}(.*?){self.arg_key_end_token}\s*"
            rf"{self.arg_value_start_token}(.*?){self.arg_value_end_token}",
            re.DOTALL,
        )

        if not self.model_tokenizer:
            raise ValueError("The model tokenizer must be passed to the ToolParser constructor during construction.")
        self.tool_calls_start_token_id = self.vocab.get(self.tool_calls_start_token)
        self.tool_calls_end_token_id = self.vocab.get(self.tool_calls_end_token)

        self.tool_call_start_token_id = self.vocab.get(self.tool_call_start_token)
        self.tool_call_end_token_id = self.vocab.get(self.tool_call_end_token)

        if self.tool_calls_start_token_id is None or self.tool_calls_end_token_id is None:
            raise RuntimeError("HYV3 Tool parser could not locate tool call start/end tokens in the tokenizer!")

    def extract_tool_calls(self, model_output: str) -> list[dict]:
        """The calls in a model output, as OpenAI tool_calls entries."""
        calls = []
        for name, args in self.tool_call_regex.findall(model_output):
            arguments = {key.strip(): value for key, value in self.func_args_regex.findall(args)}
            calls.append({"type": "function", "function": {"name": name.strip(), "arguments": json.dumps(arguments)}})
        return calls
