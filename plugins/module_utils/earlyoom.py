"""The arguments earlyoom runs with, read from its environment file the way systemd hands them over.

One parser for the two places that judge an earlyoom policy: the module hy3spark_earlyoom_info (on the node) and
the preflight filter preflight_earlyoom (on the controller). Both import it by its full name,
`ansible_collections.hy3spark.cluster.plugins.module_utils.earlyoom`: Ansible ships it with the module to the node
and resolves it for the filter through the collection loader. Plain Python, standard library only: it runs on a
node's system Python as well.

The unit reads /etc/default/earlyoom as an EnvironmentFile= and starts `earlyoom $EARLYOOM_ARGS`:
1. EnvironmentFile=: the last `EARLYOOM_ARGS=` line wins; a value opening with a quote runs to the closing quote (in
   double quotes a backslash escapes \\, ", ` and $); what follows, like an unquoted value, is kept as written,
   spaces and a `#` included, with backslash escapes resolved and trailing whitespace dropped;
2. ExecStart='s $EARLYOOM_ARGS: split at whitespace with quotes removed as a shell would, so `--prefer '(a|b)'`
   arrives as `(a|b)`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?EARLYOOM_ARGS=(.*)$")
UNBALANCED = "unbalanced quotes in EARLYOOM_ARGS"


def _read_value(raw: str) -> tuple[str, bool]:
    """(the value of one `KEY=value` line as EnvironmentFile= reads it, whether an opening quote was closed)."""
    text, value, i, closed = raw.lstrip(), "", 0, True
    if text[:1] in ("'", '"'):
        quote, i = text[0], 1
        while i < len(text) and text[i] != quote:
            if quote == '"' and text[i] == "\\" and text[i + 1:i + 2] in ('"', "\\", "`", "$"):
                i += 1
            value += text[i]
            i += 1
        closed = i < len(text)
        i += 1  # the closing quote
    return value + re.sub(r"\\(.)", r"\1", text[i:]).rstrip(), closed


def env_file_value(raw: str) -> str:
    """The value of one `KEY=value` line as systemd's EnvironmentFile= reads it (step 1 above)."""
    return _read_value(raw)[0]


def assignment(text: str) -> str | None:
    """The raw value of the file's last `EARLYOOM_ARGS=` line (the one that wins); None when it has none."""
    found = None
    for line in text.splitlines():
        m = ASSIGNMENT.match(line)
        if m:
            found = m.group(1)
    return found


def split_args(value: str) -> list[str]:
    """$EARLYOOM_ARGS as earlyoom receives it (step 2 above); unbalanced quotes split at whitespace only."""
    try:
        return shlex.split(value)
    except ValueError:
        return value.split()


def quoting_problem(raw: str) -> str | None:
    """UNBALANCED when a quote of the raw value never closes, in the file or in the value systemd splits."""
    value, closed = _read_value(raw)
    try:
        shlex.split(value)
    except ValueError:
        return UNBALANCED
    return None if closed else UNBALANCED


def file_args(text: str) -> list[str] | None:
    """The argv earlyoom gets from this environment file; None when the file sets no EARLYOOM_ARGS."""
    raw = assignment(text)
    return None if raw is None else split_args(env_file_value(raw))


def option(args: Sequence[str], name: str) -> str | None:
    """The last value of `--name X` / `--name=X`, as earlyoom's getopt_long reads it; None when absent."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found
