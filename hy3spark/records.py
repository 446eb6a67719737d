"""Run records and the lab notebook: what `up` leaves behind (one JSON record per run under runs/records/) and the
one line per run that `up` and `bench` append to labbook.md, the runs directory's history in one table.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from hy3spark.runner import RunResult
from hy3spark.spec import Loaded


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def newest_record(runs_dir: Path, cluster: str) -> tuple[Path, dict[str, Any]] | None:
    """The newest record of this cluster and its content (a runs directory holds the records of every cluster run
    from it)."""
    for path in sorted((runs_dir / "records").glob(f"*-{cluster}.json"), reverse=True):
        data = json.loads(path.read_text())
        if data.get("cluster") == cluster:
            return path, data
    return None


def last_record(runs_dir: Path, cluster: str) -> dict[str, Any] | None:
    """The newest record of this cluster, in short."""
    found = newest_record(runs_dir, cluster)
    if found is None:
        return None
    path, data = found
    return {"file": str(path), "started": data.get("started"), "status": data.get("status")}


def write_record(loaded: Loaded, runs_dir: Path, result: RunResult, summary: dict[str, Any] | None,
                 started: str, labbook: Path, ansible_args: list[str] | None = None) -> Path:
    """The record of one `up`: what ran, how it ended, and what runs on the nodes afterwards (`summary`, from
    hy3spark.status). `ansible_args` are the options passed through to ansible-playbook (a check-mode run says so
    in the lab notebook: it changed nothing)."""
    nodes = (summary or {}).get("nodes", {})
    head = nodes.get(loaded.spec.head.name, {})
    versions = head.get("versions", {})
    engine = loaded.spec.serving.engine
    args = list(ansible_args or [])
    record = {
        "cluster": loaded.spec.name,
        "engine": engine,
        "spec": loaded.source,
        "spec_sha256": loaded.sha256,
        "started": started,
        "status": result.status,
        "exit_code": result.exit_code,
        "duration_s": result.duration_s,
        "phases_s": result.phases,
        "ansible_args": args,
        "image_ids": {name: node.get("image_id") for name, node in nodes.items()},
        # The engine's own version under its name (what bench falls back on when the endpoint has no /version).
        "versions": {k: versions.get(k) or None for k in dict.fromkeys((engine, "vllm", "ray", "python", "nccl",
                                                                         "driver"))},
        "kv_lines": (summary or {}).get("kv_lines", []),
        "kv_predicted": _predicted(loaded),
        "transport": (summary or {}).get("transport"),
        "ray": (summary or {}).get("ray"),
        # Each node's GPU link readings as the run's last preflight took them (roles/preflight's "Report the GPU
        # link readings"); null when no preflight ran (a run in sync with its last one skips it). Idle values.
        "gpu_link": gpu_link_from(result, [n.name for n in loaded.spec.nodes]),
        "failures": [f.__dict__ for f in result.failures],
        "artifacts": str(result.private_data_dir),
    }
    out_dir = runs_dir / "records"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{started.replace(':', '').replace('-', '')}-{loaded.spec.name}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    kv = "; ".join(x.split("] ")[-1] for x in record["kv_lines"]) or "no KV lines"
    command = f"up {loaded.spec.name}" + (" --check" if "--check" in args else "")
    line = (f"| {started} | {command} | {engine} {record['versions'][engine] or '?'} "
            f"| {result.status} in {result.duration_s:.0f} s | {kv} | transport: {record['transport'] or '?'} "
            f"| {path.name} |\n")
    append_labbook(labbook, line)
    return path


def gpu_link_from(result: RunResult, nodes: list[str]) -> dict[str, Any] | None:
    """{node: reading} from a run that read the GPU links (preflight), else None."""
    readings = {n: result.results.get(n, {}).get("hy3spark_report_gpu_link") for n in nodes}
    return readings if any(v is not None for v in readings.values()) else None


def _predicted(loaded: Loaded) -> dict[str, Any]:
    from hy3spark.context import plan_summary

    plan = plan_summary(loaded)
    return {"kv_cache_size_line": plan["kv_cache_size_line"], "max_concurrency_line": plan["max_concurrency_line"]}


def append_labbook(labbook: Path, line: str) -> None:
    """Append one table row, starting the notebook with its header when it does not exist yet."""
    labbook.parent.mkdir(parents=True, exist_ok=True)
    new = not labbook.exists()
    with labbook.open("a") as fh:
        if new:
            fh.write("# Lab notebook\n\nOne line per run (hy3spark up / hy3spark bench).\n\n")
        fh.write(line)
