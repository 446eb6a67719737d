"""`trtllm-serve [serve] MODEL [OPTIONS]`: TensorRT-LLM's OpenAI server, as a TEST DOUBLE.

Parses the real option table (cli.py), reads and validates the extra LLM API options (options.py), binds the port
(the real server binds before it builds the LLM), builds the "LLM" over the MPI ranks (through rank 0's leader when
trtllm-llmapi-launch started it, TLLM_SPAWN_PROXY_PROCESS=1; else in this process, one rank) and then serves
/health, /health_generate, /version, /v1/models, /v1/completions and /v1/chat/completions (with stream=true as
server-sent events) on the configured host and port. No API key: trtllm-serve has none (NVIDIA/TensorRT-LLM#9950).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import VERSION, cli, engine, log, options, wire


class StartupError(Exception):
    pass


class LocalSession:
    """No launcher: this process is the only rank (one GPU per node, TRTLLM_DOUBLE_GPUS_PER_NODE)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def init(self, spec: dict[str, Any]) -> dict[str, Any]:
        gpus = int(os.environ.get("TRTLLM_DOUBLE_GPUS_PER_NODE", "1"))
        args = spec["llm_args"]
        need = args["tensor_parallel_size"] * args["pipeline_parallel_size"]
        if need > gpus:
            return {"ok": False, "world_size": 1, "errors": [
                f"tp_size * pp_size = {need} needs {need} GPUs and this node has {gpus}: across nodes, run "
                "trtllm-serve under mpirun through trtllm-llmapi-launch"]}
        reply = engine.load(0, 1, 1, spec)
        return {"ok": "error" not in reply, "world_size": 1, "ranks": [reply],
                "errors": [reply["error"]] if "error" in reply else []}

    def generate(self, seed: str, count: int) -> list[str]:
        return [engine.word(seed, i) for i in range(count)]


