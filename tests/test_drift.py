"""roles/drift's observer (library/hy3spark_drift.py) and the hy3spark_content lookup, without a node.

The role itself runs in molecule/site (re-run in sync, forced full run, a hand edit found and repaired)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def drift() -> ModuleType:
    return load(ROOT / "roles/drift/library/hy3spark_drift.py", "hy3spark_drift")


def snapshot(drift: ModuleType, tmp: Path) -> dict:
    """A record's state, through the same JSON round trip as the file on the node."""
    watch = {"files": [str(tmp / "netplan.yaml")], "trees": [str(tmp / "etc")], "models": [str(tmp / "hub")]}
    return json.loads(json.dumps(drift.observe(watch)))


@pytest.fixture
def node(tmp_path: Path) -> Path:
    (tmp_path / "etc/vllm").mkdir(parents=True)
    (tmp_path / "etc/node.env").write_text("VLLM_HOST_IP=10.0.0.2\n")
    (tmp_path / "etc/vllm/list.json").write_text("[]\n")
    (tmp_path / "netplan.yaml").write_text("network: {}\n")
    blobs = tmp_path / "hub/blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc").write_bytes(b"weights")
    (tmp_path / "hub/snapshots/rev").mkdir(parents=True)
    os.symlink("../../blobs/abc", tmp_path / "hub/snapshots/rev/model.safetensors")
    return tmp_path


def test_an_unchanged_node_matches_its_record(drift: ModuleType, node: Path) -> None:
    assert drift.differences(snapshot(drift, node), snapshot(drift, node)) == []


def test_each_kind_of_change_is_named(drift: ModuleType, node: Path) -> None:
    record = snapshot(drift, node)
    (node / "etc/node.env").write_text("VLLM_HOST_IP=10.0.0.1\n")  # content
    (node / "etc/vllm/list.json").chmod(0o600)  # mode
    (node / "etc/extra.conf").write_text("x\n")  # a new file in a watched tree
    (node / "netplan.yaml").unlink()  # a missing file
    os.truncate(node / "hub/blobs/abc", 3)  # a truncated shard
    assert drift.differences(record, snapshot(drift, node)) == [
        f"files {node}/netplan.yaml",
        f"models {node}/hub",
        f"trees {node}/etc/extra.conf",
        f"trees {node}/etc/node.env",
        f"trees {node}/etc/vllm/list.json",
    ]


def test_hub_markers_of_absent_files_are_not_model_content(drift: ModuleType, node: Path) -> None:
    record = snapshot(drift, node)
    (node / "hub/.no_exist/rev").mkdir(parents=True)
    (node / "hub/.no_exist/rev/generation_config.json").write_text("")
    assert drift.differences(record, snapshot(drift, node)) == []


def test_a_relinked_snapshot_is_a_change(drift: ModuleType, node: Path) -> None:
    record = snapshot(drift, node)
    link = node / "hub/snapshots/rev/model.safetensors"
    link.unlink()
    os.symlink("../../blobs/other", link)
    assert drift.differences(record, snapshot(drift, node)) == [f"models {node}/hub"]


def test_the_record_is_written_0600_and_atomically(drift: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "state/deployed.json"
    drift.write_record(str(path), '{"inputs": "x"}\n')
    assert (path.stat().st_mode & 0o777, path.read_text()) == (0o600, '{"inputs": "x"}\n')
    assert sorted(p.name for p in path.parent.iterdir()) == ["deployed.json"]
    assert drift.read_record(str(tmp_path / "none.json")) is None
    (tmp_path / "bad.json").write_text("{")
    assert drift.read_record(str(tmp_path / "bad.json")) == {}


def test_missing_things_are_reported_as_missing(drift: ModuleType, tmp_path: Path) -> None:
    assert drift.file_state(str(tmp_path / "no")) == "missing"
    assert drift.tree_state(str(tmp_path / "no")) == "missing"
    assert drift.model_state(str(tmp_path / "no")) == "missing"


def test_content_hash_follows_the_roles_and_ignores_caches(tmp_path: Path) -> None:
    content = load(ROOT / "plugins/lookup/hy3spark_content.py", "hy3spark_content")
    for part in ("roles/drift", "playbooks", "templates", "plugins/lookup"):
        shutil.copytree(ROOT / part, tmp_path / part)
    shutil.copy(ROOT / "site.yml", tmp_path / "site.yml")
    before = content.content_sha256(tmp_path)
    (tmp_path / "roles/drift/__pycache__").mkdir(exist_ok=True)
    (tmp_path / "roles/drift/__pycache__/x.pyc").write_bytes(b"\0")
    (tmp_path / "roles/drift/.ruff_cache").mkdir()
    assert content.content_sha256(tmp_path) == before
    defaults = tmp_path / "roles/drift/defaults/main.yml"
    defaults.write_text(defaults.read_text() + "# changed\n")
    assert content.content_sha256(tmp_path) != before


def test_interfaces_are_their_configured_addresses_and_mtu(drift: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ip -j addr show dev X` as iproute2 prints it: only the configured addresses count, not the ones the kernel
    adds and rotates by itself (link-local, SLAAC/privacy addresses marked dynamic)."""
    shown = [{"ifname": "enp1s0f1np1", "mtu": 9000, "operstate": "UP", "addr_info": [
        {"family": "inet", "local": "10.0.0.2", "prefixlen": 24, "scope": "global"},
        {"family": "inet6", "local": "fd00::2", "prefixlen": 64, "scope": "global", "dynamic": True},
        {"family": "inet6", "local": "fe80::1", "prefixlen": 64, "scope": "link"}]}]
    monkeypatch.setattr(drift, "run", lambda argv: (0, json.dumps(shown)))
    assert drift.interface_state("enp1s0f1np1") == {"mtu": 9000, "addresses": ["10.0.0.2/24"]}
    monkeypatch.setattr(drift, "run", lambda argv: (1, ""))
    assert drift.interface_state("enp1s0f1np1") == "missing"
