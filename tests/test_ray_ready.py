"""roles/vllm_serve/files/launchers/ray/ready.py, the Ray launcher's readiness gate the supervisor asks before it
starts an engine (docs/restarts.md), against the real Ray of the serving test image: a one-node Ray head with one
advertised GPU (the GPU is the only double here), then each thing that must hold the start back."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker_runs import docker, require_docker_as_root
from test_ray_sitecustomize import serving_image

REPO = Path(__file__).resolve().parent.parent
READY = (REPO / "roles" / "vllm_serve" / "files" / "launchers" / "ray" / "ready.py").read_text()


def gate(container: str, nodes: int, gpus: int, need: int) -> dict:
    proc = subprocess.run(["docker", "exec", "-i", container, "python3", "-", str(nodes), str(gpus), str(need)],
                          input=READY, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def head() -> Iterator[str]:
    require_docker_as_root("the serving image runs in Docker")
    name = f"hy3spark-ready-{uuid.uuid4().hex[:8]}"
    docker("run", "-d", "--init", "--name", name, "--shm-size", "256m", serving_image(), "ray", "start", "--head",
           "--num-gpus", "1", "--num-cpus", "2", "--object-store-memory", "78643200", "--include-dashboard=false",
           "--disable-usage-stats", "--block", timeout=120)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if docker("exec", name, "ray", "status", check=False, timeout=60).returncode == 0:
                break
            time.sleep(2)
        else:
            pytest.fail(docker("logs", name, check=False).stdout[-3000:])
        yield name
    finally:
        docker("rm", "-f", name, check=False)


def test_a_whole_cluster_with_memory_and_no_old_rank_is_ready(head: str) -> None:
    report = gate(head, 1, 1, 0)
    assert report["ok"] is True and report["why"] == "", report
    (node,) = report["nodes"]
    assert node["gpus"] == 1.0 and node["leftovers"] == [] and node["mem_available"] > 2**28, report
    assert report["ray"].startswith("2.")


def test_a_missing_node_holds_the_start(head: str) -> None:
    report = gate(head, 2, 2, 0)
    assert report["ok"] is False
    assert report["why"].startswith("Ray shows 1 of 2 nodes and 1 of 2 GPUs (alive: "), report


def test_memory_the_plan_needs_and_the_node_lacks_holds_the_start(head: str) -> None:
    report = gate(head, 1, 1, 2**50)
    ip = report["nodes"][0]["ip"]
    assert report["ok"] is False
    assert report["why"].startswith(f"{ip} has ") and "less than the 1048576.00 GiB the engine needs" in report["why"]


def test_a_rank_left_by_a_previous_engine_holds_the_start(head: str) -> None:
    docker("exec", "-d", head, "bash", "-c", "exec -a ray::RayWorkerWrapper sleep 300")
    try:
        time.sleep(1)
        report = gate(head, 1, 1, 0)
        pids = report["nodes"][0]["leftovers"]
        assert report["ok"] is False and len(pids) == 1, report
        ip = report["nodes"][0]["ip"]
        assert report["why"] == f"a previous engine's ranks are still running: {ip} PIDs {pids[0]}", report
    finally:
        docker("exec", head, "pkill", "-f", "^ray::RayWorkerWrapper", check=False)
    time.sleep(1)
    assert gate(head, 1, 1, 0)["ok"] is True


def test_no_ray_is_not_ready_and_says_so() -> None:
    require_docker_as_root("the serving image runs in Docker")
    proc = subprocess.run(["docker", "run", "--rm", "-i", serving_image(), "python3", "-", "1", "1", "0"],
                          input=READY, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] is False and report["why"].startswith("Ray is not reachable: "), report
