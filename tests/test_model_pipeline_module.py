"""hy3spark_model_pipeline run as Ansible runs it (args file in, JSON out): the hub's listing from the Hub double
(tests/hubdouble, a TEST DOUBLE of the Hugging Face Hub that huggingface_hub really talks to), then the download
pipelined with real rsync streams into a second directory standing for a worker (local rsync, no SSH: the role
adds SSH and the fabric). What is checked: every file arrives with the hub's hash, a file whose hash is wrong is
never sent and fails the run by name, the listing goes last, and a run that only sends needs no huggingface_hub."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hubdouble import HubDouble, generate

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "plugins/modules/hy3spark_model_pipeline.py"
# The module imports the collection's module_utils by full name: the checkout's collection link on the path stands
# for what Ansible packs with the module for a node.
COLLECTIONS = str(ROOT / "collections")


def module_env(*first: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["PYTHONPATH"] = os.pathsep.join([*first, COLLECTIONS, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env
REPO = "acme/pipe"
MIB = 1 << 20


def run(tmp: Path, **params: object) -> tuple[int, dict]:
    args = tmp / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": params}))
    env = module_env()
    env["HF_HOME"] = str(tmp / "hf-home")
    proc = subprocess.run([sys.executable, str(MODULE), str(args)], capture_output=True, text=True, timeout=300,
                          check=False, env=env)
    result = json.loads(proc.stdout)
    result.pop("invocation", None)
    return proc.returncode, result


def rsync_to(worker_repo: Path, head_repo: Path) -> list[str]:
    worker_repo.mkdir(parents=True, exist_ok=True)
    return ["rsync", "--copy-links", "--times", "--itemize-changes", "--stats", "--files-from=-",
            f"{head_repo}/", f"{worker_repo}/"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("repo")
    generate(root, [3 * MIB, 2 * MIB, MIB, MIB])
    with HubDouble(root, REPO) as hub:
        yield hub


def manifest(tmp: Path, hub: HubDouble, cache: Path) -> dict:
    rc, out = run(tmp, mode="manifest", repo=REPO, revision=hub.commit, cache_dir=str(cache), endpoint=hub.endpoint)
    assert rc == 0, out
    return out


def sends_for(out: dict, head_repo: Path, worker_repo: Path, streams: int) -> list[dict]:
    paths = [f"snapshots/{out['commit']}/{f['path']}" for f in out["files"]] + out["meta_files"]
    lists = [paths[i::streams] for i in range(streams)]
    return [{"worker": "w1", "argv": rsync_to(worker_repo, head_repo), "streams": lists}]


def hub_hash(path: Path, entry: dict) -> bool:
    data = path.read_bytes()
    if entry["sha256"]:
        return hashlib.sha256(data).hexdigest() == entry["sha256"]
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == entry["git_sha1"]


def test_manifest_writes_the_hubs_listing_and_a_second_call_needs_no_hub(served: HubDouble, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    out = manifest(tmp_path, served, cache)
    assert out["commit"] == served.commit and out["changed"] is True
    assert out["meta_files"] == [f"trees/{served.commit}.json"]
    shards = [f for f in out["files"] if f["path"].endswith(".safetensors")]
    assert len(shards) == 4 and all(f["sha256"] and not f["git_sha1"] for f in shards)
    tree = json.loads((cache / "models--acme--pipe" / "trees" / f"{served.commit}.json").read_text())
    assert tree["format_version"] == 1 and set(tree["files"]) == {f["path"] for f in out["files"]}
    # The listing is in the cache now: no hub at all (a closed port would fail the call).
    rc, again = run(tmp_path, mode="manifest", repo=REPO, revision=served.commit, cache_dir=str(cache),
                    endpoint="http://127.0.0.1:9")
    assert rc == 0 and again["changed"] is False and again["files"] == out["files"]


def start(tmp: Path, name: str, **params: object) -> subprocess.Popen[str]:
    args = tmp / f"{name}.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": params}))
    env = module_env()
    env["HF_HOME"] = str(tmp / "hf-home")
    return subprocess.Popen([sys.executable, str(MODULE), str(args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def finish(proc: subprocess.Popen[str]) -> tuple[int, dict]:
    out, _err = proc.communicate(timeout=300)
    result = json.loads(out)
    result.pop("invocation", None)
    return proc.returncode, result


def pipeline(tmp: Path, hub: HubDouble, out: dict, files: list[dict], streams: int) -> tuple[dict, dict, Path]:
    """The role's order: the sender in the background, then the download; both results."""
    cache, worker = tmp / "hub", tmp / "worker" / "models--acme--pipe"
    common = {"repo": REPO, "revision": hub.commit, "cache_dir": str(cache), "commit": out["commit"],
              "files": files, "fetch": [f["path"] for f in files], "ready_file": str(tmp / "state" / "ready.jsonl")}
    sender = start(tmp, "send", mode="send", sends=sends_for(out, cache / "models--acme--pipe", worker, streams),
                   **common)
    rc_d, down = run(tmp, mode="download", endpoint=hub.endpoint, max_workers=1, **common)
    rc_s, sent = finish(sender)
    return dict(down, rc=rc_d), dict(sent, rc=rc_s), worker


