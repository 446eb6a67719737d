"""Serialisers for the text formats the templates write where no standard filter fits: env files, comments and
nftables scripts.

Every value a template emits goes through a serialiser for its file's format (tests/test_template_serialisers.py
walks the templates and fails on one that does not): YAML and JSON through `to_json`/`to_nice_yaml`/`to_nice_json`,
shell words through `quote`, and these:

    env_key(name)                  an environment variable name, [A-Za-z_][A-Za-z0-9_]*, returned as it is
    env_value(value, key, quoted)  an env file value on one line, returned as it is; `quoted=true` wraps it in
                                   double quotes (systemd's EnvironmentFile=, /etc/default/earlyoom) and refuses
                                   the characters that would end or escape inside them: ", \\ and `
    one_line(value, what)          text for a comment, which only a line break can end
    nft_address(value, what)       an IP address or network (CIDR) in an nftables script, in its canonical form
    nft_name(value, what)          a name in an nftables script (a table, an interface inside "..."): letters,
                                   digits, '_', '.', '-' only, so it can neither end nft's quotes (which have no
                                   escapes), nor be a wildcard (a trailing '*'), nor start a new statement
    systemd_word(value, what)      one word of a systemd unit file's setting (an Exec*= argument, a Description=
                                   word): letters, digits and _ . , : / @ + = - only, so systemd neither splits it,
                                   nor unquotes or unescapes it, nor expands a $VARIABLE or a %specifier in it

They never escape: a value that cannot be written safely is refused with an error naming its key, so a file that
means something other than the spec is never written. The same templates are rendered by `hy3spark render`
(hy3spark/render.py loads this file and registers these filters under the same full names) and by the roles
through Ansible, which finds them as hy3spark.cluster.env_value and so on.

Plain Python, standard library only: hy3spark's render loads it without Ansible.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Every character some reader of these files takes as the end of a line: docker's --env-file and bash (\n),
# systemd's EnvironmentFile= (\n, \r), YAML (\n, \r, and in YAML 1.1 \x85, \u2028, \u2029), Python's splitlines
# (the rest). NUL ends a C string: systemd and bash would cut the value there.
LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029\x00"
# nft's names: a table, a chain, an interface name (the kernel's dev_valid_name is wider; the spec's netdev grammar
# is this). Not starting with '-' or '.', so never an option or a number's tail.
NFT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# Inside EnvironmentFile='s double quotes a backslash escapes ", \, ` and $; " ends the value.
IN_DOUBLE_QUOTES = '"\\`'
# What systemd reads literally in a unit file's words: no blank, quote, backslash, '$' (variables in Exec*=), '%'
# (specifiers), ';' (a command separator in ExecStart=) or '#'; not starting with one of Exec*='s prefixes (-@:+!).
SYSTEMD_WORD = re.compile(r"[A-Za-z0-9_./][A-Za-z0-9_.,:/@+=-]*")


class UnsafeValue(ValueError):
    """A value that would change the structure of the file it is written into."""


def _text(value: Any, what: str) -> str:
    if isinstance(value, bool) or value is None or not isinstance(value, (str, int, float)):
        raise UnsafeValue(f"{what}: {type(value).__name__} is not text; only a string or a number is written here")
    text = str(value)
    found = sorted({repr(c) for c in text if c in LINE_BREAKS})
    if found:
        raise UnsafeValue(f"{what}: the value holds {', '.join(found)}, which would start a new line in the "
                          "rendered file; a value must be one line")
    return text


def env_key(name: Any) -> str:
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
        raise UnsafeValue(f"environment variable name {name!r} is not [A-Za-z_][A-Za-z0-9_]*; an env file line "
                          "is NAME=value")
    return name


def env_value(value: Any, key: str, quoted: bool = False) -> str:
    text = _text(value, str(key))
    if not quoted:
        return text
    found = sorted({c for c in text if c in IN_DOUBLE_QUOTES})
    if found:
        raise UnsafeValue(f"{key}: the value holds {' '.join(found)}, which would end or escape its double quotes "
                          "in the rendered file")
    return f'"{text}"'


def one_line(value: Any, what: str = "comment") -> str:
    return _text(value, what)


def nft_address(value: Any, what: str = "address") -> str:
    text = _text(value, what)
    try:
        return str(ipaddress.ip_network(text, strict=True)) if "/" in text else str(ipaddress.ip_address(text))
    except ValueError:
        raise UnsafeValue(f"{what}: {text!r} is not an IP address or network; an nftables set holds only those") \
            from None


def _word(value: Any, what: str, grammar: re.Pattern[str], reader: str) -> str:
    text = _text(value, what)
    if not grammar.fullmatch(text):
        raise UnsafeValue(f"{what}: {text!r} is not {reader}")
    return text


def nft_name(value: Any, what: str = "name") -> str:
    return _word(value, what, NFT_NAME, "a name nftables reads as one (letters, digits, '_', '.', '-'; not starting "
                                         "with '-' or '.')")


def systemd_word(value: Any, what: str = "word") -> str:
    return _word(value, what, SYSTEMD_WORD, "one word systemd reads literally (letters, digits and _ . , : / @ + = - "
                                            "only, not starting with one of - @ : + ! = ,)")


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "env_key": env_key,
            "env_value": env_value,
            "one_line": one_line,
            "nft_address": nft_address,
            "nft_name": nft_name,
            "systemd_word": systemd_word,
        }