class RemoteSession:
    """The link to rank 0's MPI leader (trtllm-llmapi-launch), and a second one that only watches it."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.sock = socket.create_connection(wire.parse_addr(addr), timeout=30)
        self.sock.settimeout(None)
        self.reader = wire.Reader(self.sock)
        self.lock = threading.Lock()

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            wire.send(self.sock, request)
            reply = self.reader.one()
        if reply is None:
            gone(self.addr)
        assert reply is not None
        return reply

    def init(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self.call({"op": "init", "spec": spec})

    def generate(self, seed: str, count: int) -> list[str]:
        return list(self.call({"op": "generate", "seed": seed, "count": count})["words"])

    def watch(self) -> None:
        sock = socket.create_connection(wire.parse_addr(self.addr))
        wire.send(sock, {"op": "watch"})

        def run() -> None:
            while sock.recv(4096):
                pass
            gone(self.addr)

        threading.Thread(target=run, daemon=True).start()


_GONE = threading.Lock()


def gone(addr: str) -> None:
    _GONE.acquire()  # once, whichever thread notices first; the other waits for the exit
    log.log("E", f"the MPI session at {addr} is gone (rank 0's leader exited: a rank died or the job was "
                 "stopped); the server goes down")
    uvicorn("Shutting down")
    os._exit(1)


def uvicorn(message: str) -> None:
    print(f"INFO:     {message}", file=sys.stderr, flush=True)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    model: str
    session: LocalSession | RemoteSession
    max_seq_len: int | None


GET_ROUTES = ("/health", "/health_generate", "/version", "/v1/models")
POST_ROUTES = ("/v1/completions", "/v1/chat/completions")


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def access(self, status: int) -> None:
        phrase = HTTPStatus(status).phrase
        uvicorn(f'{self.client_address[0]}:{self.client_address[1]} - "{self.command} {self.path} '
                f'{self.request_version}" {status} {phrase}')

    def send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response_only(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.access(status)

    def send_plain(self, status: int, text: str = "") -> None:
        data = text.encode()
        self.send_response_only(status)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.access(status)

    def error(self, status: HTTPStatus, message: str, kind: str = "BadRequestError") -> None:
        self.send_json(status.value, {"object": "error", "message": message, "type": kind, "param": None,
                                      "code": status.value})

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/health":
            self.send_plain(200)
        elif path == "/health_generate":
            self.server.session.generate("health", 1)
            self.send_plain(200, "Generation health check OK")
        elif path == "/version":
            self.send_json(200, {"version": VERSION})
        elif path == "/v1/models":
            card = {"id": self.server.model, "object": "model", "created": int(time.time()),
                    "owned_by": "tensorrt_llm"}
            self.send_json(200, {"object": "list", "data": [card]})
        elif path in POST_ROUTES:
            self.send_json(405, {"detail": "Method Not Allowed"})
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        if path not in POST_ROUTES:
            if path in GET_ROUTES:
                self.send_json(405, {"detail": "Method Not Allowed"})
            else:
                self.send_json(404, {"detail": "Not Found"})
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as err:
            self.send_json(400, {"error": f"JSON decode error: {err}"})
            return
        chat = path == "/v1/chat/completions"
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                self.send_json(400, {"error": "[{'type': 'missing', 'loc': ('body', 'messages'), "
                                              "'msg': 'Field required'}]"})
                return
            prompt = " ".join(str(m.get("content") or "") for m in messages if isinstance(m, dict))
            limit = body.get("max_completion_tokens") or body.get("max_tokens") or 32
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list):
                prompt = " ".join(str(p) for p in prompt)
            if not isinstance(prompt, str):
                self.send_json(400, {"error": "[{'type': 'missing', 'loc': ('body', 'prompt'), "
                                              "'msg': 'Field required'}]"})
                return
            limit = body.get("max_tokens") or 16
        if not isinstance(limit, int) or limit < 1:
            self.error(HTTPStatus.BAD_REQUEST, f"max_tokens must be a positive integer, got {limit!r}")
            return
        prompt_tokens = len(prompt.split()) + (4 * len(body.get("messages", [])) if chat else 0)
        if self.server.max_seq_len is not None and prompt_tokens + limit > self.server.max_seq_len:
            self.error(HTTPStatus.BAD_REQUEST, f"The sum of prompt length ({prompt_tokens}) and max_tokens "
                                               f"({limit}) should not exceed max_seq_len ({self.server.max_seq_len})")
            return
        seed = hashlib.sha256(f"{self.server.model}\0{prompt}".encode()).hexdigest()[:16]
        words = self.server.session.generate(seed, limit)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(words),
                 "total_tokens": prompt_tokens + len(words)}
        if body.get("stream"):
            self.stream(chat, words, usage, bool((body.get("stream_options") or {}).get("include_usage")))
            return
        text = " ".join(words)
        created = int(time.time())
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None,
                                              "tool_calls": []}, "logprobs": None, "finish_reason": "length"}
            self.send_json(200, {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                                 "created": created, "model": self.server.model, "choices": [choice],
                                 "usage": usage})
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            self.send_json(200, {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                                 "created": created, "model": self.server.model, "choices": [choice],
                                 "usage": usage})

    def stream(self, chat: bool, words: list[str], usage: dict[str, int], include_usage: bool) -> None:
        self.send_response_only(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        base = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.server.model}

        def event(payload: Any) -> None:
            data = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        if chat:
            event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}]})
        for i, word in enumerate(words):
            text = word if i == 0 else f" {word}"
            last = "length" if i == len(words) - 1 else None
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": last} if chat
                      else {"index": 0, "text": text, "logprobs": None, "finish_reason": last})
            event({**base, "choices": [choice]})
        if include_usage:
            event({**base, "choices": [], "usage": usage})
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.access(200)


def build(args: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    extra = options.load(args["extra_llm_api_options"]) if args["extra_llm_api_options"] else {}
    return options.merged(args, extra)


def main(argv: list[str] | None = None) -> int:
    try:
        args = cli.parse(list(sys.argv[1:] if argv is None else argv))
    except cli.HelpRequested:
        sys.stdout.write(cli.help_text())
        return 0
    except cli.UsageError as err:
        sys.stderr.write(err.render())
        return err.exit_code
    log.set_level(args["log_level"])
    print(f"[TensorRT-LLM] TensorRT-LLM version: {VERSION}", flush=True)
    log.log("W", "hy3spark TEST DOUBLE: this is not TensorRT-LLM (no GPU, no weights, deterministic answers)")
    try:
        llm_args, replaced = build(args)
    except options.OptionsError as err:
        print("Traceback (most recent call last):\n  ...\npydantic_core._pydantic_core.ValidationError: "
              f"{err}", file=sys.stderr, flush=True)
        return 1
    except (OSError, ValueError) as err:  # an unreadable file, or YAML that does not parse
        print(f"Traceback (most recent call last):\n  ...\n{type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    for key in replaced:
        log.log("W", f"Overriding {key} with the extra LLM API options")
    backend = {"pytorch": "PyTorch", "tensorrt": "TensorRT", "_autodeploy": "AutoDeploy"}[args["backend"]]
    log.log("I", f"Using LLM with {backend} backend")
    server = Server((args["host"], args["port"]), Handler, bind_and_activate=False)
    try:
        server.server_bind()
    except OSError as err:
        print(f"RuntimeError: Failed to bind socket to {args['host']}:{args['port']}: {err}", file=sys.stderr)
        return 1
    addr = os.environ.get("TLLM_SPAWN_PROXY_PROCESS_IPC_ADDR", "")
    if os.environ.get("TLLM_SPAWN_PROXY_PROCESS") == "1" and addr:
        log.log("I", f"Using RemoteMpiCommSessionClient to bind to external MPI processes at {addr}")
        session: LocalSession | RemoteSession = RemoteSession(addr)
        session.watch()
    else:
        session = LocalSession()
    spec = {"model": args["model"], "revision": args["revision"], "llm_args": llm_args}
    reply = session.init(spec)
    need = llm_args["tensor_parallel_size"] * llm_args["pipeline_parallel_size"]
    if reply["ok"] and reply["world_size"] != need:
        reply = {"ok": False, "errors": [f"the MPI world has {reply['world_size']} rank(s) and tp_size * pp_size "
                                         f"= {need}: they must be equal"]}
    if not reply["ok"]:
        for problem in reply["errors"]:
            log.log("E", problem)
        print(f"RuntimeError: Executor worker returned error: {reply['errors'][0]}", file=sys.stderr, flush=True)
        return 1
    tokens = min(r["kv_tokens"] for r in reply["ranks"])
    max_seq_len = args["max_seq_len"] or min(tokens, reply["ranks"][0]["max_position_embeddings"] or tokens)
    log.log("I", f"max_seq_len={max_seq_len}, max_num_requests={args['max_batch_size']}, "
                 f"max_num_tokens={args['max_num_tokens']}, max_batch_size={args['max_batch_size']}")
    served = reply["ranks"][0]["model"]
    server.model, server.session, server.max_seq_len = served, session, args["max_seq_len"]
    uvicorn(f"Started server process [{os.getpid()}]")
    uvicorn("Waiting for application startup.")
    server.server_activate()
    uvicorn("Application startup complete.")
    uvicorn(f"Uvicorn running on http://{args['host']}:{args['port']} (Press CTRL+C to quit)")

    def stop(signum: int, _frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve_forever(poll_interval=0.2)
    uvicorn("Shutting down")
    uvicorn("Waiting for application shutdown.")
    uvicorn("Application shutdown complete.")
    uvicorn(f"Finished server process [{os.getpid()}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
