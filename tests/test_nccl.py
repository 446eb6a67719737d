"""The NCCL transport gate against real NCCL logs (tests/fixtures/nccl) and against lines built from NCCL's format."""

from __future__ import annotations

from pathlib import Path

import pytest

from hy3spark.nccl import Transport, classify, gate, parse_logs

REPO_ROOT = Path(__file__).resolve().parents[1]
# Real logs, copied into the repo (their README says from where): a public clone has nothing beside it.
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "nccl"


@pytest.fixture(scope="module")
def fixtures() -> Path:
    # Fail, never skip: without the real logs these tests would prove nothing.
    if not sorted(FIXTURES.glob("nccl-*-rank*.log")):
        pytest.fail(f"real NCCL fixtures not found in {FIXTURES}: they are part of the repository, restore them")
    return FIXTURES


def _logs(directory: Path, kind: str) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(directory.glob(f"nccl-{kind}-rank*.log"))}


def test_default_run_is_24_p2p_channels_per_rank_all_on_one_host(fixtures: Path) -> None:
    report = parse_logs(_logs(fixtures, "default"))
    # `grep -c 'via P2P/CUMEM$'` gives 24 in each rank's file and no other `via` line exists.
    counts = report.counts()
    assert counts[Transport.P2P] == 48
    assert sum(counts.values()) == 48
    for log, direction in (("nccl-default-rank0.log", (0, 1)), ("nccl-default-rank1.log", (1, 0))):
        # P2P connections are logged by the sending rank only.
        mine = [c for c in report.channels if c.log == log]
        assert len(mine) == 24
        assert {(c.src_rank, c.dst_rank) for c in mine} == {direction}
    assert {c.via for c in report.channels} == {"P2P/CUMEM"}
    assert {c.direction for c in report.channels} == {None}
    assert {c.inter_node for c in report.channels} == {False}


def test_rank_identity_is_read_from_the_init_lines(fixtures: Path) -> None:
    report = parse_logs(_logs(fixtures, "default"))
    ranks = sorted(report.ranks, key=lambda r: r.rank)
    assert [(r.rank, r.nranks, r.hostname, r.bus_id, r.cuda_dev, r.nvml_dev) for r in ranks] == [
        (0, 2, "vm", "60", 0, 0),
        (1, 2, "vm", "70", 1, 1),
    ]
    assert {r.nccl_version for r in ranks} == {"2.28.9+cuda13.0"}
    assert {r.comm_id for r in ranks} == {"0xaf38282739b91693"}
    assert [r.pid for r in ranks] == [602, 603]
    assert {r.nnodes for r in ranks} == {1}
    assert report.hosts == {"vm"}


def test_default_run_passes_but_notes_that_nothing_crossed_nodes(fixtures: Path) -> None:
    result = gate(parse_logs(_logs(fixtures, "default")))
    assert result.passed
    assert result.failures == ()
    assert result.counts[Transport.P2P] == 48
    assert any("one host (vm)" in note for note in result.notes)
    # The IB plugin found no device on this machine; the report keeps NCCL's own words for a later failure message.
    assert "nccl-default-rank0.log: NET/IB : No device found." in parse_logs(_logs(fixtures, "default")).evidence


def test_socket_run_is_8_socket_channels_and_fails_the_gate(fixtures: Path) -> None:
    report = parse_logs(_logs(fixtures, "socket"))
    # `grep -c '\[send\] via NET/Socket/0$'` and `'\[receive\] via NET/Socket/0$'`: 2 and 2 in each rank's file.
    counts = report.counts()
    assert counts[Transport.SOCKET] == 8
    assert sum(counts.values()) == 8
    pairs = [(c.log, c.direction) for c in report.channels]
    for log in ("nccl-socket-rank0.log", "nccl-socket-rank1.log"):
        assert pairs.count((log, "send")) == 2
        assert pairs.count((log, "receive")) == 2
    # Same host: the gate must still fail, since a Socket channel is the fallback whatever the hosts.
    assert {c.inter_node for c in report.channels} == {False}
    assert report.env["nccl-socket-rank0.log"]["NCCL_IB_DISABLE"] == "1"
    # NCCL counted two nodes here although both ranks share a host (P2P and SHM were disabled).
    assert {r.nnodes for r in report.ranks} == {2}

    result = gate(report)
    assert not result.passed
    assert result.counts[Transport.SOCKET] == 8
    (failure,) = result.failures
    assert failure.startswith("8 channel(s) go over NET/Socket, NCCL's TCP fallback")
    assert "channel 00: rank 0 -> rank 1 (vm -> vm) [send] via NET/Socket/0 (in nccl-socket-rank0.log)" in failure
    assert "... and 2 more" in failure
    # Why, from the logs themselves, then how to fix.
    assert "the logs say: nccl-socket-rank0.log: Failed to initialize NET plugin IB" in failure
    assert "NCCL_IB_DISABLE=1 reached nccl-socket-rank0.log, nccl-socket-rank1.log" in failure
    for fix in ("env file", "rocep1s0f1,roceP2p1s0f1", "MTU 1500 instead of 9000", "/dev/infiniband"):
        assert fix in failure
    assert "FAIL" in result.message


def test_socket_run_is_only_a_warning_when_rdma_is_not_required(fixtures: Path) -> None:
    result = gate(parse_logs(_logs(fixtures, "socket")), require_rdma=False)
    assert result.passed
    assert result.warnings[0].startswith("8 channel(s) go over NET/Socket")


