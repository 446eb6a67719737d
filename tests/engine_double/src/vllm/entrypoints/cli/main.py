"""The `vllm` command of hy3spark's TEST DOUBLE (the real one lives at the same path in vLLM).

``vllm --version`` prints ``0.23.0+testdouble``; ``vllm serve MODEL [flags]`` runs vllm.double.serve; the other
vLLM subcommands exist in the usage line but are not doubled.
"""

from __future__ import annotations

import sys

from vllm.double import args as cli_args


def main() -> None:
    argv = cli_args.preprocess(sys.argv[1:])
    parser = cli_args.build_parser()
    args = parser.parse_args(argv)
    if args.subparser is None:
        parser.print_help()
        return
    if args.subparser != "serve":
        print(
            f"vllm {args.subparser}: not available in hy3spark's vLLM TEST DOUBLE (only `vllm serve` is)",
            file=sys.stderr,
        )
        sys.exit(2)
    from vllm.double.serve import run_headless, run_serve

    if args.headless:  # no API server on this node (vllm/entrypoints/cli/serve.py)
        sys.exit(run_headless(args))
    sys.exit(run_serve(args, cli_args.non_default(args, parser)))


if __name__ == "__main__":
    main()
