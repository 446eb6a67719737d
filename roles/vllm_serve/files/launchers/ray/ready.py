"""The Ray launcher's readiness gate (docs/restarts.md): can an engine start now and succeed? Piped to
`docker exec -i <head container> python3 - NODES GPUS NEED_BYTES` by hy3spark's supervisor on the head's host.

A start can succeed when, in this order (the first that fails gives `why`):
1. Ray answers;
2. it shows exactly NODES alive nodes and GPUS GPUs;
3. every node has MemAvailable >= NEED_BYTES (what the capacity plan says the engine requests; 0: no requirement);
4. no process of a previous engine is left on any node: a vLLM rank actor (Ray titles it `ray::RayWorkerWrapper`)
   still holds its memory and its GPU.
3 and 4 are read on each node by a Ray task pinned to it. Answers once, within ANSWER_WITHIN_S (the supervisor
polls: waiting is its job), always exits 0 and prints one JSON line last:
{"ok", "why" (one sentence, empty when ok), "nodes": [{"ip", "gpus", "mem_available" (bytes), "leftovers" (PIDs
as the node's container sees them)}], "ray" (version)}; mem_available and leftovers are null where not read.

Arguments: NODES GPUS NEED_BYTES
"""

import json
import os
import sys
import threading
import time
from typing import Any

RANK_TITLE = b"ray::RayWorkerWrapper"
TASK_TIMEOUT_S = 15.0
# A wedged GCS (or a dead one whose cluster file is left) makes ray.init and other calls retry forever; past this
# the watchdog answers for them, so the supervisor hears "not reachable" instead of its own 60 s timeout.
ANSWER_WITHIN_S = 20.0

START = time.monotonic()
REPORT: dict[str, Any] = {"ok": False, "why": "", "nodes": [], "ray": None}
DECIDED = threading.Event()  # REPORT is final: a watchdog that fires now (in ray.shutdown) prints it as it is
ANSWERED = threading.Lock()  # taken by whichever prints first: one JSON line, even if the watchdog fires meanwhile


def answer(report: dict[str, Any]) -> None:
    if ANSWERED.acquire(blocking=False):
        print(json.dumps(report), flush=True)


def watchdog() -> None:
    late = {"ok": False, "why": f"Ray is not reachable: no answer within {ANSWER_WITHIN_S:.0f} s"}
    answer(REPORT if DECIDED.is_set() else {**REPORT, **late})
    os._exit(0)  # the main thread is blocked in Ray's C++ client: nothing else would end it


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def node_facts() -> dict[str, Any]:
    """On the node this task is pinned to: its MemAvailable and the rank processes a previous engine left there."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    me, left = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                title = f.read()
        except OSError:  # it ended since the listing
            continue
        if title.startswith(RANK_TITLE):
            left.append(int(name))
    return {"mem_available": available, "leftovers": sorted(left)}


def check(ray: Any, want_nodes: int, want_gpus: float, need: int) -> str:
    """Why a start cannot succeed now, or "" when it can; fills REPORT["nodes"] with what it read."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    except Exception as exc:  # no cluster here (the head's Ray is starting or gone), or it refused us
        return f"Ray is not reachable: {first_line(exc)}"
    alive = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeManagerAddress"])
    nodes = [{"ip": n["NodeManagerAddress"], "gpus": float(n.get("Resources", {}).get("GPU", 0.0)),
              "mem_available": None, "leftovers": None} for n in alive]
    REPORT["nodes"] = nodes
    gpus = sum(n["gpus"] for n in nodes)
    if len(nodes) != want_nodes or gpus != want_gpus:
        ips = ", ".join(n["ip"] for n in nodes) or "none"
        return f"Ray shows {len(nodes)} of {want_nodes} nodes and {gpus:g} of {want_gpus:g} GPUs (alive: {ips})"

    # num_cpus=0: a probe that needs no CPU to speak of must not queue behind whatever holds the node's CPUs.
    probe = ray.remote(num_cpus=0)(node_facts)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in alive]
    # Within the watchdog's time, so that a node that cannot run a task is named rather than Ray said unreachable.
    wait_s = max(0.0, min(TASK_TIMEOUT_S, ANSWER_WITHIN_S - 2 - (time.monotonic() - START)))
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    failed = []
    for node, ref in zip(nodes, refs, strict=True):
        if ref not in done:
            failed.append(f"{node['ip']} did not run the readiness task within {wait_s:.0f} s")
            continue
        try:
            node.update(ray.get(ref))
        except Exception as exc:  # a node that cannot run a task cannot run the engine's ranks either
            failed.append(f"the readiness task failed on {node['ip']}: {first_line(exc)}")
    if failed:
        return "; ".join(failed)
    short = [n for n in nodes if n["mem_available"] < need]
    if short:
        return "; ".join(f"{n['ip']} has {gib(n['mem_available'])} available, less than the {gib(need)} the engine "
                         "needs" for n in short)
    left = [n for n in nodes if n["leftovers"]]
    if left:
        return "a previous engine's ranks are still running: " + "; ".join(
            f"{n['ip']} pids {', '.join(map(str, n['leftovers']))}" for n in left)
    return ""


def main() -> None:
    want_nodes, want_gpus, need = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    timer = threading.Timer(ANSWER_WITHIN_S, watchdog)
    timer.daemon = True
    timer.start()
    try:
        import ray
    except ImportError as exc:
        REPORT["why"] = f"cannot import ray with {sys.executable}: {exc}"
    else:
        REPORT["ray"] = ray.__version__
        try:
            why = check(ray, want_nodes, want_gpus, need)
        except Exception as exc:  # Ray went away between calls: the same answer as never reaching it
            why = f"Ray is not reachable: {first_line(exc)}"
        REPORT.update(ok=not why, why=why)
        DECIDED.set()
        ray.shutdown()
    answer(REPORT)


main()
