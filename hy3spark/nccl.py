"""The NCCL transport gate: read every rank's ``NCCL_DEBUG=INFO`` log and refuse a run whose traffic fell back to TCP.

A two-Spark cluster must move tensors over RDMA (``via NET/IB/<n>/GDRDMA``). When something is off (the IB plugin
cannot find a device, NCCL_IB_DISABLE=1, the env never reached the container) NCCL does not fail: it quietly uses
``NET/Socket``, and the cluster serves at a fraction of the speed. Nothing else in the field checks this.

NCCL logs one line per connection when it sets up a channel (``Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM``,
``Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0``, ``... [receive] via NET/IB/0/GDRDMA``): ranks are the
communicator's, the bracketed numbers their devices. P2P connections are logged once, by the sender; NET connections
by both ends ([send] and [receive]). Counts here are of those lines.

Which communicator a channel line belongs to is not in the line: it is attributed to the communicator most recently
initialised by the same process, which holds for the usual one-communicator-at-a-time setup (NCCL >= 2.22 connects
lazily, at a communicator's first collective). The gate's verdict on Socket does not depend on this; only the
inter-node flag does.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

# Every NCCL line starts with "<hostname>:<pid>:<tid> [<cudaDev>] NCCL INFO "; Ray or vLLM may put their own prefix
# in front, so the header is searched for, not matched at the start.
_HEADER = re.compile(r"(?P<host>[\w.-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] NCCL INFO (?P<msg>.*)$")
_VERSION = re.compile(r"^NCCL version (?P<version>\S+)")
# "ncclCommInitRankConfig comm 0x1686d040 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 60 commId 0xaf38... - Init START"
# (older NCCL: "ncclCommInitRank", no nvmlDev, no commId).
_INIT = re.compile(
    r"^ncclCommInitRank\w* comm (?P<comm>0x[0-9a-f]+) rank (?P<rank>\d+) nranks (?P<nranks>\d+) "
    r"cudaDev (?P<cuda_dev>\d+)(?: nvmlDev (?P<nvml_dev>\d+))? busId (?P<bus_id>[0-9a-fA-F]+)"
    r"(?: commId (?P<comm_id>0x[0-9a-f]+))?"
)
# "comm 0x10725170 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0": NCCL's own count of nodes.
_TOPOLOGY = re.compile(r"^comm (?P<comm>0x[0-9a-f]+) rank \d+ nRanks \d+ nNodes (?P<nnodes>\d+)")
_CHANNEL = re.compile(
    r"^Channel (?P<channel>\d+)/(?P<conn>\d+) : (?P<src>\d+)\[(?P<src_dev>[0-9a-fA-F]+)\] -> "
    r"(?P<dst>\d+)\[(?P<dst_dev>[0-9a-fA-F]+)\](?: \[(?P<direction>send|receive)\])? via (?P<via>.+?)\s*$"
)
# "NET/IB : Using [0]rocep1s0f1:1/RoCE [1]roceP2p1s0f1:1/RoCE [RO]; OOB enp1s0f1np1:10.0.0.1<0>"; [RO] is a flag.
_IB_USING = re.compile(r"^NET/IB : Using (?P<devices>.*?)(?:; OOB|$)")
_IB_DEVICE = re.compile(r"\[\d+\](?P<name>[^\s:\[]+):\d+/(?:IB|RoCE)")
# "NCCL_IB_DISABLE set by environment to 1." (ENV subsystem) and "NCCL_SOCKET_IFNAME set to lo" (NET).
_ENV_SET = re.compile(r"^(?P<name>NCCL_\w+) set (?:by environment )?to (?P<value>.*?)\.?\s*$")


class Transport(StrEnum):
    IB_GDRDMA = "NET/IB+GDRDMA"
    IB_NO_GDRDMA = "NET/IB without GDRDMA"
    SOCKET = "NET/Socket"
    NET_OTHER = "NET (other plugin)"
    P2P = "P2P"
    SHM = "SHM"
    OTHER = "other"


def classify(via: str) -> Transport:
    """The class of a channel line's ``via`` text: ``NET/IB/0/GDRDMA``, ``NET/Socket/0``, ``P2P/CUMEM``, ``SHM/...``."""
    kind, _, rest = via.partition("/")
    if kind == "NET":
        plugin = rest.split("/", 1)[0]
        if plugin == "IB":
            return Transport.IB_GDRDMA if "/GDRDMA" in rest else Transport.IB_NO_GDRDMA
        return Transport.SOCKET if plugin == "Socket" else Transport.NET_OTHER
    return {"P2P": Transport.P2P, "SHM": Transport.SHM}.get(kind, Transport.OTHER)


