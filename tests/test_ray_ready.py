"""roles/vllm_serve/files/launchers/ray/ready.py, the Ray launcher's readiness gate the supervisor asks before it
starts an engine (docs/restarts.md), against the real Ray of the serving test image: a one-node Ray head with one
advertised GPU (the GPU is the only double here) and token auth as the node containers run it, then each thing that
must hold the start back, and a Ray that is not there or does not answer."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker_runs import docker, require_docker_as_root
from test_ray_sitecustomize import serving_image

from hy3spark.context import RAY_TOKEN

REPO = Path(__file__).resolve().parent.parent
READY = (REPO / "roles" / "vllm_serve" / "files" / "launchers" / "ray" / "ready.py").read_text()
PREFIX = f"hy3spark-ready-{os.getpid()}"
GIB = 2**30


def gate(container: str, nodes: int, gpus: int, need: int) -> tuple[dict, float]:
    """The gate's report, piped as the supervisor pipes it, and how long it took to answer."""
    started = time.monotonic()
    proc = subprocess.run(["docker", "exec", "-i", container, "python3", "-", str(nodes), str(gpus), str(need)],
                          input=READY, capture_output=True, text=True, timeout=120, check=False)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    answers = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == 1 and proc.stdout.strip().splitlines()[-1] == answers[0], proc.stdout + proc.stderr
    return json.loads(answers[0]), took


def meminfo(container: str, key: str) -> int:
    line = docker("exec", container, "grep", f"^{key}:", "/proc/meminfo").stdout.split()
    return int(line[1]) * 1024


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_docker_as_root("the serving image runs in Docker")
    image = serving_image()
    token = tmp_path_factory.mktemp("ray") / "ray-token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    name = f"{PREFIX}-head"
    # Ray's guards as hy3spark.context.ray_env gives every node container (token by file, metrics off), and the
    # head's `ray start` as _ray_argv makes it, on Ray's default ports; few CPUs and a small object store, as the
    # other tests' Ray heads have, to stay light on a shared test machine.
    docker("run", "-d", "--init", "--name", name, "--shm-size", "256m", "-v", f"{token}:{RAY_TOKEN}:ro",
           "-e", "RAY_AUTH_MODE=token", "-e", f"RAY_AUTH_TOKEN_PATH={RAY_TOKEN}",
           "-e", "RAY_enable_metrics_collection=0", image,
           "ray", "start", "--head", "--include-dashboard=false", "--num-gpus", "1", "--num-cpus", "2",
           "--object-store-memory", str(75 * 2**20), "--disable-usage-stats", "--block", timeout=120)
    try:
        deadline = time.monotonic() + 120
        while docker("exec", name, "ray", "status", check=False, timeout=60).returncode != 0:
            if time.monotonic() > deadline:
                pytest.fail("Ray did not start: " + docker("logs", name, check=False).stderr[-3000:])
            time.sleep(2)
        yield name
    finally:
        docker("rm", "-f", name, check=False)


def test_a_whole_cluster_with_memory_and_no_old_rank_is_ready(head: str) -> None:
    report, took = gate(head, 1, 1, 0)
    assert report["ok"] is True and report["why"] == "", report
    ip = docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", head).stdout.strip()
    (node,) = report["nodes"]
    assert node["ip"] == ip and node["gpus"] == 1.0 and node["leftovers"] == [], report
    assert 0 < node["mem_available"] <= meminfo(head, "MemTotal"), report
    version = docker("exec", head, "python3", "-c", "import ray; print(ray.__version__)").stdout.strip()
    assert report["ray"] == version and version.startswith("2.60."), report
    assert took < 30, took


def test_a_missing_node_holds_the_start(head: str) -> None:
    report, _ = gate(head, 2, 2, 0)
    ip = report["nodes"][0]["ip"]
    assert report["ok"] is False
    assert report["why"] == f"Ray shows 1 of 2 nodes and 1 of 2 GPUs (alive: {ip})", report


def test_memory_the_plan_needs_and_the_node_lacks_holds_the_start(head: str) -> None:
    need = 2 * meminfo(head, "MemTotal")
    report, _ = gate(head, 1, 1, need)
    (node,) = report["nodes"]
    assert report["ok"] is False
    assert re.fullmatch(rf"{re.escape(node['ip'])} has {node['mem_available'] / GIB:.2f} GiB available, less than "
                        rf"the {need / GIB:.2f} GiB the engine needs", report["why"]), report


def test_a_rank_left_by_a_previous_engine_holds_the_start_until_it_is_gone(head: str) -> None:
    # The title Ray gives vLLM's rank actors (and the engine double's), in a process Ray knows nothing of.
    started = docker("exec", head, "bash", "-c", "(exec -a ray::RayWorkerWrapper sleep 300) >/dev/null 2>&1 & echo $!")
    pid = int(started.stdout)
    try:
        report, _ = gate(head, 1, 1, 0)
        (node,) = report["nodes"]
        assert report["ok"] is False and node["leftovers"] == [pid], report
        assert report["why"] == f"a previous engine's ranks are still running: {node['ip']} pids {pid}", report
    finally:
        docker("exec", head, "kill", str(pid), check=False)
    deadline = time.monotonic() + 10
    while docker("exec", head, "test", "-e", f"/proc/{pid}", check=False).returncode == 0:
        assert time.monotonic() < deadline, f"{pid} did not end"
        time.sleep(0.2)
    report, _ = gate(head, 1, 1, 0)
    assert report["ok"] is True and report["nodes"][0]["leftovers"] == [], report


def test_a_ray_that_does_not_answer_is_not_reachable_within_the_gates_time(head: str) -> None:
    """A stopped GCS (SIGSTOP: alive, silent) keeps ray.init retrying forever; the gate still answers in time."""
    gcs = docker("exec", head, "pgrep", "-f", "gcs_server").stdout.split()
    assert len(gcs) == 1, gcs
    docker("exec", head, "kill", "-STOP", gcs[0])
    try:
        report, took = gate(head, 1, 1, 0)
    finally:
        docker("exec", head, "kill", "-CONT", gcs[0])
    assert report["ok"] is False and report["why"] == "Ray is not reachable: no answer within 20 s", report
    assert took < 30, took
    assert gate(head, 1, 1, 0)[0]["ok"] is True


def test_no_ray_is_not_ready_and_says_so() -> None:
    require_docker_as_root("the serving image runs in Docker")
    name = f"{PREFIX}-noray"
    try:
        docker("run", "-d", "--init", "--name", name, serving_image(), "sleep", "300")
        report, took = gate(name, 1, 1, 0)
    finally:
        docker("rm", "-f", name, check=False)
    assert report["ok"] is False and report["why"].startswith("Ray is not reachable: "), report
    assert report["nodes"] == [] and took < 30, report
