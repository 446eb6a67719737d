"""What Ray sees, from inside a Ray node container (piped to `docker exec -i <container> python3 -`).

Waits until this node's own address is alive in the cluster and, when asked, until the cluster has exactly the
expected node and GPU counts, or until the timeout. It always exits 0 and prints one JSON line last: the roles
decide what is a failure and explain it (which node is missing and why).

Arguments: SELF_IP TIMEOUT_S [NODES GPUS]
"""

import json
import platform
import sys
import time


def main() -> None:
    self_ip, timeout = sys.argv[1], float(sys.argv[2])
    want_nodes = int(sys.argv[3]) if len(sys.argv) > 3 else None
    want_gpus = float(sys.argv[4]) if len(sys.argv) > 4 else None
    report = {"python": platform.python_version(), "ray": None, "self_alive": False, "nodes": [], "gpus": 0.0,
              "complete": False, "error": None, "waited_s": 0.0}
    start = time.monotonic()
    try:
        import ray
    except ImportError as exc:
        report["error"] = f"cannot import ray with {sys.executable}: {exc}"
        print(json.dumps(report))
        return
    report["ray"] = ray.__version__
    connected = False
    while True:
        try:
            if not connected:
                # address="auto": the cluster this node's `ray start` joined (/tmp/ray/ray_current_cluster).
                ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
                connected = True
            alive = [n for n in ray.nodes() if n.get("Alive")]
            report["nodes"] = sorted(
                ({"ip": n["NodeManagerAddress"], "gpus": n.get("Resources", {}).get("GPU", 0.0)} for n in alive),
                key=lambda n: n["ip"])
            report["gpus"] = sum(n["gpus"] for n in report["nodes"])
            report["self_alive"] = any(n["ip"] == self_ip for n in report["nodes"])
            report["error"] = None
            report["complete"] = report["self_alive"] and (
                want_nodes is None or (len(report["nodes"]) == want_nodes and report["gpus"] == want_gpus))
        except Exception as exc:  # any failure to reach Ray is reported, then retried
            report["error"] = (f"{type(exc).__name__}: {exc}".splitlines() or ["unknown error"])[0][:300]
            if connected:
                ray.shutdown()
                connected = False
        report["waited_s"] = round(time.monotonic() - start, 1)
        if report["complete"] or time.monotonic() - start >= timeout:
            break
        time.sleep(1)
    print(json.dumps(report))


main()
