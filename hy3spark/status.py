"""`hy3spark status`: what runs on every node (containers, or the engine's unit on the host when it runs from an
operator's venv; image IDs, versions, memory), Ray's nodes and GPUs, the endpoint's health and models, the running
engine's KV and NCCL lines and the last run record, collected read-only by playbooks/status.yml; printed as a table
on a terminal and as plain lines otherwise. `up` records the same after its run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hy3spark.context import ENGINE_START, client_url
from hy3spark.engines import engine_for
from hy3spark.playbooks import AnsibleArgs, run
from hy3spark.records import last_record
from hy3spark.runner import RunResult, plain
from hy3spark.spec import Loaded, Spec

_RAY_NODES = re.compile(r"^\s*(\d+)\s+node_", re.M)
_RAY_GPUS = re.compile(r"([\d.]+)/([\d.]+) GPU")


def parse_ray_status(text: str) -> dict[str, Any]:
    """`ray status`: the Active section's node lines and the GPU usage line."""
    active = text.split("Active:", 1)[1].split("Pending:", 1)[0] if "Active:" in text else ""
    nodes = sum(int(n) for n in _RAY_NODES.findall(active))
    gpus = _RAY_GPUS.search(text)
    return {"nodes": nodes, "gpus_total": float(gpus.group(2)) if gpus else 0.0,
            "gpus_used": float(gpus.group(1)) if gpus else 0.0}


def collect_status(loaded: Loaded, runs_dir: Path, limit: str | None = None,
                   ansible: AnsibleArgs | None = None) -> tuple[RunResult, dict[str, Any]]:
    """Run playbooks/status.yml (read-only) and sum up what it found. `ansible`: the -e variables only."""
    result = run(loaded, "playbooks/status.yml", runs_dir, "status", ansible=ansible and ansible.vars_only(),
                 limit=limit)
    nodes = {host: data.get("hy3spark_report_status", {}) for host, data in result.results.items()}
    head = nodes.get(loaded.spec.head.name, {})
    lines = current_engine_lines([plain(str(x)) for x in head.get("log_lines", [])])
    summary = {
        "cluster": loaded.spec.name,
        "nodes": nodes,
        "ray": parse_ray_status(str(head.get("ray_status", ""))),
        # The URL clients use (the context's, honouring serving.host), without the OpenAI /v1 suffix.
        "endpoint": {"url": client_url(loaded.spec).removesuffix("/v1"),
                     "health": head.get("health"), "models": head.get("models", [])},
        "kv_lines": kv_lines_of(loaded.spec, lines),
        "transport": _transport(lines),
        "last_run": last_record(runs_dir, loaded.spec.name),
        "supervisor": head.get("supervisor") or None,
    }
    for node in nodes.values():
        node["units"] = parse_units(node.get("units") or {})
    return result, summary


def parse_units(shown: dict[str, str]) -> dict[str, dict[str, str]]:
    """unit -> its `systemctl show` fields, for the units systemd has loaded (a unit not installed is left out)."""
    units = {}
    for name, text in shown.items():
        fields = dict(line.split("=", 1) for line in str(text).splitlines() if "=" in line)
        if fields.get("LoadState") == "loaded":
            units[name] = fields
    return units


def describe_units(units: dict[str, dict[str, str]]) -> str:
    """`hy3spark-node.service active, enabled, 2 restarts` per unit; `none` when no unit of ours is installed."""
    parts = []
    for name, f in units.items():
        restarts = int(f.get("NRestarts") or 0)
        parts.append(f"{name} {f.get('ActiveState')}, {f.get('UnitFileState')}"
                     + (f", {restarts} restart{'s' if restarts != 1 else ''}" if restarts else ""))
    return "; ".join(parts) or "none"


def describe_supervisor(state: dict[str, Any] | None) -> str | None:
    """What the head's supervisor did last (docs/restarts.md), as one line; None when it never ran."""
    if not state:
        return None
    restarts = f"{state.get('restarts', 0)} restart(s), {state.get('starts', 0)} start(s)"
    what = state.get("state")
    if what == "gave-up":
        return f"supervisor: {state.get('cause')} (since {state.get('since')}; {restarts})"
    if what == "serving":
        return f"supervisor: serving, engine PID {state.get('pid')} (since {state.get('since')}; {restarts})"
    cause = f": {state['cause']}" if state.get("cause") else ""
    return f"supervisor: {what}{cause} (since {state.get('since')}; {restarts})"


def kv_lines_of(spec: Spec, lines: list[str]) -> list[str]:
    """The lines in which the engine reports its KV cache, by its own patterns (vLLM's size and concurrency lines,
    TensorRT-LLM's allocation line): what `up` records and bench reads."""
    patterns = [re.compile(p) for p in engine_for(spec).log_lines().values()]
    return [x for x in lines if any(p.search(x) for p in patterns)]


def current_engine_lines(lines: list[str]) -> list[str]:
    """The lines the latest engine start logged: earlier starts' KV and NCCL lines describe no running engine (the
    serve log is appended to; the serve script writes ENGINE_START at each start)."""
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
    columns = ("node", "role", "containers", "units", "image", "memory", "ray", "vllm")
    rows = []
    for name, node in summary["nodes"].items():
        # The engine's unit on the host (an operator's engine venv, no container) stands beside the containers.
        unit = node.get("engine_unit") or {}
        venv = f", venv {unit['venv']}" if unit.get("venv") else ""
        containers = ", ".join([*(f"{c.get('Names')} ({c.get('State') or c.get('Status')})"
                                  for c in node.get("containers", [])),
                                *([f"{unit.get('unit')} ({unit.get('ActiveState')}{venv})"] if unit else [])]) or "none"
        versions = node.get("versions", {})
        image = str(node.get("image_id") or "").split(":")[-1][:12] or "absent"
        rows.append((name, str(node.get("role")), containers, describe_units(node.get("units") or {}), image,
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
    supervisor = describe_supervisor(summary.get("supervisor"))
    if supervisor:
        lines.append(supervisor)
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
