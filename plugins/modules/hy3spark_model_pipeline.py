#!/usr/bin/python
"""hy3spark_model_pipeline: the hub's tree listing of a revision, then its download on the head pipelined with the
rsync streams to the workers (each shard leaves for the workers as soon as the head has it and its hash is right)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: hy3spark_model_pipeline
short_description: Download a model revision on the head while rsync streams send each verified file to the workers
description:
  - I(mode=manifest) resolves the revision to a commit and writes the hub's tree listing of it
    (C(trees/<commit>.json), huggingface_hub's own tree cache format, and C(refs/<revision>) for a branch) into the
    cache. It returns the manifest in hy3spark_model_files' form (commit, files, meta_files), so every worker can
    find what it lacks before the head has downloaded anything. A listing already in the cache needs no network.
  - I(mode=download) (run in the foreground, so the token travels only on the module's stdin) downloads the files
    in I(fetch) with huggingface_hub's hf_hub_download (I(max_workers) at once; an interrupted file resumes from
    its C(.incomplete) blob; a file the head holds wrong is fetched again), hashes each against the listing (sha256
    for LFS files, the git blob sha1 of the others; I(hash_threads) at once) and appends it to I(ready_file) as
    ready or failed, flushed line by line; C(done) last, whatever happened. Fails naming every file it could not
    get right.
  - I(mode=send) (run in the background, started just before the download; it never sees the token) runs every
    worker's I(streams) lists, one thread per stream, each running rsync (I(sends)' argv, file list on stdin)
    over whatever of its list is ready, again and again until the list is done. Files not in I(fetch) are ready at
    once; the others when I(ready_file) says so. The listing and refs (meta files) go last, and only when every
    file is on the head and right. A file that failed on the head is never sent; a download that stops without
    its C(done) line (killed) ends the wait. Fails naming the worker, the stream and rsync's error. With nothing
    in I(fetch) it needs no download and may run in the foreground.
  - huggingface_hub is imported only by I(mode=manifest) (when the listing is not cached) and I(mode=download), so
    I(mode=send) runs on the node's system Python.
options:
  mode: {description: "manifest, download or send.", type: str, choices: [manifest, download, send], required: true}
  repo: {description: org/name on the hub., type: str, required: true}
  revision: {description: "Branch, tag or 40-character commit sha.", type: str, required: true}
  cache_dir: {description: The hub cache (HF_HUB_CACHE)., type: path, required: true}
  token: {description: Hub token; empty for none., type: str, no_log: true, default: ""}
  endpoint: {description: Hub endpoint (HF_ENDPOINT); empty for the Hugging Face Hub., type: str, default: ""}
  max_workers: {description: Files downloaded at once., type: int, default: 8}
  hash_threads: {description: Downloaded files hashed at once., type: int, default: 4}
  owner: {description: User that owns the model's directory after the download., type: str}
  files:
    description: "The manifest (download, send): [{path, size, sha256, git_sha1}], paths under snapshots/<commit>/."
    type: list
    elements: dict
    default: []
  commit: {description: "The commit the manifest is of (download, send).", type: str, default: ""}
  fetch:
    description: "Manifest paths the head lacks or holds wrong: what download fetches and send waits for."
    type: list
    elements: str
    default: []
  sends:
    description: >-
      One entry per worker - worker (its name), argv (the rsync command up to the source and destination, reading
      its file list on stdin) and streams (lists of paths relative to the model's directory).
    type: list
    elements: dict
    default: []
  ready_file:
    description: >-
      The ready list the download writes and the sender follows (JSON lines; the sender removes it when done).
      Required by I(mode=send) with I(fetch); without it a download tells no one.
    type: path
  timeout_s:
    description: >-
      I(mode=send): longest the whole send may take (0: no limit). At the limit every rsync still running is
      killed (its process group: runuser, rsync and ssh), what was not ready yet is given up, and the module fails
      naming each stream that was cut. The worker keeps an interrupted file in rsync's partial dir; the next run
      resumes from it.
    type: int
    default: 0
"""

import contextlib
import json
import os
import pwd
import queue
import re
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.hy3spark.cluster.plugins.module_utils.hub_hash import matches_listing

SHA1 = re.compile(r"^[0-9a-f]{40}$")


def hub_env(endpoint):
    """What huggingface_hub reads when it is imported."""
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "0"
    os.environ.pop("HF_TOKEN", None)
    if endpoint:
        os.environ["HF_ENDPOINT"] = endpoint.rstrip("/")


