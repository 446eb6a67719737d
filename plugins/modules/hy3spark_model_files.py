#!/usr/bin/python
"""hy3spark_model_files: the manifest of one model snapshot in a Hugging Face hub cache, and its verification."""

from __future__ import annotations

DOCUMENTATION = r"""
module: hy3spark_model_files
short_description: List and verify the files of a model snapshot in a Hugging Face hub cache
description:
  - Without I(expected) (the head) it resolves the revision to a commit (a 40-character sha, or C(refs/<revision>)),
    builds the manifest of C(snapshots/<commit>/) from the hub's own metadata (C(trees/<commit>.json) when the client
    wrote it, else the blob names the snapshot links point to) and verifies the files against it.
  - With I(expected) (a worker) it verifies this node's copy against the head's manifest.
  - Verification covers every file, following links - presence, size and, where the hub published one,
    the hash (sha256 for LFS files, the git blob sha1 for the others). It also
    checks that C(refs/<revision>) names the commit. Hashes are remembered per file by (size, mtime, ctime, inode)
    in I(state_file), so an unchanged file is not read again; any write to a file changes its ctime.
  - Returns C(complete) (nothing missing or wrong, and the file set is the hub's tree listing, not only the links
    found), C(manifest_digest) (one sha256 over the commit and every file's path, size and hashes, so a worker
    that lists its own copy can be compared with the head in one step), the number of usable CPUs (C(cpus)) and
    what this node needs (paths relative to I(repo_dir)), the same split into at most I(streams) lists of about
    equal bytes (one per transfer stream; the largest file first, each to the lightest list), and the free space
    where they would land.
options:
  repo_dir: {description: The model's directory in the cache (models--org--name)., type: path, required: true}
  revision: {description: "Branch, tag or 40-character commit sha.", type: str, required: true}
  expected: {description: "The head's result (commit, files, meta_files); omit on the head.", type: dict}
  verify_hashes: {description: "Compare hashes, not only presence and size.", type: bool, default: true}
  rehash: {description: "Hash every file again, ignoring the remembered hashes.", type: bool, default: false}
  state_file: {description: Where the remembered hashes are kept (JSON); its directory is created., type: path}
  threads: {description: Files hashed in parallel., type: int, default: 4}
  fail_on_problems:
    description: "Fail, naming every bad file, when anything is missing or wrong."
    type: bool
    default: false
  streams: {description: Lists to split what this node needs into (need_streams)., type: int, default: 1}
  cache_dir:
    description: >-
      The hub cache that holds I(repo_dir). It is made a directory (mode 0755) owned by I(owner) first, as
      ansible.builtin.file would; the model's own directory is made by the download or by rsync.
    type: path
  owner: {description: Owner of I(cache_dir)., type: str}
  missing_ok:
    description: On the head, a revision with no snapshot yet is a result (C(complete) false), not a failure.
    type: bool
    default: false
  trusted:
    description: >-
      Paths (relative to I(repo_dir)) that rsync has just delivered and verified with its whole-file transfer
      checksum against the head's verified copy. Their presence and size are checked; the hub's hash is recorded
      for them without reading them again.
    type: list
    elements: str
    default: []
"""

import contextlib
import hashlib
import json
import os
import pwd
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.hy3spark.cluster.plugins.module_utils.hub_hash import file_digest

SHA1 = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def resolve_commit(repo_dir, revision):
    if SHA1.match(revision):
        return revision
    try:
        with open(os.path.join(repo_dir, "refs", revision)) as fh:
            return fh.read().strip()
    except OSError:
        return None


def manifest_from_cache(repo_dir, commit):
    """[{path, size, sha256, git_sha1}] from trees/<commit>.json, else from the snapshot's links into blobs/."""
    snapshot = os.path.join(repo_dir, "snapshots", commit)
    tree_path = os.path.join(repo_dir, "trees", commit + ".json")
    files = []
    try:
        with open(tree_path) as fh:
            tree = json.load(fh)["files"]
    except (OSError, ValueError, KeyError):
        tree = None
    if tree is not None:
        for path, info in sorted(tree.items()):
            lfs = info.get("lfs_sha256")
            files.append({"path": path, "size": int(info["size"]), "sha256": lfs,
                          "git_sha1": None if lfs else info.get("blob_id")})
        return files, f"trees/{commit}.json"
    for dirpath, dirnames, filenames in os.walk(snapshot):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, snapshot)
            try:
                size = os.stat(full).st_size
            except OSError:
                size = None  # a dangling link: the verification reports it
            blob = os.path.basename(os.readlink(full)) if os.path.islink(full) else ""
            files.append({"path": rel, "size": size, "sha256": blob if SHA256.match(blob) else None,
                          "git_sha1": blob if SHA1.match(blob) else None})
    return files, None


