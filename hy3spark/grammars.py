"""The grammars of the spec's strings: every value that lands in a file or on a command line is one of these.

Each check returns the value (perhaps normalised) or raises ValueError with what the value must look like; spec.py
attaches them to the fields, and pydantic's error carries the field path (README, "Validation", names every rule).
Regular expressions use fullmatch: `$` would let a trailing newline through.
"""

from __future__ import annotations

import ipaddress
import re

import yaml

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_NODE_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_POSIX_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_REF = re.compile(r"[A-Z_][A-Z0-9_]*")
_NETDEV = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,14}")
_PATH_PART = re.compile(r"[A-Za-z0-9_+@][A-Za-z0-9_.+@-]*|\.[A-Za-z0-9_+@-][A-Za-z0-9_.+@-]*")
_IDENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_HF_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")
SHA = re.compile(r"[0-9a-f]{40}")
_VERSION = re.compile(r"[0-9]+(?:\.[0-9]+)*(?:[.+-]?[A-Za-z0-9]+)*")
# The OCI distribution reference grammar (github.com/distribution/reference, regexp.go), with the tag required: the
# digest is a field of its own (image.digest).
_ALNUM = r"[a-z0-9]+"
_PATH_COMPONENT = rf"{_ALNUM}(?:(?:[._]|__|-+){_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_IMAGE_REF = re.compile(rf"(?P<name>(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*):"
                        r"(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})")
# Characters that break EARLYOOM_ARGS="..." (systemd's EnvironmentFile= quoting) or the split into words.
_EARLYOOM_UNSAFE = re.compile(r"[\s\"'`\\\x00-\x1f\x7f]")


# YAML 1.1 and Python's splitlines also break lines at NEL and the Unicode separators (the render's filters refuse
# them: plugins/filter/serialisers.py LINE_BREAKS), so validation refuses them too rather than pass them to render.
_UNICODE_BREAKS = "\x85\u2028\u2029"


def _control(value: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F or c in _UNICODE_BREAKS for c in value)


def plain_yaml(value: str, what: str) -> str:
    """The inventory writes names and connection values as plain YAML scalars: YAML must read them back as the
    same string (`no` is false, `123` a number, `2024-01-01` a date, `null` nothing)."""
    try:
        back = yaml.safe_load(value)
    except yaml.YAMLError:
        back = None
    if back != value or not isinstance(back, str):
        raise ValueError(f"YAML reads it as {type(back).__name__} {back!r}, not as this string, so the inventory "
                         f"would get another {what}; choose one that is plainly a word")
    return value


def node_name(value: str) -> str:
    """A host name label (RFC 1123): it names the Ansible host, the node's files and its containers."""
    if not _NODE_NAME.fullmatch(value):
        raise ValueError("is not a host name label (RFC 1123: 1-63 lower-case letters, digits and '-', "
                         "not starting or ending with '-')")
    return plain_yaml(value, "host name")


def ssh_host(value: str) -> str:
    """An IP address (v4 or v6) or a host name: what Ansible's ssh connects to."""
    try:
        ipaddress.ip_address(value)
        return plain_yaml(value, "address")
    except ValueError as exc:
        if "YAML" in str(exc):
            raise
    host = value.rstrip(".")
    if (not _HOSTNAME.fullmatch(value) or len(host) > 253
            or all(label.isdigit() for label in host.split("."))):
        raise ValueError("is neither an IP address nor a host name (RFC 1123 labels of letters, digits "
                         "and '-' joined by dots)")
    return plain_yaml(value, "address")


def posix_user(value: str) -> str:
    if not _POSIX_USER.fullmatch(value):
        raise ValueError("is not a POSIX user name (1-32 letters, digits, '_', '.', '-'; not starting "
                         "with '-', '.' or a digit)")
    return plain_yaml(value, "user name")


def env_name(value: str) -> str:
    if not ENV_NAME.fullmatch(value):
        raise ValueError("is not a valid environment variable name (letters, digits and '_', not "
                         "starting with a digit)")
    return value


def env_value(value: str) -> str:
    """A line of an env file: one line, so no newline, carriage return, NUL or other control character."""
    if _control(value.replace("\t", "")):
        raise ValueError("holds a newline, NUL or other control character; an env file value is one line")
    return value


