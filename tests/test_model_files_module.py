"""hy3spark_model_files run as Ansible runs it (args file in, JSON out) on a real hub-cache layout in tmp:
the head's shortcut for a complete pinned commit (`complete`, `missing_ok`), the CPUs it reports for the stream
default, and the worker's `trusted` files (rsync's checksum, not a second read) with what still gets caught."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "plugins/modules/hy3spark_model_files.py"
# The module imports the collection's module_utils by full name: run it with the checkout's collection link on the
# path, as Ansible's packaging of the module provides it on a node.
MODULE_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "collections"),
                                                                         os.environ.get("PYTHONPATH")])))
COMMIT = "c0ffee" + "0" * 34
SHARD = b"weights" * 100_000
CONFIG = b'{"model_type": "hy3"}\n'


def run(tmp: Path, **params: object) -> tuple[int, dict]:
    args = tmp / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": params}))
    proc = subprocess.run([sys.executable, str(MODULE), str(args)], capture_output=True, text=True, timeout=120,
                          check=False, env=MODULE_ENV)
    result = json.loads(proc.stdout)
    result.pop("invocation", None)
    return proc.returncode, result


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def head(tmp_path: Path) -> Path:
    """models--org--name as huggingface_hub 2.x leaves it: blobs, snapshot links, and trees/<commit>.json."""
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "trees").mkdir()
    tree = {}
    for name, data, lfs in (("model.safetensors", SHARD, True), ("config.json", CONFIG, False)):
        blob = hashlib.sha256(data).hexdigest() if lfs else git_sha1(data)
        (repo / "blobs" / blob).write_bytes(data)
        (repo / "snapshots" / COMMIT / name).symlink_to(f"../../blobs/{blob}")
        tree[name] = {"size": len(data), "blob_id": git_sha1(data), "lfs_sha256": blob if lfs else None}
    (repo / "trees" / f"{COMMIT}.json").write_text(json.dumps({"files": tree}))
    return repo


def head_listing(tmp: Path, repo: Path, **extra: object) -> tuple[int, dict]:
    return run(tmp, repo_dir=str(repo), revision=COMMIT, state_file=str(tmp / "head-state.json"), **extra)


def test_a_complete_pinned_commit_is_complete_and_reports_the_cpus(tmp_path: Path, head: Path) -> None:
    rc, result = head_listing(tmp_path, head)
    assert rc == 0, result
    assert result["complete"] is True
    assert result["problems"] == []
    assert result["meta_files"] == [f"trees/{COMMIT}.json"]
    assert result["cpus"] == len(os.sched_getaffinity(0))
    assert result["hashed_bytes"] == len(SHARD) + len(CONFIG)
    # The second look reads nothing: the hashes are remembered by stamp.
    rc, again = head_listing(tmp_path, head)
    assert (rc, again["complete"], again["hashed_bytes"]) == (0, True, 0)


def test_without_the_hubs_tree_listing_the_head_is_never_complete(tmp_path: Path, head: Path) -> None:
    # The links alone cannot show a file that was never downloaded: only the hub's listing can say "all of it".
    (head / "trees" / f"{COMMIT}.json").unlink()
    rc, result = head_listing(tmp_path, head)
    assert (rc, result["problems"], result["complete"]) == (0, [], False)


def test_a_damaged_head_file_is_not_complete(tmp_path: Path, head: Path) -> None:
    blob = head / "blobs" / hashlib.sha256(SHARD).hexdigest()
    data = bytearray(blob.read_bytes())
    data[1000] ^= 0x01
    blob.write_bytes(bytes(data))
    rc, result = head_listing(tmp_path, head)
    assert rc == 0
    assert result["complete"] is False
    assert [(p["path"], p["problem"]) for p in result["problems"]] == [("model.safetensors", "sha256")]


def test_missing_ok_makes_an_absent_snapshot_a_result_and_without_it_a_failure(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--absent"
    rc, result = run(tmp_path, repo_dir=str(repo), revision=COMMIT, missing_ok=True)
    assert (rc, result["complete"], result["commit"]) == (0, False, COMMIT)
    assert result["cpus"] >= 1
    rc, result = run(tmp_path, repo_dir=str(repo), revision=COMMIT)
    assert rc == 1 and result["failed"] is True
    assert "has no snapshot for revision" in result["msg"]


def worker_copy(tmp: Path, head: Path) -> tuple[Path, dict]:
    """A worker holding real files at the same layout, and the head's manifest as the role passes it."""
    _rc, manifest = head_listing(tmp, head)
    worker = tmp / "worker" / "models--org--name"
    (worker / "snapshots" / COMMIT).mkdir(parents=True)
    (worker / "trees").mkdir()
    for name in ("model.safetensors", "config.json"):
        (worker / "snapshots" / COMMIT / name).write_bytes((head / "snapshots" / COMMIT / name).read_bytes())
    (worker / "trees" / f"{COMMIT}.json").write_bytes((head / "trees" / f"{COMMIT}.json").read_bytes())
    expected = {k: manifest[k] for k in ("commit", "files", "meta_files")}
    return worker, expected


def worker_verify(tmp: Path, worker: Path, expected: dict, trusted: list[str]) -> tuple[int, dict]:
    return run(tmp, repo_dir=str(worker), revision=COMMIT, expected=expected, trusted=trusted,
               state_file=str(tmp / "worker-state.json"), fail_on_problems=True)


