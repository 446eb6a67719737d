#!/usr/bin/env python3
"""hy3spark's API front for an engine that checks no API key (trtllm-serve: NVIDIA/TensorRT-LLM#9950).

The serve script starts it in the head's engine container, in the background, right before it execs the engine
launcher (mpirun); the engine then listens on loopback only and this front on the public address. It answers as
vLLM's --api-key does (vLLM 0.23's AuthenticationMiddleware): a path under /v1 needs `Authorization: Bearer <key>`
(401 otherwise), every other path (/health, /version, /metrics) and every OPTIONS request pass without one.
Everything else is forwarded as it came: method, path, body, the end-to-end headers; the answer comes back chunk by
chunk as the engine sends it (a `stream: true` completion's server-sent events are never held back).

The key comes from the environment only: `--key-env NAME` names the variable (the serve script sources it from the
0600 secrets file and unsets it before the engine starts), so no command line, `ps` or `docker inspect` shows it.
The front exits when the process that started it does (the serve script, which execs the launcher): nothing of it
outlives a stop. If it cannot serve (no key, the port stays taken), it stops that process too, so the failed start
is seen at once, with this front's message in the serve log, instead of a /health that never answers.

Python's standard library only: the engine's image is the engine's, with no packages of ours.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import posixpath
import secrets
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

# Hop-by-hop headers (RFC 9110 7.6.1) are the connection's, not the message's (Expect too: this front answered the
# client's 100-continue itself); Host is the upstream's own, and the key stays with the front: the engine never
# sees it.
HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding",
       "upgrade", "expect", "host", "authorization"}
PARENT_POLL_S = 0.5
BIND_RETRY_S = 15.0  # a front stopped with its engine a moment ago may hold the port until its next poll
CHUNK = 65536


def log(message: str) -> None:
    print(f"hy3spark api front: {message}", file=sys.stderr, flush=True)


def protected(target: str) -> bool:
    """Whether a request target needs the key: a path under /v1, as vLLM decides it (on the percent-decoded path
    the engine's router sees). Every spelling the engine could route to /v1 counts: decoded, dot segments resolved,
    repeated slashes folded. Anything that is not a plain absolute path is refused before this (400)."""
    path = unquote(target.split("?", 1)[0].split("#", 1)[0])
    forms = {path, "/" + path.lstrip("/"), posixpath.normpath("/" + path.lstrip("/"))}
    return any(form.startswith("/v1") for form in forms)


class Front(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], key: str) -> None:
        self.upstream = upstream
        # Compared as digests with compare_digest, as vLLM does: constant time, whatever the length offered.
        self.expected = hashlib.sha256(key.encode()).digest()
        super().__init__(listen, Handler)

    def authorized(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        offered = hashlib.sha256(token.encode()).digest()
        return secrets.compare_digest(offered, self.expected) and scheme.lower() == "bearer"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Front
    timeout = 600  # an idle keep-alive client gives its thread back after this

    def log_message(self, format: str, *args: object) -> None:
        pass  # the engine logs every request itself; the serve log needs no second access line

    def _error(self, status: int, message: str, kind: str, code: str | None = None) -> None:
        """An OpenAI-style error body (vLLM's own 401 body is {"error": "Unauthorized"}; clients read the status)."""
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            self._error(411, "send the request body with a Content-Length", "invalid_request_error")
            return None
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        if not length.isdigit():
            self.close_connection = True
            self._error(400, "bad Content-Length", "invalid_request_error")
            return None
        return self.rfile.read(int(length))

    def _forward(self) -> None:
        if not self.path.startswith("/"):  # absolute-form or authority-form: not what a client of this API sends
            self.close_connection = True
            self._error(400, "the request target must be a path", "invalid_request_error")
            return
        if self.command != "OPTIONS" and protected(self.path) and not self.server.authorized(
                self.headers.get("Authorization")):
            body = self._body()  # read it all, so the connection stays usable
            if body is not None:
                self._error(401, "Unauthorized: this endpoint needs the API key (Authorization: Bearer <key>)",
                            "invalid_request_error", "invalid_api_key")
            return
        body = self._body()
        if body is None:
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
        headers["Host"] = f"{self.server.upstream[0]}:{self.server.upstream[1]}"
        if body or self.command in ("POST", "PUT", "PATCH"):
            headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(*self.server.upstream, timeout=10)
        try:
            try:
                upstream.connect()
                # A long prompt's prefill can keep the first token away for minutes: no read timeout upstream.
                upstream.sock.settimeout(None)
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                response = upstream.getresponse()
            except OSError as exc:
                self.close_connection = True
                self._error(502, f"the engine behind the API front does not answer ({exc.__class__.__name__}); "
                                 "it may still be loading", "upstream_error")
                return
            self._relay(response)
        finally:
            upstream.close()

    def _relay(self, response: http.client.HTTPResponse) -> None:
        self.send_response(response.status, response.reason)
        length = response.getheader("Content-Length")
        no_body = self.command == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200
        for key, value in response.getheaders():
            if key.lower() not in HOP and key.lower() not in ("content-length", "date", "server"):
                self.send_header(key, value)
        chunked = not no_body and length is None
        if no_body:
            if length is not None:
                self.send_header("Content-Length", length)
        elif chunked:
            # Of unknown length (the engine's streams): re-chunked to the client as each piece arrives.
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", length)
        if response.will_close and not chunked and length is None:
            self.close_connection = True
        self.end_headers()
        if no_body:
            return
        try:
            while piece := response.read1(CHUNK):
                if chunked:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                else:
                    self.wfile.write(piece)
                self.wfile.flush()
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            # The client left: closing the upstream connection (finally, above) ends the generation there too.
            self.close_connection = True
        except (http.client.IncompleteRead, OSError):
            self.close_connection = True  # the engine went away mid-answer: the client sees the cut

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _forward


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def give_up(parent: int, message: str) -> None:
    """The front is part of the serving: without it the API port answers nothing. Stop the process that started it
    (the engine launcher), so the start fails at once with this message in the serve log."""
    log(f"{message}; stopping the engine launcher (PID {parent})")
    with contextlib.suppress(OSError):
        os.kill(parent, signal.SIGTERM)
    sys.exit(1)


def bind(listen: tuple[str, int], upstream: tuple[str, int], key: str, parent: int) -> Front:
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            return Front(listen, upstream, key)
        except OSError as exc:
            if os.getppid() != parent:
                sys.exit(1)  # the launcher is gone already: nothing to serve, nobody to stop
            if time.monotonic() >= deadline:
                give_up(parent, f"cannot listen on {listen[0]}:{listen[1]}: {exc.strerror or exc}")
            time.sleep(0.5)


def watch(parent: int) -> None:
    """Exit with the parent: once it is gone, this process is some other process's child."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    log(f"the engine launcher (PID {parent}) exited; the API front exits too")
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=address, required=True, help="HOST:PORT the API answers on")
    parser.add_argument("--upstream", type=address, required=True, help="HOST:PORT of the engine (loopback)")
    parser.add_argument("--key-env", required=True, help="NAME of the environment variable that holds the key")
    args = parser.parse_args(argv)
    parent = os.getppid()
    key = os.environ.get(args.key_env, "")
    if not key:
        give_up(parent, f"{args.key_env} is not set in its environment (the serve script sources it from the "
                        "secrets file)")
    server = bind(args.listen, args.upstream, key, parent)
    threading.Thread(target=watch, args=(parent,), daemon=True).start()
    host, port = args.listen
    log(f"listening on {host}:{port} for the engine on {args.upstream[0]}:{args.upstream[1]}; "
        f"/v1 needs the API key from {args.key_env}")
    server.serve_forever()


if __name__ == "__main__":
    main()
