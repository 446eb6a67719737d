"""What NCCL prints on each rank when ``NCCL_DEBUG=INFO`` (hy3spark's transport gate reads it).

The double fakes the RDMA NIC along with the GPU. The TEST decides the transport a rank reports, through
``VLLM_DOUBLE_NCCL_NET`` (a VLLM_ variable, so vLLM's Ray executor copies it from the head to every rank): a
comma-separated list of ``[WHO=]IB|Socket``, where WHO is a rank's host name or its ``VLLM_HOST_IP``. The first
entry naming the rank wins, then an entry without WHO. ``IB=`` means ``NET/IB`` with GPUDirect RDMA (``via
NET/IB/0/GDRDMA``), ``Socket`` the silent TCP fallback (``via NET/Socket/0``). Examples: ``Socket`` (every rank
falls back), ``site-worker=Socket`` (only that node), ``10.95.0.12=Socket,IB``. A rank the variable does not decide
uses RDMA when its environment enables InfiniBand (``NCCL_IB_HCA`` set and ``NCCL_IB_DISABLE`` not 1, i.e. the
node's env file reached the container) and the TCP fallback otherwise. A malformed value stops the rank with an
error naming the variable, as a test's typo must not pass silently.

Lines follow NCCL 2.28's format (``host:pid:tid [cudaDev] NCCL INFO ...``, see shared/fixtures/nccl/) and go to
stdout, or to ``NCCL_DEBUG_FILE`` (``%h`` = hostname, ``%p`` = pid) when set, as NCCL does. One communicator over all
ranks in a ring, two channels, one GPU per node (cudaDev 0).
"""

from __future__ import annotations

import os
import random
import socket
import sys

VERSION = "2.28.9+cuda13.0"


def _forced(host: str, ip: str) -> str | None:
    raw = os.environ.get("VLLM_DOUBLE_NCCL_NET", "").strip()
    if not raw:
        return None
    default = None
    for item in raw.split(","):
        who, sep, net = item.strip().rpartition("=")
        value = {"ib": "IB", "socket": "Socket"}.get(net.strip().lower())
        if value is None:
            raise ValueError(f"VLLM_DOUBLE_NCCL_NET={raw!r}: {item.strip()!r} is not [HOST|IP=]IB or [HOST|IP=]Socket")
        if not sep:
            default = default or value
        elif who.strip() in (host, ip):
            return value
    return default


def transport(host: str | None = None, ip: str | None = None) -> str:
    """The transport this rank reports: what the test asked for (VLLM_DOUBLE_NCCL_NET), else what its env allows."""
    host = host if host is not None else socket.gethostname()
    ip = ip if ip is not None else os.environ.get("VLLM_HOST_IP", "")
    forced = _forced(host, ip)
    if forced is not None:
        return forced
    if os.environ.get("NCCL_IB_DISABLE", "0").strip() == "1" or not os.environ.get("NCCL_IB_HCA", "").strip():
        return "Socket"
    return "IB"


def hcas() -> list[str]:
    raw = os.environ.get("NCCL_IB_HCA", "").strip().lstrip("=^")
    return [item.split(":")[0] for item in raw.split(",") if item.strip()] or ["mlx5_0"]


def lines(rank: int, world: int, nodes: int, ip: str) -> list[str]:
    ifname = os.environ.get("NCCL_SOCKET_IFNAME", "").strip() or "eth0"
    net = transport(socket.gethostname(), ip)
    out = []
    for name in ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_IB_HCA"):
        if name in os.environ:
            out.append(f"{name} set by environment to {os.environ[name]}")
    out.append(f"NCCL version {VERSION}")
    if net == "IB":
        devices = " ".join(f"[{i}]{hca}:1/RoCE" for i, hca in enumerate(hcas()))
        out += [f"NET/IB : Using {devices} [RO]; OOB {ifname}:{ip}<0>", "Initialized NET plugin IB", "Using network IB"]
    else:
        out += [
            "NET/IB : No device found.",
            f"NET/Socket : Using [0]{ifname}:{ip}<0>",
            "Initialized NET plugin Socket",
            "Using network Socket",
        ]
    comm = f"0x{random.getrandbits(28):x}"
    comm_id = f"0x{random.Random(world * 7919 + nodes).getrandbits(64):016x}"
    header = f"ncclCommInitRankConfig comm {comm} rank {rank} nranks {world} cudaDev 0 nvmlDev 0 busId f01000"
    out.append(f"{header} commId {comm_id} - Init START")
    out.append(f"comm {comm} rank {rank} nRanks {world} nNodes {nodes} localRanks 1 localRank 0 MNNVL 0")
    ring = " ".join(str(r) for r in range(world))
    out += [f"Channel 00/02 : {ring}", f"Channel 01/02 : {ring}"]
    out.append(f"{header} commId {comm_id} - Init COMPLETE")
    via = "NET/IB/0/GDRDMA" if net == "IB" else "NET/Socket/0"
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    for channel in ("00", "01"):
        out.append(f"Channel {channel}/0 : {prev}[0] -> {rank}[0] [receive] via {via}")
    for channel in ("00", "01"):
        out.append(f"Channel {channel}/0 : {rank}[0] -> {nxt}[0] [send] via {via}")
    out.append(f"Connected all rings, use ring PXN 0 GDR {1 if net == 'IB' else 0}")
    return out


def emit(rank: int, world: int, nodes: int, ip: str) -> None:
    if world < 2 or os.environ.get("NCCL_DEBUG", "").strip().upper() not in ("INFO", "TRACE"):
        return
    host, pid = socket.gethostname(), os.getpid()
    text = "".join(f"{host}:{pid}:{pid} [0] NCCL INFO {line}\n" for line in lines(rank, world, nodes, ip))
    target = os.environ.get("NCCL_DEBUG_FILE", "").strip()
    if target:
        path = target.replace("%h", host).replace("%p", str(pid))
        with open(path, "a") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