def write_atomic(path, text):
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def manifest(module, p, repo_dir):
    revision = p["revision"]
    commit = revision if SHA1.match(revision) else None
    tree_path = os.path.join(repo_dir, "trees", f"{commit}.json") if commit else None
    tree, listed = None, False
    if tree_path:
        with contextlib.suppress(OSError, ValueError, KeyError), open(tree_path) as fh:
            tree = json.load(fh)["files"]
    if tree is None:
        hub_env(p["endpoint"])
        try:
            from huggingface_hub import HfApi
            from huggingface_hub.hf_api import RepoFile
        except ImportError as exc:
            module.fail_json(msg=f"huggingface_hub is not importable: {exc}")
        api = HfApi(token=p["token"] or None)
        try:
            if commit is None:
                commit = api.repo_info(p["repo"], revision=revision).sha
            tree = {}
            for f in api.list_repo_tree(p["repo"], recursive=True, revision=commit):
                if isinstance(f, RepoFile):
                    info = {"size": f.size, "blob_id": f.blob_id}
                    if f.lfs is not None:
                        info.update(lfs_sha256=f.lfs.sha256, lfs_size=f.lfs.size)
                    tree[f.path] = info
        except Exception as exc:
            module.fail_json(msg=f"listing {p['repo']}@{revision} on the hub failed: {type(exc).__name__}: {exc}")
        tree_path = os.path.join(repo_dir, "trees", f"{commit}.json")
        # huggingface_hub's tree cache format (format_version 1): its own snapshot_download reads it back.
        write_atomic(tree_path, json.dumps({"format_version": 1, "files": tree}, indent=2, sort_keys=True))
        listed = True
    meta = []
    if not SHA1.match(revision):
        ref, same = os.path.join(repo_dir, "refs", revision), False
        with contextlib.suppress(OSError), open(ref) as fh:
            same = fh.read().strip() == commit
        if not same:
            write_atomic(ref, commit)
            listed = True
        meta.append("refs/" + revision)
    meta.append(f"trees/{commit}.json")
    files = []
    for path, info in sorted(tree.items()):
        lfs = info.get("lfs_sha256")
        files.append({"path": path, "size": int(info["size"]), "sha256": lfs,
                      "git_sha1": None if lfs else info.get("blob_id")})
    return {"changed": listed, "commit": commit, "files": files, "meta_files": meta,
            "total_bytes": sum(f["size"] for f in files), "cpus": len(os.sched_getaffinity(0))}


class Board:
    """Which paths (relative to the model's directory) are on the head and verified, and which failed."""

    def __init__(self, ready):
        self.ready, self.failed, self.done = set(ready), {}, False
        self.cond = threading.Condition()

    def mark(self, rel, problem=None):
        with self.cond:
            if problem:
                self.failed[rel] = problem
            else:
                self.ready.add(rel)
            self.cond.notify_all()

    def finish(self, meta):
        with self.cond:
            if not self.failed:
                self.ready.update(meta)
            self.done = True
            self.cond.notify_all()

    def take(self, pending):
        """Block until some of `pending` is ready (returned in order) or nothing more will be: then []."""
        with self.cond:
            while True:
                batch = [r for r in pending if r in self.ready]
                if batch:
                    return batch
                for rel in [r for r in pending if r in self.failed]:
                    pending.remove(rel)
                if self.done or not pending:
                    return []
                self.cond.wait()


TIMED_OUT = 124  # timeout(1)'s exit status: the stream was killed at the deadline


