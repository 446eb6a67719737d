"""The command line. Thin: it parses arguments, calls the library, and turns domain errors into one message.

Heavy imports happen inside the subcommand that needs them, so `hy3spark render` stays well under a second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hy3spark.errors import EXIT_FAILED, EXIT_OK, Hy3SparkError

EPILOG = """\
exit codes: 0 ok; 1 a check, gate or task failed; 2 bad command-line usage; 3 invalid cluster spec;
            4 a host was unreachable; 130 interrupted (Ctrl+C).
SPEC defaults to the embedded two-Spark Hy3 spec (the recipe's 10.0.0.1 / 10.0.0.2 pair on enp1s0f1np1).
"""
RUNS_DIR_HELP = ("where run records, artifacts and the lab notebook go (default: runs/ in a checkout, else "
                 "$XDG_STATE_HOME/hy3spark, ~/.local/state/hy3spark: XDG state, not data, as they are this "
                 "machine's history of runs, not documents to carry elsewhere)")


class _VersionAction(argparse.Action):
    """--version, answered only when asked: it looks for the content, which no other option needs to do."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_args: object) -> None:
        from hy3spark import content

        print(content.version_text())
        parser.exit()


def _spec_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", type=Path, metavar="SPEC",
                   help="cluster spec YAML (default: the embedded two-Spark Hy3 spec)")


def _ops_args(p: argparse.ArgumentParser, tags: bool = True) -> None:
    """What every command that runs a playbook takes: the spec, the hosts, the output, where runs go."""
    _spec_arg(p)
    if tags:
        p.add_argument("--tags", metavar="TAGS", help="only these roles' tags (comma-separated)")
    p.add_argument("--limit", metavar="HOSTS", help="only these hosts, as ansible-playbook --limit")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    p.add_argument("--runs-dir", type=Path, metavar="DIR", help=RUNS_DIR_HELP)


PASSTHROUGH = """\
These go to ansible-playbook as given (kolla-ansible's way). An inline -e shows in the process list and in the run's
ansible-runner artifacts (and up's run record), so hy3spark refuses, before anything runs, one that would carry a
secret: a key naming a secret (the variables the spec's model.token_env and serving.api_key_env name, HF_TOKEN,
VLLM_API_KEY), a key named like a credential (*_token, *_key, *_password, *_pass, *_secret), a value holding an
exported secret's value. Secrets go by environment variable; of -e @FILE only the file's path is on the command line.
"""


def _passthrough(p: argparse.ArgumentParser, *, skip_tags: bool = True, modes: bool = True) -> None:
    g = p.add_argument_group("ansible-playbook options", PASSTHROUGH)
    g.add_argument("-e", "--extra-vars", action="append", default=[], metavar="VARS",
                   help="set variables, as ansible-playbook -e: KEY=VALUE (several, space-separated), inline "
                        "YAML/JSON, or @FILE (a YAML or JSON file; a relative path is from the current directory); "
                        "repeatable, later ones win. The usual use: a role input the spec does not carry")
    if skip_tags:
        g.add_argument("--skip-tags", metavar="TAGS",
                       help="skip the tasks and roles with these tags (comma-separated), as ansible-playbook "
                            "--skip-tags")
    if modes:
        g.add_argument("--check", action="store_true",
                       help="ansible-playbook --check: report what would change and change nothing")
        g.add_argument("--diff", action="store_true",
                       help="ansible-playbook --diff: show each change to a file or setting as a diff (with --check: "
                            "the changes a run would make)")


def _add_render(sub: argparse._SubParsersAction) -> None:
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


