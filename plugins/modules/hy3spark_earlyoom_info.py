#!/usr/bin/python
"""Read-only: where the node's earlyoom config came from, what earlyoom really runs with, what it would kill."""

from __future__ import annotations

import hashlib
import os
import re

from ansible.module_utils.basic import AnsibleModule

# How the unit hands EARLYOOM_ARGS to earlyoom: the same reading the preflight filter makes of the file.
from ansible_collections.hy3spark.cluster.plugins.module_utils.earlyoom import (
    assignment,
    env_file_value,
    option,
    quoting_problem,
    split_args,
)

DOCUMENTATION = r"""
module: hy3spark_earlyoom_info
short_description: Report the provenance and the real policy of a node's earlyoom
description:
  - Reads the earlyoom environment file, the package's conffile checksum, the systemd unit and the arguments of
    the earlyoom process actually running (C(/proc/<MainPID>/cmdline)); changes nothing.
  - "Provenance is C(hy3spark) (our managed header), C(sparkrun) (the C(# Configured by: sparkrun setup earlyoom)
    header), C(package-default) (byte-identical to the file the package shipped), C(absent) or C(unknown)."
  - Each protected process name is checked against the effective C(--prefer), C(--avoid) and C(--ignore) regexes the
    way earlyoom does it, on the name truncated to 15 characters (C(/proc/<pid>/comm)); Python's C(re) stands in for
    POSIX extended regexes, which agree on the patterns these configs use.
options:
  path:
    description: The environment file the earlyoom unit reads.
    type: path
    default: /etc/default/earlyoom
  service:
    description: The systemd unit name, without C(.service).
    type: str
    default: earlyoom
  package:
    description: The Debian package that ships earlyoom.
    type: str
    default: earlyoom
  managed_marker:
    description: The sentence our template writes on its first line after C(# ).
    type: str
    required: true
  protect_names:
    description: Process names (as earlyoom sees them) that must never be picked first.
    type: list
    elements: str
    required: true
author: hy3spark
"""

EXAMPLES = r"""
- name: Inspect earlyoom
  hy3spark.cluster.hy3spark_earlyoom_info:
    managed_marker: "{{ hy3spark.managed }}"
    protect_names: [vllm, ray, python3]
  register: found
"""

RETURN = r"""
config:
  description: The environment file (exists, sha1, mode, provenance, args as written, argv as systemd passes it).
  returned: always
  type: dict
package:
  description: Whether the package is installed, its version, the checksum of the file it shipped.
  returned: always
  type: dict
service:
  description: unit_present, active, enabled, main_pid, running argv, drop-in files.
  returned: always
  type: dict
effective:
  description: The argv the policy is judged on (the running process's, else the file's) and its regexes.
  returned: always
  type: dict
at_risk:
  description: Protected names earlyoom would pick first, each with the reason.
  returned: always
  type: list
  elements: dict
summary:
  description: One paragraph for people.
  returned: always
  type: str
"""

SPARKRUN_HEADER = "# Configured by: sparkrun setup earlyoom"
COMM_LEN = 15  # TASK_COMM_LEN - 1: earlyoom matches its regexes against /proc/<pid>/comm


def _read(path):
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def _config(path, marker, package):
    data = _read(path)
    info = {"path": path, "exists": data is not None, "sha1": None, "md5": None, "mode": None,
            "provenance": "absent", "args": None, "argv": [], "problems": []}
    if data is None:
        return info
    info["sha1"] = hashlib.sha1(data).hexdigest()
    info["md5"] = hashlib.md5(data, usedforsecurity=False).hexdigest()  # dpkg records conffiles by md5
    info["mode"] = "%04o" % (os.stat(path).st_mode & 0o7777)
    text = data.decode("utf-8", errors="replace")
    lines = text.splitlines()
    if ("# " + marker) in lines:
        info["provenance"] = "hy3spark"
    elif any(line.strip() == SPARKRUN_HEADER for line in lines):
        info["provenance"] = "sparkrun"
    elif package.get("conffile_md5") and package["conffile_md5"] == info["md5"]:
        info["provenance"] = "package-default"
    else:
        info["provenance"] = "unknown"
    raw = assignment(text)
    if raw is not None:
        info["args"] = env_file_value(raw)  # the value systemd's EnvironmentFile= parser yields
        info["argv"] = split_args(info["args"])  # what ExecStart='s $EARLYOOM_ARGS makes of it
        problem = quoting_problem(raw)
        if problem:
            info["problems"].append(problem)
    return info


def _package(module, name, path):
    info = {"installed": False, "version": None, "conffile_md5": None}
    dpkg_query = module.get_bin_path("dpkg-query")
    if not dpkg_query:
        info["installed"] = bool(module.get_bin_path("earlyoom"))
        return info
    rc, out, _err = module.run_command(
        [dpkg_query, "-W", "-f=${db:Status-Status}\n${Version}\n${Conffiles}\n", name])
    if rc != 0:
        return info
    lines = out.splitlines()
    info["installed"] = bool(lines) and lines[0] == "installed"
    info["version"] = lines[1] if len(lines) > 1 and lines[1] else None
    for line in lines[2:]:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == path:
            info["conffile_md5"] = parts[1]
    return info


