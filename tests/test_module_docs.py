"""Every module's DOCUMENTATION says what its argument_spec takes: the same options, each with only the keys
ansible-doc knows, and the same type, default and required. A comma or ': ' in a flow-style description quietly
turns its tail into a stray key (ansible-doc still renders it), which is how two modules' docs drifted before."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

MODULES = sorted((Path(__file__).resolve().parents[1] / "plugins" / "modules").glob("*.py"))
KEYS = {"description", "type", "required", "default", "elements", "choices", "no_log", "aliases", "suboptions"}


def _doc_and_spec(path: Path) -> tuple[dict, dict]:
    tree = ast.parse(path.read_text())
    doc = next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
               and getattr(n.targets[0], "id", "") == "DOCUMENTATION")
    spec = next(ast.literal_eval(n.value) for n in ast.walk(tree)
                if isinstance(n, ast.keyword) and n.arg == "argument_spec")
    return yaml.safe_load(doc), spec


def test_there_are_modules_to_check() -> None:
    assert len(MODULES) >= 4, MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_the_documentation_matches_the_argument_spec(path: Path) -> None:
    doc, spec = _doc_and_spec(path)
    options = doc["options"]
    assert sorted(options) == sorted(spec), "options documented vs taken"
    for name, option in options.items():
        assert set(option) <= KEYS, f"{name}: stray keys {sorted(set(option) - KEYS)} (a comma in a flow description?)"
        assert isinstance(option["description"], (str, list)) and option["description"], name
        taken = spec[name]
        assert option.get("type", "str") == taken.get("type", "str"), name
        assert option.get("required", False) == taken.get("required", False), name
        assert option.get("default") == taken.get("default"), name
        assert option.get("no_log", False) == taken.get("no_log", False), name