def _add_validate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check the spec for the field's known mistakes; write nothing",
                       description="Validate the spec (merged over its profile). Prints each problem with the field "
                                   "path and line, exits 3 on any problem.")
    _spec_arg(p)
    p.set_defaults(func=cmd_validate)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict vLLM's KV cache and concurrency before a 10-minute load",
                       description="Predict, from the spec, the two lines vLLM logs at the end of startup ('GPU KV "
                                   "cache size: N tokens', 'Maximum concurrency for L tokens per request: Cx') with a "
                                   "per-rank memory budget. Exits 1 when vLLM could not start or could not hold one "
                                   "full-length request; warns when the concurrency is below max_num_seqs.",
                       epilog="overhead (activation peak + non-torch memory) is the one measured term: the profile "
                              "carries a default; --calibrate reads it off a real vLLM startup log.")
    _spec_arg(p)
    p.add_argument("--calibrate", type=Path, metavar="LOG",
                   help="derive the overhead from a real vLLM startup log (requested - weights - available KV)")
    p.add_argument("--overhead", type=float, metavar="GIB", help="overhead per rank in GiB (overrides the profile)")
    p.add_argument("--free", type=float, metavar="GIB",
                   help="MemAvailable per node in GiB: also check vLLM's startup memory check (free >= requested)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)


def _add_transport(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transport", help="NCCL transport gate: fail when any channel fell back to TCP (NET/Socket)",
                       description="Read NCCL INFO logs (one file per rank, or vLLM's serve log with every Ray "
                                   "worker's lines in it) and classify each channel: NET/IB with or without "
                                   "GDRDMA, NET/Socket (TCP fallback), P2P/SHM (same node). Exits 1 when any "
                                   "channel is on NET/Socket, with why and how to fix it.")
    p.add_argument("logs", nargs="+", type=Path, metavar="LOG", help="log files; - reads standard input")
    p.add_argument("--allow-socket", action="store_true", help="report NET/Socket as a warning, not a failure")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_transport)


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="deploy: run site.yml through ansible-runner, then record the run",
                       description="Render the spec's inventory, run site.yml (preflight, network, earlyoom, image + "
                                   "model, Ray head and workers, vLLM) with live progress, and write a run record "
                                   "(JSON under runs/records/ and one line in runs/labbook.md).",
                       epilog="--tags, --skip-tags and --limit make a partial run: "
                              "the roles run whatever the drift check finds, and the nodes keep the record of their "
                              "last complete run. The status collected after the run gets the same -e (not the "
                              "rest). With --check the lab notebook line says so.")
    _ops_args(p)
    p.add_argument("--full-run", action="store_true",
                   help="run every role even when every node matches its last complete run (site.yml's drift "
                        "check would otherwise skip them and only check the endpoint)")
    p.add_argument("--rotate-ray-token", action="store_true",
                   help="make a new cluster Ray token on the head (ray.auth: token), copy it to every node and "
                        "restart every node's Ray and the engine with it (implies --full-run); the old token stops "
                        "working (the same as -e hy3spark_rotate_ray_token=true with --full-run)")
    _passthrough(p)
    p.set_defaults(func=cmd_up)


def _add_down(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="tear down: stop serving, then workers, then the head",
                       description="Run playbooks/teardown.yml: stop the engine, remove the worker containers, then "
                                   "the head's; report memory before and after. Keeps the model cache and network.")
    _ops_args(p)
    _passthrough(p)
    p.set_defaults(func=cmd_down)


def _add_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="run the preflight checks; with --dry-run also site.yml in check+diff mode",
                       description="Run the preflight role on every node (read-only): one table of every check. "
                                   "--dry-run also runs site.yml with --check --diff and shows what would change.",
                       epilog="-e and --skip-tags apply to both runs. There is no --check or --diff here: preflight "
                              "changes nothing, and --dry-run is site.yml with both.")
    _ops_args(p)
    p.add_argument("--dry-run", action="store_true", help="also run site.yml in check + diff mode")
    p.add_argument("--full-run", action="store_true",
                   help="with --dry-run: check every role even when every node matches its last complete run")
    _passthrough(p, modes=False)
    p.set_defaults(func=cmd_check)


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="nodes, containers, Ray nodes/GPUs, endpoint health, KV lines, last run",
                       description="Collect, read-only, what runs on every node and print one table.")
    _ops_args(p, tags=False)
    _passthrough(p, skip_tags=False, modes=False)
    p.set_defaults(func=cmd_status)


