"""`hy3spark transport`: the NCCL gate from the command line, on the real fixture logs (tests/fixtures/nccl)."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nccl"


def _fixture(name: str) -> str:
    path = FIXTURES / name
    assert path.is_file(), f"{path} is missing: the real NCCL logs are part of the repo (tests/fixtures/nccl)"
    return str(path)


def test_socket_logs_fail_the_gate(cli) -> None:
    result = cli("transport", _fixture("nccl-socket-rank0.log"), _fixture("nccl-socket-rank1.log"))
    assert result.code == 1
    assert "NCCL transport gate: FAIL (NET/Socket: 8)" in result.out
    assert "NCCL_IB_HCA" in result.out and "/dev/infiniband" in result.out


def test_socket_allowed_is_a_warning(cli) -> None:
    result = cli("transport", "--allow-socket", _fixture("nccl-socket-rank0.log"), _fixture("nccl-socket-rank1.log"))
    assert result.code == 0


def test_p2p_logs_pass_as_json(cli) -> None:
    result = cli("transport", "--json", _fixture("nccl-default-rank0.log"), _fixture("nccl-default-rank1.log"))
    assert result.code == 0
    data = json.loads(result.out)
    assert data["passed"] is True
    assert data["counts"]["P2P"] == 48 and data["counts"]["NET/Socket"] == 0


def test_serve_log_with_ray_prefixes(cli, tmp_path: Path) -> None:
    """vLLM forwards each Ray worker's output to the driver with a prefix: one serve log holds every rank."""
    rank0 = Path(_fixture("nccl-socket-rank0.log")).read_text()
    rank1 = Path(_fixture("nccl-socket-rank1.log")).read_text()
    merged = tmp_path / "serve.log"
    merged.write_text(rank0 + "".join(f"(RayWorkerWrapper pid=233, ip=10.0.0.2) {line}\n"
                                      for line in rank1.splitlines()))
    result = cli("transport", str(merged))
    assert result.code == 1 and "NET/Socket: 8" in result.out


def test_missing_log(cli, tmp_path: Path) -> None:
    result = cli("transport", str(tmp_path / "none.log"))
    assert result.code == 1 and "No such file or directory" in result.err


def test_logs_on_standard_input() -> None:
    """vllm_serve pipes the serve log's NCCL lines in: `hy3spark transport -`."""
    import subprocess
    import sys

    text = Path(_fixture("nccl-socket-rank0.log")).read_text() + Path(_fixture("nccl-socket-rank1.log")).read_text()
    proc = subprocess.run([sys.executable, "-m", "hy3spark", "transport", "-"], input=text, capture_output=True,
                          text=True)
    assert proc.returncode == 1 and "NET/Socket: 8" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "hy3spark", "transport", "-"], input="", capture_output=True,
                          text=True)
    assert proc.returncode == 1, "a log without any channel line must not pass the gate"
