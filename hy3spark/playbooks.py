"""Running hy3spark's playbooks for the operator's commands (up, down, check, status): each run gets an inventory
rendered fresh from the spec, goes through ansible-runner (hy3spark.runner), and ends as a line, a failure summary
or a JSON document. The CLI and `ansible-playbook site.yml` share one implementation: the roles.

What a user passes through to ansible-playbook (kolla-ansible's way: -e, --skip-tags, --check, --diff) is checked
here before anything runs: -e values reach ansible-playbook's command line as given, so one that would carry a secret
is refused.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hy3spark import render
from hy3spark.errors import EXIT_OK, UsageError
from hy3spark.runner import Progress, RunResult, failure_summary, run_playbook
from hy3spark.spec import Loaded

EXTRA_VARS_FLAG = "-e/--extra-vars"
# A variable named like a credential holds one: the roles' own (__vllm_serve_api_key, __drift_hf_token,
# __status_key) and Ansible's (ansible_password, ansible_become_pass). Names of variables (vllm_serve_api_key_env),
# files (ansible_ssh_private_key_file) and counts (vllm_serve_smoke_max_tokens) end otherwise and pass.
_CREDENTIAL = re.compile(r"(?:^|_)(?:token|api_?key|key|pass|passwd|password|secrets?)$", re.IGNORECASE)


def secret_names(loaded: Loaded) -> list[str]:
    spec = loaded.spec
    return [n for n in (spec.model.token_env, spec.serving.api_key_env) if n]


@dataclass(frozen=True)
class AnsibleArgs:
    """The options a user passes through to ansible-playbook, checked (`ansible_args`)."""

    extra_vars: tuple[str, ...] = ()  # each as ansible-playbook's -e takes it; an @FILE made absolute
    skip_tags: str | None = None
    check: bool = False
    diff: bool = False

    def cmdline(self) -> list[str]:
        """For ansible-runner's command line (run_playbook takes --check and --diff as its own arguments)."""
        out = [arg for value in self.extra_vars for arg in ("-e", value)]
        return [*out, "--skip-tags", self.skip_tags] if self.skip_tags else out

    def argv(self) -> list[str]:
        """Every option, as a run record keeps them."""
        return [*self.cmdline(), *(["--check"] if self.check else []), *(["--diff"] if self.diff else [])]

    def vars_only(self) -> AnsibleArgs:
        """For a read-only playbook run alongside (status after up): the same variables (connection settings, say),
        none of the run's selection or mode."""
        return replace(self, skip_tags=None, check=False, diff=False)


def ansible_args(loaded: Loaded, extra_vars: list[str] | None = None, skip_tags: str | None = None,
                 check: bool = False, diff: bool = False) -> AnsibleArgs:
    """Check what goes to ansible-playbook before anything runs. Each inline -e is read as ansible-playbook reads
    it (ansible.utils.vars.load_extra_vars: inline YAML/JSON or KEY=VALUE pairs) and refused, with the flag named,
    when a key at any depth names a secret or a credential or a value holds an exported secret's value. Of an @FILE
    only the path reaches the command line: it must exist, and is passed on as an absolute path."""
    from hy3spark.engines import SECRET_NAMES, engine_for

    # Every name a secret goes by (any engine's on the head, the controller's the spec names) -> what to export.
    names: dict[str, str | None] = dict.fromkeys(SECRET_NAMES)
    for engine_var, source in engine_for(loaded.spec).secret_env().items():
        names[engine_var.upper()] = names[source.upper()] = source
    exported = {n: os.environ[n] for n in secret_names(loaded) if os.environ.get(n)}
    given = []
    for value in extra_vars or []:
        value, variables = _read_extra_vars(value)
        given.append(value)
        for where, key, text in _walk(variables):
            _refuse_secret(where, key, text, names, exported)
    return AnsibleArgs(tuple(given), skip_tags or None, check, diff)