def _add_logs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="follow the vLLM log on the head (Ctrl+C detaches; the engine keeps running)",
                       description="Print the tail of the engine's log on the head and follow it. Ctrl+C detaches "
                                   "and never stops the server.")
    _spec_arg(p)
    p.add_argument("--no-follow", action="store_true", help="print the tail and exit")
    p.add_argument("-n", "--lines", type=int, default=100, help="lines of tail to start with (default 100)")
    p.add_argument("--runs-dir", type=Path, metavar="DIR", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_logs)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="the lab's load test: tok/s, req/s, TTFT, TPOT per concurrency level",
                       description="Load-test the endpoint with an established load generator (guidellm, or `vllm "
                                   "bench serve` in the head container) and report, per concurrency level, output "
                                   "tokens/s, requests/s, time to first token and time per output token (p50, p99). "
                                   "Appends one line per run to the lab notebook and keeps the tool's report under "
                                   "runs/bench/.",
                       epilog="TPOT is vLLM's definition (first token excluded). guidellm runs from its own venv: "
                              "scripts/bench-venv creates it. The API key comes from the variable the spec names "
                              "(serving.api_key_env) and never reaches a command line. Each line also keeps the "
                              "split (TP x PP, launcher), the last up's KV lines and every GPU's PCIe link "
                              "generation and width read on the nodes while the load runs (the current values "
                              "drop at idle). The line names the engine and its version (the endpoint's /version, "
                              "else the last up's record, else unknown). `hy3spark labbook --compare A B` shows runs "
                              "side by side.")
    _spec_arg(p)
    p.add_argument("--label", metavar="L", help="the run's name in the lab notebook (default: the cluster name)")
    p.add_argument("--target", metavar="URL",
                   help="OpenAI base URL, e.g. http://127.0.0.1:8888/v1 (default: the spec's endpoint)")
    p.add_argument("--tool", choices=("guidellm", "vllm"), default="guidellm",
                   help="load generator: guidellm (default) or `vllm bench serve` inside the head container")
    p.add_argument("--concurrency", default="1,2,4", metavar="LIST", help="concurrency levels (default 1,2,4)")
    p.add_argument("--requests", type=int, default=20, metavar="N", help="requests per level (default 20)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N",
                   help="output tokens per request (default 256; synthetic prompts decode exactly N)")
    p.add_argument("--prompt-tokens", type=int, default=512, metavar="N",
                   help="synthetic prompt length in tokens (default 512)")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="a prompt set instead of synthetic prompts: .txt (one per line), .jsonl/.json, .csv")
    p.add_argument("--processor", metavar="DIR",
                   help="tokenizer for guidellm's prompts (default: a small offline one; the counts reported "
                        "come from the server)")
    p.add_argument("--link", choices=("nodes", "record", "off"), default="nodes",
                   help="the GPUs' PCIe links: nodes (default) reads them on every node while the load runs "
                        "(playbooks/preflight.yml --tags gpu_link, over SSH as the other commands), falling back to "
                        "the last up's run record (idle readings) when the nodes cannot be asked; record uses that "
                        "record; off reads none")
    p.add_argument("--labbook", type=Path, metavar="PATH", help="lab notebook (default: labbook.md in the runs dir)")
    p.add_argument("--runs-dir", type=Path, metavar="DIR", help=RUNS_DIR_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    _passthrough(p, skip_tags=False, modes=False)
    p.set_defaults(func=cmd_bench)


def _add_labbook(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("labbook", help="list the lab notebook's bench runs, or compare runs side by side",
                       description="List the bench runs of the lab notebook (date, label, engine and version, "
                                   "report). With --compare, show two or more runs side by side, a vLLM run beside a "
                                   "TensorRT-LLM run of one cluster as well: label, engine and version, model, split "
                                   "(TP x PP, launcher), each GPU's PCIe link generation and width (under load, or "
                                   "where they were read), the KV cache tokens and maximum concurrency, and per "
                                   "concurrency level output tokens/s, requests/s, TTFT and TPOT at p50 / p99.",
                       epilog="A label names its newest run; a report directory's name (the notebook's last "
                              "column) names one run. Example: hy3spark labbook --compare two-card-tp two-card-pp")
    p.add_argument("--compare", nargs="+", metavar="LABEL", help="two or more labels (or report directory names)")
    p.add_argument("--labbook", type=Path, metavar="PATH", help="lab notebook (default: labbook.md in the runs dir)")
    p.add_argument("--runs-dir", type=Path, metavar="DIR", help=RUNS_DIR_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output (the runs' results)")
    p.set_defaults(func=cmd_labbook)


def _add_profiles(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profiles", help="list the built-in profiles", description="List the built-in profiles.")
    p.set_defaults(func=cmd_profiles)


# The subcommands in the order --help lists them: one builder each.
COMMANDS = (_add_render, _add_validate, _add_plan, _add_transport, _add_up, _add_down, _add_check, _add_status,
            _add_logs, _add_bench, _add_labbook, _add_profiles)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hy3spark",
        description="Turn two or more NVIDIA DGX Sparks into one LLM endpoint, from one cluster spec.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction,
                        help="print hy3spark's version and its Ansible content's (and where that is), and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def _load(spec: Path | None):  # -> hy3spark.spec.Loaded, imported lazily for start-up time
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


def cmd_plan(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from hy3spark import planning

    loaded = _load(args.spec)
    if not planning.plannable(loaded.spec):
        raise Hy3SparkError(f"{loaded.source}: {planning.not_planned(loaded.spec)}")
    overhead = planning.overhead_for(loaded, args.calibrate, args.overhead)
    plan = planning.plan_for(loaded, overhead, args.free)
    nodes = planning.rank_nodes(loaded)
    errors = [p for p in plan.problems if p.severity == "error"]
    if args.json:
        data = {
            "cluster": loaded.spec.name,
            "overhead_bytes": overhead.bytes,
            "overhead_source": overhead.source,
            "ranks": [{"rank": r.rank, "node": nodes[r.rank] if r.rank < len(nodes) else None,
                       "pp_rank": r.pp_rank, "tp_rank": r.tp_rank, "kv_layers": r.kv_layers,
                       "total_bytes": r.total_bytes, "requested_bytes": r.requested_bytes,
                       "weights_bytes": r.weights_bytes, "overhead_bytes": r.overhead_bytes,
                       "kv_available_bytes": r.kv_available_bytes, "num_blocks": r.num_blocks,
                       "kv_needed_bytes": r.kv_needed_bytes} for r in plan.rows],
            "kv_cache_tokens": plan.kv_cache_tokens,
            "max_concurrency": round(plan.max_concurrency, 2),
            "lines": [plan.kv_cache_size_line, plan.max_concurrency_line],
            "vllm_error": dataclasses.asdict(plan.vllm_error) if plan.vllm_error else None,
            "remedy": dataclasses.asdict(plan.remedy) if plan.remedy else None,
            "problems": [{"severity": str(p.severity), "code": p.code, "message": p.message} for p in plan.problems],
        }
        print(json.dumps(data, indent=2))
        return 1 if errors else EXIT_OK
    s = loaded.spec.serving
    gib = planning.GIB
    print(f"plan for {loaded.spec.name} ({loaded.source}): {s.engine} TP={s.tensor_parallel} PP={s.pipeline_parallel}, "
          f"{loaded.spec.model.repo}, KV dtype {s.kv_cache_dtype}, max_model_len {s.max_model_len:,}, "
          f"max_num_seqs {s.max_num_seqs}")
    print(f"overhead: {overhead.bytes / gib:.2f} GiB per rank ({overhead.source})")
    # With pipeline parallel each stage has its own layers, weights and blocks: show the stage and its KV layers.
    staged = s.pipeline_parallel > 1
    header = f"{'rank':>4}  {'node':<16} {'total':>8} {'requested':>10} {'weights':>8} {'overhead':>9} " \
             f"{'KV memory':>10} {'blocks':>8}" + (f" {'stage':>5} {'layers':>6}" if staged else "")
    print(header + "   (GiB)")

    def g(v: int | None) -> str:
        return "-" if v is None else f"{v / gib:.2f}"

    for r in plan.rows:
        node = nodes[r.rank] if r.rank < len(nodes) else "?"
        print(f"{r.rank:>4}  {node:<16} {g(r.total_bytes):>8} {g(r.requested_bytes):>10} {g(r.weights_bytes):>8} "
              f"{g(r.overhead_bytes):>9} {g(r.kv_available_bytes):>10} {r.num_blocks:>8}"
              + (f" {r.pp_rank:>5} {r.kv_layers:>6}" if staged else ""))
    print("predicted vLLM startup lines:")
    print(f"  {plan.kv_cache_size_line}")
    print(f"  {plan.max_concurrency_line}")
    for p in plan.problems:
        print(f"{p.severity}: {p.message}", file=sys.stderr)
    return 1 if errors else EXIT_OK


def cmd_transport(args: argparse.Namespace) -> int:
    import json

    from hy3spark import nccl

    texts = {}
    for path in args.logs:
        if str(path) == "-":
            texts["stdin"] = sys.stdin.read()
            continue
        try:
            texts[str(path)] = path.read_text(errors="replace")
        except OSError as exc:
            raise Hy3SparkError(f"{path}: {exc.strerror}") from None
    report = nccl.parse_logs(texts)
    result = nccl.gate(report, require_rdma=not args.allow_socket)
    if args.json:
        print(json.dumps({"passed": result.passed, "counts": {str(k): v for k, v in result.counts.items()},
                          "message": result.message}, indent=2))
    else:
        print(result.message)
    return EXIT_OK if result.passed else 1


def _runs_dir(args: argparse.Namespace) -> Path:
    from hy3spark import content

    return (args.runs_dir or content.default_runs_dir()).resolve()


def _full_run(args: argparse.Namespace) -> dict[str, bool] | None:
    if getattr(args, "rotate_ray_token", False):  # up only: every Ray restarts, so every role after it runs
        return {"drift_full_run": True, "hy3spark_rotate_ray_token": True}
    return {"drift_full_run": True} if args.full_run else None


def _ansible(args: argparse.Namespace, loaded):  # -> hy3spark.playbooks.AnsibleArgs
    """The ansible-playbook options this command was given, checked against the spec before anything runs."""
    from hy3spark.playbooks import ansible_args

    return ansible_args(loaded, args.extra_vars, getattr(args, "skip_tags", None), getattr(args, "check", False),
                        getattr(args, "diff", False))


def cmd_up(args: argparse.Namespace) -> int:
    from hy3spark import playbooks, records, status

    loaded = _load(args.spec)
    ansible = _ansible(args, loaded)
    runs = _runs_dir(args)
    started = records.now()
    result = playbooks.run(loaded, "site.yml", runs, "up", ansible, tags=args.tags, limit=args.limit,
                           extravars=_full_run(args))
    summary = None
    # What runs now (image IDs, versions, containers, KV lines), also after a failed step: the nodes answered.
    if result.exit_code in (EXIT_OK, EXIT_FAILED):
        _status_result, summary = status.collect_status(loaded, runs, limit=args.limit, ansible=ansible)
    record = records.write_record(loaded, runs, result, summary, started, runs / "labbook.md", ansible.argv())
    if not args.json:
        print(f"run record: {record}")
    return playbooks.finish(result, args.json, {"record": str(record)})


def cmd_down(args: argparse.Namespace) -> int:
    from hy3spark import playbooks

    loaded = _load(args.spec)
    ansible = _ansible(args, loaded)
    result = playbooks.run(loaded, "playbooks/teardown.yml", _runs_dir(args), "down", ansible, tags=args.tags,
                           limit=args.limit)
    return playbooks.finish(result, args.json, reports=True)


def cmd_check(args: argparse.Namespace) -> int:
    import json

    from hy3spark import playbooks

    loaded = _load(args.spec)
    ansible = _ansible(args, loaded)
    runs = _runs_dir(args)
    result = playbooks.run(loaded, "playbooks/preflight.yml", runs, "preflight", ansible, limit=args.limit)

    def dry_run():  # -> RunResult
        return playbooks.run(loaded, "site.yml", runs, "dry run", ansible, tags=args.tags, limit=args.limit,
                             check=True, diff=True, extravars=_full_run(args))

    if args.json:
        # One JSON document: the preflight run, and the dry run when it ran.
        out: dict[str, object] = {"preflight": playbooks.payload(result, reports=True), "exit_code": result.exit_code}
        if args.dry_run and result.exit_code == EXIT_OK:
            dry = dry_run()
            out.update(dry_run=playbooks.payload(dry), exit_code=dry.exit_code)
        print(json.dumps(out, indent=2, default=str))
        return out["exit_code"]
    code = playbooks.finish(result, args.json, reports=True)
    if args.dry_run and code == EXIT_OK:
        code = playbooks.finish(dry_run(), args.json)
    return code


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from hy3spark import playbooks, status

    loaded = _load(args.spec)
    result, summary = status.collect_status(loaded, _runs_dir(args), limit=args.limit, ansible=_ansible(args, loaded))
    if result.exit_code != EXIT_OK:
        return playbooks.finish(result, args.json)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        status.print_status(summary)
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    from hy3spark import logs

    loaded = _load(args.spec)
    runs = _runs_dir(args)
    if args.lines < 1:
        raise Hy3SparkError("--lines must be at least 1")
    if args.no_follow:
        sys.stdout.write(logs.read_log(loaded, runs, args.lines))
        return EXIT_OK
    return logs.follow_log(loaded, runs, args.lines)


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    from hy3spark import bench

    if args.requests < 1 or args.max_tokens < 1 or args.prompt_tokens < 1:
        raise Hy3SparkError("--requests, --max-tokens and --prompt-tokens must be at least 1")
    settings = bench.Settings(concurrency=bench.parse_levels(args.concurrency), requests=args.requests,
                              max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens, prompts=args.prompts,
                              processor=args.processor)
    runs = _runs_dir(args)
    labbook = (args.labbook or runs / "labbook.md").resolve()
    loaded = _load(args.spec)
    result = bench.run(loaded, settings=settings, tool=args.tool, label=args.label, target=args.target,
                       labbook=labbook, runs_dir=runs, link=args.link, ansible=_ansible(args, loaded))
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        bench.print_table(result)
        print(f"lab notebook: {labbook}")
    return EXIT_OK


def cmd_labbook(args: argparse.Namespace) -> int:
    import json

    from hy3spark import bench

    runs = _runs_dir(args)
    labbook = (args.labbook or runs / "labbook.md").resolve()
    if args.compare is None:
        lines = bench.labbook_runs(labbook)
        if args.json:
            print(json.dumps(lines, indent=2))
        for line in [] if args.json else lines:
            print(f"{line['date']}  {line['label']}  {line['engine']}  ({line['run']})")
        return EXIT_OK
    if len(args.compare) < 2:
        raise Hy3SparkError("--compare needs two or more labels")
    results = bench.load_runs(labbook, runs, args.compare)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        sys.stdout.write(bench.compare_table(results))
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