def run_rsync(argv, batch, deadline):
    """One rsync over `batch` (its file list on stdin), in its own process group so a deadline kills all of it
    (runuser, rsync and its ssh): returns (rc, stdout, stderr); rc TIMED_OUT when the deadline came first."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate("\n".join(batch) + "\n",
                                          timeout=None if deadline is None else max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return TIMED_OUT, stdout, stderr
    return proc.returncode, stdout, stderr


def send_stream(board, argv, files, out, deadline=None, timeout_s=0):
    pending = list(files)
    while pending:
        batch = board.take(pending)
        if not batch:
            break
        rc, stdout, stderr = run_rsync(argv, batch, deadline)
        sent = re.findall(r"Total bytes sent: ([0-9,]+)", stdout)
        out["bytes_sent"] += int(sent[-1].replace(",", "")) if sent else 0
        out["files"] += len([ln for ln in stdout.splitlines() if re.match(r"^[<>ch.*][fdLDS]", ln)])
        out["batches"] += 1
        if rc == TIMED_OUT:
            out["rc"] = rc
            out["stderr"] = (f"killed after the transfer's {timeout_s} s (model_sync_transfer_timeout_s) with "
                             f"{len(pending)} file(s) of its share not done; the worker keeps the interrupted file "
                             "in its partial dir and the next run resumes from it")
            return
        if rc != 0:
            out["rc"] = rc
            out["stderr"] = stderr[-2000:]
            return
        if out.get("first_sent_s") is None:
            out["first_sent_s"] = round(time.monotonic() - out["started"], 2)
        for rel in batch:
            pending.remove(rel)
    out["unsent"] = pending


def chown_tree(path, owner):
    entry = pwd.getpwnam(owner)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            st = os.lstat(name)
            if (st.st_uid, st.st_gid) != (entry.pw_uid, entry.pw_gid):
                os.lchown(name, entry.pw_uid, entry.pw_gid)


class ReadyList:
    """The download's side of the ready list: one JSON line per file that is on the head with the hub's hash
    ({"ready": rel}) or failed ({"failed": rel, "why": ...}), then {"done": true}. Appended and flushed line by
    line, so the sender (another process) can act on each at once."""

    def __init__(self, path):
        self.path, self.lock, self.failed, self.ready = path, threading.Lock(), {}, []
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        self.fh = open(path, "a")  # noqa: SIM115 (closed by done())
        self.fh.write(json.dumps({"pid": os.getpid()}) + "\n")
        self.fh.flush()

    def mark(self, rel, problem=None):
        with self.lock:
            if problem:
                self.failed[rel] = problem
            else:
                self.ready.append(rel)
            self.fh.write(json.dumps({"failed": rel, "why": problem} if problem else {"ready": rel}) + "\n")
            self.fh.flush()

    def done(self):
        with self.lock:
            self.fh.write(json.dumps({"done": True}) + "\n")
            self.fh.close()


def download(module, p, repo_dir):
    """Fetch `fetch` on the head, hash each file as it lands, and tell the sender through the ready list."""
    commit, entries = p["commit"], {f["path"]: f for f in p["files"]}
    snap_rel = f"snapshots/{commit}/"
    fetch = [path for path in p["fetch"] if path in entries]
    started = time.monotonic()
    board = ReadyList(p["ready_file"]) if p["ready_file"] else ReadyList(os.devnull)
    try:
        hub_env(p["endpoint"])
        try:
            from huggingface_hub import hf_hub_download
        except ImportError as exc:
            module.fail_json(msg=f"huggingface_hub is not importable: {exc}")
        hashes = ThreadPoolExecutor(max_workers=max(1, p["hash_threads"]))
        checks = queue.Queue()

        def check(path, got):
            ok = matches_listing(got, entries[path])
            board.mark(snap_rel + path, None if ok else "hash differs from the hub's listing")

        def get(path):
            # A file the head holds wrong is fetched again (force_download); a missing one resumes its .incomplete.
            force = os.path.lexists(os.path.join(repo_dir, snap_rel + path))
            try:
                got = hf_hub_download(p["repo"], path, revision=commit, cache_dir=p["cache_dir"],
                                      token=p["token"] or None, force_download=force)
            except Exception as exc:
                board.mark(snap_rel + path, f"download failed: {type(exc).__name__}: {exc}")
                return
            checks.put(hashes.submit(check, path, got))

        with ThreadPoolExecutor(max_workers=max(1, p["max_workers"])) as pool:
            list(pool.map(get, fetch))
        while not checks.empty():
            checks.get().result()
        hashes.shutdown()
        if p["owner"]:
            chown_tree(repo_dir, p["owner"])
    finally:
        board.done()
    result = {"changed": bool(fetch), "commit": commit, "verified": board.ready,
              "download": {"files": len(fetch), "bytes": sum(entries[f]["size"] or 0 for f in fetch),
                           "seconds": round(time.monotonic() - started, 2)}}
    if board.failed:
        names = "; ".join(f"{rel}: {why}" for rel, why in sorted(board.failed.items()))
        module.fail_json(msg=f"{len(board.failed)} file(s) could not be got on the head (nothing wrong was sent): "
                             f"{names}", **result)
    return result


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def feed(board, path, poll_s, pending, start_timeout_s=600, deadline=None):
    """Follow the download's ready list into the board until its done line. A download that never starts, or whose
    process is gone without its done line (killed), ends the wait, and so does the send's deadline: what the
    download did not deliver by then is not sent."""
    waited = 0.0
    while not os.path.exists(path):
        if waited > start_timeout_s or (deadline is not None and time.monotonic() > deadline):
            for rel in pending:
                board.mark(rel, "the download never started")
            return
        time.sleep(poll_s)
        waited += poll_s
    pid = None
    with open(path) as fh:
        buf = ""
        while True:
            line = fh.readline()
            if not line.endswith("\n"):
                buf += line
                if pid is not None and not alive(pid):
                    for rel in pending - board.ready - set(board.failed):
                        board.mark(rel, "the download stopped before it")
                    return
                if deadline is not None and time.monotonic() > deadline:
                    for rel in pending - board.ready - set(board.failed):
                        board.mark(rel, "the transfer's time ran out before the head had it")
                    return
                time.sleep(poll_s)
                continue
            entry, buf = json.loads(buf + line), ""
            if entry.get("done"):
                return
            if "pid" in entry:
                pid = entry["pid"]
                continue
            board.mark(entry.get("ready") or entry["failed"], entry.get("why"))


def send(module, p, repo_dir):
    """Every worker's streams, each sending what of its list is ready, until the list is done."""
    commit, entries = p["commit"], {f["path"]: f for f in p["files"]}
    snap_rel = f"snapshots/{commit}/"
    fetch = {path for path in p["fetch"] if path in entries}
    meta = sorted({rel for send in p["sends"] for stream in send["streams"] for rel in stream
                   if not rel.startswith(snap_rel)})
    board = Board(snap_rel + path for path in entries if path not in fetch)
    started = time.monotonic()
    deadline = started + p["timeout_s"] if p["timeout_s"] > 0 else None
    senders, threads = [], []
    for item in p["sends"]:
        for i, files in enumerate(item["streams"]):
            out = {"worker": item["worker"], "stream": i + 1, "rc": 0, "files": 0, "bytes_sent": 0, "batches": 0,
                   "started": started}
            senders.append(out)
            threads.append(threading.Thread(target=send_stream, args=(board, item["argv"], files, out, deadline,
                                                                      p["timeout_s"]), daemon=True))
    if not fetch:
        board.finish(meta)  # all on the head already: each stream sends its whole list in one rsync
    for t in threads:
        t.start()
    if fetch:
        feed(board, p["ready_file"], 0.2, {snap_rel + path for path in fetch}, deadline=deadline)
        with contextlib.suppress(OSError):
            os.unlink(p["ready_file"])
        board.finish(meta)
    for t in threads:
        t.join()
    workers = {}
    for out in senders:
        w = workers.setdefault(out["worker"], {"rc": 0, "files": 0, "bytes_sent": 0, "streams": 0, "batches": 0,
                                               "first_sent_s": None})
        w["rc"] = max(w["rc"], out["rc"])
        for key in ("files", "bytes_sent", "batches"):
            w[key] += out[key]
        w["streams"] += 1
        if out.get("first_sent_s") is not None:
            w["first_sent_s"] = min(x for x in (w["first_sent_s"], out["first_sent_s"]) if x is not None)
    result = {"changed": bool(senders), "commit": commit, "transfers": workers,
              "seconds": round(time.monotonic() - started, 2)}
    problems = [f"{o['worker']} stream {o['stream']}: rsync exit {o['rc']}: {o.get('stderr', '').strip()}"
                for o in senders if o["rc"]]
    held = sorted(rel for rel in board.failed)
    if held:
        problems.append(f"not sent, the head could not get them: {', '.join(held)}")
    if problems:
        module.fail_json(msg="the transfer to the workers failed: " + "; ".join(problems), **result)
    return result


