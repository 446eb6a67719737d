"""The per-run Docker containers and network the engine doubles' tests start (tests/test_engine_double.py,
tests/test_trtllm_double.py): names carry the pytest process's PID (`<prefix>-<pid>`, `-head`, `-worker`), since other
engineers run the suite on the same machine, and the network takes the first free subnet of a few."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest


def docker(*args: str, check: bool = True, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, timeout=timeout, **kwargs)


def require_docker_as_root(why_root: str) -> None:
    """Skip (with the reason) a test that needs a Docker engine and root; the full run counts a skip as a failure."""
    if shutil.which("docker") is None or docker("info", check=False).returncode != 0:
        pytest.skip("needs a Docker engine")
    if os.geteuid() != 0:
        pytest.skip(f"needs root ({why_root})")


def remove_leftovers(prefix: str, label: str) -> None:
    """This run's containers and network, and those of earlier runs (labelled `label`) whose pytest is gone."""
    runs = {f"{prefix}-{os.getpid()}"}
    for kind, field in (("ps -a", "{{.Names}}"), ("network ls", "{{.Name}}")):
        for name in docker(*kind.split(), "--filter", f"label={label}", "--format", field).stdout.split():
            pid = name.removeprefix(f"{prefix}-").split("-")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                runs.add(f"{prefix}-{pid}")
    for run in runs:
        docker("rm", "-f", f"{run}-head", f"{run}-worker", check=False)
        docker("network", "rm", run, check=False)


def create_network(name: str, label: str, subnets: list[str]) -> tuple[str, str]:
    """The network on the first free subnet; the head's and the worker's addresses there (.11, .12)."""
    for subnet in subnets:
        if docker("network", "create", "--label", label, "--subnet", subnet, name, check=False).returncode == 0:
            return subnet.replace(".0/24", ".11"), subnet.replace(".0/24", ".12")
    pytest.fail(f"no free subnet among {subnets[0]}..{subnets[-1]} for the test network")
