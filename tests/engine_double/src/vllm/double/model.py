"""The model, as vLLM 0.23 resolves it: a local directory, or a Hub repo id looked up in the local Hugging Face cache.

Resolution runs huggingface_hub's real code (``snapshot_download(..., local_files_only=True)``, cache from
``HF_HUB_CACHE``/``HF_HOME``). A repo that is not in the cache fails the way vLLM fails in offline mode:
``ValueError: Invalid repository ID or local directory specified: '<repo>'``. The double NEVER downloads: without
``HF_HUB_OFFLINE=1`` the real vLLM would try the Hub; the double warns and fails the same way.

config.json gives the shape that sizes the KV cache; tokenizer_config.json gives the special tokens the tool and
reasoning parsers look up (a stand-in for the tokenizer's vocabulary).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.double import log

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"

INVALID_REPO = (
    "Invalid repository ID or local directory specified: '{model}'.\n"
    "Please verify the following requirements:\n"
    "1. Provide a valid Hugging Face repository ID.\n"
    "2. Specify a local directory that contains a recognized configuration file.\n"
    "   - For Hugging Face models: ensure the presence of a 'config.json'.\n"
    "   - For Mistral models: ensure the presence of a 'params.json'.\n"
)


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def snapshot_dir(model: str, revision: str | None) -> Path:
    """The model's directory on THIS machine; raises ValueError (vLLM's message) when it is not there."""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, CONFIG_NAME)):
            raise ValueError(INVALID_REPO.format(model=model))
        return Path(model)
    if model.startswith(("/", "./", "../")):
        raise ValueError(INVALID_REPO.format(model=model))
    from huggingface_hub import snapshot_download

    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        path = snapshot_download(repo_id=model, revision=revision or "main", cache_dir=cache_dir, local_files_only=True)
    except Exception as err:  # LocalEntryNotFoundError, RevisionNotFoundError, HFValidationError...
        raise ValueError(INVALID_REPO.format(model=model)) from err
    if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        raise ValueError(INVALID_REPO.format(model=model))
    return Path(path)


@dataclass
class FakeTokenizer:
    """What the hy_v3 parsers use of a Hugging Face tokenizer: ``vocab``/``get_vocab()`` and ``init_kwargs``."""

    init_kwargs: dict[str, Any]
    vocab: dict[str, int] = field(default_factory=dict)

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


@dataclass
class Model:
    tag: str
    revision: str | None
    path: Path
    config: dict[str, Any]
    tokenizer: FakeTokenizer

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or ["UnknownForCausalLM"]
        return str(archs[0])

    @property
    def max_position_embeddings(self) -> int | None:
        value = self.config.get("max_position_embeddings")
        return int(value) if value else None

    def weight_bytes(self) -> int:
        """total_size from the safetensors index, else the size of the *.safetensors files."""
        index = self.path / INDEX_NAME
        if index.is_file():
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            if total is not None:
                return int(total)
        return sum(p.stat().st_size for p in self.path.glob("*.safetensors") if p.exists())


def load_tokenizer(path: Path) -> FakeTokenizer:
    init_kwargs: dict[str, Any] = {}
    vocab: dict[str, int] = {}
    config = path / "tokenizer_config.json"
    if config.is_file():
        init_kwargs = json.loads(config.read_text())
        for token_id, token in (init_kwargs.get("added_tokens_decoder") or {}).items():
            if isinstance(token, dict) and "content" in token:
                vocab[token["content"]] = int(token_id)
    tokenizer_json = path / "tokenizer.json"
    if tokenizer_json.is_file():
        data = json.loads(tokenizer_json.read_text())
        for token in data.get("added_tokens") or []:
            vocab.setdefault(token["content"], int(token["id"]))
    return FakeTokenizer(init_kwargs=init_kwargs, vocab=vocab)


def resolve(tag: str, revision: str | None) -> Model:
    if not offline() and not os.path.isdir(tag):
        log.warning(
            "model.py:612",
            "hy3spark TEST DOUBLE: HF_HUB_OFFLINE is not set; the real vLLM would contact the Hugging Face Hub here. "
            "The double only reads the local cache.",
        )
    path = snapshot_dir(tag, revision)
    config = json.loads((path / CONFIG_NAME).read_text())
    return Model(tag=tag, revision=revision, path=path, config=config, tokenizer=load_tokenizer(path))


def verify_files(path: Path) -> tuple[int, list[str]]:
    """Check the weights on this machine as a loader would: every shard named by the index must open.

    Returns (bytes, shard names). Raises FileNotFoundError for a missing shard or a dangling hub-cache symlink
    (the ``rsync -a`` of ``snapshots/`` alone), RuntimeError when there are no weights at all.
    """
    index = path / INDEX_NAME
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise RuntimeError(f"Cannot find any model weights with `{path}`")
    total = 0
    for shard in shards:
        file = path / shard
        if not file.exists():
            target = f" (a symlink to {os.readlink(file)} that does not resolve)" if file.is_symlink() else ""
            raise FileNotFoundError(f"[Errno 2] No such file or directory: '{file}'{target}")
        with open(file, "rb") as handle:
            handle.read(1)
        total += file.stat().st_size
    return total, shards