@dataclass(frozen=True)
class RankInfo:
    """One rank of one communicator, from its init line."""

    log: str  # label of the log it came from
    comm_id: str  # NCCL's commId, shared by all ranks of a communicator (the comm pointer when not logged)
    rank: int
    nranks: int
    hostname: str
    pid: int
    cuda_dev: int
    nvml_dev: int | None
    bus_id: str
    nccl_version: str | None
    nnodes: int | None  # NCCL's own node count for the communicator, when logged


@dataclass(frozen=True)
class Channel:
    log: str
    comm_id: str | None
    channel: int
    conn_index: int
    src_rank: int
    dst_rank: int
    direction: str | None  # "send" or "receive" for NET lines; None for P2P/SHM, which log the sender only
    via: str
    transport: Transport
    src_host: str | None
    dst_host: str | None
    line: str

    @property
    def inter_node(self) -> bool | None:
        """True when the ranks are on different hosts; None when a host is unknown."""
        if self.src_host is None or self.dst_host is None:
            return None
        return self.src_host != self.dst_host

    def describe(self) -> str:
        hosts = f" ({self.src_host} -> {self.dst_host})" if self.src_host and self.dst_host else ""
        direction = f" [{self.direction}]" if self.direction else ""
        return (
            f"channel {self.channel:02d}: rank {self.src_rank} -> rank {self.dst_rank}{hosts}{direction} via "
            f"{self.via} (in {self.log})"
        )


@dataclass(frozen=True)
class TransportReport:
    ranks: tuple[RankInfo, ...]
    channels: tuple[Channel, ...]
    # "NCCL_X set by environment to Y" per log: what actually reached the process.
    env: Mapping[str, Mapping[str, str]]
    # IB devices NCCL said it uses, per log (empty when it found none).
    ib_devices: Mapping[str, tuple[str, ...]]
    # Lines that explain a fallback ("NET/IB : No device found.", "Failed to initialize NET plugin IB").
    evidence: tuple[str, ...]

    def counts(self) -> dict[Transport, int]:
        counted = Counter(channel.transport for channel in self.channels)
        return {transport: counted[transport] for transport in Transport}

    @property
    def hosts(self) -> frozenset[str]:
        return frozenset(rank.hostname for rank in self.ranks)


