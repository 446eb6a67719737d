"""Is a render sound? `assert_sound(outputs)` checks each rendered file against its format's own reader.

For anyone who renders a spec and wants to know the files mean what they say (the render tests, the adversarial
corpus of issue 14): every YAML file parses to one document with each key once, every JSON file parses with each
key once, every shell script passes `bash -n`, and every env file (node.env, secrets.env, /etc/default/earlyoom) is
blank lines, `#` comments and NAME=value lines only, Open MPI's hostfile `HOST slots=N` lines, OpenSSH's client config
what `ssh -G` reads, and its server config `Keyword value` lines, and hy3spark's nftables script what `nft -c -f`
accepts (nft checks it against the kernel without applying it; on a machine without nft or without the right to ask
the kernel, it is checked by its shape: scripts/ensure-docker installs nftables for a full run). A file whose
format is not known fails: a new kind of file must say how it is checked.

    from soundness import assert_sound
    assert_sound(render_all(loaded))          # or a {path: content} mapping
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from hy3spark.render import Output

ENV_LINE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=[^\n\r\x00]*")
ENV_FILES = {"earlyoom"}  # /etc/default/earlyoom: systemd's EnvironmentFile= of earlyoom.service
# Open MPI's hostfile: `HOST slots=N` lines and `#` comments; a host is an IPv4 address (a fabric address) or localhost.
HOSTFILES = {"openmpi-hostfile"}
HOSTFILE_LINE = re.compile(r"(?:\d{1,3}(?:\.\d{1,3}){3}|localhost) slots=[1-9]\d*")
# OpenSSH's configs (the mpi launcher's): the client's is read by the real reader, `ssh -G -F FILE host`; the
# server's by its shape (no sshd here: the trtllm scenario's sshd reads it for real): `Keyword value` lines and `#`
# comments, one line each.
SSH_CONFIGS = {"ssh_config": "ssh", "sshd_config": "sshd"}
SSHD_LINE = re.compile(r"[A-Z][A-Za-z0-9]+ [^\s#][^\n\r\x00]*")
# The port table (templates/ports.txt.j2): one port or range a line, its bind address and who may reach it.
PORT_TABLES = {"ports.txt"}
# hy3spark's nftables script (templates/firewall.nft.j2): checked by `nft -c -f`, nft's own reader with the kernel.
NFT_SCRIPTS = {"firewall.nft"}
PORT_LINE = re.compile(r"\d{1,5}(?:-\d{1,5})?/tcp bind [0-9.:a-f]+ from (?:fabric|clients|loopback|ssh): [^\n\r\x00]+")


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader, except that a key given twice is an error (PyYAML lets the last one win)."""


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def file_format(path: str) -> str:
    name = PurePosixPath(path).name
    if name in ENV_FILES:
        return "env"
    if name in HOSTFILES:
        return "hostfile"
    if name in SSH_CONFIGS:
        return SSH_CONFIGS[name]
    if name in PORT_TABLES:
        return "ports"
    if name in NFT_SCRIPTS:
        return "nft"
    suffix = PurePosixPath(path).suffix
    formats = {".yml": "yaml", ".yaml": "yaml", ".json": "json", ".sh": "sh", ".env": "env", ".service": "systemd"}
    if suffix not in formats:
        raise AssertionError(f"{path}: no soundness check knows this file's format; add it to tests/soundness.py")
    return formats[suffix]


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"key(s) given twice: {twice}")
    return dict(pairs)


