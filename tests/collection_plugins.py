"""The collection's plugins imported by full name, as Ansible imports them: the checkout's link
collections/ansible_collections/hy3spark/cluster -> the repo makes `ansible_collections.hy3spark.cluster` importable,
so a plugin's own `from ansible_collections.hy3spark.cluster.plugins.module_utils...` imports resolve as in a run."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
COLLECTIONS = REPO / "collections"
PREFIX = "ansible_collections.hy3spark.cluster.plugins"


def plugin(kind: str, name: str) -> ModuleType:
    """`plugin("lookup", "hy3spark_state")`: plugins/<kind>/<name>.py of the collection."""
    if str(COLLECTIONS) not in sys.path:
        sys.path.insert(0, str(COLLECTIONS))
    return importlib.import_module(f"{PREFIX}.{kind}.{name}")
