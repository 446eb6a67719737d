"""The serving engine inside a node's container (piped to `docker exec -i <container> python3 - COMMAND ...`): the
head's, and under a launcher whose ranks each node starts itself (native) every other node's too. Or on the host,
from an operator's engine venv (one node, no container: piped to `<venv>/bin/python3 -`), where a transient systemd
unit runs it.

Ray is PID 1 there and the engine is a `docker exec -d` child of nothing we hold, so it is found by its command
line: the serve script, or the engine process it execs into (HY3SPARK_ENGINE's `process`: an argv word and the
word after it). On the host every process of the machine is visible, so with HY3SPARK_ENGINE_UNIT set only the
processes of that unit (its cgroup) count: another engine someone runs beside it is not ours.
Prints one JSON line last and exits 0, except without HY3SPARK_ENGINE (exit 1, nothing recognisable).

  status SCRIPT URL LOG                       engine PIDs, whether /health answers now, the KV cache lines
  pids SCRIPT                                 engine PIDs only (no /health request, which the engine logs)
  stop SCRIPT TIMEOUT_S                       SIGTERM, wait, then SIGKILL
  wait SCRIPT URL TIMEOUT_S LOG LINES [APPEAR_S]
                                             until /health answers 200; stop at once if the engine died (a
                                             fresh start gets APPEAR_S, default 5, to appear)
  ranks SCRIPT LOG LINES                      a node that serves no API: its engine PIDs and its log's last lines

What only one engine needs is not here: it lives beside that engine's task files (files/engines/<engine>/).
"""

import json
import os
import re
import signal
import sys
import time
import urllib.error
import urllib.request

# What the engine is, from the inventory (`hy3spark.engine`, hy3spark/engines/): how its process is recognised and
# which log lines say what its KV cache holds. The role passes it as HY3SPARK_ENGINE (JSON) to `docker exec -e`.
ENGINE = json.loads(os.environ.get("HY3SPARK_ENGINE") or "null") or {}
KV_CACHE = re.compile(ENGINE.get("log_lines", {}).get("kv_cache", r"(?!)"))
CONCURRENCY = re.compile(ENGINE.get("log_lines", {}).get("concurrency", r"(?!)"))
# The systemd unit the engine runs in on the host (`hy3spark-engine.service`); empty in a container.
UNIT = os.environ.get("HY3SPARK_ENGINE_UNIT", "")


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _in_unit(pid: int) -> bool:
    """Whether the process belongs to UNIT: a line of /proc/PID/cgroup ends in /UNIT (cgroup v2 and v1 alike)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return any(line.rstrip("\n").endswith("/" + UNIT) for line in f)
    except OSError:
        return False


def _is_engine(argv: list[str], script: str) -> bool:
    # The script as what runs (`bash SCRIPT`, or SCRIPT itself), never as an argument: a probe like this one
    # (`python3 - status SCRIPT ...`), which the supervisor and a role may run at the same time, is no engine.
    if script in argv[:2]:
        return True
    exe, arg = ENGINE.get("process", {}).get("exe"), ENGINE.get("process", {}).get("arg")
    return any(os.path.basename(a) == exe and argv[i + 1:i + 2] == [arg] for i, a in enumerate(argv))


def engines(script: str) -> list[int]:
    """Engine PIDs, without the children that share the command line (the log tee's subshell)."""
    me = os.getpid()
    pids = (int(p) for p in os.listdir("/proc") if p.isdigit())
    found = {p for p in pids if p != me and _is_engine(_cmdline(p), script) and (not UNIT or _in_unit(p))}
    return sorted(p for p in found if _ppid(p) not in found)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop(script: str, timeout: float) -> dict:
    pids = engines(script)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    killed = [p for p in pids if _alive(p)]
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    return {"stopped": pids, "killed": killed}


def _settle(path: str, limit: float = 5.0) -> None:
    """Let the log tee drain what a dead engine wrote last: wait until the file stops growing."""
    deadline, last = time.monotonic() + limit, -1
    while time.monotonic() < deadline:
        try:
            size = os.path.getsize(path)
        except OSError:
            return
        if size == last:
            return
        last = size
        time.sleep(0.5)


def _tail(path: str, lines: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in f.readlines()[-lines:]]
    except OSError as exc:
        return [f"(cannot read {path}: {exc.strerror})"]


def _startup_lines(path: str) -> dict:
    out = {"kv_cache_line": None, "kv_cache_tokens": None, "max_concurrency_line": None, "max_concurrency": None}
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if m := KV_CACHE.search(line):
                    out["kv_cache_line"], out["kv_cache_tokens"] = m.group(0), int(m.group(1).replace(",", ""))
                elif m := CONCURRENCY.search(line):
                    out["max_concurrency_line"], out["max_concurrency"] = m.group(0), float(m.group(2))
    except OSError:
        pass
    return out


def _health(url: str) -> tuple[bool, object]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200, resp.status
    except (urllib.error.URLError, OSError) as exc:
        return False, str(getattr(exc, "reason", exc))[:200]


def status(script: str, url: str, log: str) -> dict:
    pids = engines(script)
    healthy, answer = _health(url) if pids else (False, None)
    report = {"pids": pids, "pid": pids[0] if pids else None, "alive": bool(pids), "healthy": healthy,
              "health": answer}
    if healthy:
        report.update(_startup_lines(log))
    return report


def wait(script: str, url: str, timeout: float, log: str, lines: int, appear: float = 5.0) -> dict:
    start = time.monotonic()
    report = {"healthy": False, "alive": False, "pid": None, "waited_s": 0.0, "health": None}
    while True:
        pids = engines(script)
        report["pid"] = pids[0] if pids else None
        report["alive"] = bool(pids)
        if not pids and time.monotonic() - start > appear:
            break  # the engine exited (a fresh start gets `appear` seconds to show up)
        if pids:
            report["healthy"], report["health"] = _health(url)
        if report["healthy"] or time.monotonic() - start >= timeout:
            break
        time.sleep(1)
    report["waited_s"] = round(time.monotonic() - start, 1)
    if report["healthy"]:
        report.update(_startup_lines(log))
    else:
        _settle(log)
        report["log_tail"] = _tail(log, lines)
    return report


def ranks(script: str, log: str, lines: int) -> dict:
    pids = engines(script)
    if not pids:
        _settle(log)
    return {"pids": pids, "pid": pids[0] if pids else None, "alive": bool(pids), "log_tail": _tail(log, lines)}


def main() -> None:
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd in ("status", "pids", "stop", "wait", "ranks") and not ENGINE.get("process"):
        # Without it no engine process can be recognised, and "none running" would start a second one: refuse.
        sys.exit("engine.py: HY3SPARK_ENGINE is not set; the role passes hy3spark.engine with docker exec -e")
    if cmd == "status":
        result = status(args[0], args[1], args[2])
    elif cmd == "pids":
        pids = engines(args[0])
        result = {"pids": pids, "pid": pids[0] if pids else None, "alive": bool(pids)}
    elif cmd == "stop":
        result = stop(args[0], float(args[1]))
    elif cmd == "wait":
        result = wait(args[0], args[1], float(args[2]), args[3], int(args[4]), *(float(a) for a in args[5:6]))
    elif cmd == "ranks":
        result = ranks(args[0], args[1], int(args[2]))
    else:
        result = {"error": f"unknown command {cmd}"}
    print(json.dumps(result))


main()
