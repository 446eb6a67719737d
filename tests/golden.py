#!/usr/bin/env python3
"""Golden renders: every output of every example spec (one per profile) and of the embedded default, plus the
repo's `inventory/` (the embedded default's inventory, what `./hy3 render --out .` writes there).

A golden records what was rendered, not that it is right: tests/test_render_invariants.py checks that. So a golden
is never regenerated blindly. This script prints a unified diff of every file that would change, then:

    .venv/bin/python tests/golden.py            # on a terminal: asks "accept? [y/N]" before writing
    .venv/bin/python tests/golden.py --accept   # writes without asking (the diff is printed all the same)
    .venv/bin/python tests/golden.py --check    # writes nothing; exits 1 when anything differs

Read the diff like code before accepting it: a line that disappears from ray_non_carry_over_env_vars.json or a
node.env is a behaviour change on every cluster.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
sys.path.insert(0, str(REPO))

from hy3spark.render import render_all  # noqa: E402
from hy3spark.spec import load_spec  # noqa: E402

# The trees this script owns, relative to the repo: every file under them is rendered, or stale.
TREES = ("tests/golden", "inventory")


def cases() -> dict[str, Path | None]:
    found: dict[str, Path | None] = {"default": None}
    for path in sorted((REPO / "examples").glob("*.yml")):
        found[path.stem] = path
    return found


def portable(content: str) -> str:
    """Golden files must not depend on where the checkout lives (the spec's absolute path is in the inventory)."""
    return content.replace(str(REPO), "<repo>")


def expected() -> dict[str, str]:
    """Every file the goldens and inventory/ should hold, by path relative to the repo."""
    files: dict[str, str] = {}
    for name, spec in cases().items():
        for out in render_all(load_spec(spec)):
            files[f"tests/golden/{name}/{out.path}"] = portable(out.content)
    # The embedded default has no spec file, so its inventory holds no absolute path: written as rendered.
    for out in render_all(load_spec(None)):
        if out.kind == "inventory":
            files[out.path] = out.content
    return files


@dataclass(frozen=True)
class Change:
    path: str  # relative to the root
    old: str | None  # None: a new file
    new: str | None  # None: a stale file, removed

    def diff(self) -> str:
        source = "/dev/null" if self.old is None else f"a/{self.path}"
        target = "/dev/null" if self.new is None else f"b/{self.path}"
        lines = list(difflib.unified_diff((self.old or "").splitlines(keepends=True),
                                          (self.new or "").splitlines(keepends=True), fromfile=source, tofile=target))
        if not lines:  # an empty file created or removed: difflib has no hunk to show
            lines = [f"--- {source}\n", f"+++ {target}\n"]
        return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def changes(root: Path = REPO, want: dict[str, str] | None = None, trees: tuple[str, ...] = TREES) -> list[Change]:
    """What writing `want` (default: every golden) under `root` would change in `trees`: edited, new and stale
    files, in path order."""
    want = expected() if want is None else want
    want = {p: c for p, c in want.items() if p.startswith(tuple(f"{t}/" for t in trees))}
    have: dict[str, str] = {}
    for tree in trees:
        for file in (root / tree).rglob("*"):
            if file.is_file():
                have[file.relative_to(root).as_posix()] = file.read_text()
    found = [Change(p, have.get(p), want[p]) for p in want if have.get(p) != want[p]]
    found += [Change(p, have[p], None) for p in have if p not in want]
    return sorted(found, key=lambda c: c.path)


def apply(found: list[Change], root: Path = REPO) -> None:
    for change in found:
        target = root / change.path
        if change.new is None:
            target.unlink()
            for parent in target.parents:
                if parent == root or any(parent.iterdir()):
                    break
                parent.rmdir()
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(change.new)


def summary(found: list[Change]) -> str:
    new = sum(c.old is None for c in found)
    gone = sum(c.new is None for c in found)
    return f"{len(found)} file(s) differ: {len(found) - new - gone} changed, {new} new, {gone} stale"


def main(argv: list[str] | None = None, root: Path = REPO, stdin: TextIO | None = None,
         out: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="print the diff and exit 1 if anything differs")
    mode.add_argument("--accept", action="store_true", help="write the changes without asking (after the diff)")
    args = parser.parse_args(argv)
    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if out is None else out

    found = changes(root)
    if not found:
        print(f"goldens and inventory/ match the render ({', '.join(TREES)})", file=out)
        return 0
    for change in found:
        out.write(change.diff())
    print(summary(found), file=out)
    if args.check:
        print("review the diff, then run tests/golden.py to accept it", file=out)
        return 1
    if not args.accept:
        if not stdin.isatty():
            print("not written: no terminal to ask on; review the diff above, then run tests/golden.py --accept",
                  file=out)
            return 1
        print("accept? [y/N] ", end="", file=out, flush=True)
        if stdin.readline().strip().lower() not in ("y", "yes"):
            print("not written", file=out)
            return 1
    apply(found, root)
    print(f"wrote {len(found)} file(s)", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
