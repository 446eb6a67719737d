#!/usr/bin/python
"""hy3spark_drift: compare a node with the record of its last complete site.yml run, or write that record.

The same observation runs at the end of a complete run (it becomes the node's record, with the hash of the run's
inputs) and at the start of the next one (it is compared with the record), so both sides always observe the same
things the same way. Only WHAT differs is returned (names, never contents): the record holds hashes of files that
may be secret (the secrets env file), so it is written 0600 and never returned.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import stat
import subprocess
import tempfile
import urllib.error
import urllib.request

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: hy3spark_drift
short_description: Compare a node with its hy3spark deployment record, or write the record
description:
  - Observes what site.yml manages on the node (files and directory trees by SHA-256, mode and owner; the fabric
    interfaces' addresses and MTU; systemd units' state and running argv; image IDs; Ray containers' IDs and
    start times; the engine's processes; the model's hub cache entries by size and mtime).
  - C(state=compared) compares that with the record and the expected inputs hash; C(state=recorded) writes the
    record (mode 0600) when it differs.
options:
  watch:
    description: What to observe (keys files, trees, user_files, interfaces, units, images, containers, processes,
      models, health).
    type: dict
    required: true
  record:
    description: Path of the record file.
    type: path
    required: true
  inputs:
    description: SHA-256 of everything the run's outcome depends on (spec, role inputs, secrets, hy3spark's code).
    type: str
    required: true
  state:
    description: compared (read only) or recorded (write the record).
    type: str
    choices: [compared, recorded]
    default: compared
"""

RETURN = r"""
in_sync:
  description: The record exists, its inputs hash is the expected one, and every observation equals the record.
  type: bool
differs:
  description: What differs, as "kind name" strings (for example "files /etc/default/earlyoom"), or why there is no
    comparison ("no record").
  type: list
health:
  description: HTTP status of watch.health (or the connection error), when asked.
  type: raw
"""


def file_state(path: str) -> object:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    entry = {"mode": f"{stat.S_IMODE(st.st_mode):04o}", "uid": st.st_uid, "gid": st.st_gid}
    if stat.S_ISLNK(st.st_mode):
        entry["link"] = os.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        entry["sha256"] = digest.hexdigest()
    else:
        entry["type"] = "dir" if stat.S_ISDIR(st.st_mode) else "other"
    return entry


def tree_state(root: str) -> object:
    if not os.path.isdir(root):
        return "missing"
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in [".", *sorted(filenames)]:
            path = os.path.normpath(os.path.join(dirpath, name))
            out[os.path.relpath(path, root)] = file_state(path)
    return out


def model_state(root: str) -> object:
    if not os.path.isdir(root):
        return "missing"
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        # huggingface_hub's markers of files a repo does not have (written when the engine looks for one): not model.
        dirnames[:] = sorted(d for d in dirnames if d != ".no_exist")
        for name in sorted(filenames) + sorted(d for d in dirnames if os.path.islink(os.path.join(dirpath, d))):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (
                ["link", os.readlink(path)] if stat.S_ISLNK(st.st_mode) else ["file", st.st_size, st.st_mtime_ns]
            )
    return out


