"""The engine double's `vllm serve` parser against vLLM 0.23.0's own option table, without Docker.

tests/fixtures/vllm-0.23.0/serve-args.json was extracted from the real vLLM 0.23.0 parser (SERVE-ARGS.md beside it):
every action, and 38 argv lists the real parser was given with what it did. The double builds its parser from a table
derived from that fixture; here every recorded probe is replayed through the double (same values, same argparse error
line, same exception, same warnings, same verdict of vLLM's two namespace checks), every action is compared with the
fixture's, every option string is parsed, and so is the `vllm serve` command hy3spark renders for every example spec.

The double's package is named `vllm`, so it is never imported into this process: a child Python with the double's
source tree on its path (this file, run as a script) parses a batch of argv lists and answers in JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
DOUBLE = REPO / "tests" / "engine_double"
FIXTURE = REPO / "tests" / "fixtures" / "vllm-0.23.0" / "serve-args.json"
# The copy's sha256, as tests/fixtures/vllm-0.23.0/SERVE-ARGS.md records it (the shared file's).
FIXTURE_SHA256 = "6d96c1bc50777d837cfb9cd4a9ead106fec0542eb05c4236f16b6666214070ea"
DATA = json.loads(FIXTURE.read_text())
PROBES = DATA["underscore_normalisation"]["probes"]
OPTIONS = [option for option in DATA["options"] if not option["positional"]]
BASELINE = ["vllm", "serve", "probe-org/probe-model"]  # what each probe's `changed` is measured against
LOG_LINE = re.compile(r"^(?P<level>[A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\] (?P<message>.*)$")


# --- the child: the double's parser, in a process of its own -----------------------------------------------------


def _jsonable(value: Any) -> Any:
    """Namespace values as JSON; a default the table holds as a repr (vllm.double.args.ReprDefault) as {"repr": ...}."""
    return json.loads(json.dumps(value, default=lambda obj: {"repr": repr(obj)}))


def _parse(argv: list[str]) -> dict[str, Any]:
    from vllm.double import args as cli_args
    from vllm.double.serve import validate_serve_args

    out, err = io.StringIO(), io.StringIO()
    outcome: dict[str, Any] = {}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            namespace = cli_args.build_parser().parse_args(cli_args.preprocess(argv[1:]))
    except SystemExit as exc:
        outcome["exit"] = exc.code
    except Exception as exc:  # what vLLM raises out of main(): a traceback, exit 1
        outcome["exception"] = f"{type(exc).__name__}: {exc}"
    else:
        outcome["namespace"] = _jsonable(vars(namespace))
        try:
            validate_serve_args(namespace)
            outcome["validation"] = "ok"
        except Exception as exc:
            outcome["validation"] = f"{type(exc).__name__}: {exc}"
    outcome["stdout"], outcome["stderr"] = out.getvalue(), err.getvalue()
    return outcome


def _describe() -> dict[str, Any]:
    from vllm.double import args as cli_args

    top = cli_args.build_parser()
    serve = top._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    group_of = {id(action): group.title for group in serve._action_groups for action in group._group_actions}
    actions = [
        {
            "option_strings": action.option_strings,
            "dest": action.dest,
            "action": type(action).__name__,
            "nargs": action.nargs,
            "type": getattr(action.type, "__name__", None),
            "choices": action.choices,
            "const": action.const,
            "default": action.default,
            "required": action.required,
            "group": group_of[id(action)],
        }
        for action in serve._actions
    ]
    return _jsonable(
        {
            "top": {"prog": top.prog, "allow_abbrev": top.allow_abbrev},
            "serve": {"prog": serve.prog, "usage": serve.usage, "allow_abbrev": serve.allow_abbrev},
            "subcommands": list(top._subparsers._group_actions[0].choices),  # type: ignore[union-attr]
            "actions": actions,
        }
    )


def _child() -> None:
    request = json.load(sys.stdin)
    answer = {"parsed": [_parse(argv) for argv in request.get("parse", [])]}
    if request.get("describe"):
        answer["described"] = _describe()
    json.dump(answer, sys.stdout)


def double(parse: list[list[str]] | None = None, describe: bool = False) -> dict[str, Any]:
    """Parse each argv (``vllm serve ...``) with the double, in a child Python; optionally describe its parser."""
    env = {**os.environ, "PYTHONPATH": str(DOUBLE / "src")}
    result = subprocess.run(
        [sys.executable, __file__],
        input=json.dumps({"parse": parse or [], "describe": describe}),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def changed(outcome: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    assert "namespace" in outcome, outcome
    return {key: value for key, value in outcome["namespace"].items() if baseline["namespace"].get(key) != value}


def error_line(outcome: dict[str, Any]) -> str:
    return outcome["stderr"].strip().splitlines()[-1]


def warnings(outcome: dict[str, Any]) -> list[str]:
    """The double's log lines, as the fixture records vLLM's (``LEVEL: message``)."""
    found = (LOG_LINE.match(line) for line in outcome["stdout"].splitlines())
    return [f"{match['level']}: {match['message']}" for match in found if match]


# --- the shipped table --------------------------------------------------------------------------------------------


def test_the_fixture_is_vllms_table_as_extracted() -> None:
    assert hashlib.sha256(FIXTURE.read_bytes()).hexdigest() == FIXTURE_SHA256
    assert DATA["vllm_version"] == "0.23.0"
    assert (len(DATA["options"]), sum(len(o["option_strings"]) for o in DATA["options"])) == (263, 354)


def test_the_shipped_table_is_the_one_made_from_the_fixture() -> None:
    """serve_args.json cannot drift from the fixture: it is exactly what make_args_table.py makes of it."""
    sys.path.insert(0, str(DOUBLE))
    try:
        import make_args_table
    finally:
        sys.path.remove(str(DOUBLE))
    shipped = (DOUBLE / "src" / "vllm" / "double" / "serve_args.json").read_text()
    assert make_args_table.render(make_args_table.build_table(FIXTURE)) == shipped
    table = json.loads(shipped)
    assert table["source"]["sha256"] == FIXTURE_SHA256
    assert [o["option_strings"] for o in table["options"]] == [o["option_strings"] for o in DATA["options"]]
    assert table["tool_call_parsers"] == DATA["tool_call_parsers"]
    assert table["reasoning_parsers"] == DATA["reasoning_parsers"]


# --- the parser the double builds ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def described() -> dict[str, Any]:
    return double(describe=True)["described"]


def _callable_name(qualified: str | None) -> str | None:
    """argparse names a type by its __name__: the last part of the qualified name the fixture records."""
    return None if qualified is None else qualified.rsplit(".", 1)[-1]


def test_the_parsers_are_set_up_as_vllms(described: dict[str, Any]) -> None:
    parser = DATA["parser"]
    assert described["top"] == {"prog": parser["top_prog"], "allow_abbrev": parser["top_allow_abbrev"]}
    assert described["serve"] == {
        "prog": parser["serve_prog"],
        "usage": parser["serve_usage"],
        "allow_abbrev": parser["allow_abbrev"],
    }
    assert parser["allow_abbrev"] is True  # what the double used to refuse
    assert described["subcommands"] == DATA["subcommands"]


def test_every_action_is_registered_as_vllm_registers_it(described: dict[str, Any]) -> None:
    """Same actions in the same order (ambiguous-prefix errors list candidates in that order), each with vLLM's option
    strings, dest, action class, nargs, type name, choices, const, default and group."""
    actions = described["actions"]
    assert [a["option_strings"] for a in actions] == [o["option_strings"] for o in DATA["options"]]
    for mine, vllms in zip(actions, DATA["options"], strict=True):
        default = {"repr": vllms["default"]} if vllms["default_is_repr"] else vllms["default"]
        assert mine["dest"] == vllms["dest"]
        assert mine["action"] == vllms["action"], vllms["dest"]
        assert mine["nargs"] == vllms["nargs"], vllms["dest"]
        assert mine["type"] == _callable_name(vllms["type_callable"]), vllms["dest"]
        assert mine["choices"] == vllms["choices"], vllms["dest"]
        assert mine["const"] == vllms["const"], vllms["dest"]
        assert mine["default"] == default, vllms["dest"]
        assert mine["required"] == vllms["required"], vllms["dest"]
        assert mine["group"] == vllms["group"], vllms["dest"]


# --- vLLM's recorded parses, replayed -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replayed() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    parsed = double(parse=[BASELINE] + [probe["argv"] for probe in PROBES])["parsed"]
    return parsed[0], parsed[1:]


def _vllm_verdict(validation: dict[str, str]) -> str:
    """`vllm serve` runs validate_parsed_serve_args, then validate_api_server_args: the first failure stops it."""
    failures = [validation[check] for check in ("validate_parsed_serve_args", "validate_api_server_args")]
    return next((result for result in failures if result != "ok"), "ok")


@pytest.mark.parametrize("index", range(len(PROBES)), ids=[" ".join(p["argv"][2:]) for p in PROBES])
def test_each_recorded_probe_gives_vllms_outcome(
    replayed: tuple[dict[str, Any], list[dict[str, Any]]], index: int
) -> None:
    baseline, outcomes = replayed
    probe, outcome = PROBES[index], outcomes[index]
    assert baseline.get("validation") == "ok", baseline
    if "exception" in probe:
        assert outcome.get("exception") == probe["exception"], outcome
    elif not probe["ok"]:
        assert outcome.get("exit") == probe["exit"], outcome
        assert error_line(outcome) == probe["error"]
    else:
        assert changed(outcome, baseline) == probe["changed"]
        assert outcome["validation"] == _vllm_verdict(probe["validation"])
        assert warnings(outcome) == probe.get("vllm_logged", [])


def test_every_probe_replays_identically(replayed: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    """The count the README states: all 38, parsed ones also with vLLM's verdict and warnings."""
    baseline, outcomes = replayed
    same = 0
    for probe, outcome in zip(PROBES, outcomes, strict=True):
        if "exception" in probe:
            same += outcome.get("exception") == probe["exception"]
        elif not probe["ok"]:
            same += outcome.get("exit") == probe["exit"] and error_line(outcome) == probe["error"]
        else:
            same += (
                changed(outcome, baseline) == probe["changed"]
                and outcome["validation"] == _vllm_verdict(probe["validation"])
                and warnings(outcome) == probe.get("vllm_logged", [])
            )
    assert (same, len(PROBES)) == (38, 38)