def test_download_pipelined_with_streams_delivers_every_file_with_the_hubs_hash(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    generate(root, [3 * MIB, 3 * MIB, 2 * MIB, 2 * MIB])
    # 8 MiB/s and one file at a time: the download takes about a second and a half, long enough to see the
    # sender deliver files while it goes on.
    with HubDouble(root, REPO, rate=8 * MIB) as hub:
        out = manifest(tmp_path, hub, tmp_path / "hub")
        down, sent, worker = pipeline(tmp_path, hub, out, out["files"], 2)
    assert down["rc"] == 0 and sent["rc"] == 0, (down, sent)
    assert down["download"]["files"] == len(out["files"])
    assert sorted(down["verified"]) == sorted(f"snapshots/{out['commit']}/{f['path']}" for f in out["files"])
    w1 = sent["transfers"]["w1"]
    assert w1["rc"] == 0 and w1["streams"] == 2 and w1["bytes_sent"] >= out["total_bytes"]
    # Pipelined: the streams ran rsync more than once each (files as they landed), the first well before the end.
    assert w1["batches"] > 2, w1
    assert w1["first_sent_s"] < down["download"]["seconds"] / 2, (w1, down["download"])
    for entry in out["files"]:
        got = worker / "snapshots" / out["commit"] / entry["path"]
        assert not got.is_symlink() and hub_hash(got, entry), entry["path"]
    assert (worker / "trees" / f"{out['commit']}.json").is_file()
    assert not (tmp_path / "state" / "ready.jsonl").exists()


def test_a_file_with_the_wrong_hash_fails_by_name_and_is_never_sent(served: HubDouble, tmp_path: Path) -> None:
    out = manifest(tmp_path, served, tmp_path / "hub")
    bad = next(f for f in out["files"] if f["path"].endswith(".safetensors"))
    files = [dict(f, sha256="0" * 64) if f["path"] == bad["path"] else f for f in out["files"]]
    down, sent, worker = pipeline(tmp_path, served, out, files, 1)
    rel = f"snapshots/{out['commit']}/{bad['path']}"
    assert down["rc"] != 0 and f"{rel}: hash differs from the hub's listing" in down["msg"]
    assert sent["rc"] != 0 and "not sent, the head could not get them: " + rel in sent["msg"]
    assert not (worker / "snapshots" / out["commit"] / bad["path"]).exists()
    # Nothing partial looks complete: the listing is held back when a file failed.
    assert not (worker / "trees" / f"{out['commit']}.json").exists()
    others = [f for f in files if f["path"] != bad["path"]]
    assert all((worker / "snapshots" / out["commit"] / f["path"]).is_file() for f in others)


def test_a_killed_download_ends_the_senders_wait(served: HubDouble, tmp_path: Path) -> None:
    """A download SIGKILLed before its done line: the sender sees its process gone and stops, sending nothing
    it was not told of (no four-hour wait for the async budget)."""
    out = manifest(tmp_path, served, tmp_path / "hub")
    ready = tmp_path / "state" / "ready.jsonl"
    ready.parent.mkdir()
    victim = subprocess.Popen(["sleep", "30"])
    ready.write_text(json.dumps({"pid": victim.pid}) + "\n")
    cache, worker = tmp_path / "hub", tmp_path / "worker" / "models--acme--pipe"
    sender = start(tmp_path, "send", mode="send", repo=REPO, revision=served.commit, cache_dir=str(cache),
                   commit=out["commit"], files=out["files"], fetch=[f["path"] for f in out["files"]],
                   ready_file=str(ready), sends=sends_for(out, cache / "models--acme--pipe", worker, 2))
    victim.kill()
    victim.wait()
    rc, sent = finish(sender)
    assert rc != 0 and "the head could not get them" in sent["msg"], sent
    assert not (worker / "snapshots").exists()


def head_with_everything(tmp: Path, hub: HubDouble) -> tuple[Path, Path, dict]:
    """The head's cache with the whole model downloaded and verified: (cache, the worker's model dir, manifest)."""
    cache, worker = tmp / "hub", tmp / "worker" / "models--acme--pipe"
    out = manifest(tmp, hub, cache)
    rc, res = run(tmp, mode="download", repo=REPO, revision=hub.commit, cache_dir=str(cache), endpoint=hub.endpoint,
                  commit=out["commit"], files=out["files"], fetch=[f["path"] for f in out["files"]])
    assert rc == 0, res
    return cache, worker, out


def test_sending_alone_imports_no_huggingface_hub(served: HubDouble, tmp_path: Path) -> None:
    cache, worker, out = head_with_everything(tmp_path, served)
    # The head holds it all now; a pure send runs with huggingface_hub made unimportable.
    blocker = tmp_path / "nohub"
    (blocker / "huggingface_hub").mkdir(parents=True)
    (blocker / "huggingface_hub" / "__init__.py").write_text("raise ImportError('blocked for the test')\n")
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {
        "mode": "send", "repo": REPO, "revision": served.commit, "cache_dir": str(cache),
        "commit": out["commit"], "files": out["files"], "fetch": [],
        "sends": sends_for(out, cache / "models--acme--pipe", worker, 3)}}))
    env = module_env(str(blocker))
    proc = subprocess.run([sys.executable, str(MODULE), str(args)], capture_output=True, text=True, timeout=120,
                          check=False, env=env)
    res = json.loads(proc.stdout)
    assert proc.returncode == 0, res
    assert res["transfers"]["w1"]["streams"] == 3 and res["transfers"]["w1"]["batches"] == 3
    assert all((worker / "snapshots" / out["commit"] / f["path"]).is_file() for f in out["files"])


