"""The engine double's NCCL lines are decided by the test (VLLM_DOUBLE_NCCL_NET), and hy3spark's real gate reads them.

The double fakes the RDMA NIC, so what it reports must be the test's choice: otherwise the gate's failure branch
would never fail in a deployment test. The module is stdlib-only and is loaded from its file, without Docker.
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path
from types import ModuleType

import pytest

from hy3spark import nccl as gate_module

DOUBLE_NCCL = Path(__file__).resolve().parent / "engine_double" / "src" / "vllm" / "double" / "nccl.py"


@pytest.fixture
def double() -> ModuleType:
    spec = importlib.util.spec_from_file_location("double_nccl", DOUBLE_NCCL)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_DOUBLE_NCCL_NET", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "VLLM_HOST_IP", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")


@pytest.mark.parametrize(
    ("value", "host", "ip", "expected"),
    [
        ("Socket", "spark-a", "10.0.0.1", "Socket"),
        ("ib", "spark-a", "10.0.0.1", "IB"),
        ("spark-b=Socket", "spark-b", "10.0.0.2", "Socket"),
        ("10.0.0.2=Socket,IB", "spark-b", "10.0.0.2", "Socket"),
        ("10.0.0.2=Socket,IB", "spark-a", "10.0.0.1", "IB"),
        ("IB,spark-b=Socket", "spark-b", "10.0.0.2", "Socket"),  # a named entry beats the default, wherever it is
    ],
)
def test_the_test_decides_each_ranks_transport(
    double: ModuleType, monkeypatch: pytest.MonkeyPatch, value: str, host: str, ip: str, expected: str
) -> None:
    monkeypatch.setenv("NCCL_IB_HCA", "rocep1s0f1,roceP2p1s0f1")  # the env would say RDMA: the test's word wins
    monkeypatch.setenv("VLLM_DOUBLE_NCCL_NET", value)
    assert double.transport(host, ip) == expected


def test_a_rank_the_variable_does_not_name_follows_its_env(double: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_DOUBLE_NCCL_NET", "spark-b=Socket")
    assert double.transport("spark-a", "10.0.0.1") == "Socket"  # no NCCL_IB_HCA reached it
    monkeypatch.setenv("NCCL_IB_HCA", "rocep1s0f1")
    assert double.transport("spark-a", "10.0.0.1") == "IB"
    monkeypatch.setenv("NCCL_IB_DISABLE", "1")
    assert double.transport("spark-a", "10.0.0.1") == "Socket"


@pytest.mark.parametrize("value", ["TCP", "spark-b=", "spark-b=Sockets", "IB,,Socket"])
def test_a_malformed_value_stops_the_rank_naming_the_variable(
    double: ModuleType, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("VLLM_DOUBLE_NCCL_NET", value)
    with pytest.raises(ValueError, match=r"VLLM_DOUBLE_NCCL_NET=.* is not \[HOST\|IP=\]IB or \[HOST\|IP=\]Socket"):
        double.transport("spark-b", "10.0.0.2")


def _two_rank_logs(double: ModuleType, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """What the two ranks of a two-node cluster print, each as its own host (the gate labels logs by host)."""
    logs = {}
    for rank, (host, ip) in enumerate((("spark-a", "10.0.0.1"), ("spark-b", "10.0.0.2"))):
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        lines = double.lines(rank, 2, 2, ip)
        logs[host] = "".join(f"{host}:100:100 [0] NCCL INFO {line}\n" for line in lines)
    return logs


def test_socket_on_one_node_fails_the_real_gate_naming_that_node(
    double: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCCL_IB_HCA", "rocep1s0f1,roceP2p1s0f1")
    monkeypatch.setenv("VLLM_DOUBLE_NCCL_NET", "spark-b=Socket")
    result = gate_module.gate(gate_module.parse_logs(_two_rank_logs(double, monkeypatch)))
    assert not result.passed
    text = "\n".join(result.failures)
    assert "channel(s) go over NET/Socket, NCCL's TCP fallback" in text
    assert "via NET/Socket/0 (in spark-b)" in text and "(in spark-a)" not in text
    assert result.counts[gate_module.Transport.SOCKET] == 4  # spark-b: 2 channels x (send + receive)
    assert result.counts[gate_module.Transport.IB_GDRDMA] == 4


def test_rdma_everywhere_passes_the_real_gate(double: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_IB_HCA", "rocep1s0f1,roceP2p1s0f1")
    monkeypatch.setenv("VLLM_DOUBLE_NCCL_NET", "IB")
    result = gate_module.gate(gate_module.parse_logs(_two_rank_logs(double, monkeypatch)))
    assert result.passed, result.failures
    assert result.counts[gate_module.Transport.IB_GDRDMA] == 8
