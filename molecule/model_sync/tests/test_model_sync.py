"""model_sync scenario: what a user relies on after the model_sync role ran on a head and two workers.

The model is the Hub double's synthetic repo (tests/hubdouble, a TEST DOUBLE of the Hugging Face Hub) served from
the head with a token. model-sync-w1 started empty (and side_effect.yml killed and resumed a transfer to it);
model-sync-w2 started with a truncated shard and a same-size corrupted shard.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from scenario import ansible_node as node

HEAD, W1, W2 = "model-sync-head", "model-sync-w1", "model-sync-w2"
WORKERS = (W1, W2)
FABRIC_IP = {HEAD: "10.94.0.140", W1: "10.94.0.141", W2: "10.94.0.142"}
REPO = "hubdouble/tiny-model"
COMMIT = "d0771674110ed6a93513dba8db5337607c4fb9c9"
CACHE = "/var/lib/hy3spark/hub"
REPO_DIR = f"{CACHE}/models--hubdouble--tiny-model"
SNAPSHOT = f"{REPO_DIR}/snapshots/{COMMIT}"
TOKEN = os.environ.get("HY3SPARK_HUB_TOKEN", "hubdouble-test-token-3f9c2a")
DAMAGED = ("model-00002-of-00006.safetensors", "model-00003-of-00006.safetensors")

# Hashes of every file under a directory, computed on the node itself.
_HASHES = r"""
import hashlib, json, os, sys
out = {}
for name in sorted(os.listdir(sys.argv[1])):
    p = os.path.join(sys.argv[1], name)
    if os.path.isdir(p):
        continue
    data = open(p, "rb").read()
    out[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                 "git_sha1": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(), "link": os.path.islink(p)}
print(json.dumps(out))
"""


def hub_manifest() -> dict:
    """What the Hub double publishes for the repo (size, git oid, sha256 of LFS files), read on the head."""
    out = node(HEAD).check_output("cd /opt/hubdouble && python3 -m hubdouble manifest --root /srv/hub/repo")
    data = json.loads(out)
    assert data["commit"] == COMMIT
    return data["files"]


def hashes(name: str, directory: str = SNAPSHOT) -> dict:
    return json.loads(node(name).check_output(f"python3 -c {shlex.quote(_HASHES)} {directory}"))


@pytest.mark.parametrize("name", WORKERS)
def test_worker_has_every_file_with_the_hubs_size_and_hash(name: str) -> None:
    expected, got = hub_manifest(), hashes(name)
    assert sorted(got) == sorted(expected)
    for path, info in expected.items():
        assert got[path]["size"] == info["size"], path
        if info["sha256"]:
            assert got[path]["sha256"] == info["sha256"], path
        else:
            assert got[path]["git_sha1"] == info["git_oid"], path


def test_head_cache_is_blobs_plus_links_and_workers_get_real_files() -> None:
    head = node(HEAD)
    for path in hub_manifest():
        assert head.file(f"{SNAPSHOT}/{path}").is_symlink, f"head: {path} is not a hub-cache link"
    for name in WORKERS:
        for path, info in hashes(name).items():
            assert not info["link"], f"{name}: {path} arrived as a link"
        assert not node(name).file(f"{REPO_DIR}/blobs").exists, f"{name} got blobs/ as well"


@pytest.mark.parametrize("name", WORKERS)
def test_worker_tree_is_owned_by_the_deploying_user_and_clean(name: str) -> None:
    host = node(name)
    assert host.file(SNAPSHOT).user == "ubuntu"
    assert host.file(f"{SNAPSHOT}/config.json").user == "ubuntu"
    leftovers = host.check_output(f"find {REPO_DIR} -name '.hy3spark-partial' -o -name '*.incomplete'")
    assert leftovers == "", leftovers
    assert host.file(f"{REPO_DIR}/trees/{COMMIT}.json").is_file


def test_w2_repairs_only_the_damaged_shards() -> None:
    """Files of the seeded copy that were right keep their own mtime: they were verified, not sent again."""
    host = node(W2)
    seeded = dict(line.rsplit(" ", 1) for line in host.check_output("cat /root/seed-mtimes").splitlines())
    for path, mtime in seeded.items():
        now = host.check_output(f"stat -c %Y {path}").strip()
        if os.path.basename(path) in DAMAGED:
            head_mtime = node(HEAD).check_output(f"stat -L -c %Y {path}").strip()
            assert now == head_mtime != mtime, f"{path} was not replaced by the head's copy"
        else:
            assert now == mtime, f"{path} was sent again although it was right"


@pytest.mark.parametrize("name", WORKERS)
def test_worker_tree_loads_offline_at_the_revision(name: str, tmp_path: Path) -> None:
    """What vLLM does on the worker (HF_HUB_OFFLINE=1, HF_HUB_CACHE=<cache>, revision from the spec)."""
    subprocess.run(["docker", "cp", f"{name}:{CACHE}", str(tmp_path / "hub")], check=True)
    code = ("import sys\nfrom huggingface_hub import snapshot_download\n"
            "print(snapshot_download(sys.argv[1], revision=sys.argv[2], cache_dir=sys.argv[3]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update({"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(tmp_path / "home")})
    proc = subprocess.run([sys.executable, "-c", code, REPO, COMMIT, str(tmp_path / "hub")], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(f"snapshots/{COMMIT}")


def test_download_used_the_token_and_resumed_a_dropped_connection() -> None:
    log = [json.loads(line) for line in node(HEAD).check_output("cat /var/log/hubdouble.jsonl").splitlines()]
    api = [r for r in log if r["path"].startswith("/api/") and r["status"] == 200]
    assert api and {r["auth"] for r in api} == {"valid"}
    shard = [r for r in log if r.get("file") == "model-00001-of-00006.safetensors" and r["method"] == "GET"]
    assert shard[0].get("dropped_after") == 11534336
    assert [r["range"] for r in shard if r["status"] == 206] == ["bytes=10485760-"]
    # Downloaded once: converge, idempotence, check and side_effect found the pinned commit complete locally.
    assert len([r for r in log if r["path"].startswith("/api/")]) == 1


@pytest.mark.parametrize("name", (HEAD, W1, W2))
def test_token_is_nowhere_on_the_nodes(name: str) -> None:
    host = node(name)
    places = "/var/lib/hy3spark /etc/hy3spark /root /home/ubuntu /tmp /var/log"
    found = host.run(f"grep -rlF -- {TOKEN} {places} 2>/dev/null; journalctl --no-pager -o cat | grep -cF -- {TOKEN}")
    assert found.stdout.strip() == "0", found.stdout
    procs = host.check_output("ps -eo args")
    assert TOKEN not in procs