def test_the_sends_deadline_kills_its_rsyncs_and_names_the_stream(served: HubDouble, tmp_path: Path) -> None:
    """timeout_s: a send slower than its budget is cut at the deadline (the whole process group, so no rsync is
    left running) and fails naming the worker's stream and the role input that set the budget."""
    cache, worker, out = head_with_everything(tmp_path, served)
    sends = sends_for(out, cache / "models--acme--pipe", worker, 1)
    sends[0]["argv"].insert(1, "--bwlimit=256")  # 256 KiB/s: the 7 MiB take about 28 s, the budget is 1 s
    # rsync under a parent that forks it, as runuser does in the role: killing the parent alone would leave it.
    sends[0]["argv"] = ["sh", "-c", 'rsync "$@"; exit $?', "sh", *sends[0]["argv"][1:]]
    began = time.monotonic()
    rc, sent = run(tmp_path, mode="send", repo=REPO, revision=served.commit, cache_dir=str(cache),
                   commit=out["commit"], files=out["files"], sends=sends, timeout_s=1)
    took = time.monotonic() - began
    assert rc != 0 and "w1 stream 1: rsync exit 124: killed after the transfer's 1 s (model_sync_transfer_timeout_s)" \
        in sent["msg"], sent
    assert took < 10, f"the send ran {took:.1f} s past a 1 s budget"
    left = subprocess.run(["pgrep", "-f", f"rsync.*{worker}"], capture_output=True, text=True, check=False)
    assert left.stdout.strip() == "", f"rsync still running after the deadline: {left.stdout}"


def test_the_sends_deadline_ends_a_wait_for_a_download_that_hangs(served: HubDouble, tmp_path: Path) -> None:
    """A download that is alive but delivers nothing: the send's deadline ends the wait and names what it lacked."""
    out = manifest(tmp_path, served, tmp_path / "hub")
    ready = tmp_path / "state" / "ready.jsonl"
    ready.parent.mkdir()
    hung = subprocess.Popen(["sleep", "60"])
    try:
        ready.write_text(json.dumps({"pid": hung.pid}) + "\n")
        cache, worker = tmp_path / "hub", tmp_path / "worker" / "models--acme--pipe"
        began = time.monotonic()
        rc, sent = run(tmp_path, mode="send", repo=REPO, revision=served.commit, cache_dir=str(cache),
                       commit=out["commit"], files=out["files"], fetch=[f["path"] for f in out["files"]],
                       ready_file=str(ready), sends=sends_for(out, cache / "models--acme--pipe", worker, 2),
                       timeout_s=1)
        took = time.monotonic() - began
    finally:
        hung.kill()
        hung.wait()
    assert rc != 0 and "not sent, the head could not get them" in sent["msg"], sent
    assert took < 10, f"the send waited {took:.1f} s on a 1 s budget"
    assert not (worker / "snapshots").exists()