def load_state(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def save_state(path, state):
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(state, fh, indent=0, sort_keys=True)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def split_streams(need, sizes, streams):
    """`need` in at most `streams` lists of about equal bytes: the largest file first, each to the lightest list.

    Greedy longest-first is within 4/3 of the best split and keeps a list's files in the order they were needed;
    empty lists are left out (fewer files than streams). Meta files (refs, the tree listing) weigh nothing and go
    to the lightest list.
    """
    lists = [[] for _ in range(max(1, min(streams, len(need))))]
    loads = [0] * len(lists)
    order = {path: i for i, path in enumerate(need)}
    for path in sorted(need, key=lambda n: (-sizes.get(n, 0), order[n])):
        lightest = loads.index(min(loads))
        lists[lightest].append(path)
        loads[lightest] += sizes.get(path, 0)
    return [sorted(lst, key=order.__getitem__) for lst in lists if lst]


def free_bytes(path):
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path or "/")
    return st.f_bavail * st.f_frsize


def ensure_cache_dir(module, path, owner):
    """`path` a directory, mode 0755, owned by `owner` (its uid; the group is left alone). Returns changed."""
    try:
        uid = pwd.getpwnam(owner).pw_uid if owner else -1
    except KeyError:
        module.fail_json(msg=f"the cache's owner {owner} is not a user on this node (model_sync_user)")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not os.path.isdir(path):
        module.fail_json(msg=f"{path} (model_sync_cache_dir) exists and is not a directory")
    if st is not None and (uid == -1 or st.st_uid == uid) and st.st_mode & 0o7777 == 0o755:
        return False
    if not module.check_mode:
        os.makedirs(path, mode=0o755, exist_ok=True)
        os.chmod(path, 0o755)
        if uid != -1:
            os.chown(path, uid, -1)
    return True


