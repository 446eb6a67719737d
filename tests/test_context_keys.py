"""The inventory context has one declared shape (hy3spark.context.Context), and everything reads inside it.

Two directions, so that neither side can drift alone:
- every built context, for the example specs and every profile, matches the declared types key for key;
- every `hy3spark.<a>.<b>` and `hy3spark_node.<a>` a template, role, playbook or Molecule file reads names a declared
  key (a typo or a key the context stopped deriving fails here, not halfway through a deployment).
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError
from test_render_invariants import CASES, NAMES
from typing_extensions import is_typeddict

from hy3spark import content
from hy3spark.context import Context, Group, NodeContext, build_context
from hy3spark.spec import load_spec, parse_spec

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yml"))


def check_shape(value: Any, hint: Any, where: str) -> list[str]:
    """Where `value` differs from `hint`: missing or undeclared keys of a TypedDict, or a value of another type."""
    if is_typeddict(hint):
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, declared {hint.__name__}"]
        hints = typing.get_type_hints(hint)
        problems = [f"{where}.{k}: missing" for k in hints if k not in value]
        problems += [f"{where}.{k}: not declared in {hint.__name__}" for k in value if k not in hints]
        for key in hints.keys() & value.keys():
            problems += check_shape(value[key], hints[key], f"{where}.{key}")
        return problems
    if typing.get_origin(hint) is dict and is_typeddict(typing.get_args(hint)[1]):
        return [p for k, v in value.items() for p in check_shape(v, typing.get_args(hint)[1], f"{where}[{k}]")]
    try:
        TypeAdapter(hint).validate_python(value, strict=True)
    except ValidationError as exc:
        return [f"{where}: {value!r} is not {hint}: {exc.errors()[0]['msg']}"]
    return []


@pytest.mark.parametrize("name", NAMES)
def test_built_context_matches_its_declared_type(name: str) -> None:
    # The render invariants' 30 specs: the default, the examples, the Molecule clusters and their variations (a
    # loopback host without a key, no mgmt address, a single node, ...), so optional values appear both set and not.
    ctx = build_context(parse_spec(CASES[name].text, name))
    assert check_shape(ctx, Context, "context") == []


def test_the_shape_check_fails_on_a_missing_an_extra_and_a_mistyped_key() -> None:
    ctx = build_context(load_spec(EXAMPLES[0]))
    group = ctx["hy3spark"]
    del group["serving"]["probe_url"]
    group["serving"]["surprise"] = 1
    group["node_count"] = "2"
    problems = check_shape(ctx, Context, "context")
    assert any(p.startswith("context.hy3spark.serving.probe_url: missing") for p in problems), problems
    assert any(p.startswith("context.hy3spark.serving.surprise: not declared") for p in problems), problems
    assert any(p.startswith("context.hy3spark.node_count: '2' is not") for p in problems), problems
    assert len(problems) == 3, problems


# `hy3spark.serving.port`, `hy3spark_node.container.name`, ... (a dotted read; subscripts are not reads of a key name)
READ = re.compile(r"\b(hy3spark_node|hy3spark)((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
# Not context reads: file names (group_vars/all/hy3spark.yml), the Python package in prose (hy3spark.spec), and the
# collection's full names (hy3spark.cluster.site, hy3spark.cluster.hy3spark_secret).
NOT_READS = {"yml", "j2", "json", "spec", "context", "cli", "nccl", "capacity", "planning", "render", "runner",
             "content", "engines", "bench", "drift", "profiles", "errors", "transport", "secrets_file"}


def collection_names() -> set[str]:
    root = content.root()
    names = {p.stem for p in (root / "playbooks").glob("*.yml")} | {p.name for p in (root / "roles").iterdir()}
    names |= {p.stem for p in (root / "plugins").glob("*/*.py")}
    # A filter file holds many filters: the names its filters() returns ("name": function).
    for path in (root / "plugins" / "filter").glob("*.py"):
        names |= set(re.findall(r'^\s+"(\w+)": \w+,$', path.read_text(), flags=re.MULTILINE))
    return names


def read_paths(text: str) -> list[tuple[str, list[str]]]:
    found = []
    for match in READ.finditer(text):
        segments = match.group(2).lstrip(".").split(".")
        if segments[0] in NOT_READS:
            continue
        found.append((match.group(1), segments))
    return found


def undeclared(var: str, segments: list[str], fqcn: set[str]) -> str | None:
    """Why this read names no declared key, or None when it does."""
    if var == "hy3spark" and segments[0] == "cluster" and len(segments) > 1:
        return None if segments[1] in fqcn else f"hy3spark.cluster.{segments[1]} names nothing in the collection"
    hint: Any = Group if var == "hy3spark" else NodeContext
    for i, seg in enumerate(segments):
        if typing.get_origin(hint) is typing.Union or isinstance(hint, types.UnionType):
            # An optional section (`hy3spark.fabric`: None without a fabric): its keys are read where it is set.
            section = [a for a in typing.get_args(hint) if is_typeddict(a)]
            hint = section[0] if section else hint
        if is_typeddict(hint):
            hints = typing.get_type_hints(hint)
            if seg not in hints:
                return f"{var}.{'.'.join(segments[:i + 1])}: {hint.__name__} declares no {seg!r}"
            hint = hints[seg]
            continue
        origin = typing.get_origin(hint) or hint
        if origin is dict or hint is Any:
            return None  # a key of a mapping, or a dict method: the type says nothing more
        base = {str: str, int: int, float: float, bool: bool, list: list}.get(origin)
        if base is None and typing.get_origin(hint) is typing.Union:
            base = next((a for a in typing.get_args(hint) if a is not type(None)), None)
        if base is not None and hasattr(base, seg):
            return None  # a method call such as .split or .index
        return f"{var}.{'.'.join(segments[:i + 1])}: {seg!r} read from a {hint}"
    return None


def sources() -> list[Path]:
    found = [*(REPO / "templates").glob("*.j2"), REPO / "site.yml", *(REPO / "playbooks").glob("*.yml")]
    for pattern in ("*.yml", "*.j2", "*.py"):
        found += (REPO / "roles").rglob(pattern)
        found += (REPO / "molecule").rglob(pattern)
    return sorted(p for p in found if ".rendered" not in p.parts and "tests" not in p.parts)


def test_every_read_of_the_context_names_a_declared_key() -> None:
    fqcn = collection_names()
    reads, problems = 0, []
    for path in sources():
        for var, segments in read_paths(path.read_text()):
            reads += 1
            why = undeclared(var, segments, fqcn)
            if why:
                problems.append(f"{path.relative_to(REPO)}: {why}")
    assert reads > 150, reads  # the scan sees the roles and templates (a wrong glob would find nothing)
    assert problems == []


@pytest.mark.parametrize(("text", "expected"), [
    ("{{ hy3spark.serving.port }}", None),
    ("{{ hy3spark.serving.prot }}", "hy3spark.serving.prot: Serving declares no 'prot'"),
    ("{{ hy3spark_node.container.nmae }}", "hy3spark_node.container.nmae: Container declares no 'nmae'"),
    ("{{ hy3spark.node_order.index(x) }}", None),
    ("{{ hy3spark.head.fabric_ip }}", "hy3spark.head.fabric_ip: 'fabric_ip' read from a <class 'str'>"),
    ("{{ hy3spark_node.env.NCCL_DEBUG }}", None),
    ("hy3spark.cluster.site", None),
    ("hy3spark.cluster.nosuch", "hy3spark.cluster.nosuch names nothing in the collection"),
])
def test_the_read_check_catches_a_misspelled_key(text: str, expected: str | None) -> None:
    [(var, segments)] = read_paths(text)
    assert undeclared(var, segments, collection_names()) == expected
