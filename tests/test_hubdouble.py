"""The Hub double (tests/hubdouble, a TEST DOUBLE of the Hugging Face Hub) against the REAL huggingface_hub.

Each download runs `snapshot_download` in a fresh subprocess: huggingface_hub reads HF_* at import time, and a
subprocess is also what a killed transfer looks like. Nothing in huggingface_hub is mocked.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hubdouble import HubDouble, generate

pytest.importorskip("huggingface_hub")

REPO = "hubdouble/tiny-model"
MIB = 1 << 20
BIG = "model-00001-of-00003.safetensors"

_DOWNLOAD = """
import json, sys
from huggingface_hub import snapshot_download
path = snapshot_download(sys.argv[1], revision=sys.argv[2], cache_dir=sys.argv[3])
print(json.dumps({"path": path}))
"""


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    generate(root, [12 * MIB, 256 * 1024, 256 * 1024])  # one shard above the client's 10 MiB chunk
    return root


def _env(endpoint: str, token: str | None = None, offline: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update({"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_XET": "1", "HF_HOME": "/nonexistent-hf-home"})
    if token:
        env["HF_TOKEN"] = token
        env.pop("HF_HUB_DISABLE_IMPLICIT_TOKEN")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def _download(endpoint: str, cache: Path, revision: str = "main", **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _DOWNLOAD, REPO, revision, str(cache)], env=_env(endpoint, **kw),
                          capture_output=True, text=True, timeout=120, check=False)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fresh_download_builds_the_hub_cache_layout(repo_dir: Path, tmp_path: Path) -> None:
    with HubDouble(repo_dir, REPO) as hub:
        proc = _download(hub.endpoint, tmp_path)
        assert proc.returncode == 0, proc.stderr
        snapshot = Path(json.loads(proc.stdout.splitlines()[-1])["path"])
        storage = tmp_path / "models--hubdouble--tiny-model"
        assert snapshot == storage / "snapshots" / hub.commit
        assert (storage / "refs" / "main").read_text() == hub.commit
        for path, info in hub.index.files.items():
            local = snapshot / path
            assert local.is_symlink(), f"{path} should be a snapshot symlink into blobs/"
            assert os.readlink(local) == f"../../blobs/{info.etag}"
            assert local.stat().st_size == info.size
            if info.lfs:
                assert _sha256(local) == info.sha256
        tree = json.loads((storage / "trees" / f"{hub.commit}.json").read_text())
        assert tree["files"][BIG]["lfs_sha256"] == hub.index.files[BIG].sha256
        # The LFS files went through the CDN redirect, the small ones were served in place.
        gets = [r for r in hub.requests if r["method"] == "GET" and r.get("file")]
        assert {r["file"] for r in gets if r["path"].startswith("/lfs-cdn/")} == {
            p for p, i in hub.index.files.items() if i.lfs}
        assert not [r for r in gets if r["status"] == 206], "a clean download needs no Range request"


def test_dropped_connection_resumes_with_range(repo_dir: Path, tmp_path: Path) -> None:
    # The client writes in 10 MiB chunks and resumes from the last whole chunk: cut past the first one.
    cut, chunk = 11 * MIB, 10 * MIB
    with HubDouble(repo_dir, REPO, drop_once={BIG: cut}) as hub:
        proc = _download(hub.endpoint, tmp_path)
        assert proc.returncode == 0, proc.stderr
        snapshot = Path(json.loads(proc.stdout.splitlines()[-1])["path"])
        assert _sha256(snapshot / BIG) == hub.index.files[BIG].sha256
        big = [r for r in hub.requests if r.get("file") == BIG and r["method"] == "GET"]
        assert big[0].get("dropped_after") == cut
        resumed = [r for r in big if r["status"] == 206]
        assert resumed, f"expected a Range request after the drop, saw {big}"
        assert resumed[0]["range"] == f"bytes={chunk}-"
        # Resumed, not restarted: only the unfinished chunk went over the wire twice.
        assert sum(r["bytes"] for r in big) == hub.index.files[BIG].size + (cut - chunk)


def _size(path: Path) -> int:
    """A file's size, 0 once it is gone: a small file's .incomplete is renamed when it completes, between the glob
    that found it and this stat."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_killed_download_then_rerun_completes(repo_dir: Path, tmp_path: Path) -> None:
    """A SIGKILLed download leaves the cache incomplete; the next call fetches what is missing."""
    code = _DOWNLOAD.replace("print(", "0 and print(")
    with HubDouble(repo_dir, REPO, rate=4 * MIB) as hub:
        proc = subprocess.Popen([sys.executable, "-c", code, REPO, "main", str(tmp_path)],
                                env=_env(hub.endpoint), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        blobs = tmp_path / "models--hubdouble--tiny-model" / "blobs"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None and not any(
                _size(p) > MIB for p in blobs.glob("*.incomplete")):
            time.sleep(0.05)
        assert proc.poll() is None, "the download finished before it could be killed"
        proc.kill()
        proc.wait()
        blob = tmp_path / "models--hubdouble--tiny-model" / "blobs" / hub.index.files[BIG].sha256
        assert not blob.exists(), "the big blob must not be complete after the kill"
        hub.rate = None
        again = _download(hub.endpoint, tmp_path)
        assert again.returncode == 0, again.stderr
        assert _sha256(blob) == hub.index.files[BIG].sha256


def test_token_is_required_and_sent_as_bearer(repo_dir: Path, tmp_path: Path) -> None:
    secret = "hf_" + "x" * 30
    with HubDouble(repo_dir, REPO, token=secret) as hub:
        denied = _download(hub.endpoint, tmp_path / "a")
        assert denied.returncode != 0
        assert "RepositoryNotFoundError" in denied.stderr or "401" in denied.stderr
        ok = _download(hub.endpoint, tmp_path / "b", token=secret)
        assert ok.returncode == 0, ok.stderr
        assert {r["auth"] for r in hub.requests if r["path"].startswith("/api/") and r["status"] == 200} == {"valid"}
        assert secret not in json.dumps(hub.requests)


def test_errors_carry_hub_error_codes(repo_dir: Path, tmp_path: Path) -> None:
    with HubDouble(repo_dir, REPO) as hub:
        bad_rev = _download(hub.endpoint, tmp_path, revision="v9-does-not-exist")
        assert bad_rev.returncode != 0 and "RevisionNotFoundError" in bad_rev.stderr
        code = ("import sys\nfrom huggingface_hub import hf_hub_download\n"
                "hf_hub_download(sys.argv[1], 'missing.bin', cache_dir=sys.argv[2])\n")
        missing = subprocess.run([sys.executable, "-c", code, REPO, str(tmp_path)], env=_env(hub.endpoint),
                                 capture_output=True, text=True, timeout=60, check=False)
        assert missing.returncode != 0 and "EntryNotFoundError" in missing.stderr
        other = subprocess.run([sys.executable, "-c", _DOWNLOAD, "someone/else", "main", str(tmp_path)],
                               env=_env(hub.endpoint), capture_output=True, text=True, timeout=60, check=False)
        assert other.returncode != 0 and "RepositoryNotFoundError" in other.stderr


def test_offline_load_accepts_real_files_in_the_snapshot(repo_dir: Path, tmp_path: Path) -> None:
    """The layout model_sync gives a worker: refs/, trees/ and snapshots/<sha>/ holding real files (no blobs/).
    With HF_HUB_OFFLINE=1 (the node env) huggingface_hub resolves the revision to that snapshot, as vLLM does."""
    with HubDouble(repo_dir, REPO) as hub:
        head = tmp_path / "head"
        assert _download(hub.endpoint, head).returncode == 0
        commit = hub.commit
    storage = "models--hubdouble--tiny-model"
    worker = tmp_path / "worker" / storage
    # What rsync --copy-links gives: the links into blobs/ become real files.
    shutil.copytree(head / storage / "snapshots" / commit, worker / "snapshots" / commit, symlinks=False)
    for sub in ("refs", "trees"):
        shutil.copytree(head / storage / sub, worker / sub)
    proc = _download("http://127.0.0.1:9", tmp_path / "worker", offline=True)
    assert proc.returncode == 0, proc.stderr
    snapshot = Path(json.loads(proc.stdout.splitlines()[-1])["path"])
    assert snapshot == worker / "snapshots" / commit
    assert not (snapshot / BIG).is_symlink()
    # Missing shard on the worker: the cached tree listing makes the offline load refuse instead of half-loading.
    (snapshot / BIG).unlink()
    broken = _download("http://127.0.0.1:9", tmp_path / "worker", offline=True)
    assert broken.returncode != 0 and "incomplete" in broken.stderr.lower()


def test_link_rate_is_shared_by_every_download(repo_dir: Path, tmp_path: Path) -> None:
    """link_rate is one link for all responses: two snapshot downloads side by side take twice as long as the bytes
    of one at that rate, where a per-response cap (rate) would let them finish in the time of one."""
    link = 8 * MIB
    with HubDouble(repo_dir, REPO, link_rate=link) as hub:
        total = sum(f.size for f in hub.index.files.values())
        began = time.monotonic()
        procs = [subprocess.Popen([sys.executable, "-c", _DOWNLOAD, REPO, "main", str(tmp_path / str(i))],
                                  env=_env(hub.endpoint), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for i in range(2)]
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
        took = time.monotonic() - began
    assert took >= 2 * total / link * 0.95, f"two downloads of {total} bytes took {took:.2f} s at {link} B/s"
    for i in range(2):
        blob = tmp_path / str(i) / "models--hubdouble--tiny-model" / "blobs" / hub.index.files[BIG].sha256
        assert _sha256(blob) == hub.index.files[BIG].sha256
