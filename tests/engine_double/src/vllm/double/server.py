"""vLLM's OpenAI-compatible HTTP surface, on the standard library's ThreadingHTTPServer.

Routes: ``GET /health`` (200, empty body; 503 once the engine is dead), ``GET /version``, ``GET /v1/models``,
``POST /v1/completions`` and ``POST /v1/chat/completions`` (``"stream": true`` gives Server-Sent Events:
``data: {chunk}`` lines, then ``data: [DONE]``), and the double's own ``GET /double/workers`` (what each rank saw;
not in vLLM). With ``--api-key`` or ``VLLM_API_KEY``, every path under ``/v1`` needs ``Authorization: Bearer <key>``
and answers 401 ``{"error": "Unauthorized"}`` otherwise; ``/health`` stays open, as in vLLM.

Answers are deterministic (generate.py). ``VLLM_DOUBLE_TOKEN_DELAY_S`` sleeps between tokens and
``VLLM_DOUBLE_PREFILL_DELAY_S`` before the first one, so a load test measures something; at most ``--max-num-seqs``
requests generate at once, the rest wait, as vLLM's scheduler queues them.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vllm.double import generate, log
from vllm.double.model import FakeTokenizer


def env_float(name: str) -> float:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else 0.0


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class ServerState:
    served_names: list[str]
    model_root: str
    max_model_len: int
    max_num_seqs: int
    api_keys: list[str]
    tokenizer: FakeTokenizer
    tool_parser: Any = None
    reasoning_parser: Any = None
    enable_auto_tool_choice: bool = False
    access_log: bool = True
    workers: list[dict[str, Any]] = field(default_factory=list)
    dead: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    slots: threading.BoundedSemaphore = field(init=False)

    def __post_init__(self) -> None:
        self.slots = threading.BoundedSemaphore(self.max_num_seqs)
        self.token_digests = [hashlib.sha256(f"Bearer {key}".encode()).digest() for key in self.api_keys]

    def authorized(self, header: str | None) -> bool:
        if not self.api_keys:
            return True
        digest = hashlib.sha256((header or "").encode()).digest()
        return any(digest == expected for expected in self.token_digests)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: ServerState  # set on the subclass made by make_server

    def version_string(self) -> str:
        return "uvicorn"

    # --- plumbing -------------------------------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _access(self, status: int) -> None:
        if self.state.access_log:
            phrase = HTTPStatus(status).phrase
            client = f"{self.client_address[0]}:{self.client_address[1]}"
            log.uvicorn(f'{client} - "{self.command} {self.path} {self.request_version}" {status} {phrase}')

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        if body or content_type != "application/json":
            self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._access(status)

    def _json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode())

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            data = json.loads(raw or b"{}")
        except json.JSONDecodeError as err:
            raise RequestError(400, f"JSON decode error: {err}") from None
        if not isinstance(data, dict):
            raise RequestError(400, "Input should be a valid dictionary or object to extract fields from")
        return data

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        routes = {
            "/health": {"GET": self.health},
            "/version": {"GET": self.version},
            "/v1/models": {"GET": self.models},
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat},
            "/double/workers": {"GET": self.workers},
        }
        if path.startswith("/v1") and not self.state.authorized(self.headers.get("authorization")):
            self._json(401, {"error": "Unauthorized"})
            return
        if path not in routes:
            self._json(404, {"detail": "Not Found"})
            return
        handler = routes[path].get("GET" if method == "HEAD" else method)
        if handler is None:
            self._json(405, {"detail": "Method Not Allowed"})
            return
        try:
            handler()
        except RequestError as err:
            self._json(err.status, err.body())
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_POST(self) -> None:
        self._route("POST")

    # --- endpoints ------------------------------------------------------------------------------------------
    def health(self) -> None:
        self._send(503 if self.state.dead else 200, b"")

    def version(self) -> None:
        from vllm import __version__

        self._json(200, {"version": __version__})

    def workers(self) -> None:
        self._json(200, {"test_double": True, "workers": self.state.workers})

    def models(self) -> None:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.state.created,
                "owned_by": "vllm",
                "root": self.state.model_root,
                "parent": None,
                "max_model_len": self.state.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex}",
                        "object": "model_permission",
                        "created": self.state.created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in self.state.served_names
        ]
        self._json(200, {"object": "list", "data": data})

    def _check_model(self, request: dict[str, Any]) -> str:
        model = request.get("model")
        if model is None:
            return self.state.served_names[0]
        if model not in self.state.served_names:
            raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return str(model)

    def _budget(self, prompt_tokens: int, max_tokens: int | None) -> int:
        limit = self.state.max_model_len
        if prompt_tokens >= limit:
            raise RequestError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request has {prompt_tokens} "
                "input tokens. Please reduce the length of the input messages.",
            )
        if max_tokens is not None and prompt_tokens + max_tokens > limit:
            raise RequestError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
            )
        return limit - prompt_tokens

    @staticmethod
    def _max_tokens(request: dict[str, Any], default: int | None) -> int | None:
        value = request.get("max_completion_tokens", request.get("max_tokens", default))
        if value is None:
            return None
        if not isinstance(value, int) or value < 1:
            raise RequestError(400, f"max_tokens must be at least 1, got {value}.", param="max_tokens")
        return value

    def completions(self) -> None:
        request = self._body()
        model = self._check_model(request)
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError(400, "The double accepts one text prompt (a string).", param="prompt")
        max_tokens = self._max_tokens(request, 16)
        prompt_tokens = generate.count_tokens(prompt)
        budget = self._budget(prompt_tokens, max_tokens)
        tokens, finish = generate.generate(prompt, max_tokens, budget)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        usage = self._usage(prompt_tokens, len(tokens))
        if request.get("stream"):

            def chunk(text: str, reason: str | None) -> dict[str, Any]:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
                return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}

            self._stream(
                tokens,
                lambda t: chunk(t, None),
                chunk("", finish),
                rid,
                created,
                model,
                usage,
                request,
                "text_completion",
            )
            return
        self._generate_wait(len(tokens))
        choice = {
            "index": 0,
            "text": "".join(tokens),
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        self._json(
            200,
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
                "system_fingerprint": None,
                "kv_transfer_params": None,
            },
        )

    def chat(self) -> None:
        request = self._body()
        model = self._check_model(request)
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "Field required: messages", param="messages")
        thinking = self._parsers(request)
        max_tokens = self._max_tokens(request, None)
        prompt_tokens = generate.chat_prompt_tokens(messages)
        budget = self._budget(prompt_tokens, max_tokens)
        prompt_text = json.dumps(messages, sort_keys=True)
        tokens, finish = generate.generate(prompt_text, max_tokens, budget)
        reasoning = generate.reasoning_tokens(prompt_text) if thinking else []
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        usage = self._usage(prompt_tokens, len(tokens) + len(reasoning))
        if request.get("stream"):

            def delta_chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
                if reason is not None:
                    choice["stop_reason"] = None
                return {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }

            first = delta_chunk({"role": "assistant", "content": ""})
            pieces = [("reasoning", t) for t in reasoning] + [("content", t) for t in tokens]
            self._stream(
                pieces,
                lambda p: delta_chunk({p[0]: p[1]}),
                delta_chunk({"content": ""}, finish),
                rid,
                created,
                model,
                usage,
                request,
                "chat.completion.chunk",
                first=first,
            )
            return
        self._generate_wait(len(tokens) + len(reasoning))
        message = {
            "role": "assistant",
            "content": "".join(tokens),
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning": "".join(reasoning) if reasoning else None,
        }
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        self._json(
            200,
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            },
        )

    # --- helpers --------------------------------------------------------------------------------------------
    def _parsers(self, request: dict[str, Any]) -> bool:
        """Build the request's tool and reasoning parsers as vLLM does; True when the answer starts with reasoning."""
        tools = request.get("tools")
        tool_choice = request.get("tool_choice", "auto" if tools else "none")
        if tools and tool_choice == "auto" and not self.state.enable_auto_tool_choice:
            raise RequestError(
                400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            )
        if tools and tool_choice != "none" and self.state.tool_parser is not None:
            try:
                self.state.tool_parser(self.state.tokenizer)
            except RuntimeError as err:
                log.exception("serving_chat.py:310", "Error in tool parser creation.", err)
                raise RequestError(400, str(err)) from None
        if self.state.reasoning_parser is None:
            return False
        kwargs = request.get("chat_template_kwargs") or {}
        try:
            parser = self.state.reasoning_parser(
                self.state.tokenizer, chat_template_kwargs=kwargs, reasoning_effort=request.get("reasoning_effort")
            )
        except RuntimeError as err:
            log.exception("serving_chat.py:297", "Error in reasoning parser creation.", err)
            raise RequestError(400, str(err)) from None
        return bool(getattr(parser, "thinking", False))

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
        }

    def _generate_wait(self, count: int) -> None:
        with self.state.slots:
            time.sleep(env_float("VLLM_DOUBLE_PREFILL_DELAY_S") + count * env_float("VLLM_DOUBLE_TOKEN_DELAY_S"))

    def _stream(
        self,
        pieces: list[Any],
        make: Any,
        last: dict[str, Any],
        rid: str,
        created: int,
        model: str,
        usage: dict[str, Any],
        request: dict[str, Any],
        obj: str,
        first: dict[str, Any] | None = None,
    ) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        self._access(200)

        def event(payload: Any) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            frame = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(frame):x}\r\n".encode() + frame + b"\r\n")
            self.wfile.flush()

        delay = env_float("VLLM_DOUBLE_TOKEN_DELAY_S")
        with self.state.slots:
            time.sleep(env_float("VLLM_DOUBLE_PREFILL_DELAY_S"))
            if first is not None:
                event(first)
            for piece in pieces:
                event(make(piece))
                if delay:
                    time.sleep(delay)
            event(last)
        options = request.get("stream_options") or {}
        if options.get("include_usage"):
            event({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage})
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def make_server(host: str, port: int, state: ServerState) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"state": state})
    # Bound now, listening only once the engine is up (vLLM binds its socket before starting the engine, and
    # uvicorn listens after): during startup a client gets "connection refused", not a hang.
    server = ThreadingHTTPServer((host, port), handler, bind_and_activate=False)
    server.daemon_threads = True
    server.allow_reuse_address = True
    try:
        server.server_bind()
    except OSError:
        server.server_close()
        raise
    return server