# --- every option string ------------------------------------------------------------------------------------------

# A value each type accepts, and what vLLM's converter makes of it.
SAMPLES: dict[str, tuple[str, Any]] = {
    "int": ("3", 3),
    "float": ("0.5", 0.5),
    "str": ("x-y_Z", "x-y_Z"),
    "json": ('{"a": 1}', {"a": 1}),
    "json:<Config>": ("{}", {}),  # every field at its default: vLLM's validation passes too
    "str|json": ('{"a": 1}', {"a": 1}),
    "human_readable_int": ("2k", 2000),
    "human_readable_int_or_auto": ("2K", 2048),
    "lambda": ("x-y_Z", "x_y_z"),
}


def _sample(option: dict[str, Any], spelling: str) -> tuple[list[str], Any]:
    """The words that give the option a value, and the value vLLM would store."""
    if option["action"] == "_StoreTrueAction":
        return [spelling], True
    if option["action"] == "BooleanOptionalAction":
        return [spelling], not spelling.startswith("--no-")
    if option["action"] == "LoRAParserAction":
        return [spelling, "adapter=/loras/a"], [{"name": "adapter", "path": "/loras/a"}]
    kind = re.sub(r"^optional\[(.*)\]$", r"\1", option["type"])
    text, value = SAMPLES["json:<Config>" if kind.startswith("json:") else kind]
    if option["choices"]:
        # Not the last: --mm-encoder-attn-dtype's is "None", which its optional[str] type makes None, and vLLM then
        # refuses it as no choice.
        value = option["choices"][0]
        text = str(value)
    if option["nargs"] == "+" or option["action"] == "_AppendAction":
        value = [value]
    return [spelling, text], value


