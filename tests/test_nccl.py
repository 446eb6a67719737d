"""The NCCL transport gate against real NCCL logs (tests/fixtures/nccl) and against lines built from NCCL's format."""

from __future__ import annotations

import dataclasses
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


# --- What the mutation run (scripts/mutation nccl) showed untested -------------------------------------------------
def _socket_lines(count: int, host: str = "spark-a", pid: int = 100) -> str:
    """`count` [send] lines over NET/Socket from rank 0 (spark-a) to rank 1, with rank 0's init line only."""
    header = f"{host}:{pid}:{pid} [0] NCCL INFO "
    lines = [f"{header}ncclCommInitRankConfig comm 0x5555 rank 0 nranks 2 cudaDev 0 busId f01000 commId 0x1234abcd"]
    lines += [f"{header}Channel {channel:02d}/0 : 0[0] -> 1[0] [send] via NET/Socket/0" for channel in range(count)]
    return "\n".join(lines) + "\n"


def _failure(report_logs: dict[str, str]) -> str:
    """The gate's one NET/Socket failure (logs with a single rank's init line also fail for the silent rank)."""
    result = gate(parse_logs(report_logs))
    assert not result.passed
    (failure,) = [text for text in result.failures if "go over NET/Socket" in text]
    return failure


@pytest.mark.parametrize(("count", "tail"), [(2, None), (6, None), (7, "... and 1 more"), (16, "... and 10 more")])
def test_a_failure_lists_six_socket_channels_then_counts_the_rest(count: int, tail: str | None) -> None:
    failure = _failure({"spark-a": _socket_lines(count)})
    assert failure.startswith(f"{count} channel(s) go over NET/Socket")
    listed = [line for line in failure.splitlines() if line.startswith("    channel ")]
    assert len(listed) == min(count, 6)
    assert listed[0] == "    channel 00: rank 0 -> rank 1 [send] via NET/Socket/0 (in spark-a)"
    if tail is None:
        assert "... and" not in failure
    else:
        assert f"\n    {tail}\n" in failure


def test_a_channel_whose_peer_log_is_missing_has_no_inter_node_verdict() -> None:
    # Only spark-a's log: rank 1's host is unknown, so whether a channel crossed nodes is unknown too, and the
    # message must not invent a host ("spark-a -> None").
    report = parse_logs({"spark-a": _socket_lines(2)})
    assert {(c.src_host, c.dst_host) for c in report.channels} == {("spark-a", None)}
    assert {c.inter_node for c in report.channels} == {None}
    assert report.channels[0].describe() == "channel 00: rank 0 -> rank 1 [send] via NET/Socket/0 (in spark-a)"


def test_channel_lines_without_init_lines_are_still_judged() -> None:
    # NCCL_DEBUG_SUBSYS without INIT keeps the channel lines but not the rank identity: the gate must still fail
    # on Socket, and say nothing about hosts it never saw.
    text = "".join(f"spark-a:100:100 [0] NCCL INFO Channel {c:02d}/0 : 0[0] -> 1[0] [send] via NET/Socket/0\n"
                   for c in range(2))
    report = parse_logs({"spark-a": text})
    assert report.ranks == () and report.hosts == frozenset()
    result = gate(report)
    assert not result.passed
    assert result.counts[Transport.SOCKET] == 2
    assert result.notes == ()


def test_every_communicator_of_a_process_is_one_rank_entry() -> None:
    # vLLM's ranks initialise several communicators (world, TP group, ...), each logged as Init START and again
    # as Init COMPLETE: each communicator is one entry, whatever the order of their pointers.
    header = "spark-a:100:100 [0] NCCL INFO "
    text = "".join(
        f"{header}ncclCommInitRankConfig comm {comm} rank {rank} nranks 2 cudaDev 0 nvmlDev 0 busId f01000 "
        f"commId {comm_id} - Init {phase}\n"
        for comm, rank, comm_id in (("0x5b", 0, "0xb1"), ("0x5c", 1, "0xc1"), ("0x5a", 0, "0xa1"))
        for phase in ("START", "COMPLETE")
    )
    report = parse_logs({"spark-a": text})
    assert sorted((r.comm_id, r.rank) for r in report.ranks) == [("0xa1", 0), ("0xb1", 0), ("0xc1", 1)]


def test_socket_causes_name_only_the_logs_that_lack_nccl_ib_hca(fixtures: Path) -> None:
    # The real socket run never set NCCL_IB_HCA and disabled IB by environment: both are named, and the generic
    # "NCCL_IB_DISABLE=1 in the container's environment" is not repeated after the specific one.
    failure = _failure(_logs(fixtures, "socket"))
    assert "NCCL_IB_HCA does not appear in nccl-socket-rank0.log, nccl-socket-rank1.log" in failure
    assert "NCCL_IB_DISABLE=1 in the container's environment" not in failure
    # A log with NCCL_IB_HCA set, or without any NCCL_* line at all (nothing to tell from), is not named; with no
    # IB_DISABLE seen, the generic cause is listed.
    with_hca = _constructed_rank("spark-a", 0, 100, {0: "NET/Socket/0"})
    failure = _failure({"spark-a": with_hca, "spark-b": _socket_lines(1, host="spark-b", pid=200)})
    assert "does not appear in" not in failure
    assert "NCCL_IB_DISABLE=1 reached" not in failure
    assert "\n    - NCCL_IB_DISABLE=1 in the container's environment" in failure


