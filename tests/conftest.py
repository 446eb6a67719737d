from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from hy3spark.cli import main

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    """Run the real CLI entry point in-process (the subprocess path is covered in test_cli.py)."""

    def run(*argv: str) -> Result:
        code = main(list(argv))
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


# The files that spend minutes on containers go first: under pytest-xdist (scripts/test: --dist loadfile) each starts
# at once on its own worker and the quick files fill the other workers meanwhile, instead of one of them starting
# last and running alone at the end. Without xdist the order changes nothing a test may depend on (each file keeps
# its own order).
SLOW_FIRST = ("test_operator_cli.py", "test_bench.py", "test_engine_double.py", "test_trtllm_double.py",
              "test_bench_trtllm.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the files keep their order among themselves, and each file its tests
