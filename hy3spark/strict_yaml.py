"""The strict YAML loader behind every cluster spec: plain data only, each key once, a line for every field.

A spec is copied between people, so it is read as untrusted text. PyYAML's SafeLoader builds no arbitrary objects, but
it still lets the last of two equal keys win without a word, expands anchors and aliases (a few hundred bytes of
aliases expand to gigabytes), builds bytes from `!!binary`, dates from date-looking text and sets from `!!set`. This
loader builds its values from the parser's events instead of a composed node graph, so it refuses each of those at
the event that brings it, before reading further, and records the line of every mapping key and sequence item as it
goes (no second walk that could expand aliases).

What it accepts: one document of at most MAX_VALUES mappings, sequences and scalars, nested at most MAX_DEPTH deep;
scalars resolved as SafeLoader resolves them (null, true/false, int, float, text), except that a date-looking plain
scalar stays the text written; finite floats only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import ScalarNode
from yaml.resolver import Resolver

MAX_BYTES = 1024 * 1024  # a real spec is a few kilobytes
MAX_DEPTH = 20  # a real spec nests four levels deep; the limit keeps every recursive walk after this one safe
# A real spec has a few hundred values. The limit bounds the work of every step after the loader (the secret and
# Jinja walks, the profile merge, pydantic, rendering) by the count of values, which 1 MiB alone does not: 1 MiB of
# short env entries is 140,000 values and took about 2 s to validate.
MAX_VALUES = 10_000

Path = tuple[str | int, ...]

# libyaml parses a 1 MiB spec in about 0.1 s, PyYAML's own parser in about 2 s: use it where the wheel has it.
_Parser = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader
_RESOLVER = Resolver()
_CONSTRUCTOR = SafeConstructor()
_YAML_TAG = "tag:yaml.org,2002:"
# SafeConstructor's builders for the implicit scalar types kept; timestamps are left out on purpose.
_BUILD = {
    f"{_YAML_TAG}null": _CONSTRUCTOR.construct_yaml_null,
    f"{_YAML_TAG}bool": _CONSTRUCTOR.construct_yaml_bool,
    f"{_YAML_TAG}int": _CONSTRUCTOR.construct_yaml_int,
    f"{_YAML_TAG}float": _CONSTRUCTOR.construct_yaml_float,
}
_MERGE = f"{_YAML_TAG}merge"
_KIND = {type(None): "null", bool: "boolean", int: "number", float: "number"}


class StrictYAMLError(Exception):
    """A refusal: the 1-based line (None for the whole file), the field path, the message."""

    def __init__(self, line: int | None, path: Path | None, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.path = path
        self.message = message


@dataclass
class _Frame:
    value: dict[Any, Any] | list[Any]
    path: Path
    key_lines: dict[Any, int]  # mapping: the line of each key seen so far, for the duplicate message
    key: Any = None
    has_key: bool = False  # mapping: a key was read and waits for its value


def _short_tag(tag: str) -> str:
    return f"!!{tag.removeprefix(_YAML_TAG)}" if tag.startswith(_YAML_TAG) else tag


def _scalar(event: yaml.ScalarEvent, path: Path, line: int, is_key: bool) -> Any:
    if not event.implicit[0]:  # quoted or block text: always a string
        return event.value
    tag = _RESOLVER.resolve(ScalarNode, event.value, (True, False))
    if tag == _MERGE and is_key:
        raise StrictYAMLError(line, path, "merge keys (<<) are not accepted: write the fields out in full")
    build = _BUILD.get(tag)
    if build is None:  # text, a date-looking scalar, `=`
        return event.value
    try:
        value = build(ScalarNode(tag, event.value))
    except ValueError:  # an integer of thousands of digits (Python's int-from-text limit)
        raise StrictYAMLError(line, path, f"{event.value[:20]}... is not a number hy3spark can read") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise StrictYAMLError(line, path, f"{event.value} is not a finite number; write a finite number")
    return value


def _yaml_error(exc: yaml.YAMLError, text: str, path: Path | None) -> StrictYAMLError:
    """The parser's complaint with its line and the field it was reading (`path`: the deepest one open then)."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        problem = getattr(exc, "problem", None) or str(exc)
        context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and context_mark is not None and context_mark.line != mark.line:
            problem += f" ({context} that starts at line {context_mark.line + 1})"  # where an indentation slip began
        bad_line = text.split("\n")[mark.line] if mark.line < text.count("\n") + 1 else ""
        if "\t" in bad_line[: len(bad_line) - len(bad_line.lstrip(" \t")) + 1]:
            problem += "; YAML indents with spaces only: replace the tab at the start of the line with spaces"
        return StrictYAMLError(mark.line + 1, path or None, f"malformed YAML: {problem}")
    if isinstance(exc, yaml.reader.ReaderError):  # a control character: the reader knows its position only (it reads
        # ahead of the parser, so the field open then is not the one that holds it)
        line = text.count("\n", 0, exc.position) + 1
        return StrictYAMLError(line, None, f"malformed YAML: character #x{exc.character:04x} is not allowed "
                                                   "in YAML text (control characters are refused)")
    return StrictYAMLError(None, path or None, f"malformed YAML: {exc}")


