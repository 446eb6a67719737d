"""The command line both table generators share (make_kv_table.py, make_args_table.py): write the double's table
derived from a fixture, or with --check only compare and exit 1 when the shipped table is stale."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def main(doc: str, table: Path, make: Callable[[], str], script: str) -> int:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the table is stale")
    args = parser.parse_args()
    text = make()
    if args.check:
        if table.read_text() != text:
            print(f"{table} is stale: run {script}", file=sys.stderr)
            return 1
        return 0
    table.write_text(text)
    print(f"wrote {table}")
    return 0
