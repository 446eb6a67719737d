"""Golden renders: every output of every example spec (one per profile) and of the embedded default.

Regenerate after a deliberate change, then review the diff like code:
    .venv/bin/python tests/golden.py
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
sys.path.insert(0, str(REPO))

from hy3spark.render import render_all  # noqa: E402
from hy3spark.spec import load_spec  # noqa: E402


def cases() -> dict[str, Path | None]:
    found: dict[str, Path | None] = {"default": None}
    for path in sorted((REPO / "examples").glob("*.yml")):
        found[path.stem] = path
    return found


def portable(content: str) -> str:
    """Golden files must not depend on where the checkout lives (the spec's absolute path is in the inventory)."""
    return content.replace(str(REPO), "<repo>")


def main() -> None:
    for name, spec in cases().items():
        target = GOLDEN / name
        shutil.rmtree(target, ignore_errors=True)
        for out in render_all(load_spec(spec)):
            file = target / out.path
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(portable(out.content))
        print(f"wrote {target.relative_to(REPO)}")


if __name__ == "__main__":
    main()