def _open_path(stack: list[_Frame]) -> Path:
    """The field being read when the parser stopped: the innermost open mapping's pending key, or the list's next
    item."""
    if not stack:
        return ()
    top = stack[-1]
    if isinstance(top.value, list):
        return (*top.path, len(top.value))
    return (*top.path, str(top.key)) if top.has_key else top.path


def load(text: str) -> tuple[Any, dict[Path, int]]:
    """Parse one spec document. Returns the data and the line of every field path; raises StrictYAMLError."""
    size = len(text.encode("utf-8", "surrogatepass")) if len(text) * 4 > MAX_BYTES else len(text)
    if size > MAX_BYTES:
        raise StrictYAMLError(None, None, too_big_message(size))
    lines: dict[Path, int] = {}
    stack: list[_Frame] = []
    root: Any = None
    documents = values = 0
    try:
        for event in yaml.parse(text, Loader=_Parser):
            if isinstance(event, yaml.DocumentStartEvent):
                documents += 1
                if documents > 1:
                    raise StrictYAMLError(event.start_mark.line + 1, None, "a second YAML document (---): the spec "
                                                                           "is one document")
                continue
            if not isinstance(event, yaml.NodeEvent | yaml.CollectionEndEvent):
                continue  # stream start and end, document end
            line = event.start_mark.line + 1
            if isinstance(event, yaml.CollectionEndEvent):
                done = stack.pop()
                value = done.value
                is_key = False
            else:
                parent = stack[-1] if stack else None
                is_key = parent is not None and isinstance(parent.value, dict) and not parent.has_key
                if parent is None:
                    path: Path = ()
                elif isinstance(parent.value, list):
                    path = (*parent.path, len(parent.value))
                elif is_key:
                    path = parent.path  # a key's own path is known once it is read
                else:
                    path = (*parent.path, str(parent.key))
                if isinstance(event, yaml.AliasEvent) or event.anchor is not None:
                    raise StrictYAMLError(line, path, f"YAML anchors and aliases (&{event.anchor}, *{event.anchor}) "
                                                      "are not accepted: write each value out in full")
                if event.tag is not None:
                    raise StrictYAMLError(line, path, f"the YAML tag {_short_tag(event.tag)} is not accepted: the "
                                                      "spec takes plain text, numbers, true/false, lists and mappings "
                                                      "(quote a value to keep it as text)")
                values += 1
                if values > MAX_VALUES:
                    raise StrictYAMLError(line, path, f"the spec holds more than {MAX_VALUES:,} values (keys, "
                                                      "items and scalars); a cluster spec has a few hundred")
                if not is_key:
                    lines.setdefault(path, line)
                if isinstance(event, yaml.ScalarEvent):
                    value = _scalar(event, path, line, is_key)
                else:
                    if is_key:
                        raise StrictYAMLError(line, path, "a mapping key must be a plain value, not a list or a "
                                                          "mapping")
                    if len(path) >= MAX_DEPTH:
                        raise StrictYAMLError(line, path, f"nested more than {MAX_DEPTH} levels deep; a cluster spec "
                                                          "is a few levels deep")
                    container: dict[Any, Any] | list[Any] = {} if isinstance(event, yaml.MappingStartEvent) else []
                    stack.append(_Frame(container, path, {}))
                    continue
            if not stack:
                root = value
                continue
            parent = stack[-1]
            if isinstance(parent.value, list):
                parent.value.append(value)
            elif not parent.has_key:
                key_path = (*parent.path, str(value))
                if not isinstance(value, str):
                    shown = event.value or "(empty)"  # the key's scalar event: the text as written
                    raise StrictYAMLError(line, parent.path,
                                          f"the key {shown} is read by YAML as a {_KIND[type(value)]}, not a name: "
                                          "every key in a spec is a field, node or variable name (quote it if "
                                          "it is meant as text)")
                first = parent.key_lines.get(value)
                if first is not None:
                    raise StrictYAMLError(line, key_path, f"duplicate key (first at line {first}); YAML would "
                                                          "silently keep the last one: write the key once")
                parent.key_lines[value] = line
                lines[key_path] = line
                parent.key, parent.has_key = value, True
            else:
                parent.value[parent.key] = value
                parent.has_key = False
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, text, _open_path(stack)) from None
    return root, lines


def too_big_message(size: int | None) -> str:
    said = "more than 1 MiB" if size is None else f"{size:,} bytes"
    return f"the spec is {said}; the limit is 1 MiB ({MAX_BYTES:,} bytes), and a cluster spec is a few kilobytes"
