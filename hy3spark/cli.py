"""The command line. Thin: it parses arguments, calls the library, and turns domain errors into one message.

Heavy imports happen inside the subcommand that needs them, so `hy3spark render` stays well under a second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hy3spark import __version__
from hy3spark.errors import EXIT_OK, Hy3SparkError

EPILOG = """\
exit codes: 0 ok; 1 a check, gate or task failed; 2 bad command-line usage; 3 invalid cluster spec;
            4 a host was unreachable.
SPEC defaults to the embedded two-Spark Hy3 spec (the recipe's 10.0.0.1 / 10.0.0.2 pair on enp1s0f1np1).
"""


def _spec_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", type=Path, metavar="SPEC",
                   help="cluster spec YAML (default: the embedded two-Spark Hy3 spec)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hy3spark",
        description="Turn two or more NVIDIA DGX Sparks into one LLM endpoint, from one cluster spec.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hy3spark {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("render", help="preview or write every file derived from the spec",
                       description="Render the inventory and every deployed file from the spec. With no option the "
                                   "files are printed to stdout; nothing is written.",
                       epilog="kinds for --only: inventory, netplan, earlyoom, env, container, serve, pi (or a glob "
                              "over the listed paths, e.g. 'files/spark-b/*')")
    _spec_arg(p)
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="write the files under DIR (atomically; files a previous render made and this one does not "
                        "are removed). Use --out . to refresh the repo's inventory/")
    p.add_argument("--only", metavar="NAME", help="only the files of this kind or matching this glob")
    p.add_argument("--diff", type=Path, metavar="DIR",
                   help="show what would change against an earlier render in DIR; exits 1 when something would")
    p.add_argument("--format", choices=("text", "json"), default="text", help="stdout format (default text)")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("validate", help="check the spec for the field's known mistakes; write nothing",
                       description="Validate the spec (merged over its profile). Prints each problem with the field "
                                   "path and line, exits 3 on any problem.")
    _spec_arg(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("profiles", help="list the built-in profiles", description="List the built-in profiles.")
    p.set_defaults(func=cmd_profiles)
    return parser


def _load(spec: Path | None):  # noqa: ANN202 - returns hy3spark.spec.Loaded; imported lazily
    from hy3spark.spec import load_spec

    loaded = load_spec(spec)
    for warning in loaded.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return loaded


def cmd_render(args: argparse.Namespace) -> int:
    from hy3spark import render

    loaded = _load(args.spec)
    everything = render.render_all(loaded)
    outputs = render.select(everything, args.only)
    if args.diff is not None:
        text, changed = render.diff(outputs, args.diff)
        sys.stdout.write(text if changed else f"no changes against {args.diff}\n")
        return 1 if changed else EXIT_OK
    if args.out is not None:
        removed = render.write(outputs, args.out, loaded.sha256, all_outputs=args.only is None)
        print(f"wrote {len(outputs)} files under {args.out} from {loaded.source}")
        for path in removed:
            print(f"removed {path} (no longer rendered)")
        return EXIT_OK
    if args.format == "json":
        sys.stdout.write(render.as_json(outputs, loaded.warnings))
    else:
        sys.stdout.write(render.preview(outputs))
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    loaded = _load(args.spec)
    spec = loaded.spec
    print(f"{loaded.source}: ok: cluster {spec.name!r}, {len(spec.nodes)} node(s), {spec.gpu_count} GPU(s), "
          f"{spec.serving.engine} TP={spec.serving.tensor_parallel} PP={spec.serving.pipeline_parallel}, "
          f"model {spec.model.repo}@{spec.model.revision}")
    return EXIT_OK


def cmd_profiles(args: argparse.Namespace) -> int:
    from hy3spark.spec import available_profiles, profile_description

    for name in available_profiles():
        print(f"{name}\n    {profile_description(name)}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    try:
        return int(args.func(args))
    except Hy3SparkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