OPTION_STRINGS = [(o, s) for o in OPTIONS if o["action"] != "_HelpAction" for s in o["option_strings"]]


@pytest.fixture(scope="module")
def every_option(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    config = tmp_path_factory.mktemp("config") / "serve.yaml"
    config.write_text("max-num-seqs: 5\n")
    argvs = []
    for option, spelling in OPTION_STRINGS:
        if option["dest"] == "model":  # vLLM moves --model to the positional slot: no other model may be given
            argvs.append(["vllm", "serve", spelling, "probe-org/other"])
        elif option["dest"] == "config":
            argvs.append([*BASELINE, spelling, str(config)])
        else:
            argvs.append(BASELINE + _sample(option, spelling)[0])
    parsed = double(parse=[BASELINE, *argvs])["parsed"]
    return parsed[0], parsed[1:]


def test_the_table_has_every_option_string_the_double_must_take() -> None:
    assert len(OPTION_STRINGS) == 354 - 2  # all but -h/--help, which print the help and exit


@pytest.mark.parametrize("index", range(len(OPTION_STRINGS)), ids=[s for _, s in OPTION_STRINGS])
def test_every_option_string_parses_with_its_type(
    every_option: tuple[dict[str, Any], list[dict[str, Any]]], index: int
) -> None:
    baseline, outcomes = every_option
    option, spelling = OPTION_STRINGS[index]
    outcome = outcomes[index]
    assert "namespace" in outcome, error_line(outcome) if outcome.get("stderr") else outcome
    if option["dest"] == "model":
        assert changed(outcome, baseline) == {"model_tag": "probe-org/other"}
    elif option["dest"] == "config":
        assert changed(outcome, baseline) == {"max_num_seqs": 5}  # the file's flags, then --config is gone
    else:
        assert outcome["namespace"][option["dest"]] == _sample(option, spelling)[1]


# --- what hy3spark renders ----------------------------------------------------------------------------------------

def _vllm_examples() -> list[str]:
    from hy3spark.spec import load_spec

    # The vLLM double checks vLLM's commands; TensorRT-LLM's example is its own double's (tests/trtllm_double/).
    return sorted(p.name for p in (REPO / "examples").glob("*.yml") if load_spec(p).spec.serving.engine == "vllm")


SPECS = _vllm_examples()


@pytest.fixture(scope="module")
def rendered() -> dict[str, tuple[list[str], dict[str, Any]]]:
    from hy3spark.engines.vllm import VllmEngine
    from hy3spark.spec import load_spec

    # Every command a node runs: the head's, and under the native launcher each other node's --headless one.
    argvs = {}
    for name, loaded in [*((n, load_spec(REPO / "examples" / n)) for n in SPECS), ("the default spec", load_spec())]:
        engine = VllmEngine(loaded.spec)
        for index, node in enumerate(loaded.spec.nodes):
            if argv := engine.node_argv(index):
                argvs[name if index == 0 else f"{name} on {node.name}"] = argv
    outcomes = double(parse=list(argvs.values()))["parsed"]
    return {name: (argv, outcome) for (name, argv), outcome in zip(argvs.items(), outcomes, strict=True)}


NATIVE_WORKERS = ["hy3-two-spark-native.yml on spark-b"]


def test_the_examples_are_all_checked(rendered: dict[str, tuple[list[str], dict[str, Any]]]) -> None:
    assert len(SPECS) >= 4
    assert set(rendered) == {*SPECS, "the default spec", *NATIVE_WORKERS}


@pytest.mark.parametrize("spec", [*SPECS, "the default spec", *NATIVE_WORKERS])
def test_the_rendered_serve_command_parses_and_passes_vllms_checks(
    rendered: dict[str, tuple[list[str], dict[str, Any]]], spec: str
) -> None:
    argv, outcome = rendered[spec]
    assert argv[:2] == ["vllm", "serve"]
    assert "namespace" in outcome, outcome["stderr"] or outcome
    assert outcome["validation"] == "ok"
    assert warnings(outcome) == []  # no --model, no duplicate flag
    namespace = outcome["namespace"]
    assert namespace["model_tag"] == argv[2]
    for flag, dest in (("--tensor-parallel-size", "tensor_parallel_size"), ("--max-model-len", "max_model_len")):
        assert namespace[dest] == int(argv[argv.index(flag) + 1])
    assert namespace["gpu_memory_utilization"] == float(argv[argv.index("--gpu-memory-utilization") + 1])
    if "--nnodes" in argv:  # the native launcher on several nodes: vLLM's mp executor and its rendezvous
        assert namespace["distributed_executor_backend"] == "mp"
        assert (namespace["nnodes"], namespace["master_addr"], namespace["master_port"]) == (2, "10.0.0.1", 29501)
        assert namespace["node_rank"] == (1 if " on " in spec else 0)
        assert namespace["headless"] is (" on " in spec)
    elif flag_value(argv, "--distributed-executor-backend") == "mp":
        # The native launcher on one machine (the two-card desktop): the mp executor, no rendezvous flags.
        assert namespace["nnodes"] == 1 and not namespace["headless"]
        assert namespace["tensor_parallel_size"] * namespace["pipeline_parallel_size"] == 2
    else:
        assert namespace["distributed_executor_backend"] == "ray"
    assert namespace["tool_call_parser"] in DATA["tool_call_parsers"]


def flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


# --- errors and the rewriting beyond the probes -------------------------------------------------------------------

REJECTED = {
    "an unknown flag": (["--foo"], "vllm: error: unrecognized arguments: --foo"),
    "--disable-log-requests (removed in vLLM 0.17)": (
        ["--disable-log-requests"],
        "vllm: error: unrecognized arguments: --disable-log-requests",
    ),
    "--swap-space (removed)": (["--swap-space=4"], "vllm: error: unrecognized arguments: --swap-space=4"),
    "--swap-space with a separate value": (
        ["--swap-space", "4"],
        "vllm: error: unrecognized arguments: --swap-space 4",
    ),
    "--no-disable-log-stats (only --disable-log-stats exists)": (
        ["--no-disable-log-stats"],
        "vllm: error: unrecognized arguments: --no-disable-log-stats",
    ),
    "a bad int": (["--port", "abc"], "vllm serve: error: argument --port: invalid int value: 'abc'"),
    "a bad int for an aliased option": (
        ["-tp", "two"],
        "vllm serve: error: argument --tensor-parallel-size/-tp: invalid int value: 'two'",
    ),
    "a bad human-readable int": (
        ["--max-num-batched-tokens", "1.5K"],
        "vllm serve: error: argument --max-num-batched-tokens: Decimals are not allowed with binary suffixes like K. "
        "Did you mean to use 1.5k instead?",
    ),
    "a bad human-readable int that is no number": (
        ["--max-num-batched-tokens", "lots"],
        "vllm serve: error: argument --max-num-batched-tokens: invalid human_readable_int value: 'lots'",
    ),
    "a bad choice": (
        ["--dtype", "fp4"],
        "vllm serve: error: argument --dtype: invalid choice: 'fp4' (choose from 'auto', 'bfloat16', 'float', "
        "'float16', 'float32', 'half')",
    ),
    "a bad JSON value": (
        ["--default-chat-template-kwargs", "{x"],
        "vllm serve: error: argument --default-chat-template-kwargs: invalid loads value: '{x'",
    ),
    "--model without its value": (
        ["--model", "--port", "9000"],
        "vllm: error: argument --model: expected one argument",
    ),
}


@pytest.fixture(scope="module")
def rejected() -> dict[str, dict[str, Any]]:
    outcomes = double(parse=[BASELINE + words for words, _ in REJECTED.values()])["parsed"]
    return dict(zip(REJECTED, outcomes, strict=True))


@pytest.mark.parametrize("case", list(REJECTED))
def test_rejected_with_vllms_argparse_error(rejected: dict[str, dict[str, Any]], case: str) -> None:
    outcome = rejected[case]
    assert outcome.get("exit") == 2, outcome
    assert error_line(outcome) == REJECTED[case][1]
    top = REJECTED[case][1].startswith("vllm: ")
    assert outcome["stderr"].startswith("usage: vllm [-h] [-v]" if top else "usage: vllm serve [model_tag] [options]")


def test_an_optional_typed_value_fails_with_vllms_wrapper_message() -> None:
    """optional[int]: vLLM's _optional_type wraps int and reports the type, not `invalid int value`."""
    option = next(o for o in OPTIONS if o["type"] == "optional[int]")
    outcome = double(parse=[[*BASELINE, option["option_strings"][0], "x"]])["parsed"][0]
    assert outcome.get("exit") == 2
    assert error_line(outcome) == (
        f"vllm serve: error: argument {'/'.join(option['option_strings'])}: Value x cannot be converted to "
        "<class 'int'>."
    )


ACCEPTED = {
    "dotted keys merge into one JSON object; values are JSON, else human-readable ints, else strings": (
        [
            *["--compilation-config.pass_config.fuse_norm", "true", "--compilation_config.mode=3"],
            *["--compilation-config.cache_dir", "/c", "--compilation-config.max_cudagraph_capture_size", "1k"],
        ],
        {
            "compilation_config": {
                "pass_config": {"fuse_norm": True},
                "mode": 3,
                "cache_dir": "/c",
                "max_cudagraph_capture_size": 1000,
            }
        },
        [],
    ),
    "a dotted list with +": (
        ["--compilation-config.custom_ops+", "a,b", "--compilation-config.custom_ops+=c"],
        {"compilation_config": {"custom_ops": ["a", "b", "c"]}},
        [],
    ),
    "a dotted key given twice": (
        ["--speculative-config.method", "mtp", "--speculative-config.method", "eagle"],
        {"speculative_config": {"method": "eagle"}},
        ["WARNING: Found duplicate keys --speculative-config.method"],
    ),
    "-O <n> and -O=<n> (both become --optimization-level)": (
        ["-O", "1", "-O=0"],
        {"optimization_level": "0"},
        ["WARNING: Found duplicate keys --optimization-level"],
    ),
    "the empty string clears an optional value given before": (
        ["--max-log-len", "7", "--max-log-len", ""],
        {},
        ["WARNING: Found duplicate keys --max-log-len"],
    ),
    "'None' clears it too": (["--served-model-name", "None", "x"], {"served_model_name": [None, "x"]}, []),
    "a plain string where a dict or a string is taken": (
        ["--hf-overrides", "text"],
        {"hf_overrides": "text"},
        [],
    ),
    "vLLM's backend names are normalised": (
        ["--moe-backend", "Flashinfer-Cutlass"],
        {"moe_backend": "flashinfer_cutlass"},
        [],
    ),
    "--hf-token without a value": (["--hf-token"], {"hf_token": True}, []),
    "unique prefixes of long flags (argparse's allow_abbrev, as vLLM)": (
        ["--enforce-eag", "--gpu-memory-util", "0.5"],
        {"enforce_eager": True, "gpu_memory_utilization": 0.5},
        [],
    ),
    "the native launcher's flags and their aliases": (
        ["-n", "2", "-r", "1", "--headless", "--master-addr", "10.0.0.1", "--master-port", "29600"],
        {"nnodes": 2, "node_rank": 1, "headless": True, "master_addr": "10.0.0.1", "master_port": 29600},
        [],
    ),
    "the hybrid KV cache manager switch reaches the namespace": (
        ["--disable-hybrid-kv-cache-manager"],
        {"disable_hybrid_kv_cache_manager": True},
        [],
    ),
}


@pytest.fixture(scope="module")
def accepted() -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    parsed = double(parse=[BASELINE] + [BASELINE + words for words, _, _ in ACCEPTED.values()])["parsed"]
    return parsed[0], dict(zip(ACCEPTED, parsed[1:], strict=True))


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_accepted_as_vllm_rewrites_and_converts_it(
    accepted: tuple[dict[str, Any], dict[str, dict[str, Any]]], case: str
) -> None:
    baseline, outcomes = accepted
    _, expected, logged = ACCEPTED[case]
    assert changed(outcomes[case], baseline) == expected
    assert warnings(outcomes[case]) == logged


VERDICTS = {
    "a registered tool-call parser with auto tool choice": (
        ["--enable-auto-tool-choice", "--tool-call-parser", "gemma4"],
        "ok",
    ),
    "a reasoning parser vLLM registers, named in --structured-outputs-config": (
        ["--structured-outputs-config.reasoning_parser", "hy_v3"],
        "ok",
    ),
    "an unknown reasoning parser in --structured-outputs-config": (
        ["--structured-outputs-config", '{"reasoning_parser": "gpt_oss"}'],
        "KeyError: 'invalid reasoning parser: gpt_oss (chose from { " + ",".join(DATA["reasoning_parsers"]) + " })'",
    ),
    "an executor backend vLLM does not have": (
        ["--distributed-executor-backend", "slurm"],
        "ValueError: hy3spark TEST DOUBLE: --distributed-executor-backend slurm is none of vLLM 0.23's executor "
        "backends (ray, mp, uni, external_launcher), which vLLM's ParallelConfig refuses",
    ),
}


def test_vllms_namespace_checks_use_the_tables_parser_names() -> None:
    outcomes = double(parse=[BASELINE + words for words, _ in VERDICTS.values()])["parsed"]
    assert {case: o["validation"] for case, o in zip(VERDICTS, outcomes, strict=True)} == {
        case: verdict for case, (_, verdict) in VERDICTS.items()
    }


# --- the `vllm` command itself -------------------------------------------------------------------------------------


def _vllm(*words: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(DOUBLE / "src")}
    return subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", *words],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_the_command_rejects_a_removed_flag_before_starting() -> None:
    result = _vllm("serve", "probe-org/probe-model", "--disable-log-requests")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: vllm [-h] [-v]")
    assert result.stderr.strip().splitlines()[-1] == "vllm: error: unrecognized arguments: --disable-log-requests"


def test_the_command_raises_vllms_error_for_a_served_name_without_a_model() -> None:
    result = _vllm("serve", "--served-model-name", "x")
    assert result.returncode == 1
    probe = next(p for p in PROBES if p["argv"] == ["vllm", "serve", "--served-model-name", "x"])
    assert result.stderr.strip().splitlines()[-1] == probe["exception"]


if __name__ == "__main__":
    _child()