def test_trusted_files_are_recorded_without_being_read(tmp_path: Path, head: Path) -> None:
    worker, expected = worker_copy(tmp_path, head)
    rc, result = worker_verify(tmp_path, worker, expected, [f"snapshots/{COMMIT}/model.safetensors"])
    assert rc == 0, result
    # Only the file rsync did not just deliver was read.
    assert result["hashed_bytes"] == len(CONFIG)
    state = json.loads((tmp_path / "worker-state.json").read_text())
    assert state["model.safetensors"]["sha256"] == hashlib.sha256(SHARD).hexdigest()
    assert state["model.safetensors"]["trusted"] == "rsync"


def test_a_trusted_file_of_the_wrong_size_still_fails(tmp_path: Path, head: Path) -> None:
    worker, expected = worker_copy(tmp_path, head)
    shard = worker / "snapshots" / COMMIT / "model.safetensors"
    shard.write_bytes(SHARD[:-10])
    rc, result = worker_verify(tmp_path, worker, expected, [f"snapshots/{COMMIT}/model.safetensors"])
    assert rc == 1
    assert "model.safetensors (size)" in result["msg"]


def test_a_write_after_the_transfer_makes_the_next_run_read_the_file(tmp_path: Path, head: Path) -> None:
    worker, expected = worker_copy(tmp_path, head)
    shard = worker / "snapshots" / COMMIT / "model.safetensors"
    assert worker_verify(tmp_path, worker, expected, [f"snapshots/{COMMIT}/model.safetensors"])[0] == 0
    # A bit flipped in place (same size): the trust was for the bytes rsync wrote, and ctime moved since.
    with shard.open("r+b") as fh:
        fh.seek(5000)
        byte = fh.read(1)
        fh.seek(5000)
        fh.write(bytes([byte[0] ^ 0x80]))
    rc, result = worker_verify(tmp_path, worker, expected, [])
    assert rc == 1
    assert [(p["path"], p["problem"]) for p in result["problems"]] == [("model.safetensors", "sha256")]
    assert result["need"] == [f"snapshots/{COMMIT}/model.safetensors"]


def test_trust_outside_the_snapshot_is_ignored(tmp_path: Path, head: Path) -> None:
    # Only snapshots/<commit>/ paths can be trusted; anything else in the list is not a file of the manifest.
    worker, expected = worker_copy(tmp_path, head)
    rc, result = worker_verify(tmp_path, worker, expected, ["model.safetensors", f"snapshots/{'f' * 40}/config.json"])
    assert rc == 0, result
    assert result["hashed_bytes"] == len(SHARD) + len(CONFIG)


def test_the_cache_directory_is_made_with_its_owner_and_mode_then_left_alone(tmp_path: Path, head: Path) -> None:
    import pwd

    cache = tmp_path / "new" / "hub"
    me = pwd.getpwuid(os.getuid()).pw_name
    rc, result = run(tmp_path, repo_dir=str(cache / "models--org--name"), revision=COMMIT, missing_ok=True,
                     cache_dir=str(cache), owner=me)
    assert (rc, result["changed"]) == (0, True), result
    assert cache.is_dir() and cache.stat().st_mode & 0o7777 == 0o755 and cache.stat().st_uid == os.getuid()
    rc, result = run(tmp_path, repo_dir=str(cache / "models--org--name"), revision=COMMIT, missing_ok=True,
                     cache_dir=str(cache), owner=me)
    assert (rc, result["changed"]) == (0, False)
    cache.chmod(0o700)
    rc, result = run(tmp_path, repo_dir=str(cache / "models--org--name"), revision=COMMIT, missing_ok=True,
                     cache_dir=str(cache), owner=me)
    assert (rc, result["changed"], cache.stat().st_mode & 0o7777) == (0, True, 0o755)


def test_a_cache_owner_that_is_no_user_is_named(tmp_path: Path) -> None:
    rc, result = run(tmp_path, repo_dir=str(tmp_path / "hub/models--org--name"), revision=COMMIT, missing_ok=True,
                     cache_dir=str(tmp_path / "hub"), owner="no-such-user-here")
    assert rc == 1
    assert result["msg"] == "the cache's owner no-such-user-here is not a user on this node (model_sync_user)"
    assert not (tmp_path / "hub").exists()


def test_a_file_where_the_cache_should_be_is_named(tmp_path: Path) -> None:
    (tmp_path / "hub").write_text("not a directory")
    rc, result = run(tmp_path, repo_dir=str(tmp_path / "hub/models--org--name"), revision=COMMIT, missing_ok=True,
                     cache_dir=str(tmp_path / "hub"))
    assert rc == 1
    assert result["msg"] == f"{tmp_path / 'hub'} (model_sync_cache_dir) exists and is not a directory"


def test_a_synced_worker_lists_the_heads_manifest_digest_and_a_changed_listing_does_not(tmp_path: Path,
                                                                                       head: Path) -> None:
    _rc, on_head = head_listing(tmp_path, head)
    worker, _expected = worker_copy(tmp_path, head)
    rc, own = run(tmp_path, repo_dir=str(worker), revision=COMMIT, missing_ok=True,
                  state_file=str(tmp_path / "worker-state.json"))
    assert rc == 0, own
    assert own["complete"] is True
    assert own["manifest_digest"] == on_head["manifest_digest"]
    # A worker whose own listing drops a file (edited, or from another sync) is complete by itself, but not the
    # head's: the role then checks it against the head's manifest.
    tree_path = worker / "trees" / f"{COMMIT}.json"
    tree = json.loads(tree_path.read_text())
    del tree["files"]["config.json"]
    tree_path.write_text(json.dumps(tree))
    rc, own = run(tmp_path, repo_dir=str(worker), revision=COMMIT, missing_ok=True,
                  state_file=str(tmp_path / "worker-state.json"))
    assert (rc, own["complete"]) == (0, True)
    assert own["manifest_digest"] != on_head["manifest_digest"]
