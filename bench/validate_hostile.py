"""Benchmark (not a test): wall time of `python -m hy3spark validate` on hostile and oversized specs.

Goal: under 1 s for every case, refused or accepted, on a 2-core CI machine. Each CLI run is a fresh interpreter, as
a user would start it, so its numbers include Python's start-up and imports (the first row, the plain example, is
that baseline) and swing with the machine's load; the `load_spec` column is the same validation in this process,
imports done: the spec's own cost. It asserts nothing and exits 0: it reports medians, the exit code and the first
line of what validate said.
    .venv/bin/python bench/validate_hostile.py [--runs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = (REPO / "examples" / "hy3-two-spark.yml").read_text()
MIB = 1024 * 1024


def _serving(extra: str) -> str:
    return EXAMPLE.replace("  api_key_env: VLLM_API_KEY ", f"{extra}\n  api_key_env: VLLM_API_KEY ")


def _bomb(levels: int) -> str:
    lines = ["b0: &b0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 9)}]" for i in range(1, levels)]
    return EXAMPLE + "\n".join(lines) + "\n"


def _padded(text: str, size: int) -> bytes:
    data = text.encode()
    return data + b"#" + b"x" * (size - len(data) - 2) + b"\n"


def _env_entries(size: int | None = None, count: int = 0) -> str:
    """container.env with `count` short entries, or as many as fit under `size` bytes: the most values per byte."""
    head = EXAMPLE + "container:\n  env:\n"
    entry = "    K{:06d}: v\n"
    if size is not None:
        count = (size - len(head.encode())) // len(entry.format(0))
    return head + "".join(entry.format(i) for i in range(count))


CASES: dict[str, str | bytes] = {
    "the example (baseline)": EXAMPLE,
    "duplicate top-level key": EXAMPLE + "serving:\n  port: 9000\n",
    "duplicate nested key": EXAMPLE.replace("  fabric_ip: 10.0.0.1/24", "  fabric_ip: 10.0.0.1/24\n"
                                                                        "  fabric_ip: 10.0.0.9/24"),
    "alias bomb (9 levels, 9^9)": _bomb(9),
    "anchor and alias": EXAMPLE.replace("  interfaces: [enp1s0f1np1]", "  interfaces: &i [enp1s0f1np1]\n  hcas: *i"),
    "!!binary": EXAMPLE.replace("  revision: main", "  revision: !!binary bWFpbg=="),
    "!!python/object/apply": EXAMPLE.replace("name: hy3-pair", "name: !!python/object/apply:os.system [id]"),
    "!!set": EXAMPLE.replace("  interfaces: [enp1s0f1np1]", "  interfaces: !!set {enp1s0f1np1}"),
    "date in speculative_config": _serving("  speculative_config: {method: mtp, num_speculative_tokens: 1, "
                                           "note: 2024-01-01}"),
    "total_memory_gib: .inf": EXAMPLE + "hardware:\n  total_memory_gib: .inf\n",
    "total_memory_gib: .nan": EXAMPLE + "hardware:\n  total_memory_gib: .nan\n",
    "integer of 5000 digits": EXAMPLE.replace("  mtu: 9000", "  mtu: " + "9" * 5000),
    "nesting 100,000 deep": _serving("  speculative_config: " + "[" * 100_000 + "]" * 100_000),
    "second document": EXAMPLE + "---\nname: other\n",
    "NUL character": EXAMPLE.replace("name: hy3-pair", "name: hy3\0pair"),
    "not UTF-8": EXAMPLE.encode().replace(b"name: hy3-pair", b"name: caf\xe9"),
    "profile: ../x": EXAMPLE.replace("profile: hy3-295b-nvfp4-tp2", "profile: ../x"),
    "profile: /tmp/p": EXAMPLE.replace("profile: hy3-295b-nvfp4-tp2", "profile: /tmp/p"),
    "exactly 1 MiB (a comment)": _padded(EXAMPLE, MIB),
    "4,900 env entries (9,900 values)": _env_entries(count=4_900),
    "1 MiB of env entries": _env_entries(MIB),
    "a 1 MiB string": EXAMPLE.replace("name: hy3-pair", "name: " + "a" * (MIB - len(EXAMPLE) - 1)),
    "1 MiB + 1 byte": _padded(EXAMPLE, MIB + 1),
    "20 MB": _padded(EXAMPLE, 20_000_000),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--goal", type=float, default=1.0, help="seconds; the table says which cases are above it")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from hy3spark.errors import SpecError
    from hy3spark.spec import load_spec

    print(f"{'case':32s} {'bytes':>10s} {'exit':>4s} {'CLI median':>10s} {'CLI max':>8s} {'load_spec':>9s}  "
          "first line of the answer")
    over = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, content in CASES.items():
            spec = Path(tmp) / "cluster.yml"
            if isinstance(content, bytes):
                spec.write_bytes(content)
            else:
                spec.write_text(content)
            times = []
            for _ in range(args.runs):
                start = time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "hy3spark", "validate", str(spec)], cwd=REPO,
                                      capture_output=True, text=True)
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            in_process = []
            for _ in range(args.runs):
                start = time.perf_counter()
                with contextlib.suppress(SpecError):
                    load_spec(spec)
                in_process.append(time.perf_counter() - start)
            if median >= args.goal:
                over.append(label)
            said = (proc.stdout if proc.returncode == 0 else proc.stderr).strip().splitlines()[0]
            said = said.replace(str(spec), "cluster.yml").removeprefix("error: ")
            print(f"{label:32s} {spec.stat().st_size:10,d} {proc.returncode:4d} {median * 1000:7.0f} ms "
                  f"{max(times) * 1000:5.0f} ms {statistics.median(in_process) * 1000:6.0f} ms  {said[:100]}")
    print(f"goal: every CLI median under {args.goal * 1000:.0f} ms: "
          f"{'met' if not over else 'NOT met for ' + ', '.join(over)} ({args.runs} runs each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