def manifest_digest(commit, files):
    """One sha256 over the commit and every file's path, size and hashes: two nodes whose listings give the same
    digest hold the same manifest (a worker's own trees/<commit>.json is the head's, byte for byte, once synced)."""
    canonical = json.dumps({"commit": commit, "files": sorted(files, key=lambda f: f["path"])}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def cpu_count():
    """The CPUs this process may run on (a cgroup or taskset limit counts), as `nproc` says."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def main():
    module = AnsibleModule(
        argument_spec={
            "repo_dir": {"type": "path", "required": True},
            "revision": {"type": "str", "required": True},
            "expected": {"type": "dict"},
            "verify_hashes": {"type": "bool", "default": True},
            "rehash": {"type": "bool", "default": False},
            "state_file": {"type": "path"},
            "threads": {"type": "int", "default": 4},
            "fail_on_problems": {"type": "bool", "default": False},
            "streams": {"type": "int", "default": 1},
            "cache_dir": {"type": "path"},
            "owner": {"type": "str"},
            "missing_ok": {"type": "bool", "default": False},
            "trusted": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    p = module.params
    repo_dir, revision, expected = p["repo_dir"].rstrip("/"), p["revision"], p["expected"]
    changed = ensure_cache_dir(module, p["cache_dir"], p["owner"]) if p["cache_dir"] else False

    if expected is None:
        commit = resolve_commit(repo_dir, revision)
        if commit is None or not os.path.isdir(os.path.join(repo_dir, "snapshots", commit)):
            if p["missing_ok"]:
                module.exit_json(changed=changed, complete=False, commit=commit, cpus=cpu_count(),
                                 msg=f"no snapshot of {revision} in {repo_dir} yet")
            module.fail_json(msg=f"{repo_dir} has no snapshot for revision {revision} (refs/{revision} missing or "
                                 "no snapshots/<commit>/)", commit=commit)
        files, tree_file = manifest_from_cache(repo_dir, commit)
        meta_files = ([] if SHA1.match(revision) else ["refs/" + revision]) + ([tree_file] if tree_file else [])
    else:
        commit, files, meta_files = expected["commit"], expected["files"], expected["meta_files"]

    snapshot_rel = "snapshots/" + commit
    snapshot = os.path.join(repo_dir, snapshot_rel)
    state = load_state(p["state_file"]) if p["state_file"] and not p["rehash"] else {}
    trusted = {rel[len(snapshot_rel) + 1:] for rel in p["trusted"] if rel.startswith(snapshot_rel + "/")}
    new_state = {}
    problems, need, to_hash = [], [], []
    for entry in files:
        full = os.path.join(snapshot, entry["path"])
        try:
            st = os.stat(full)
        except OSError:
            problems.append({"path": entry["path"], "problem": "missing" if not os.path.islink(full) else
                             "dangling link", "expected": entry["size"], "actual": None})
            continue
        if entry["size"] is not None and st.st_size != entry["size"]:
            problems.append({"path": entry["path"], "problem": "size", "expected": entry["size"],
                             "actual": st.st_size})
            continue
        kind = "sha256" if entry["sha256"] else "git_sha1" if entry["git_sha1"] else None
        if p["verify_hashes"] and kind:
            stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
            known = state.get(entry["path"])
            if known and known["stamp"] == stamp and kind in known:
                new_state[entry["path"]] = known
            elif entry["path"] in trusted:
                # rsync compared its whole-file checksum of what it wrote with the head's: the bytes are the head's,
                # whose hash the head verified. Recorded with this file's stamp, so any later write re-reads it.
                new_state[entry["path"]] = {"stamp": stamp, kind: entry[kind], "trusted": "rsync"}
            else:
                to_hash.append((entry, full, stamp, kind))
    hashed = 0
    with ThreadPoolExecutor(max_workers=max(1, p["threads"])) as pool:
        results = pool.map(lambda item: {item[3]: file_digest(item[1], item[3])}, to_hash)
        for (entry, _full, stamp, _kind), digest in zip(to_hash, results, strict=True):
            new_state[entry["path"]] = {"stamp": stamp, **digest}
            hashed += stamp[0]
    for entry in files:
        got = new_state.get(entry["path"])
        if not got:
            continue
        for kind in ("sha256", "git_sha1"):
            if entry[kind] and got.get(kind) != entry[kind]:
                problems.append({"path": entry["path"], "problem": kind, "expected": entry[kind], "actual": got[kind]})
                new_state.pop(entry["path"])
                break
    for entry in problems:
        need.append(snapshot_rel + "/" + entry["path"])
    meta_problems = []
    for rel in meta_files:
        if rel.startswith("refs/"):
            current = resolve_commit(repo_dir, rel[5:]) if not SHA1.match(rel[5:]) else None
            if current != commit:
                meta_problems.append({"path": rel, "problem": "ref", "expected": commit, "actual": current})
        elif not os.path.isfile(os.path.join(repo_dir, rel)):
            meta_problems.append({"path": rel, "problem": "missing", "expected": None, "actual": None})
    need += [m["path"] for m in meta_problems]
    problems += meta_problems

    if p["state_file"] and not module.check_mode:
        if new_state != state:
            save_state(p["state_file"], new_state)
        else:
            os.makedirs(os.path.dirname(p["state_file"]), mode=0o755, exist_ok=True)

    sizes = {snapshot_rel + "/" + f["path"]: f["size"] or 0 for f in files}
    need_bytes = sum(sizes.get(n, 0) for n in need)
    listed = {f["path"] for f in files}
    extras = []
    for dirpath, dirnames, filenames in os.walk(snapshot):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".hy3spark-partial"))
        extras += [os.path.relpath(os.path.join(dirpath, n), snapshot) for n in sorted(filenames)
                   if os.path.relpath(os.path.join(dirpath, n), snapshot) not in listed]
    result = {
        "changed": changed,
        "commit": commit,
        "snapshot": snapshot,
        "files": files,
        "meta_files": meta_files,
        "total_bytes": sum(f["size"] or 0 for f in files),
        "problems": problems,
        "need": need,
        "need_bytes": need_bytes,
        "need_streams": split_streams(need, sizes, p["streams"]),
        "hashed_bytes": hashed,
        "extras": extras,
        "free_bytes": free_bytes(repo_dir),
        "cpus": cpu_count(),
        "manifest_digest": manifest_digest(commit, files),
        "complete": not problems and any(m.startswith("trees/") for m in meta_files),
    }
    if problems and p["fail_on_problems"]:
        names = ", ".join(f"{x['path']} ({x['problem']})" for x in problems)
        module.fail_json(msg=f"{len(problems)} file(s) of {os.path.basename(repo_dir)}@{commit} are missing or wrong "
                             f"on this node: {names}", **result)
    module.exit_json(**result)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
