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
import shutil
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
    start times; the engine's processes, in its container or on the host; the model's hub cache entries by size,
    mtime, mode and owner; nftables tables by the SHA-256 of what C(nft list table) prints).
  - C(state=compared) compares that with the record and the expected inputs hash; C(state=recorded) writes the
    record (mode 0600) when it differs.
options:
  watch:
    description: What to observe (keys files, trees, user_files, interfaces, units, images, containers, processes,
      models, nft_tables ("FAMILY NAME", for example "inet hy3spark"), health).
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
  description: What differs, as "kind name (fields)" strings (for example "files /etc/default/earlyoom (sha256)",
    "containers hy3-head (id, started_at)", "models .../blobs/x (missing)"), or why there is no comparison
    ("no record").
  type: list
health:
  description: HTTP status of watch.health (or the connection error), when asked.
  type: raw
"""


def owner_mode(st: os.stat_result) -> dict:
    return {"mode": f"{stat.S_IMODE(st.st_mode):04o}", "uid": st.st_uid, "gid": st.st_gid}


def file_state(path: str) -> object:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    entry = owner_mode(st)
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


def walk_state(root: str, entry, skip: frozenset = frozenset(), dir_links: bool = False) -> object:
    """Every entry below `root` (itself as "."), by relative path, as `entry` describes it; "missing" if no directory.
    `skip`: directory names not entered; `dir_links`: list the links to directories too (os.walk does not enter
    them)."""
    if not os.path.isdir(root):
        return "missing"
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))] if dir_links else []
        for name in [".", *sorted(filenames), *links]:
            path = os.path.normpath(os.path.join(dirpath, name))
            out[os.path.relpath(path, root)] = entry(path)
    return out


def tree_state(root: str) -> object:
    return walk_state(root, file_state)


def model_entry(path: str) -> dict:
    """A file by size and mtime, not by hash (model_sync verified the hashes when it transferred it; hashing
    hundreds of GB is no per-run check); a link by its target; a directory by mode and owner only (its mtime moves
    whenever the hub adds an entry). Mode and owner everywhere: model_sync sets them (0644 files, the sync user)."""
    st = os.lstat(path)
    entry = owner_mode(st)
    if stat.S_ISLNK(st.st_mode):
        entry["link"] = os.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        entry.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
    else:
        entry["type"] = "dir" if stat.S_ISDIR(st.st_mode) else "other"
    return entry


def model_state(root: str) -> object:
    # huggingface_hub's markers of files a repo does not have (written when the engine looks for one): not model.
    return walk_state(root, model_entry, skip=frozenset({".no_exist"}), dir_links=True)


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


def in_unit(pid: str, unit: str, proc: str = "/proc") -> bool:
    """Whether the process belongs to the systemd unit: a line of /proc/PID/cgroup ends in /UNIT (v1 and v2)."""
    try:
        with open(f"{proc}/{pid}/cgroup", encoding="utf-8") as fh:
            return any(line.rstrip("\n").endswith("/" + unit) for line in fh)
    except OSError:
        return False


def process_state(spec: dict) -> object:
    """PIDs and start times of the processes whose command line holds spec["match"]: in spec["container"] (docker
    top), or with no container on the host itself, there only those of spec["unit"] when it names one (another
    engine someone runs beside ours is not ours)."""
    container, unit = spec.get("container"), spec.get("unit")
    if container:
        rc, out = run(["docker", "top", container, "-eo", "pid,lstart,args"])
        if rc != 0:
            return "container not running"
    else:
        rc, out = run(["ps", "-eo", "pid,lstart,args"])
        if rc != 0:
            return "no process list"
    rows = []
    for line in out.splitlines()[1:]:
        fields = line.split(None, 6)
        if len(fields) == 7 and spec["match"] in fields[6] and (container or not unit or in_unit(fields[0], unit)):
            rows.append(" ".join(fields[:6]))
    return sorted(rows)


def process_key(spec: dict) -> str:
    """A process watch's name: its container, or the host's (its unit, when it names one)."""
    if spec.get("container"):
        return spec["container"]
    return f"host {spec['unit']}" if spec.get("unit") else "host"


def nft_table_state(table: str) -> object:
    """A table as `nft list table FAMILY NAME` prints it (its rules and sets, no handles or counters), by hash: one
    flushed, deleted or edited by hand differs. "missing" when nft has no such table (or there is no nft)."""
    # Ansible's PATH for a module may lack the sbin directories nft lives in.
    rc, out = run([shutil.which("nft") or "/usr/sbin/nft", "list", "table", *table.split()])
    return {"sha256": hashlib.sha256(out.encode()).hexdigest()} if rc == 0 else "missing"


def health(url: str) -> object:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))


INPUTS_CHANGED = "inputs (the spec, a role input, a secret or hy3spark's own code changed)"
OBSERVERS = {
    "files": file_state,
    "trees": tree_state,
    "interfaces": interface_state,
    "units": unit_state,
    "images": image_state,
    "containers": container_state,
    "models": model_state,
    "nft_tables": nft_table_state,
}


def observe(watch: dict) -> dict:
    state: dict = {kind: {name: fn(name) for name in watch.get(kind) or []} for kind, fn in OBSERVERS.items()}
    state["processes"] = {process_key(p): process_state(p) for p in watch.get("processes") or []}
    user = watch.get("user_files")
    if user:
        try:
            home = pwd.getpwnam(user["user"]).pw_dir
            state["user_files"] = {p: file_state(os.path.join(home, p)) for p in user["paths"]}
        except KeyError:
            state["user_files"] = {"(user)": f"no user {user['user']}"}
    return state


# Kinds whose every watched name holds entries of its own (a tree's files, a model's files): named one by one.
NESTED = ("trees", "models")


def what(old: object, new: object) -> str:
    """How one observation differs from its record: the fields that changed, or that it appeared or went."""
    if isinstance(old, dict) and isinstance(new, dict):
        return f" ({', '.join(sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)))})"
    if old is None:
        return " (new)"
    if new is None:
        return " (gone)"
    if new == "missing":
        return " (missing)"
    if old == "missing":
        return " (was missing)"
    return ""


def differences(recorded: dict, state: dict) -> list:
    diffs = []
    for kind in sorted(set(recorded) | set(state)):
        old, new = recorded.get(kind, {}), state.get(kind, {})
        for name in sorted(set(old) | set(new)):
            if old.get(name) == new.get(name):
                continue
            if kind in NESTED and isinstance(old.get(name), dict) and isinstance(new.get(name), dict):
                inner_old, inner_new = old[name], new[name]
                diffs.extend(
                    f"{kind} {os.path.normpath(os.path.join(name, k))}{what(inner_old.get(k), inner_new.get(k))}"
                    for k in sorted(set(inner_old) | set(inner_new))
                    if inner_old.get(k) != inner_new.get(k)
                )
            else:
                diffs.append(f"{kind} {name}{what(old.get(name), new.get(name))}")
    return diffs


def compare(record: dict, inputs: str, state: dict) -> list:
    """What differs between a node's record and its state now, the run's inputs hash first."""
    differs = [] if record.get("inputs") == inputs else [INPUTS_CHANGED]
    return differs + differences(record.get("state", {}), state)


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
        differs = compare(record, inputs, state)
    result.update(in_sync=not differs, differs=differs)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
