"""The model a rank loads: a checkpoint directory, or a Hugging Face repository in the node's local hub cache.

Every rank looks on its own node (the Sparks do not share a disk), with huggingface_hub's cache layout and
variables (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`). The Hub itself is never asked:
a repository missing from the cache fails that rank's start, naming the host and the cache path.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelError(Exception):
    pass


@dataclass(frozen=True)
class Model:
    name: str  # what /v1/models reports: the repository name, or a checkpoint directory's own name
    path: Path
    config: dict[str, Any]
    total_size: int  # bytes of weights (the safetensors index's total_size; 0 when unknown)


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def _snapshot(repo: str, revision: str | None) -> Path:
    cache = hub_cache()
    folder = cache / f"models--{repo.replace('/', '--')}"
    ref = revision or "main"
    sha = ref
    if (folder / "refs" / ref).is_file():
        sha = (folder / "refs" / ref).read_text().strip()
    snapshot = folder / "snapshots" / sha
    if not (snapshot / "config.json").is_file():
        raise ModelError(
            f"{repo} (revision {ref}) is not in the local Hugging Face cache {cache} on host "
            f"{socket.gethostname()}, and the TEST DOUBLE never downloads: OSError: We couldn't connect to "
            "'https://huggingface.co' to load the files, and couldn't find them in the cached files.")
    return snapshot


def resolve(name: str, revision: str | None = None) -> Model:
    local = Path(name)
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelError(f"{name} has no config.json (host {socket.gethostname()})")
        path, served = local, local.name
    else:
        path, served = _snapshot(name, revision), name
    config = json.loads((path / "config.json").read_text())
    index = path / "model.safetensors.index.json"
    total = 0
    if index.is_file():
        total = int(json.loads(index.read_text()).get("metadata", {}).get("total_size", 0))
    return Model(name=served, path=path, config=config, total_size=total)
