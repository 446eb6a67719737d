"""vLLM's internal TCP ports: where vLLM 0.23 opens them, the double opens them too, so a firewall test can see them.

- ``get_open_port`` is vLLM's (vllm/utils/network_utils.py ``get_open_port``/``_get_open_port``, with
  vllm/envs.py ``get_vllm_port`` for ``VLLM_PORT``): with ``VLLM_PORT`` set, the first port from it upward that binds
  on all addresses (a port that does not: ``Port %d is already in use, trying port %d`` at INFO); unset, a free port
  the kernel picks. The probe socket is closed again: the caller binds the port later, as vLLM does.
- the torch.distributed store (``init_process_group(init_method="tcp://ip:port")``): rank 0's TCPStore server listens
  on ALL addresses, whatever address the init method names; the other ranks connect to the init method's address and
  fail with torch's ``DistNetworkError`` text when it never answers.
- a MessageQueue with readers on other nodes (vllm/distributed/device_communicators/shm_broadcast.py, the writer's
  ``remote_socket``): bound to ``tcp://<get_ip()>:<get_open_port()>``, the node's own address only.

No torch and no ZMQ: the listeners accept connections and hold them; nothing is sent over them.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import re
import socket
import threading
import time
from urllib.parse import urlsplit

from vllm.double import log

# urllib3's parse_url finds a scheme in anything starting like this (its _SCHEME_RE): vLLM's URI check.
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+-]*:")


class DistStoreError(RuntimeError):
    pass


class DistNetworkError(RuntimeError):
    pass


# Tracebacks name them as torch does (torch.distributed.DistStoreError: ...).
DistStoreError.__module__ = DistNetworkError.__module__ = "torch.distributed"


def vllm_port() -> int | None:
    """envs.VLLM_PORT (vllm/envs.py get_vllm_port)."""
    if "VLLM_PORT" not in os.environ:
        return None
    port = os.getenv("VLLM_PORT", "0")
    try:
        return int(port)
    except ValueError as err:
        if _SCHEME.match(port):
            raise ValueError(
                f"VLLM_PORT '{port}' appears to be a URI. This may be caused by a Kubernetes service discovery issue,"
                "check the warning in: https://docs.vllm.ai/en/stable/serving/env_vars.html"
            ) from None
        raise ValueError(f"VLLM_PORT '{port}' must be a valid integer") from err


def get_open_port(tag: str | None = None) -> int:
    """vLLM's get_open_port without VLLM_DP_MASTER_PORT (data parallelism is not doubled). ``tag``: the process the
    log line belongs to (log.ENGINE in the engine core, None in a worker)."""
    port = vllm_port()
    if port is not None:
        while True:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.bind(("", port))
                    return port
            except OSError:
                port += 1
                log.info("network_utils.py:205", f"Port {port - 1} is already in use, trying port {port}", tag)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def tcp_uri(ip: str, port: int) -> str:
    """get_distributed_init_method / get_tcp_uri."""
    try:
        bracketed = ipaddress.ip_address(ip).version == 6
    except ValueError:
        bracketed = False
    return f"tcp://[{ip}]:{port}" if bracketed else f"tcp://{ip}:{port}"


def split_uri(uri: str) -> tuple[str, int]:
    parts = urlsplit(uri)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"not a tcp://host:port address: {uri!r}")
    return parts.hostname, parts.port


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on (host, port); host "" is every address. OSError when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libuv (TCPStore) and ZMQ set it
    try:
        sock.bind((host, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def store_socket(port: int) -> socket.socket:
    """Rank 0's TCPStore server socket: every address of the node, torch's error when it cannot listen."""
    try:
        return listening_socket("", port)
    except OSError as err:
        code = err.errno or 0
        raise DistNetworkError(
            f"The server socket has failed to listen on any local network address. port: {port}, useIpv6: false, "
            f"code: -{code}, name: {errno.errorcode.get(code, 'UNKNOWN')}, message: {(err.strerror or '').lower()}"
        ) from None


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCPStore client: retry until the server answers, torch's DistNetworkError after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=2)
        except OSError:
            if time.monotonic() >= deadline:
                raise DistNetworkError(
                    f"The client socket has timed out after {int(timeout_s * 1000)}ms while trying to connect to "
                    f"({host}, {port})."
                ) from None
            time.sleep(0.2)
            continue
        sock.settimeout(None)
        return sock


def connect_queue(address: str, timeout_s: float, rank: int) -> socket.socket:
    """A remote reader joining a MessageQueue's ``remote_subscribe_addr``. vLLM's ZMQ subscriber would retry for ever
    (the writer blocks in ``wait_until_ready``); the double gives up after the distributed timeout."""
    host, port = split_uri(address)
    try:
        return connect(host, port, timeout_s)
    except DistNetworkError:
        raise RuntimeError(
            f"hy3spark TEST DOUBLE: rank {rank} could not reach the broadcast queue at {address} within "
            f"{timeout_s:g} s (vLLM's ZMQ subscriber would keep waiting)"
        ) from None


class Listener:
    """A listening socket kept open until ``close``: an accept loop in a daemon thread holds every connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.host, self.port = sock.getsockname()[:2]
        self.peers: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"listener-{self.port}").start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.peers.append(conn)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        self.sock.close()
        for conn in self.peers:
            conn.close()