def _nft_problems(path: str, text: str) -> list[str]:
    nft = shutil.which("nft") or next((p for p in ("/usr/sbin/nft", "/sbin/nft") if os.access(p, os.X_OK)), None)
    if nft is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".nft") as f:
            f.write(text)
            f.flush()
            proc = subprocess.run([nft, "-c", "-f", f.name], capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            return []
        if "Operation not permitted" not in proc.stderr:
            return [f"{path}: nft -c: {proc.stderr.strip()}"]
    # No nft, or no CAP_NET_ADMIN to ask the kernel: the shape, one table of ours replaced in one transaction.
    head = [line for line in text.split("\n") if line.strip() and not line.startswith("#")][:3]
    found = [] if re.fullmatch(r"table inet (\w+)\ndelete table inet \1\ntable inet \1 \{", "\n".join(head)) else [
        f"{path}: does not start by replacing one table (table inet T / delete table inet T / table inet T {{)"]
    if text.count("{") != text.count("}"):
        found.append(f"{path}: unbalanced braces")
    return found


def _unit_problems(path: str, text: str) -> list[str]:
    """systemd's own reading of a unit (`systemd-analyze verify`): it exits 0 on a key it ignores, so every line
    it prints about the file counts."""
    name = PurePosixPath(path).name
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / name
        unit.write_text(text)
        proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if name in line]
    return [f"{path}: systemd-analyze verify: {line}" for line in said] or (
        [] if proc.returncode == 0 else [f"{path}: systemd-analyze verify exited {proc.returncode}"])


def problems(path: str, text: str) -> list[str]:
    """What is wrong with one rendered file, as `path: reason` lines (none for a sound file)."""
    fmt = file_format(path)
    if fmt == "yaml":
        try:
            docs = list(yaml.load_all(text, Loader=_UniqueKeyLoader))
        except yaml.YAMLError as exc:
            return [f"{path}: not YAML: {exc}"]
        return [] if len(docs) == 1 else [f"{path}: {len(docs)} YAML documents, one expected"]
    if fmt == "json":
        try:
            json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except ValueError as exc:
            return [f"{path}: not JSON: {exc}"]
        return []
    if fmt == "sh":
        proc = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, check=False)
        return [] if proc.returncode == 0 else [f"{path}: bash -n: {proc.stderr.strip()}"]
    if fmt == "ssh":
        with tempfile.NamedTemporaryFile("w", suffix=".ssh_config") as f:
            f.write(text)
            f.flush()
            proc = subprocess.run(["ssh", "-G", "-F", f.name, "node.invalid"], capture_output=True, text=True,
                                  check=False)
        return [] if proc.returncode == 0 else [f"{path}: ssh -G: {proc.stderr.strip()}"]
    if fmt == "sshd":
        return [f"{path}:{number}: not a `Keyword value` line: {line!r}"
                for number, line in enumerate(text.split("\n"), 1)
                if line.strip() and not line.startswith("#") and not SSHD_LINE.fullmatch(line)]
    if fmt == "ports":
        return [f"{path}:{number}: not a `PORT/tcp bind ADDR from REACH: what` line: {line!r}"
                for number, line in enumerate(text.split("\n"), 1)
                if line.strip() and not line.startswith("#") and not PORT_LINE.fullmatch(line)]
    if fmt == "nft":
        return _nft_problems(path, text)
    if fmt == "systemd":
        return _unit_problems(path, text)
    if fmt == "hostfile":
        return [f"{path}:{number}: not a `HOST slots=N` line: {line!r}"
                for number, line in enumerate(text.split("\n"), 1)
                if line.strip() and not line.startswith("#") and not HOSTFILE_LINE.fullmatch(line)]
    if "\r" in text or "\x00" in text:
        return [f"{path}: a carriage return or NUL in an env file"]
    found = []
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip() and not line.startswith("#") and not ENV_LINE.fullmatch(line):
            found.append(f"{path}:{number}: not a NAME=value line: {line!r}")
    return found


def assert_sound(outputs: Iterable[Output] | Mapping[str, str]) -> None:
    files = dict(outputs) if isinstance(outputs, Mapping) else {o.path: o.content for o in outputs}
    assert files, "nothing rendered"
    found = [p for path, text in sorted(files.items()) for p in problems(path, text)]
    assert not found, "unsound render:\n" + "\n".join(found)
