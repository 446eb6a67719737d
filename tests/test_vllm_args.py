"""serving.extra_args against vLLM 0.23.0's real option table (hy3spark/engines/vllm_args.py).

The packaged table is derived from the option table extracted from the real vLLM parser
(tests/fixtures/vllm-0.23.0/serve-args.json); the probes recorded beside it (argv lists the real parser was given,
and what it did) are replayed here: what vLLM refused, hy3spark refuses; what vLLM took, hy3spark takes unless a
spec field, a secret or the launcher owns it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hy3spark.engines import vllm_args

REPO = Path(__file__).resolve().parent.parent
FIXTURE = json.loads((REPO / "tests" / "fixtures" / "vllm-0.23.0" / "serve-args.json").read_text())
BASELINE = ["vllm", "serve", "probe-org/probe-model"]
PROBES = [p for p in FIXTURE["underscore_normalisation"]["probes"] if p["argv"][:3] == BASELINE]
HELD = set(vllm_args.OWNED) | set(vllm_args.SECRET) | vllm_args.LAUNCHER | set(vllm_args.OTHER)


def test_the_packaged_table_is_the_one_the_script_derives_from_the_fixture() -> None:
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "make_vllm_flags.py"), "--check"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    table = vllm_args.table()
    assert table["vllm_version"] == FIXTURE["vllm_version"] == "0.23.0"
    assert len(table["options"]) == len([o for o in FIXTURE["options"] if not o["positional"]])


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: " ".join(p["argv"][3:]))
def test_every_recorded_probe_is_judged_as_vllm_judged_it(probe: dict) -> None:
    words = probe["argv"][3:]
    found = vllm_args.check(words)
    if not probe["ok"]:
        assert found, f"vLLM refused {words} ({probe.get('error')}), hy3spark took it"
    elif set(probe.get("changed", {})) & HELD:
        assert found, f"{words} sets {probe['changed']}, which hy3spark holds"
    else:
        assert found == [], f"vLLM took {words}; hy3spark said {found}"


# (extra_args, index of the refused word, what the message says): the smuggling the issue found, and its cousins.
REFUSED = [
    (["--api_key=abc"], 0, "'--api_key' is vLLM's --api-key: it would put a secret on the process command line"),
    (["--api-key", "abc"], 0, "'--api-key': it would put a secret"),
    (["--api-k=abc"], 0, "'--api-k' is vLLM's --api-key: it would put a secret"),
    (["--hf-token=abc"], 0, "'--hf-token': it would put a secret on the process command line"),
    (["--hf_token", "abc"], 0, "'--hf_token' is vLLM's --hf-token"),
    (["-tp", "4"], 0, "'-tp' is vLLM's --tensor-parallel-size: it is set from serving.tensor_parallel"),
    (["--tensor_parallel_size=4"], 0, "is vLLM's --tensor-parallel-size"),
    (["--tensor-parallel", "4"], 0, "'--tensor-parallel' is vLLM's --tensor-parallel-size"),
    (["-pp", "2"], 0, "it is set from serving.pipeline_parallel"),
    (["--port=9000"], 0, "it is set from serving.port"),
    (["--host", "0.0.0.0"], 0, "it is set from serving.host"),
    (["--model", "x/y"], 0, "it is set from model.repo"),
    (["--revision=main"], 0, "it is set from model.revision"),
    (["--served-model-name", "a", "b"], 0, "it is set from serving.served_name"),
    (["--max_model_len=1000"], 0, "it is set from serving.max_model_len"),
    (["--speculative-config.method", "mtp"], 0, "it is set from serving.speculative_config"),
    (["--download-dir", "/tmp"], 0, "it is set from model.cache_dir"),
    (["--distributed-executor-backend=mp"], 0, "hy3spark's launcher decides where the ranks run"),
    (["--data-parallel-size", "2"], 0, "hy3spark's launcher decides"),
    (["-dp", "2"], 0, "hy3spark's launcher decides"),
    (["--nnodes", "2"], 0, "hy3spark's launcher decides"),
    (["--config", "x.yaml"], 0, "reads more flags from a YAML file"),
    (["--help"], 0, "prints the help and exits"),
    (["--max-num"], 0, "'--max-num' is ambiguous in vLLM 0.23.0: it could be --max-num-batched-tokens"),
    (["--max_num_batched_tokens=8k"], 0, "it is set from serving.max_num_batched_tokens"),
    (["--swap-space", "4"], 0, "'--swap-space' is not a `vllm serve` option in vLLM 0.23.0"),
    (["--no-disable-log-stats"], 0, "is not a `vllm serve` option"),
    (["-tp_size", "2"], 0, "single-dash words must be one of its short aliases exactly"),
    (["-q4"], 0, "single-dash words must be one of its short aliases exactly"),
    (["--seed"], 0, "'--seed' needs a value"),
    (["--seed", "--enforce-eager"], 0, "'--seed' needs a value"),
    (["--enable-prefix-caching=1"], 0, "takes no value"),
    (["serve-me"], 0, "is a value with no option before it"),
    (["--seed", "1", "2"], 2, "'2' is a value with no option before it"),
    (["--"], 0, "is a value with no option before it"),
    (["--async-scheduling", "--async_scheduling"], 1, "given twice (first at extra_args[0])"),
    (["--block-size=16", "--block-size", "32"], 1, "given twice"),
]


@pytest.mark.parametrize(("args", "index", "message"), REFUSED, ids=lambda v: repr(v) if isinstance(v, list) else "")
def test_smuggled_and_unknown_options_are_refused(args: list[str], index: int, message: str) -> None:
    found = vllm_args.check(args)
    assert any(i == index and message in text for i, text in found), found


def test_a_refusal_never_echoes_the_value() -> None:
    for args in (["--api-key=s3cret-value"], ["--api_key", "s3cret-value"], ["--hf-token=s3cret-value"]):
        assert all("s3cret" not in text for _, text in vllm_args.check(args))


ACCEPTED = [
    ["--enable-prefix-caching"],
    ["--no-enable-prefix-caching"],
    ["--no_enable_prefix_caching"],
    ["--max-num-partial-prefills", "2"],
    ["--max_long_partial_prefills=1"],
    ["--async-scheduling"],
    ["--seed", "-1"],
    ["--allowed-origins=*"],
    ["-q", "awq"],
    ["--quantization=awq"],
    ["-O3"],
    ["-O", "3"],
    ["--compilation-config.level", "3"],
    ["--lora-modules", "a=/m/a", "b=/m/b", "--enable-lora"],
    ["--middleware", "a.b", "--middleware", "c.d"],
    ["--hf-overrides", '{"rope_scaling": null}'],
    ["--enable-eplb"],
    ["--block-size", "16", "--enable-chunked-prefill"],
]


@pytest.mark.parametrize("args", ACCEPTED, ids=repr)
def test_real_options_pass(args: list[str]) -> None:
    assert vllm_args.check(args) == []


# --- the same words through the engine double's argparse parser, built from the same fixture -----------------------
_RESOLVE_IN_THE_DOUBLE = """
import contextlib, io, json, sys
from vllm.double import args as cli_args

