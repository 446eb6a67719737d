"""Running hy3spark's playbooks for the operator's commands (up, down, check, status): each run gets an inventory
rendered fresh from the spec, goes through ansible-runner (hy3spark.runner), and ends as a line, a failure summary
or a JSON document. The CLI and `ansible-playbook site.yml` share one implementation: the roles.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hy3spark import render
from hy3spark.errors import EXIT_OK
from hy3spark.runner import Progress, RunResult, failure_summary, run_playbook
from hy3spark.spec import Loaded


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