def test_an_unknown_network_plugin_is_a_warning_of_its_own() -> None:
    result = gate(parse_logs({"spark-a": _constructed_rank("spark-a", 0, 100, {0: "NET/UCX/0"}),
                              "spark-b": _constructed_rank("spark-b", 1, 200, {0: "NET/UCX/0"})}))
    assert result.passed
    assert result.counts[Transport.NET_OTHER] == 4
    (warning,) = result.warnings
    assert warning.startswith("4 channel(s) use a network plugin this gate does not know:")
    assert "channel 00: rank 0 -> rank 1 (spark-a -> spark-b) [send] via NET/UCX/0 (in spark-a)" in warning


@pytest.mark.parametrize(
    ("via", "expected"),
    [
        # Plugin and transport names sort on both sides of the known ones; only the exact names count.
        ("NET/UCX/0", Transport.NET_OTHER),
        ("NET/IBext/0/GDRDMA", Transport.NET_OTHER),
        ("CollNet/0", Transport.OTHER),
        ("NVLS/0", Transport.OTHER),
    ],
)
def test_classify_only_exact_transport_names(via: str, expected: Transport) -> None:
    assert classify(via) is expected


def test_reports_and_verdicts_are_read_only() -> None:
    # The gate's verdict is handed to the CLI and the role's report as a value: nothing downstream can flip it.
    report = parse_logs({"spark-a": _socket_lines(1)})
    result = gate(report)
    for obj, attr in ((result, "passed"), (report, "channels"), (report.channels[0], "transport"),
                      (report.ranks[0], "hostname")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, attr, None)


# --- every rank must be heard from: Ray folds the other ranks' lines unless RAY_DEDUP_LOGS=0 -------------------------
def test_a_rank_that_logged_nothing_fails_the_gate_even_when_the_rest_is_rdma() -> None:
    # What the serve log of a two-node Ray deployment holds when Ray's log deduplication folded the worker's lines
    # into the head's ("[repeated 2x across cluster]"): rank 0's lines only, all RDMA. The worker's transport is
    # unknown, so the gate must not pass.
    head = _constructed_rank("spark-a", 0, 100, {0: "NET/IB/0/GDRDMA", 1: "NET/IB/0/GDRDMA"})
    result = gate(parse_logs({"serve.log": head}))
    assert not result.passed
    (failure,) = result.failures
    assert failure.startswith("some ranks logged no NCCL lines, so their transport is unknown: communicator ")
    assert "has 2 ranks; rank(s) 1 logged nothing (heard from: spark-a)" in failure
    assert "RAY_DEDUP_LOGS=0" in failure


def test_every_rank_heard_from_passes(fixtures: Path) -> None:
    both = {"spark-a": _constructed_rank("spark-a", 0, 100, {0: "NET/IB/0/GDRDMA"}),
            "spark-b": _constructed_rank("spark-b", 1, 200, {0: "NET/IB/0/GDRDMA"})}
    assert gate(parse_logs(both)).passed
    # The real two-rank logs, both files: every rank of every communicator logged its init line.
    assert not any("logged nothing" in text for text in gate(parse_logs(_logs(fixtures, "default"))).failures)
    # The same real run with rank 1's file missing: rank 1 of the real communicator is named.
    only_rank0 = {k: v for k, v in _logs(fixtures, "default").items() if "rank0" in k}
    assert any("rank(s) 1 logged nothing" in text for text in gate(parse_logs(only_rank0)).failures)


def test_a_silent_rank_is_named_with_the_hosts_of_its_own_communicator_only() -> None:
    # Three communicators: 0xb1 spans spark-a and spark-b and lacks rank 2; 0xa1 and 0xc1 are complete one-rank
    # communicators elsewhere, so their hosts must not be listed as having been heard from for 0xb1.
    def init(host: str, pid: int, rank: int, nranks: int, comm_id: str) -> str:
        return (f"{host}:{pid}:{pid} [0] NCCL INFO ncclCommInitRankConfig comm 0x{pid} rank {rank} nranks {nranks} "
                f"cudaDev 0 busId f01000 commId {comm_id}\n"
                f"{host}:{pid}:{pid} [0] NCCL INFO Channel 00/0 : {rank}[0] -> {rank}[0] via P2P/CUMEM\n")

    logs = {"a": init("spark-a", 100, 0, 3, "0xb1"), "b": init("spark-b", 200, 1, 3, "0xb1"),
            "c": init("spark-c", 300, 0, 1, "0xa1"), "d": init("spark-d", 400, 0, 1, "0xc1")}
    (failure,) = gate(parse_logs(logs)).failures
    assert "; communicator" not in failure
    assert "communicator 0xb1 has 3 ranks; rank(s) 2 logged nothing (heard from: spark-a, spark-b)" in failure