top = cli_args.build_parser()
serve = top._subparsers._group_actions[0].choices["serve"]
answers = []
for word in json.load(sys.stdin):
    spelled = cli_args._spelled([word])[0]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            found = serve._parse_optional(spelled)
    except SystemExit:
        answers.append("<ambiguous>")
        continue
    action = found[0] if found else None
    answers.append(action.dest if action is not None else None)
json.dump(answers, sys.stdout)
"""


def _words() -> list[str]:
    """Every long option string of the table, written with underscores, with `=x`, and cut to every prefix; and
    words that are no option. (Single-dash words are left out on purpose: argparse reads `-q4` as `-q 4`, hy3spark
    refuses anything but an exact alias.)"""
    words = {"--swap-space", "--api-key-file", "--hostname", "--port-range", "--no-disable-log-stats", "--x"}
    for option in vllm_args.table()["options"]:
        for string in option["strings"]:
            if not string.startswith("--"):
                words.add(string)
                continue
            words |= {string, "--" + string[2:].replace("-", "_"), f"{string}=x"}
            words |= {string[:cut] for cut in range(3, len(string))}
    return sorted(words)


def test_every_spelling_and_prefix_resolves_as_argparse_resolves_it() -> None:
    """hy3spark's resolver against argparse itself (the double's parser: vLLM's table, allow_abbrev on)."""
    words = _words()
    result = subprocess.run([sys.executable, "-c", _RESOLVE_IN_THE_DOUBLE], input=json.dumps(words),
                            capture_output=True, text=True, check=False, timeout=300,
                            env={"PYTHONPATH": str(REPO / "tests" / "engine_double" / "src"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    theirs = json.loads(result.stdout)
    differ = []
    for word, dest in zip(words, theirs, strict=True):
        option, why = vllm_args._resolve(vllm_args._spelled(word)[0])
        ours = option["dest"] if option else ("<ambiguous>" if "ambiguous" in why else None)
        if ours != dest:
            differ.append((word, ours, dest))
    assert len(words) > 3000
    assert differ == []