def _read_extra_vars(value: str) -> tuple[str, Any]:
    """The -e to pass on and the variables it sets on the command line."""
    if value.startswith("@"):
        # Absolute: ansible-runner starts ansible-playbook in the content directory, not here.
        path = Path(value[1:]).expanduser().resolve()
        if not path.is_file():
            raise UsageError(f"{EXTRA_VARS_FLAG} {value}: no such file")
        return f"@{path}", {}
    if not value:
        return value, {}
    if value[0] in "/.":
        raise UsageError(f"{EXTRA_VARS_FLAG} {value}: a file needs an @ in front (-e @{value})")
    from ansible.errors import AnsibleError

    try:
        if value[0] in "[{":
            from ansible.parsing.dataloader import DataLoader

            data = DataLoader().load(value)
        else:
            from ansible.parsing.splitter import parse_kv

            data = parse_kv(value)
    except AnsibleError as exc:
        raise UsageError(f"{EXTRA_VARS_FLAG} {_shown(value)}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{EXTRA_VARS_FLAG} {_shown(value)}: not a mapping of variables (KEY=VALUE, YAML/JSON or "
                         f"@FILE)")
    return value, data


def _shown(value: str) -> str:
    """A -e as an error names it: a file by its name, inline data by its start (its values are the user's own)."""
    return value if value.startswith("@") or len(value) <= 40 else value[:37] + "..."


def _walk(data: Any, path: str = "") -> list[tuple[str, str, str | None]]:
    """(where, key, None) for every key at any depth (a mapping variable can carry a secret too) and (where, "",
    text) for every string value."""
    out: list[tuple[str, str, str | None]] = []
    if isinstance(data, dict):
        for key, value in data.items():
            where = f"{path}.{key}" if path else str(key)
            out.append((where, str(key), None))
            out.extend(_walk(value, where))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            out.extend(_walk(value, f"{path}[{i}]"))
    elif isinstance(data, str):
        out.append((path, "", data))
    return out


def _refuse_secret(where: str, key: str, text: str | None, names: dict[str, str | None],
                   exported: dict[str, str]) -> None:
    why = ("-e values are passed to ansible-playbook as given, where the process list and the run's artifacts would "
           "show them.")
    if key.upper() in names:
        source = names[key.upper()]
        instead = (f"Export {source} instead (the variable the spec names for it)" if source else
                   "Name a variable for it in the spec (model.token_env, serving.api_key_env) and export that")
        raise UsageError(f"{EXTRA_VARS_FLAG}: refused: {where!r} names a secret. {why} {instead}; hy3spark hands "
                         f"the spec's secrets to the playbook in a 0600 file.")
    if key and _CREDENTIAL.search(key):
        raise UsageError(f"{EXTRA_VARS_FLAG}: refused: {where!r} is named like a credential. {why} The spec's "
                         f"secrets go by environment variable (model.token_env, serving.api_key_env); any other goes "
                         f"in a file (-e @FILE, an Ansible vault) or the inventory.")
    for name, secret in exported.items():
        if text and secret in text:
            raise UsageError(f"{EXTRA_VARS_FLAG}: refused: the value of {where!r} holds the secret {name}. {why} "
                             f"Leave it in {name}; the roles read it from there.")


def render_inventory(loaded: Loaded, runs_dir: Path) -> Path:
    """Render the spec's inventory for this run (never a stale one)."""
    target = runs_dir / "inventory" / loaded.spec.name
    outputs = [o for o in render.render_all(loaded) if o.kind == "inventory"]
    render.write(outputs, target, loaded.sha256, all_outputs=True)
    return target / "inventory" / "hosts.yml"


def run(loaded: Loaded, playbook: str, runs_dir: Path, title: str, ansible: AnsibleArgs | None = None,
        **kwargs: Any) -> RunResult:
    """Run one playbook with a fresh inventory and live progress. `ansible`'s --check and --diff add to (never
    turn off) those the caller asks for itself (`check --dry-run`)."""
    inventory = render_inventory(loaded, runs_dir)
    ansible = ansible or AnsibleArgs()
    kwargs["check"] = kwargs.get("check", False) or ansible.check
    kwargs["diff"] = kwargs.get("diff", False) or ansible.diff
    with Progress(title) as progress:
        return run_playbook(playbook, inventory, runs_dir=runs_dir, secret_names=secret_names(loaded),
                            progress=progress, extra_args=ansible.cmdline(), **kwargs)


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
