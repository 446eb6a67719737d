#!/usr/bin/env python3
"""Summarise a pytest JUnit report for scripts/test: counts, and every skipped test with its reason.

Usage: junit_summary.py [--require-run] LABEL REPORT.xml

Prints `LABEL: N run, N failed, N skipped` and one line per skipped test (`  skipped: test id: reason`).
With --require-run (the Molecule verifiers) it exits 1 when the report is missing, when no test ran, or when any
test was skipped: Molecule's testinfra verifier passes a scenario whose tests/ holds no test file.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(argv: list[str]) -> int:
    require_run = "--require-run" in argv
    args = [a for a in argv if a != "--require-run"]
    if len(args) != 2 or args[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    label, path = args[0], Path(args[1])
    if not path.is_file():
        print(f"{label}: no JUnit report at {path}: the tests did not run", file=sys.stderr)
        return 1
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    total = failed = 0
    skipped: list[str] = []
    for case in cases:
        total += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        skip = case.find("skipped")
        if skip is not None and skip.get("type") == "pytest.xfail":
            continue  # an expected failure that failed: a result, not a skip
        if skip is not None:
            skipped.append(f"  skipped: {name}: {skip.get('message', '').strip()}")
    ran = total - len(skipped)
    print(f"{label}: {ran} run, {failed} failed, {len(skipped)} skipped")
    for line in skipped:
        print(line)
    if require_run and ran == 0:
        print(f"{label}: no test ran: a scenario must verify something (tests/test_*.py)", file=sys.stderr)
        return 1
    if require_run and skipped:
        print(f"{label}: {len(skipped)} test(s) skipped: a skip is not a pass", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
