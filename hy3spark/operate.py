"""The operator's commands: up, down, check, status, logs. Each runs hy3spark's playbooks through ansible-runner,
on an inventory rendered fresh from the spec for that run, so the CLI and `ansible-playbook site.yml` share one
implementation: the roles.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hy3spark import render
from hy3spark.context import SERVE_LOG
from hy3spark.errors import EXIT_OK, Hy3SparkError
from hy3spark.runner import (
    Progress,
    RunResult,
    ansible_envvars,
    environ_without,
    failure_summary,
    interruptible,
    plain,
    run_playbook,
)
from hy3spark.spec import Loaded

# The line templates/serve.sh.j2 writes to the serve log each time the engine starts. The log is appended to, so
# what describes the engine now (its KV lines, its NCCL channels) is what follows the last such line.
ENGINE_START = "hy3spark: starting "


def secret_names(loaded: Loaded) -> list[str]:
    spec = loaded.spec
    return [n for n in (spec.model.token_env, spec.serving.api_key_env) if n]


def render_inventory(loaded: Loaded, runs_dir: Path) -> Path:
    """Render the spec's inventory for this run (never a stale one)."""
    target = runs_dir / "inventory" / loaded.spec.name
    outputs = [o for o in render.render_all(loaded) if o.kind == "inventory"]
    render.write(outputs, target, loaded.sha256, all_outputs=True)
    return target / "inventory" / "hosts.yml"


def run(loaded: Loaded, playbook: str, runs_dir: Path, title: str, **kwargs: Any) -> RunResult:
    inventory = render_inventory(loaded, runs_dir)
    with Progress(title) as progress:
        return run_playbook(playbook, inventory, runs_dir=runs_dir, secret_names=secret_names(loaded),
                            progress=progress, **kwargs)


def payload(result: RunResult, extra: dict[str, Any] | None = None, reports: bool = False) -> dict[str, Any]:
    """A run's outcome as `--json` prints it."""
    return {
        "playbook": result.playbook, "status": result.status, "rc": result.rc, "exit_code": result.exit_code,
        "duration_s": result.duration_s, "phases": result.phases,
        "failures": [f.__dict__ for f in result.failures], "artifacts": str(result.private_data_dir),
        **({"reports": [r.__dict__ for r in result.reports]} if reports else {}),
        **({"diffs": result.diffs} if result.diffs else {}),
        **(extra or {}),
    }


def finish(result: RunResult, json_out: bool, extra: dict[str, Any] | None = None, reports: bool = False) -> int:
    """The outcome on stdout (JSON or a line) and a failure's summary on stderr; before them what would change (a
    diff-mode run) and, with `reports`, what the run's report tasks printed (preflight table, teardown's memory)."""
    if json_out:
        print(json.dumps(payload(result, extra, reports), indent=2, default=str))
        return result.exit_code
    if reports and result.exit_code == EXIT_OK:
        for report in result.reports:
            print(report.text)
    for diff in result.diffs:
        print(diff, end="")
    if result.exit_code != EXIT_OK:
        print(failure_summary(result), file=sys.stderr)
    else:
        print(f"{result.playbook}: ok in {result.duration_s:.0f} s")
    return result.exit_code


# --- status -------------------------------------------------------------------------------------------------------
_RAY_NODES = re.compile(r"^\s*(\d+)\s+node_", re.M)
_RAY_GPUS = re.compile(r"([\d.]+)/([\d.]+) GPU")


def parse_ray_status(text: str) -> dict[str, Any]:
    """`ray status`: the Active section's node lines and the GPU usage line."""
    active = text.split("Active:", 1)[1].split("Pending:", 1)[0] if "Active:" in text else ""
    nodes = sum(int(n) for n in _RAY_NODES.findall(active))
    gpus = _RAY_GPUS.search(text)
    return {"nodes": nodes, "gpus_total": float(gpus.group(2)) if gpus else 0.0,
            "gpus_used": float(gpus.group(1)) if gpus else 0.0}


def collect_status(loaded: Loaded, runs_dir: Path, limit: str | None = None) -> tuple[RunResult, dict[str, Any]]:
    result = run(loaded, "playbooks/status.yml", runs_dir, "status", limit=limit)
    nodes = {host: data.get("hy3spark_report_status", {}) for host, data in result.results.items()}
    head = nodes.get(loaded.spec.head.name, {})
    lines = current_engine_lines([plain(str(x)) for x in head.get("log_lines", [])])
    summary = {
        "cluster": loaded.spec.name,
        "nodes": nodes,
        "ray": parse_ray_status(str(head.get("ray_status", ""))),
        "endpoint": {"url": f"http://{loaded.spec.head.fabric_ip.ip}:{loaded.spec.serving.port}",
                     "health": head.get("health"), "models": head.get("models", [])},
        "kv_lines": [x for x in lines if "KV cache size" in x or "Maximum concurrency" in x],
        "transport": _transport(lines),
        "last_run": last_record(runs_dir, loaded.spec.name),
    }
    return result, summary


