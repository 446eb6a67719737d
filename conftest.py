"""Repo-wide pytest hooks: in the full run (scripts/test sets HY3SPARK_STRICT_TESTS=1) a skip is a failure.

Tests that need Docker, root or the images skip when those are missing, which is right on a laptop and wrong in
the full run: there a green pytest step must mean every test ran. So a skip (in setup, in the test, or a whole
module at collection, e.g. `pytest.importorskip`) becomes a failure that keeps the skip's reason. Expected
failures (xfail) are left alone. `scripts/test --quick` sets it to 0 and lists the skips instead. This file sits at
the repo root so that every test tree (tests/, roles/*/tests/, the Molecule verifiers) gets it.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

STRICT = os.environ.get("HY3SPARK_STRICT_TESTS", "") == "1"


def _reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _as_failure(report: pytest.TestReport | pytest.CollectReport) -> None:
    report.outcome = "failed"
    report.longrepr = (
        f"could not run: {_reason(report.longrepr)}\n"
        "A skip is a failure in the full run (HY3SPARK_STRICT_TESTS=1): give this machine what the test needs "
        "(scripts/test installs Docker and builds the images), or run `scripts/test --quick`, which lists skips."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        _as_failure(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if STRICT and report.skipped:
        _as_failure(report)