def parse_logs(logs: Mapping[str, str] | Sequence[str]) -> TransportReport:
    """Parse every rank's NCCL INFO log (label -> text, or texts labelled "log 0", "log 1", ...)."""
    labelled = dict(logs) if isinstance(logs, Mapping) else {f"log {i}": text for i, text in enumerate(logs)}
    ranks: list[RankInfo] = []
    raw_channels: list[tuple[str, str | None, re.Match[str], str]] = []
    env: dict[str, dict[str, str]] = {}
    ib_devices: dict[str, tuple[str, ...]] = {}
    evidence: list[str] = []
    for label, text in labelled.items():
        version: str | None = None
        comm_of_pointer: dict[str, str] = {}
        current_comm: dict[int, str] = {}  # pid -> comm most recently initialised by that process
        nnodes: dict[str, int] = {}
        pending: list[tuple[re.Match[str], re.Match[str]]] = []  # init lines, completed once nnodes is known
        env[label] = {}
        for line in text.splitlines():
            header = _HEADER.search(line)
            if header is None:
                continue
            msg, pid = header["msg"], int(header["pid"])
            if match := _VERSION.match(msg):
                version = match["version"]
            elif match := _INIT.match(msg):
                comm_id = match["comm_id"] or match["comm"]
                comm_of_pointer[match["comm"]] = comm_id
                current_comm[pid] = comm_id
                # Init START and Init COMPLETE both match; one rank entry per communicator is enough.
                if not any(m["comm"] == match["comm"] for _, m in pending):
                    pending.append((header, match))
            elif match := _TOPOLOGY.match(msg):
                nnodes[comm_of_pointer.get(match["comm"], match["comm"])] = int(match["nnodes"])
            elif match := _CHANNEL.match(msg):
                raw_channels.append((label, current_comm.get(pid), match, line.strip()))
            elif match := _ENV_SET.match(msg):
                env[label][match["name"]] = match["value"]
            elif match := _IB_USING.match(msg):
                ib_devices[label] = tuple(device["name"] for device in _IB_DEVICE.finditer(match["devices"]))
            elif msg.startswith(("NET/IB : No device found", "Failed to initialize NET plugin IB")):
                evidence.append(f"{label}: {msg.strip()}")
        for head, init in pending:
            comm_id = init["comm_id"] or init["comm"]
            ranks.append(
                RankInfo(
                    log=label,
                    comm_id=comm_id,
                    rank=int(init["rank"]),
                    nranks=int(init["nranks"]),
                    hostname=head["host"],
                    pid=int(head["pid"]),
                    cuda_dev=int(init["cuda_dev"]),
                    nvml_dev=int(init["nvml_dev"]) if init["nvml_dev"] is not None else None,
                    bus_id=init["bus_id"],
                    nccl_version=version,
                    nnodes=nnodes.get(comm_id),
                )
            )
    host_of = {(rank.comm_id, rank.rank): rank.hostname for rank in ranks}
    channels = tuple(
        Channel(
            log=label,
            comm_id=comm_id,
            channel=int(match["channel"]),
            conn_index=int(match["conn"]),
            src_rank=int(match["src"]),
            dst_rank=int(match["dst"]),
            direction=match["direction"],
            via=match["via"],
            transport=classify(match["via"]),
            src_host=host_of.get((comm_id, int(match["src"]))),
            dst_host=host_of.get((comm_id, int(match["dst"]))),
            line=line,
        )
        for label, comm_id, match, line in raw_channels
    )
    return TransportReport(
        ranks=tuple(ranks),
        channels=channels,
        env={label: dict(values) for label, values in env.items()},
        ib_devices=ib_devices,
        evidence=tuple(evidence),
    )


@dataclass(frozen=True)
class GateResult:
    passed: bool
    counts: Mapping[Transport, int]
    failures: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        summary = ", ".join(f"{transport.value}: {n}" for transport, n in self.counts.items() if n)
        verdict = "PASS" if self.passed else "FAIL"
        lines = [f"NCCL transport gate: {verdict} ({summary or 'no channel lines'})"]
        lines += [f"  error: {text}" for text in self.failures]
        lines += [f"  warning: {text}" for text in self.warnings]
        lines += [f"  note: {text}" for text in self.notes]
        return "\n".join(lines)


# How many offending channel lines a message lists before summarising the rest.
_LISTED_CHANNELS = 6


def _listing(channels: Sequence[Channel]) -> str:
    shown = [f"\n    {channel.describe()}" for channel in channels[:_LISTED_CHANNELS]]
    more = len(channels) - _LISTED_CHANNELS
    return "".join(shown) + (f"\n    ... and {more} more" if more > 0 else "")


def _silent_ranks(report: TransportReport) -> list[str]:
    """Per communicator, the ranks (of its nranks) that logged no init line: their channels went unseen."""
    seen: dict[str, set[int]] = {}
    size: dict[str, int] = {}
    for rank in report.ranks:
        seen.setdefault(rank.comm_id, set()).add(rank.rank)
        size[rank.comm_id] = max(size.get(rank.comm_id, 0), rank.nranks)
    silent = []
    for comm_id, nranks in size.items():
        missing = [r for r in range(nranks) if r not in seen[comm_id]]
        if missing:
            hosts = ", ".join(sorted({rank.hostname for rank in report.ranks if rank.comm_id == comm_id}))
            listed = ", ".join(str(r) for r in missing)
            silent.append(f"communicator {comm_id} has {nranks} ranks; rank(s) {listed} logged nothing (heard from: "
                          f"{hosts})")
    return silent


