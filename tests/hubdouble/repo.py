"""The synthetic model repository the Hub double serves, and the hub metadata of any directory served as a repo.

`generate()` writes a small model in the shape of a real safetensors checkpoint: config.json, tokenizer files,
`model.safetensors.index.json` (with `metadata.total_size` and a `weight_map`) and N shards. Each shard is a VALID
safetensors file holding one uint8 tensor of deterministic pseudo-random bytes (seeded by the shard number), so the
same arguments always give byte-identical files, and the same commit sha.

`index_repo()` computes what the Hub would report for each file: size, git blob sha1 (the `oid` / ETag of a regular
file) and, for files stored in Git LFS, the sha256 of the content (the ETag of an LFS file: it becomes the blob's
name in the local cache) and the oid of the LFS pointer file. The commit sha is derived from the listing, so
changing any file changes the commit.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import random
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

# Files the Hub stores in Git LFS (a real repo says so in .gitattributes).
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.model", "*.gguf")
INDEX_FILE = ".hubdouble-index.json"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileInfo:
    path: str
    size: int
    git_oid: str  # sha1 of the git blob (for LFS files: of the pointer file)
    sha256: str | None  # content sha256, LFS files only (the Hub knows it only for those)

    @property
    def lfs(self) -> bool:
        return self.sha256 is not None

    @property
    def etag(self) -> str:
        """What the Hub sends as X-Linked-Etag/ETag, and the blob's file name in the local cache."""
        return self.sha256 if self.sha256 else self.git_oid


@dataclass(frozen=True)
class RepoIndex:
    commit: str
    files: dict[str, FileInfo]

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files.values())


def is_lfs(path: str) -> bool:
    return any(fnmatch.fnmatch(Path(path).name, pattern) for pattern in LFS_PATTERNS)


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _hash_file(path: Path) -> tuple[str, str]:
    """(git blob sha1, sha256) of a file, read once in chunks."""
    size = path.stat().st_size
    sha1 = hashlib.sha1(b"blob %d\0" % size)
    sha256 = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            sha1.update(chunk)
            sha256.update(chunk)
    return sha1.hexdigest(), sha256.hexdigest()


def _walk(root: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel != INDEX_FILE:
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def index_repo(root: str | os.PathLike[str]) -> RepoIndex:
    """Hub metadata of every file under root. Hashes are cached in root/.hubdouble-index.json by (size, mtime)."""
    root = Path(root)
    cache_path = root / INDEX_FILE
    try:
        cached = json.loads(cache_path.read_text())["files"]
    except (OSError, ValueError, KeyError):
        cached = {}
    files: dict[str, FileInfo] = {}
    stamps: dict[str, list[int]] = {}
    for rel in _walk(root):
        st = (root / rel).stat()
        stamp = [st.st_size, st.st_mtime_ns]
        hit = cached.get(rel)
        if hit and hit["stamp"] == stamp:
            info = FileInfo(**hit["info"])
        else:
            blob_sha1, sha256 = _hash_file(root / rel)
            if is_lfs(rel):
                info = FileInfo(rel, st.st_size, git_blob_sha1(lfs_pointer(sha256, st.st_size)), sha256)
            else:
                info = FileInfo(rel, st.st_size, blob_sha1, None)
        files[rel] = info
        stamps[rel] = stamp
    listing = "".join(f"{f.path}\0{f.git_oid}\n" for f in files.values()).encode()
    commit = hashlib.sha1(b"hubdouble-commit\0" + listing).hexdigest()
    with contextlib.suppress(OSError):  # a read-only repo is fine: hashing again next time is the only cost
        cache_path.write_text(json.dumps(
            {"files": {p: {"stamp": stamps[p], "info": asdict(i)} for p, i in files.items()}}, indent=1))
    return RepoIndex(commit=commit, files=files)


def _write_random(path: Path, size: int, seed: int, header: bytes = b"") -> None:
    rng = random.Random(seed)
    with path.open("wb") as fh:
        fh.write(header)
        left = size
        while left:
            n = min(left, _CHUNK)
            fh.write(rng.randbytes(n))
            left -= n


def _safetensors_header(tensor: str, nbytes: int) -> bytes:
    header = {"__metadata__": {"format": "pt"},
              tensor: {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def generate(out: str | os.PathLike[str], shard_sizes: list[int], *, name: str = "hubdouble-tiny") -> RepoIndex:
    """Write a synthetic safetensors model with one shard per entry of shard_sizes (tensor bytes per shard)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    count = len(shard_sizes)
    weight_map: dict[str, str] = {}
    for i, nbytes in enumerate(shard_sizes, start=1):
        shard = f"model-{i:05d}-of-{count:05d}.safetensors"
        tensor = f"model.layers.{i - 1}.weight"
        weight_map[tensor] = shard
        target = out / shard
        header = _safetensors_header(tensor, nbytes)
        if target.is_file() and target.stat().st_size == len(header) + nbytes:
            continue  # deterministic content: an existing shard of the right size is this shard
        _write_random(target, nbytes, seed=i, header=header)
    small = {
        "config.json": {"architectures": ["HubDoubleForCausalLM"], "model_type": name, "num_hidden_layers": count,
                        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                        "max_position_embeddings": 4096, "torch_dtype": "uint8"},
        "generation_config.json": {"do_sample": False, "max_new_tokens": 16},
        "tokenizer_config.json": {"model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast",
                                  "bos_token": "<s>", "eos_token": "</s>"},
        "tokenizer.json": {"version": "1.0", "model": {"type": "WordLevel", "unk_token": "<unk>",
                                                       "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "hub": 3}}},
        "model.safetensors.index.json": {"metadata": {"total_size": sum(shard_sizes)}, "weight_map": weight_map},
    }
    for fname, data in small.items():
        (out / fname).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (out / ".gitattributes").write_text("".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS))
    (out / "README.md").write_text(f"# {name}\n\nSynthetic weights for tests (hy3spark's Hub double). Not a model.\n")
    return index_repo(out)