def netdev(value: str) -> str:
    """A Linux network device name (the kernel's dev_valid_name, and no option-like leading '-')."""
    if value in (".", "..") or not _NETDEV.fullmatch(value):
        raise ValueError("is not a network device name (1-15 letters, digits, '_', '.', '-'; not starting "
                         "with '-' or '.'; no '/', ':' or spaces)")
    return value


def abs_path(value: str) -> str:
    """An absolute, normalised path: '/' and components of letters, digits and `._+@-`; no '.', '..', '//', spaces,
    ':' (docker's volume separator) or control characters. A trailing '/' is dropped."""
    path = value.rstrip("/") if len(value) > 1 else value
    parts = path.split("/")
    if not value.startswith("/") or path == "" or path == "/":
        raise ValueError("must be an absolute path below / (for example /var/lib/hy3spark/hub)")
    bad = [p for p in parts[1:] if p in (".", "..") or not _PATH_PART.fullmatch(p)]
    if bad or len(path) > 1024:
        raise ValueError("is not a normalised absolute path: no '.', '..' or empty components, and only "
                         "letters, digits and ._+@- in each (for example /var/lib/hy3spark/hub)")
    return path


def image_ref(value: str) -> str:
    match = _IMAGE_REF.fullmatch(value) if len(value) <= 512 else None
    first = value.split("/", 1)[0] if "/" in value else ""
    # As docker reads it: the first component is a registry only with a '.', a ':' or as localhost; else it is a
    # path component, which is lower case.
    registry = "." in first or ":" in first or first == "localhost"
    if match is None or len(match["name"]) > 255 or (first and not registry and first != first.lower()):
        raise ValueError("is not an OCI image reference name:tag (for example "
                         "ghcr.io/org/engine:v1.2; lower-case path components, the digest goes in image.digest)")
    return value


def hf_repo(value: str) -> str:
    parts = value.split("/")
    if len(parts) != 2 or not all(_HF_PART.fullmatch(p) for p in parts) or "--" in value or ".." in value:
        raise ValueError("is not a Hugging Face repo id org/name (letters, digits, '_', '.', '-'; no "
                         "'--' or '..'; up to 96 characters each)")
    return value


def git_revision(value: str) -> str:
    """A 40-hex commit, or a branch or tag name by `git check-ref-format --allow-onelevel` (a warning says it moves)."""
    if SHA.fullmatch(value):
        return value
    parts = value.split("/")
    bad = (
        not value or len(value) > 255 or value.startswith(("-", "/")) or value.endswith(("/", "."))
        or ".." in value or "//" in value or "@{" in value or value == "@"
        or any(c in value for c in " ~^:?*[\\") or _control(value)
        or any(p.startswith(".") or p.endswith(".lock") for p in parts)
    )
    if bad:
        raise ValueError("is neither a 40-character commit sha nor a branch or tag name (git "
                         "check-ref-format: no '..', spaces, ~^:?*[\\, no leading '-' or '.')")
    return value


def ident(value: str) -> str:
    """A name vLLM, Pi or Ray looks up (parser names, providers): letters, digits, `_.-`, not starting with '-'."""
    if not _IDENT.fullmatch(value):
        raise ValueError("is not a name (1-128 letters, digits, '_', '.', '-'; not starting with '-' "
                         "or '.')")
    return value


def text(value: str) -> str:
    """Free text shown to people (labels): one line, no control characters."""
    if _control(value) or len(value) > 256:
        raise ValueError("must be one line of at most 256 characters, without control characters")
    return value


def version(value: str) -> str:
    if not _VERSION.fullmatch(value) or len(value) > 64:
        raise ValueError("is not a version (for example 2.60.0)")
    return value


def earlyoom_pattern(value: str) -> str:
    """A pattern earlyoom compiles (POSIX extended regex) inside EARLYOOM_ARGS="--prefer ^(a|b)$": no whitespace,
    quotes, backslash or control characters, no Python-only `(?` syntax, and it must compile."""
    if not value or len(value) > 128:
        raise ValueError("must be a non-empty pattern of at most 128 characters")
    if _EARLYOOM_UNSAFE.search(value):
        raise ValueError("holds whitespace, a quote, a backslash or a control character, which would "
                         "break the quoting of EARLYOOM_ARGS; write the pattern without them")
    if "(?" in value:
        raise ValueError("uses Python-only regex syntax '(?'; earlyoom reads POSIX extended regexes")
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"is not a valid regular expression: {exc}") from None
    return value