# CONSTRUCTED, NOT REAL: no two-host RDMA run exists here. These lines follow NCCL's documented channel format
# ("Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA") and the header/init line shapes of the real fixtures,
# with two made-up hosts, spark-a and spark-b, one GPU each.
def _constructed_rank(host: str, rank: int, pid: int, transports: dict[int, str]) -> str:
    peer = 1 - rank
    lines = [
        f"{host}:{pid}:{pid} [0] NCCL INFO NCCL version 2.28.9+cuda13.0",
        f"{host}:{pid}:{pid} [0] NCCL INFO NCCL_IB_HCA set to =rocep1s0f1,roceP2p1s0f1",
        f"{host}:{pid}:{pid} [0] NCCL INFO NET/IB : Using [0]rocep1s0f1:1/RoCE [1]roceP2p1s0f1:1/RoCE [RO]; "
        f"OOB enp1s0f1np1:10.0.0.{rank + 1}<0>",
        f"{host}:{pid}:{pid} [0] NCCL INFO ncclCommInitRankConfig comm 0x5555{rank} rank {rank} nranks 2 cudaDev 0 "
        f"nvmlDev 0 busId f01000 commId 0x1234abcd - Init START",
        f"{host}:{pid}:{pid} [0] NCCL INFO comm 0x5555{rank} rank {rank} nRanks 2 nNodes 2 localRanks 1 localRank 0 "
        "MNNVL 0",
    ]
    for channel, via in transports.items():
        lines.append(
            f"{host}:{pid}:{pid} [0] NCCL INFO Channel {channel:02d}/0 : {peer}[0] -> {rank}[0] [receive] via {via}"
        )
        lines.append(
            f"{host}:{pid}:{pid} [0] NCCL INFO Channel {channel:02d}/0 : {rank}[0] -> {peer}[0] [send] via {via}"
        )
    return "\n".join(lines) + "\n"


def test_constructed_two_spark_rdma_run_passes() -> None:
    ib = dict.fromkeys(range(4), "NET/IB/0/GDRDMA")
    # The worker's lines as vLLM's Ray driver relays them, behind a "(RayWorkerWrapper pid=N, ip=A) " prefix.
    worker = "".join(
        f"(RayWorkerWrapper pid=200, ip=10.0.0.2) {line}\n"
        for line in _constructed_rank("spark-b", 1, 200, ib).splitlines()
    )
    report = parse_logs({"spark-a": _constructed_rank("spark-a", 0, 100, ib), "spark-b": worker})
    assert report.counts()[Transport.IB_GDRDMA] == 16
    assert {c.inter_node for c in report.channels} == {True}
    assert report.ib_devices == {"spark-a": ("rocep1s0f1", "roceP2p1s0f1"), "spark-b": ("rocep1s0f1", "roceP2p1s0f1")}
    result = gate(report)
    assert result.passed, result.message
    assert result.failures == result.warnings == result.notes == ()


def test_constructed_one_socket_channel_among_ib_fails_and_names_it() -> None:
    mixed = {0: "NET/IB/0/GDRDMA", 1: "NET/IB/0/GDRDMA", 2: "NET/Socket/0", 3: "NET/IB/0/GDRDMA"}
    ib = dict.fromkeys(range(4), "NET/IB/0/GDRDMA")
    report = parse_logs(
        {"spark-a": _constructed_rank("spark-a", 0, 100, mixed), "spark-b": _constructed_rank("spark-b", 1, 200, ib)}
    )
    assert report.counts()[Transport.SOCKET] == 2
    assert report.counts()[Transport.IB_GDRDMA] == 14
    result = gate(report)
    assert not result.passed
    (failure,) = result.failures
    assert failure.startswith("2 channel(s) go over NET/Socket")
    assert "channel 02: rank 1 -> rank 0 (spark-b -> spark-a) [receive] via NET/Socket/0 (in spark-a)" in failure
    assert "channel 02: rank 0 -> rank 1 (spark-a -> spark-b) [send] via NET/Socket/0 (in spark-a)" in failure


def test_constructed_one_roce_twin_and_no_gdrdma_are_warnings() -> None:
    text = _constructed_rank("spark-a", 0, 100, {0: "NET/IB/0"}).replace(" [1]roceP2p1s0f1:1/RoCE", "")
    result = gate(parse_logs({"spark-a": text, "spark-b": _constructed_rank("spark-b", 1, 200, {0: "NET/IB/0"})}))
    assert result.passed
    assert any(w.startswith("4 channel(s) use RDMA without GPUDirect") for w in result.warnings)
    assert any("spark-a: NCCL uses one IB device (rocep1s0f1)" in w for w in result.warnings)


def test_logs_without_channel_lines_fail() -> None:
    result = gate(parse_logs(["vm:1:1 [0] NCCL INFO NCCL version 2.28.9+cuda13.0\n"]))
    assert not result.passed
    assert "NCCL_DEBUG=INFO" in result.failures[0]


@pytest.mark.parametrize(
    ("via", "expected"),
    [
        ("NET/IB/0/GDRDMA", Transport.IB_GDRDMA),
        ("NET/IB/1/GDRDMA/Shared", Transport.IB_GDRDMA),
        ("NET/IB/0", Transport.IB_NO_GDRDMA),
        ("NET/Socket/0", Transport.SOCKET),
        ("NET/AWS Libfabric/0/GDRDMA", Transport.NET_OTHER),
        ("P2P/CUMEM", Transport.P2P),
        ("P2P/IPC/read", Transport.P2P),
        ("P2P/direct pointer", Transport.P2P),
        ("SHM/direct/direct", Transport.SHM),
    ],
)
def test_classify(via: str, expected: Transport) -> None:
    assert classify(via) is expected