def _socket_causes(report: TransportReport) -> list[str]:
    """Why NCCL may have fallen back to sockets: what the logs show first, then the usual causes."""
    causes = [f"the logs say: {line}" for line in report.evidence]
    ib_disabled = [label for label, values in report.env.items() if values.get("NCCL_IB_DISABLE") == "1"]
    if ib_disabled:
        causes.append(f"NCCL_IB_DISABLE=1 reached {', '.join(ib_disabled)}: set it to 0 or drop it")
    # NCCL logs a variable when it reads it, so only a log with env lines at all can show one missing, and even then
    # it may be that the IB plugin stopped before reading it.
    no_hca = [label for label, values in report.env.items() if values and "NCCL_IB_HCA" not in values]
    if no_hca:
        causes.append(
            f"NCCL_IB_HCA does not appear in {', '.join(no_hca)}: it is unset there, or the IB plugin stopped first"
        )
    causes += [
        "NCCL_SOCKET_IFNAME or NCCL_IB_HCA not reaching the container: put them in the container's env file on every "
        "node (vLLM's Ray executor also copies the head's NCCL_* values to workers unless "
        "ray_non_carry_over_env_vars.json lists them)",
        "only one RoCE twin in NCCL_IB_HCA, or the other port's HCA: a cabled port has two twins, list both "
        "(e.g. rocep1s0f1,roceP2p1s0f1) as `ibdev2netdev` pairs them with the fabric interface",
        "MTU 1500 instead of 9000 on the fabric interface of either node (`ip link`; set mtu 9000 in netplan on both)",
        "/dev/infiniband not passed into the container (--device /dev/infiniband), so NCCL finds no IB device",
    ]
    if not ib_disabled:
        causes.append("NCCL_IB_DISABLE=1 in the container's environment")
    return causes


def gate(report: TransportReport, require_rdma: bool = True) -> GateResult:
    """Pass only when no channel that goes over the network uses NET/Socket (the TCP fallback), whatever the hosts.

    With ``require_rdma=False`` a Socket channel is a warning instead (a lab without RDMA). A gate without any channel
    line fails either way: it cannot tell what NCCL did.
    """
    counts = report.counts()
    failures: list[str] = []
    warnings: list[str] = []
    notes: list[str] = []
    if not report.channels:
        failures.append(
            "no NCCL channel lines in the logs, so the transport is unknown: run every rank with NCCL_DEBUG=INFO "
            "(and NCCL_DEBUG_SUBSYS including INIT) and run at least one collective so NCCL connects"
        )
        return GateResult(passed=False, counts=counts, failures=tuple(failures))
    silent = _silent_ranks(report)
    if silent:
        failures.append(
            "some ranks logged no NCCL lines, so their transport is unknown: "
            + "; ".join(silent)
            + ". Every rank must run with NCCL_DEBUG=INFO, and its output must reach this log (under Ray, "
            "RAY_DEDUP_LOGS=0: Ray folds lines that differ only in numbers into '[repeated Nx across cluster]')"
        )
    sockets = [channel for channel in report.channels if channel.transport is Transport.SOCKET]
    if sockets:
        text = (
            f"{len(sockets)} channel(s) go over NET/Socket, NCCL's TCP fallback, instead of RDMA:{_listing(sockets)}"
            "\n  NCCL uses sockets when its IB plugin finds no usable device. Check:"
            + "".join(f"\n    - {cause}" for cause in _socket_causes(report))
        )
        (failures if require_rdma else warnings).append(text)
    no_gdr = [channel for channel in report.channels if channel.transport is Transport.IB_NO_GDRDMA]
    if no_gdr:
        warnings.append(
            f"{len(no_gdr)} channel(s) use RDMA without GPUDirect (no /GDRDMA):{_listing(no_gdr)}\n  NCCL stages "
            "the data through host buffers. Check GPUDirect RDMA support in the container (nvidia-peermem or "
            "dma-buf) and that NCCL_NET_GDR_LEVEL is not set lower"
        )
    other = [channel for channel in report.channels if channel.transport is Transport.NET_OTHER]
    if other:
        warnings.append(f"{len(other)} channel(s) use a network plugin this gate does not know:{_listing(other)}")
    for label, devices in report.ib_devices.items():
        if len(devices) == 1:
            warnings.append(
                f"{label}: NCCL uses one IB device ({devices[0]}); a cabled Spark port has two RoCE twins "
                "(e.g. rocep1s0f1,roceP2p1s0f1) and one alone runs at about half speed: list both in NCCL_IB_HCA"
            )
    if len(report.hosts) == 1:
        notes.append(
            f"all ranks run on one host ({next(iter(report.hosts))}): nothing here crossed between nodes; a "
            "multi-node gate needs the logs of a multi-node run"
        )
    return GateResult(
        passed=not failures, counts=counts, failures=tuple(failures), warnings=tuple(warnings), notes=tuple(notes)
    )