def current_engine_lines(lines: list[str]) -> list[str]:
    """The lines the latest engine start logged: earlier starts' KV and NCCL lines describe no running engine."""
    starts = [i for i, line in enumerate(lines) if line.startswith(ENGINE_START)]
    return lines[starts[-1] + 1:] if starts else lines


def _transport(lines: list[str]) -> str | None:
    if not lines:
        return None
    vias = [x for x in lines if " via " in x]
    if not vias:
        return None
    from hy3spark import nccl

    report = nccl.parse_logs(["\n".join(vias)])
    counts = {str(k): v for k, v in report.counts().items() if v}
    return ", ".join(f"{k}: {v}" for k, v in counts.items()) or None


def print_status(summary: dict[str, Any], console: Any = None) -> None:
    """A table on a terminal; plain lines (one per node, nothing cut short) when the output goes elsewhere."""
    from rich.console import Console

    console = console or Console()
    columns = ("node", "role", "containers", "image", "memory", "ray", "vllm")
    rows = []
    for name, node in summary["nodes"].items():
        containers = ", ".join(f"{c.get('Names')} ({c.get('State') or c.get('Status')})"
                               for c in node.get("containers", [])) or "none"
        versions = node.get("versions", {})
        image = str(node.get("image_id") or "").split(":")[-1][:12] or "absent"
        rows.append((name, str(node.get("role")), containers, image,
                     f"{int(node.get('mem_available_bytes') or 0) / (1 << 30):.1f} GiB free",
                     versions.get("ray") or "-", versions.get("vllm") or "-"))
    ray, endpoint = summary["ray"], summary["endpoint"]
    health = endpoint["health"]
    health_text = ("healthy" if health == 200 else "not probed" if health is None
                   else "not answering" if health in (-1, 0) else f"answers {health}")
    lines = [f"Ray: {ray['nodes']} node(s), {ray['gpus_total']:g} GPU(s) ({ray['gpus_used']:g} in use)",
             f"endpoint {endpoint['url']}: {health_text}; models: {', '.join(endpoint['models']) or 'none'}",
             *(f"  {line.split('] ')[-1]}" for line in summary["kv_lines"])]
    if summary["transport"]:
        lines.append(f"NCCL transport: {summary['transport']}")
    last = summary.get("last_run")
    if last:
        lines.append(f"last run: {last.get('started')} {last.get('status')} ({last.get('file')})")
    if console.is_terminal:
        from rich.table import Table

        table = Table(title=f"cluster {summary['cluster']}")
        for i, col in enumerate(columns):
            # Names are what a user copies into --limit: never shortened; the rest folds when the terminal is narrow.
            table.add_column(col, no_wrap=i == 0, min_width=max([len(r[0]) for r in rows] + [4]) if i == 0 else None,
                             overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        for line in lines:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        return
    print(f"cluster {summary['cluster']}", file=console.file)
    for row in rows:
        print("  ".join([row[0], row[1], *(f"{col} {value}" for col, value in zip(columns[2:], row[2:], strict=True))]),
              file=console.file)
    for line in lines:
        print(line, file=console.file)


# --- run records --------------------------------------------------------------------------------------------------
def last_record(runs_dir: Path, cluster: str) -> dict[str, Any] | None:
    """The newest record of this cluster (a runs directory holds the records of every cluster run from it)."""
    for path in sorted((runs_dir / "records").glob(f"*-{cluster}.json"), reverse=True):
        data = json.loads(path.read_text())
        if data.get("cluster") == cluster:
            return {"file": str(path), "started": data.get("started"), "status": data.get("status")}
    return None


def write_record(loaded: Loaded, runs_dir: Path, result: RunResult, summary: dict[str, Any] | None,
                 started: str, labbook: Path) -> Path:
    nodes = (summary or {}).get("nodes", {})
    head = nodes.get(loaded.spec.head.name, {})
    versions = head.get("versions", {})
    record = {
        "cluster": loaded.spec.name,
        "spec": loaded.source,
        "spec_sha256": loaded.sha256,
        "started": started,
        "status": result.status,
        "exit_code": result.exit_code,
        "duration_s": result.duration_s,
        "phases_s": result.phases,
        "image_ids": {name: node.get("image_id") for name, node in nodes.items()},
        "versions": {k: versions.get(k) or None for k in ("vllm", "ray", "python", "nccl", "driver")},
        "kv_lines": (summary or {}).get("kv_lines", []),
        "kv_predicted": _predicted(loaded),
        "transport": (summary or {}).get("transport"),
        "ray": (summary or {}).get("ray"),
        "failures": [f.__dict__ for f in result.failures],
        "artifacts": str(result.private_data_dir),
    }
    out_dir = runs_dir / "records"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{started.replace(':', '').replace('-', '')}-{loaded.spec.name}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    kv = "; ".join(x.split("] ")[-1] for x in record["kv_lines"]) or "no KV lines"
    line = (f"| {started} | up {loaded.spec.name} | {loaded.spec.serving.engine} {record['versions']['vllm'] or '?'} "
            f"| {result.status} in {result.duration_s:.0f} s | {kv} | transport: {record['transport'] or '?'} "
            f"| {path.name} |\n")
    _append_labbook(labbook, line)
    return path


def _predicted(loaded: Loaded) -> dict[str, Any]:
    from hy3spark.context import plan_summary

    plan = plan_summary(loaded)
    return {"kv_cache_size_line": plan["kv_cache_size_line"], "max_concurrency_line": plan["max_concurrency_line"]}


def _append_labbook(labbook: Path, line: str) -> None:
    labbook.parent.mkdir(parents=True, exist_ok=True)
    new = not labbook.exists()
    with labbook.open("a") as fh:
        if new:
            fh.write("# Lab notebook\n\nOne line per run (hy3spark up / hy3spark bench).\n\n")
        fh.write(line)


# --- logs ---------------------------------------------------------------------------------------------------------
class ServeLog:
    """The engine's log on the head, read through ansible-runner (the spec's SSH settings) in a private data dir of
    this command's own (0700), with the secrets out of the environment ansible-runner writes to disk."""

    def __init__(self, loaded: Loaded, runs_dir: Path) -> None:
        self.loaded = loaded
        self.inventory = render_inventory(loaded, runs_dir)
        self.private = Path(tempfile.mkdtemp(prefix=time.strftime("logs-%Y%m%d-%H%M%S-"), dir=runs_dir))

    def read(self, offset: int | None, lines: int, stop: Any) -> tuple[str, int] | None:
        """From byte `offset` (or the last `lines` lines) up to the size measured first, so the next read starts
        exactly where this one ended. None when `stop` was set during the read."""
        import ansible_runner

        log = shlex.quote(SERVE_LOG)
        head = self.loaded.spec.head.name
        body = (f"tail -c +{offset + 1} {log} | head -c $((size - {offset}))" if offset is not None
                else f"head -c \"$size\" {log} | tail -n {lines}")
        script = (f"[ -f {log} ] || {{ echo 'no {SERVE_LOG} on this node: nothing has been served here yet' >&2; "
                  f"exit 1; }}; size=$(stat -c %s {log}) && echo \"$size\" && {body}")
        with environ_without(secret_names(self.loaded)):
            r = ansible_runner.run(
                private_data_dir=str(self.private), inventory=str(self.inventory), host_pattern=head,
                module="ansible.builtin.shell", module_args=script, quiet=True,
                envvars=ansible_envvars(),
                rotate_artifacts=3, cancel_callback=stop.is_set,
            )
        if r.status == "canceled":
            return None
        for ev in r.events:
            if ev.get("event") == "runner_on_ok":
                out = ev["event_data"]["res"].get("stdout", "")
                size_line, _, text = out.partition("\n")
                return text + ("\n" if text else ""), int(size_line.strip() or 0)
            if ev.get("event") in ("runner_on_failed", "runner_on_unreachable"):
                res = ev["event_data"]["res"]
                raise Hy3SparkError(f"cannot read {SERVE_LOG} on {head}: {res.get('stderr') or res.get('msg')}")
        raise Hy3SparkError(f"cannot read {SERVE_LOG} on {head}: ansible-runner {r.status} (rc {r.rc})")


def read_log(loaded: Loaded, runs_dir: Path, lines: int) -> str:
    """The last `lines` lines of the serve log on the head."""
    with interruptible() as stop:
        got = ServeLog(loaded, runs_dir).read(None, lines, stop)
    if got is None:
        raise KeyboardInterrupt
    return got[0]


def follow_log(loaded: Loaded, runs_dir: Path, lines: int, interval: float = 2.0) -> int:
    """Print the tail, then new bytes every `interval` s. Ctrl+C detaches; the engine keeps running."""
    log = ServeLog(loaded, runs_dir)
    with interruptible() as stop:
        size: int | None = None
        while not stop.is_set():
            got = log.read(size, lines, stop)
            if got is None:
                break
            text, new_size = got
            if size is not None and new_size < size:  # rotated or truncated: start over from its beginning
                got = log.read(0, lines, stop)
                if got is None:
                    break
                text, new_size = got
            sys.stdout.write(text)
            sys.stdout.flush()
            size = new_size
            stop.wait(interval)
    print("\ndetached (the engine keeps running)", file=sys.stderr)
    return EXIT_OK


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
