"""The Ray launcher's readiness gate (docs/restarts.md): can an engine start now and succeed? Piped to
`docker exec -i <head container> python3 - NODES GPUS NEED_BYTES` by hy3spark's supervisor on the head's host.

A start can succeed when
1. Ray answers, and shows exactly NODES alive nodes and GPUS GPUs;
2. every node has MemAvailable >= NEED_BYTES (what the capacity plan says the engine requests; 0: no requirement);
3. no process of a previous engine is left on any node: a vLLM rank actor (Ray titles it `ray::RayWorkerWrapper`)
   still holds its memory and its GPU.
2 and 3 are read on each node by a Ray task pinned to it. Answers once (no waiting: the supervisor polls), always
exits 0 and prints one JSON line last: {"ok", "why" (one sentence, empty when ok), "nodes", "ray"}.
"""

import json
import sys

RANK_TITLE = b"ray::RayWorkerWrapper"
TASK_TIMEOUT_S = 15


def node_facts() -> dict:
    """MemAvailable and the rank processes left on the node this runs on."""
    import os

    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    me, left = os.getpid(), []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read()
        except OSError:
            continue
        if pid != me and title.startswith(RANK_TITLE):
            left.append(pid)
    return {"mem_available": available, "leftovers": sorted(left)}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check(want_nodes: int, want_gpus: float, need: int) -> dict:
    report: dict = {"ok": False, "why": "", "nodes": [], "ray": None}
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError as exc:
        report["why"] = f"cannot import ray with {sys.executable}: {exc}"
        return report
    report["ray"] = ray.__version__
    try:
        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    except Exception as exc:  # no cluster here yet (the head's Ray is starting), or it refused us
        report["why"] = f"Ray is not reachable: {(str(exc).splitlines() or [type(exc).__name__])[0][:300]}"
        return report
    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        nodes = sorted(({"ip": n["NodeManagerAddress"], "id": n["NodeID"],
                         "gpus": float(n.get("Resources", {}).get("GPU", 0.0))} for n in alive),
                       key=lambda n: n["ip"])
        gpus = sum(n["gpus"] for n in nodes)
        report["nodes"] = [{"ip": n["ip"], "gpus": n["gpus"]} for n in nodes]
        if len(nodes) != want_nodes or gpus != want_gpus:
            ips = ", ".join(n["ip"] for n in nodes) or "none"
            report["why"] = (f"Ray shows {len(nodes)} of {want_nodes} nodes and {gpus:g} of {want_gpus:g} GPUs "
                             f"(alive: {ips})")
            return report
        probe = ray.remote(num_cpus=0)(node_facts)
        pending = {n["ip"]: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["id"], soft=False))
                   .remote() for n in nodes}
        for entry in report["nodes"]:
            try:
                entry.update(ray.get(pending[entry["ip"]], timeout=TASK_TIMEOUT_S))
            except Exception as exc:  # a node that cannot run a task is not ready for the engine's ranks either
                report["why"] = (f"{entry['ip']} did not run the readiness probe within {TASK_TIMEOUT_S} s: "
                                 f"{(str(exc).splitlines() or [type(exc).__name__])[0][:200]}")
                return report
    finally:
        ray.shutdown()
    short = [n for n in report["nodes"] if n["mem_available"] < need]
    if short:
        report["why"] = "; ".join(f"{n['ip']} has {gib(n['mem_available'])} available, less than the {gib(need)} "
                                  "the engine needs" for n in short)
        return report
    left = [n for n in report["nodes"] if n["leftovers"]]
    if left:
        report["why"] = "a previous engine's ranks are still running: " + "; ".join(
            f"{n['ip']} PIDs {', '.join(map(str, n['leftovers']))}" for n in left)
        return report
    report["ok"] = True
    return report


def main() -> None:
    report = check(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
    print(json.dumps(report))


main()
