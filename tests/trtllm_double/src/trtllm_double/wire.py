"""The proxy link between `trtllm-serve` (no MPI in its environment) and rank 0's MPI leader, as
TLLM_SPAWN_PROXY_PROCESS_IPC_ADDR names it: JSON lines over TCP on 127.0.0.1 (the engine's own is ZeroMQ)."""

from __future__ import annotations

import json
import socket
from typing import Any


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


class Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def messages(self) -> list[dict[str, Any]] | None:
        """The complete messages that arrived (one recv); None when the peer closed the link."""
        chunk = self.sock.recv(65536)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def one(self) -> dict[str, Any] | None:
        while b"\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    return host, int(port)
