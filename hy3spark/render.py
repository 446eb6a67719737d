"""Render every file a deployment needs from the spec, with the same templates the roles deploy.

Jinja settings match Ansible's `template` module (trim_blocks on, lstrip_blocks off, trailing newline kept),
and the only filters the templates use exist on both sides: Ansible's `to_json`, `to_nice_json`, `to_nice_yaml` and
`quote` re-implemented here to give the same text, and the collection's serialisers (plugins/filter/serialisers.py:
`hy3spark.cluster.env_value` and its kin) loaded from the collection itself. So the preview is byte-identical to what
lands on a node; tests/test_template_parity.py and the role scenarios prove it. Every value a template emits goes
through one of these serialisers (tests/test_template_serialisers.py), so no value can change a file's structure.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import importlib.util
import json
import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from hy3spark import content
from hy3spark.context import build_context
from hy3spark.errors import Hy3SparkError, SpecError
from hy3spark.spec import Loaded

MANIFEST = ".hy3spark-render.json"


@dataclass(frozen=True)
class Output:
    path: str  # relative to the render root
    kind: str  # what --only matches besides globs
    content: str
    mode: int = 0o644


def to_json(data: Any, **kwargs: Any) -> str:
    # Ansible's to_json: json.dumps with its defaults (ASCII only, ', ' and ': ' separators, keys in order).
    return json.dumps(data, **kwargs)


def to_nice_json(data: Any, indent: int = 4, sort_keys: bool = True) -> str:
    # Ansible's to_nice_json: indent 4, sorted keys, (',', ': ') separators.
    return json.dumps(data, indent=indent, sort_keys=sort_keys, separators=(",", ": "))


def to_nice_yaml(data: Any, indent: int = 4) -> str:
    return yaml.safe_dump(data, indent=indent, default_flow_style=False, sort_keys=False, width=10_000)


COLLECTION = "hy3spark.cluster"


@functools.cache  # one module: render_all catches the UnsafeValue its filters raise
def serialisers() -> ModuleType:
    """The collection's filter plugin plugins/filter/serialisers.py, loaded from the content the roles run."""
    path = content.path("plugins", "filter", "serialisers.py")
    spec = importlib.util.spec_from_file_location("hy3spark._serialisers", path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(str(content.path("templates"))),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=False,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(to_json=to_json, to_nice_json=to_nice_json, to_nice_yaml=to_nice_yaml, quote=shlex.quote)
    # By full name, as the roles call them: Ansible finds a collection's filters by no other.
    env.filters.update({f"{COLLECTION}.{name}": f for name, f in serialisers().FilterModule().filters().items()})
    return env


def render_all(loaded: Loaded) -> list[Output]:
    """Every output, in memory. Nothing is written here, so a failure leaves no half-written tree."""
    ctx = build_context(loaded)
    group, nodes = ctx["hy3spark"], ctx["nodes"]
    env = environment()

    unsafe = serialisers().UnsafeValue

    def tpl(name: str, **extra: Any) -> str:
        try:
            return env.get_template(name).render(hy3spark=group, nodes=nodes, **extra)
        except unsafe as exc:
            # Validation refuses these values first; this is the last line, never a file that means something else.
            source = loaded.path or "the cluster spec"
            raise SpecError(source, [f"{source}: {exc} (in templates/{name}); nothing was written"]) from None

    outputs = [
        Output("inventory/hosts.yml", "inventory", tpl("inventory/hosts.yml.j2")),
        Output("inventory/group_vars/all/hy3spark.yml", "inventory", tpl("inventory/group_vars.yml.j2")),
    ]
    for name, node in nodes.items():
        outputs.append(Output(f"inventory/host_vars/{name}.yml", "inventory",
                              tpl("inventory/host_vars.yml.j2", hy3spark_node=node)))
    for name, node in nodes.items():
        root = f"files/{name}"
        if group["fabric"] is not None:  # one machine with no cabled port: nothing for netplan to configure
            outputs.append(Output(f"{root}/etc/netplan/60-hy3spark-fabric.yaml", "netplan",
                                  tpl("netplan-fabric.yaml.j2", hy3spark_node=node), 0o600))
        if group["earlyoom"]["policy"] == "protect":
            outputs.append(Output(f"{root}/etc/default/earlyoom", "earlyoom", tpl("earlyoom.j2", hy3spark_node=node)))
        outputs.append(Output(f"{root}/etc/hy3spark/node.env", "env", tpl("node.env.j2", hy3spark_node=node), 0o600))
        outputs.append(Output(f"{root}/container.json", "container", tpl("container.json.j2", hy3spark_node=node)))
        # Every port this node listens on, and who may reach it: the firewall's input, deployed beside its rules.
        outputs.append(Output(f"{root}/etc/hy3spark/ports.txt", "ports", tpl("ports.txt.j2", hy3spark_node=node)))
        if group["firewall"]["enabled"]:  # hy3spark's nftables table, which admits each port only from its "from"
            outputs.append(Output(f"{root}/etc/hy3spark/firewall.nft", "firewall",
                                  tpl("firewall.nft.j2", hy3spark_node=node)))
        outputs.append(Output(f"{root}/docker-run.sh", "container", tpl("docker-run.sh.j2", hy3spark_node=node),
                              0o755))
        if node["serve_argv"]:  # every node under the native launcher; the head only under Ray
            outputs.append(Output(f"{root}/etc/hy3spark/serve.sh", "serve", tpl("serve.sh.j2", hy3spark_node=node),
                                  0o755))
        if node["role"] == "head" and group["paths"]["vllm_config_root"] in node["env"].values():
            # In the config root of an engine that reads one (VLLM_CONFIG_ROOT in its env).
            outputs.append(Output(f"{root}/etc/hy3spark/vllm/ray_non_carry_over_env_vars.json", "serve",
                                  tpl("ray_non_carry_over_env_vars.json.j2", hy3spark_node=node)))
        if node["role"] == "head" and group["engine_options"] is not None:
            outputs.append(Output(f"{root}{group['paths']['engine_options']}", "serve",
                                  tpl("engine-options.yml.j2", hy3spark_node=node)))
        if group["mpi"] is not None:  # every node's container mounts it (OMPI_MCA_orte_default_hostfile)
            outputs.append(Output(f"{root}{group['mpi']['hostfile']}", "serve",
                                  tpl("openmpi-hostfile.j2", hy3spark_node=node)))
            # Its sshd's config; mpirun's ssh config on the head (the keys they name are made on the nodes).
            outputs.append(Output(f"{root}{group['mpi']['sshd_config']}", "serve",
                                  tpl("mpi-sshd_config.j2", hy3spark_node=node)))
            if node["role"] == "head":
                outputs.append(Output(f"{root}{group['mpi']['ssh_config']}", "serve",
                                      tpl("mpi-ssh_config.j2", hy3spark_node=node)))
        restarts = group["restarts"]
        if restarts["enabled"]:  # docs/restarts.md: the container at boot; on the head, the engine's supervisor
            outputs.append(Output(f"{root}{restarts['unit_dir']}/{restarts['node_unit']}", "units",
                                  tpl("hy3spark-node.service.j2", hy3spark_node=node)))
            if restarts["supervised"] and node["role"] == "head":
                outputs.append(Output(f"{root}{restarts['unit_dir']}/{restarts['supervisor_unit']}", "units",
                                      tpl("hy3spark-supervisor.service.j2", hy3spark_node=node)))
                outputs.append(Output(f"{root}{restarts['config']}", "units",
                                      tpl("supervisor.json.j2", hy3spark_node=node)))
    outputs.append(Output("files/pi/models.json", "pi", tpl("pi-models.json.j2")))
    outputs.append(Output("files/pi/settings.json", "pi", tpl("pi-settings.json.j2")))
    return outputs


KINDS = ("inventory", "netplan", "earlyoom", "env", "container", "ports", "firewall", "serve", "units", "pi")


def select(outputs: list[Output], only: str | None) -> list[Output]:
    if not only:
        return outputs
    chosen = [o for o in outputs
              if o.kind == only or fnmatch.fnmatch(o.path, only) or fnmatch.fnmatch(o.path, f"*{only}*")]
    if not chosen:
        raise Hy3SparkError(f"--only {only!r} matches no rendered file; use a kind ({', '.join(KINDS)}) or a glob "
                            "over the paths that `hy3spark render` lists")
    return chosen


def preview(outputs: list[Output]) -> str:
    parts = []
    for o in outputs:
        body = o.content if o.content.endswith("\n") else o.content + "\n"
        parts.append(f"==> {o.path} (mode {o.mode:04o}) <==\n{body}")
    return "\n".join(parts)


def as_json(outputs: list[Output], warnings: list[str]) -> str:
    files = [{"path": o.path, "kind": o.kind, "mode": f"{o.mode:04o}", "content": o.content} for o in outputs]
    return json.dumps({"files": files, "warnings": warnings}, indent=2) + "\n"


def diff(outputs: list[Output], against: Path) -> tuple[str, int]:
    """Unified diff of the render against an earlier one; also lists files the new render no longer makes."""
    chunks: list[str] = []
    changed = 0
    wanted = {o.path for o in outputs}
    for o in outputs:
        old_path = against / o.path
        old = old_path.read_text() if old_path.is_file() else ""
        if old == o.content:
            continue
        changed += 1
        chunks.extend(difflib.unified_diff(old.splitlines(keepends=True), o.content.splitlines(keepends=True),
                                           fromfile=f"a/{o.path}" if old_path.is_file() else "/dev/null",
                                           tofile=f"b/{o.path}"))
    for old_file in _previous_files(against):
        if old_file not in wanted:
            changed += 1
            chunks.append(f"--- a/{old_file}\n+++ /dev/null\n(no longer rendered)\n")
    return "".join(chunks), changed


def _previous_files(root: Path) -> list[str]:
    manifest = root / MANIFEST
    if manifest.is_file():
        try:
            return list(json.loads(manifest.read_text())["files"])
        except (ValueError, KeyError, TypeError):
            return []
    return []


def write(outputs: list[Output], root: Path, spec_sha256: str, all_outputs: bool) -> list[str]:
    """Write atomically: each file via a temp file + rename, the manifest last; stale files of a full render removed.

    Returns the paths removed because the spec no longer produces them.
    """
    root.mkdir(parents=True, exist_ok=True)
    for o in outputs:
        target = root / o.path
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(o.content)
            os.chmod(tmp, o.mode)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    removed: list[str] = []
    if all_outputs:
        wanted = {o.path for o in outputs}
        for old in _previous_files(root):
            if old not in wanted and (root / old).is_file():
                (root / old).unlink()
                removed.append(old)
        manifest = {"spec_sha256": spec_sha256, "files": sorted(wanted)}
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{MANIFEST}.")
        with os.fdopen(fd, "w") as fh:
            json.dump(manifest, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, root / MANIFEST)
    return removed