def main():
    module = AnsibleModule(
        argument_spec={
            "mode": {"type": "str", "choices": ["manifest", "download", "send"], "required": True},
            "repo": {"type": "str", "required": True},
            "revision": {"type": "str", "required": True},
            "cache_dir": {"type": "path", "required": True},
            "token": {"type": "str", "default": "", "no_log": True},
            "endpoint": {"type": "str", "default": ""},
            "max_workers": {"type": "int", "default": 8},
            "hash_threads": {"type": "int", "default": 4},
            "owner": {"type": "str"},
            "files": {"type": "list", "elements": "dict", "default": []},
            "commit": {"type": "str", "default": ""},
            "fetch": {"type": "list", "elements": "str", "default": []},
            "sends": {"type": "list", "elements": "dict", "default": []},
            "ready_file": {"type": "path"},
            "timeout_s": {"type": "int", "default": 0},
        },
    )
    p = module.params
    org, name = p["repo"].split("/", 1)
    repo_dir = os.path.join(p["cache_dir"], f"models--{org}--{name}")
    if p["mode"] == "manifest":
        module.exit_json(**manifest(module, p, repo_dir))
    if p["mode"] == "send" and p["fetch"] and not p["ready_file"]:
        module.fail_json(msg="ready_file is required with fetch: it is how the download tells the sender")
    if not SHA1.match(p["commit"]):
        module.fail_json(msg=f"commit must be the 40-character sha of the manifest, got {p['commit']!r}")
    module.exit_json(**(download if p["mode"] == "download" else send)(module, p, repo_dir))


if __name__ == "__main__":
    main()
