"""What NCCL prints on each rank when ``NCCL_DEBUG=INFO`` (hy3spark's transport gate reads it, hy3spark/nccl.py).

The double fakes the RDMA NIC with the GPU. ``TRTLLM_DOUBLE_NCCL_NET`` decides what a rank reports: a comma list
of ``[HOST=]IB|Socket`` (the first entry naming the rank's host name wins, then one without a host). Otherwise a
rank reports RDMA (``via NET/IB/0/GDRDMA``) when its own environment enables InfiniBand (``NCCL_IB_HCA`` set,
``NCCL_IB_DISABLE`` not 1) and the silent TCP fallback (``via NET/Socket/0``) when not. A rank on another node
sees only what mpirun passed it (``-x NAME``) and what its sshd session has, as with the real engine: a node's
container env does not reach a rank started over SSH. Lines follow NCCL 2.27's format, to stdout or to
``NCCL_DEBUG_FILE`` (``%h`` host, ``%p`` pid). One communicator over all ranks in a ring, two channels.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys

VERSION = "2.27.7+cuda13.0"


def transport(host: str) -> str:
    raw = os.environ.get("TRTLLM_DOUBLE_NCCL_NET", "").strip()
    default = None
    for item in filter(None, (part.strip() for part in raw.split(","))):
        who, sep, net = item.rpartition("=")
        value = {"ib": "IB", "socket": "Socket"}.get(net.strip().lower())
        if value is None:
            raise ValueError(f"TRTLLM_DOUBLE_NCCL_NET={raw!r}: {item!r} is not [HOST=]IB or [HOST=]Socket")
        if not sep:
            default = default or value
        elif who.strip() == host:
            return value
    if default:
        return default
    if os.environ.get("NCCL_IB_DISABLE", "0").strip() == "1" or not os.environ.get("NCCL_IB_HCA", "").strip():
        return "Socket"
    return "IB"


def _address(ifname: str) -> str:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", *(["dev", ifname] if ifname else [])],
                         capture_output=True, text=True, check=False).stdout.split("\n")
    for line in out:
        words = line.split()
        if len(words) > 3 and words[1] != "lo":
            return words[3].split("/")[0]
    return "127.0.0.1"


def lines(rank: int, world: int, nodes: int, host: str) -> list[str]:
    ifname = os.environ.get("NCCL_SOCKET_IFNAME", "").strip().lstrip("=^")
    ip = _address(ifname.split(",")[0] if ifname else "")
    ifname = ifname.split(",")[0] if ifname else "eth0"
    net = transport(host)
    out = [f"{name} set by environment to {os.environ[name]}"
           for name in ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_IB_HCA") if name in os.environ]
    out.append(f"NCCL version {VERSION}")
    if net == "IB":
        hcas = [h.split(":")[0] for h in os.environ.get("NCCL_IB_HCA", "").lstrip("=^").split(",") if h.strip()]
        devices = " ".join(f"[{i}]{hca}:1/RoCE" for i, hca in enumerate(hcas or ["mlx5_0"]))
        out += [f"NET/IB : Using {devices} [RO]; OOB {ifname}:{ip}<0>", "Initialized NET plugin IB", "Using network IB"]
    else:
        out += ["NET/IB : No device found.", f"NET/Socket : Using [0]{ifname}:{ip}<0>",
                "Initialized NET plugin Socket", "Using network Socket"]
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
    out += [f"Channel {c}/0 : {prev}[0] -> {rank}[0] [receive] via {via}" for c in ("00", "01")]
    out += [f"Channel {c}/0 : {rank}[0] -> {nxt}[0] [send] via {via}" for c in ("00", "01")]
    out.append(f"Connected all rings, use ring PXN 0 GDR {1 if net == 'IB' else 0}")
    return out


def emit(rank: int, world: int, nodes: int) -> None:
    if world < 2 or os.environ.get("NCCL_DEBUG", "").strip().upper() not in ("INFO", "TRACE"):
        return
    host, pid = socket.gethostname(), os.getpid()
    text = "".join(f"{host}:{pid}:{pid} [0] NCCL INFO {line}\n" for line in lines(rank, world, nodes, host))
    target = os.environ.get("NCCL_DEBUG_FILE", "").strip()
    if target:
        with open(target.replace("%h", host).replace("%p", str(pid)), "a") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
