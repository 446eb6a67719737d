#!/usr/bin/env python3
"""Converge benchmark (a script, not a test): the second `site` converge's wall time over the first, same run.

The first converge takes two bare test nodes (molecule/site: dnodes with the serving image and the synthetic model
already in place, as prepare.yml leaves them) to a serving, verified endpoint with site.yml: the drift check (no
record yet), preflight, network, earlyoom, distribution, Ray head and worker containers, the cluster gate, the
engine started and gated on /health and a completion, each node's deployment record. The second changes nothing:
the drift check compares every node with its record (inputs hash, managed files, interfaces, earlyoom, image,
containers, engine processes, model cache, /health), skips the roles and sends one completion, and must report
changed=0. Goal: the second run takes at most 25% of the first.

    .venv/bin/python bench/converge.py [--runs 1] [--keep] [--json out.json]

It renders the scenario's spec, creates and prepares the nodes with Molecule, times the converges, then destroys
the nodes (unless --keep). Needs the images from scripts/build-images and tests/engine_double/build-image
(.cache/images.env). Numbers depend on this machine (2 shared cores): the ratio is what to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = "site"
GOAL = 0.25


def environment() -> dict[str, str]:
    env = {**os.environ, "LC_ALL": "C.UTF-8", "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0", "PY_COLORS": "0",
           # Seconds per role in each converge, to see where the second run's time goes.
           "ANSIBLE_CALLBACKS_ENABLED": "ansible.posix.profile_roles"}
    env_file = ROOT / ".cache" / "images.env"
    if not env_file.is_file():
        raise SystemExit(f"bench: {env_file} is missing: run scripts/build-images and tests/engine_double/build-image")
    for line in env_file.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip():
            env.setdefault(key.strip(), value.strip())
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = f"{bindir}:{env.get('PATH', '')}"
    return env


def molecule(env: dict[str, str], *args: str, check: bool = True) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "molecule", *args, "-s", SCENARIO], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise SystemExit(f"bench: molecule {' '.join(args)} failed ({proc.returncode}):\n{out[-4000:]}")
    return took, out


def role_seconds(output: str) -> dict[str, float]:
    """profile_roles' recap: `<role> ------- 12.34s` lines (roles imported by another role are listed separately)."""
    recap = re.finditer(r"^\s*(?:│\s*)?(\S+) -{3,} (\d+\.\d+)s\s*$", output, re.M)
    return {m.group(1): float(m.group(2)) for m in recap}


def changed(output: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"(site-\S+)\s+: ok=\d+\s+changed=(\d+)", output)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="create/converge/converge/destroy cycles")
    parser.add_argument("--keep", action="store_true", help="leave the nodes running after the last run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    env = environment()
    subprocess.run([sys.executable, "-m", "hy3spark", "render", f"molecule/{SCENARIO}/cluster.yml", "--out",
                    f"molecule/{SCENARIO}/.rendered"], cwd=ROOT, env=env, check=True, capture_output=True)
    results = []
    try:
        for run in range(1, args.runs + 1):
            molecule(env, "destroy")
            molecule(env, "create")
            molecule(env, "prepare")
            load = os.getloadavg()[0]
            first, out1 = molecule(env, "converge")
            second, out2 = molecule(env, "converge")
            result = {"run": run, "first_s": round(first, 1), "second_s": round(second, 1),
                      "ratio": round(second / first, 3), "second_changed": changed(out2),
                      "first_changed": changed(out1), "load_1m_before": round(load, 1),
                      "first_roles_s": role_seconds(out1), "second_roles_s": role_seconds(out2)}
            results.append(result)
            print(f"run {run}: first converge {first:6.1f} s, second {second:6.1f} s -> {second / first:5.1%} "
                  f"(second run changed: {result['second_changed']}; load {load:.1f})", flush=True)
            for role in sorted(result["first_roles_s"], key=lambda r: -result["first_roles_s"][r]):
                print(f"    {role:12s} first {result['first_roles_s'][role]:6.1f} s   "
                      f"second {result['second_roles_s'].get(role, 0.0):6.1f} s", flush=True)
            if run < args.runs or not args.keep:
                molecule(env, "destroy")
    except BaseException:
        if not args.keep:
            molecule(env, "destroy", check=False)
        raise
    worst = max(r["ratio"] for r in results)
    idempotent = all(set(r["second_changed"].values()) == {0} for r in results)
    print(f"goal: second converge at most {GOAL:.0%} of the first: {'met' if worst <= GOAL else 'NOT met'} "
          f"(worst {worst:.1%}); second converge changed nothing: {'yes' if idempotent else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps({"goal": GOAL, "runs": results}, indent=2) + "\n")
    return 0 if worst <= GOAL and idempotent else 1


if __name__ == "__main__":
    sys.exit(main())