def _service(module, unit):
    info = {"unit_present": False, "active": False, "active_state": None, "enabled": None, "main_pid": 0,
            "argv": None, "dropins": [], "fragment": None}
    systemctl = module.get_bin_path("systemctl")
    if not systemctl:
        return info
    props = "LoadState,ActiveState,UnitFileState,MainPID,DropInPaths,FragmentPath"
    rc, out, _err = module.run_command([systemctl, "show", "-p", props, unit + ".service"])
    if rc != 0:
        return info
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    info["unit_present"] = values.get("LoadState") == "loaded"
    info["active_state"] = values.get("ActiveState")
    info["active"] = values.get("ActiveState") == "active"
    info["enabled"] = values.get("UnitFileState") or None
    info["fragment"] = values.get("FragmentPath") or None
    info["dropins"] = [p for p in values.get("DropInPaths", "").split() if p]
    try:
        info["main_pid"] = int(values.get("MainPID", "0"))
    except ValueError:
        info["main_pid"] = 0
    if info["main_pid"] > 0:
        raw = _read(f"/proc/{info['main_pid']}/cmdline")
        if raw:
            info["argv"] = [a.decode("utf-8", errors="replace") for a in raw.split(b"\0")[:-1]][1:]
    return info


def _compile(pattern, flag, problems):
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        problems.append(f"{flag} {pattern!r} is not a valid regex ({exc}): earlyoom refuses to start with it")
        return None


def _risks(argv, names, problems):
    prefer = _compile(option(argv, "--prefer"), "--prefer", problems)
    avoid = _compile(option(argv, "--avoid"), "--avoid", problems)
    ignore = _compile(option(argv, "--ignore"), "--ignore", problems)
    at_risk = []
    for name in names:
        comm = name[:COMM_LEN]
        if ignore and ignore.search(comm):
            continue
        if prefer and prefer.search(comm):
            at_risk.append({"name": name, "comm": comm, "reason": "matches --prefer: killed first"})
        elif not (avoid and avoid.search(comm)):
            at_risk.append({"name": name, "comm": comm,
                            "reason": "not in --avoid: chosen by size like any process, and the engine is the largest"})
    regexes = {"prefer": option(argv, "--prefer"), "avoid": option(argv, "--avoid"),
               "ignore": option(argv, "--ignore")}
    return at_risk, regexes


_ORIGIN = {
    "hy3spark": "written by hy3spark",
    "sparkrun": "written by `sparkrun setup earlyoom`",
    "package-default": "the package's default",
    "absent": "absent",
    "unknown": "of unknown origin (edited by hand or by another tool)",
}


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "default": "/etc/default/earlyoom"},
            "service": {"type": "str", "default": "earlyoom"},
            "package": {"type": "str", "default": "earlyoom"},
            "managed_marker": {"type": "str", "required": True},
            "protect_names": {"type": "list", "elements": "str", "required": True},
        },
        supports_check_mode=True,
    )
    p = module.params
    package = _package(module, p["package"], p["path"])
    config = _config(p["path"], p["managed_marker"], package)
    service = _service(module, p["service"])
    problems = list(config["problems"])
    if service["active"] and service["argv"] is not None:
        source, argv = "running", service["argv"]
    elif config["exists"] and config["args"] is not None:
        source, argv = "config", config["argv"]
    else:
        source, argv = "none", []
    at_risk, regexes = _risks(argv, p["protect_names"], problems) if source != "none" else ([], {})
    effective = {"source": source, "argv": argv, "regexes": regexes}

    parts = [f"{p['path']}: {_ORIGIN[config['provenance']]}"]
    if config["args"] is not None:
        parts.append(f"EARLYOOM_ARGS={config['args']}")
    if not package["installed"]:
        parts.append(f"package {p['package']} not installed")
    if service["active"]:
        parts.append(f"earlyoom running (pid {service['main_pid']}) with: {' '.join(service['argv'] or [])}")
    else:
        parts.append(f"earlyoom not running ({service['active_state'] or 'no unit'}, "
                     f"{service['enabled'] or 'not installed'})")
    if service["dropins"]:
        parts.append(f"drop-ins: {', '.join(service['dropins'])}")
    if source != "none":
        when = "would" if source == "running" else "if started, would"
        by_reason: dict[str, list[str]] = {}
        for risk in at_risk:
            by_reason.setdefault(risk["reason"], []).append(risk["name"])
        picked = " / ".join(f"{', '.join(names)} ({reason})" for reason, names in by_reason.items())
        parts.append(f"{when} pick first: {picked or 'none of ' + ', '.join(p['protect_names'])}")
    parts.extend(f"problem: {problem}" for problem in problems)

    module.exit_json(changed=False, config=config, package=package, service=service, effective=effective,
                     at_risk=at_risk, problems=problems, summary="; ".join(parts))


if __name__ == "__main__":
    main()
