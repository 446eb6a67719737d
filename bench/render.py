"""Benchmark (not a test): median wall time of `python -m hy3spark render` on the embedded default spec.

Goal: under 0.5 s on a 2-core CI machine. Each run is a fresh interpreter, as a user would start it.
    .venv/bin/python bench/render.py [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--goal", type=float, default=0.5, help="seconds; exit 1 when the median is above it")
    args = parser.parse_args()
    commands = {
        "render (preview)": [sys.executable, "-m", "hy3spark", "render"],
        "validate": [sys.executable, "-m", "hy3spark", "validate"],
        "--help": [sys.executable, "-m", "hy3spark", "--help"],
    }
    worst = 0.0
    for label, cmd in commands.items():
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        worst = max(worst, median)
        print(f"{label:18s} median {median * 1000:6.0f} ms  min {min(times) * 1000:5.0f} ms  "
              f"max {max(times) * 1000:5.0f} ms  ({args.runs} runs)")
    print(f"goal: median under {args.goal * 1000:.0f} ms: {'met' if worst < args.goal else 'NOT met'}")
    return 0 if worst < args.goal else 1


if __name__ == "__main__":
    sys.exit(main())