def run(argv: list[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, proc.stdout


def interface_state(name: str) -> object:
    rc, out = run(["ip", "-j", "addr", "show", "dev", name])
    if rc != 0 or not out.strip():
        return "missing"
    link = json.loads(out)[0]
    # The configured addresses: link-local and dynamic ones (SLAAC, privacy addresses) come and go by themselves.
    addrs = sorted(
        f"{a['local']}/{a['prefixlen']}"
        for a in link.get("addr_info", [])
        if a.get("scope") != "link" and not a.get("dynamic")
    )
    return {"mtu": link.get("mtu"), "addresses": addrs}


def unit_state(name: str) -> object:
    _rc, out = run(["systemctl", "show", name, "--property", "ActiveState,UnitFileState,MainPID"])
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    argv = None
    pid = props.get("MainPID", "0")
    if pid not in ("", "0"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
        except OSError:
            argv = None
    return {"active": props.get("ActiveState"), "enabled": props.get("UnitFileState"), "argv": argv}


def image_state(ref: str) -> object:
    rc, out = run(["docker", "image", "inspect", "--format", "{{.Id}}", ref])
    return out.strip() if rc == 0 else "missing"


def container_state(name: str) -> object:
    rc, out = run(["docker", "inspect", "--type", "container", name])
    if rc != 0:
        return "missing"
    info = json.loads(out)[0]
    return {
        "id": info["Id"],
        "image": info["Image"],
        "running": info["State"]["Running"],
        "started_at": info["State"]["StartedAt"],
    }


def process_state(spec: dict) -> object:
    rc, out = run(["docker", "top", spec["container"], "-eo", "pid,lstart,args"])
    if rc != 0:
        return "container not running"
    rows = []
    for line in out.splitlines()[1:]:
        fields = line.split(None, 6)
        if len(fields) == 7 and spec["match"] in fields[6]:
            rows.append(" ".join(fields[:6]))
    return sorted(rows)


def health(url: str) -> object:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))


OBSERVERS = {
    "files": file_state,
    "trees": tree_state,
    "interfaces": interface_state,
    "units": unit_state,
    "images": image_state,
    "containers": container_state,
    "models": model_state,
}


def observe(watch: dict) -> dict:
    state: dict = {kind: {name: fn(name) for name in watch.get(kind) or []} for kind, fn in OBSERVERS.items()}
    state["processes"] = {p["container"]: process_state(p) for p in watch.get("processes") or []}
    user = watch.get("user_files")
    if user:
        try:
            home = pwd.getpwnam(user["user"]).pw_dir
            state["user_files"] = {p: file_state(os.path.join(home, p)) for p in user["paths"]}
        except KeyError:
            state["user_files"] = {"(user)": f"no user {user['user']}"}
    return state


def differences(recorded: dict, state: dict) -> list:
    diffs = []
    for kind in sorted(set(recorded) | set(state)):
        old, new = recorded.get(kind, {}), state.get(kind, {})
        for name in sorted(set(old) | set(new)):
            if old.get(name) != new.get(name):
                if isinstance(old.get(name), dict) and isinstance(new.get(name), dict) and kind == "trees":
                    inner = sorted(k for k in set(old[name]) | set(new[name]) if old[name].get(k) != new[name].get(k))
                    diffs.extend(f"{kind} {os.path.join(name, k)}" for k in inner)
                else:
                    diffs.append(f"{kind} {name}")
    return diffs


def read_record(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def write_record(path: str, content: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".deployed.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(content)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "watch": {"type": "dict", "required": True},
            "record": {"type": "path", "required": True},
            "inputs": {"type": "str", "required": True},
            "state": {"type": "str", "choices": ["compared", "recorded"], "default": "compared"},
        },
        supports_check_mode=True,
    )
    watch, path, inputs = module.params["watch"], module.params["record"], module.params["inputs"]
    state = observe(watch)
    result: dict = {"changed": False}
    if watch.get("health"):
        result["health"] = health(watch["health"])
    if module.params["state"] == "recorded":
        content = json.dumps({"inputs": inputs, "state": state}, sort_keys=True, indent=1) + "\n"
        current = None
        try:
            with open(path, encoding="utf-8") as fh:
                current = fh.read()
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            mode = None
        if current != content or mode != 0o600:
            result["changed"] = True
            if not module.check_mode:
                write_record(path, content)
        module.exit_json(**result)
    record = read_record(path)
    if record is None:
        differs = ["no record (no complete site.yml run on this node yet)"]
    elif not record:
        differs = [f"the record {path} is unreadable"]
    else:
        differs = (
            []
            if record.get("inputs") == inputs
            else ["inputs (the spec, a role input, a secret or hy3spark's own code changed)"]
        )
        differs += differences(record.get("state", {}), state)
    result.update(in_sync=not differs, differs=differs)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
