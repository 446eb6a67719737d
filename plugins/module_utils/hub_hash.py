"""The hashes the Hugging Face Hub publishes for a file, computed one way for every module that checks a model.

`ansible_collections.hy3spark.cluster.plugins.module_utils.hub_hash`: Ansible ships it with the module to the node.
The hub's tree listing gives an LFS file's sha256 (`lfs.oid`) and any other file's git blob sha1 (`oid`: sha1 of
`blob <size>\\0` then the bytes). hy3spark_model_files verifies a copy with it; hy3spark_model_pipeline verifies
each download as it lands.
"""

from __future__ import annotations

import hashlib
import os

CHUNK = 8 << 20


def file_digest(path, kind):
    """The hex digest of `path` of the given kind: "sha256" or "git_sha1"."""
    if kind == "sha256":
        digest = hashlib.sha256()
    elif kind == "git_sha1":
        digest = hashlib.sha1(b"blob %d\0" % os.stat(path).st_size)
    else:
        raise ValueError(f"unknown hub hash kind {kind!r} (sha256 or git_sha1)")
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def matches_listing(path, entry):
    """True when `path` holds what the listing's `entry` says: its sha256, else its git blob sha1, else (neither
    published) its size."""
    for kind in ("sha256", "git_sha1"):
        if entry.get(kind):
            return file_digest(path, kind) == entry[kind]
    return os.stat(path).st_size == entry["size"]
