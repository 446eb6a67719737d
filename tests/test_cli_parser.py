"""The command line's parser: one builder per subcommand (hy3spark.cli.COMMANDS), each command's options parsed
as a user types them, every option explained in --help, and --help answered quickly without the heavy imports.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hy3spark import cli

# One command line per subcommand, with every option it has, and what the parser must make of it.
CASES = {
    "render": (["x.yml", "--out", "d", "--only", "env", "--diff", "old", "--format", "json"],
               {"spec": Path("x.yml"), "out": Path("d"), "only": "env", "diff": Path("old"), "format": "json"}),
    "validate": (["x.yml"], {"spec": Path("x.yml")}),
    "plan": (["--calibrate", "serve.log", "--overhead", "1.5", "--free", "110", "--json"],
             {"spec": None, "calibrate": Path("serve.log"), "overhead": 1.5, "free": 110.0, "json": True}),
    "transport": (["a.log", "-", "--allow-socket", "--json"],
                  {"logs": [Path("a.log"), Path("-")], "allow_socket": True, "json": True}),
    "up": (["x.yml", "--tags", "ray", "--limit", "spark-a", "--json", "--runs-dir", "r", "--full-run", "-e", "a=1",
            "--extra-vars", "@v.yml", "--skip-tags", "model", "--check", "--diff"],
           {"spec": Path("x.yml"), "tags": "ray", "limit": "spark-a", "json": True, "runs_dir": Path("r"),
            "full_run": True, "extra_vars": ["a=1", "@v.yml"], "skip_tags": "model", "check": True, "diff": True}),
    "down": (["--tags", "serve", "--limit", "spark-b", "-e", "{\"b\": 2}", "--skip-tags", "head", "--check"],
             {"tags": "serve", "limit": "spark-b", "extra_vars": ['{"b": 2}'], "skip_tags": "head", "check": True,
              "diff": False, "json": False}),
    "check": (["--dry-run", "--full-run", "--tags", "network", "-e", "a=1", "-e", "b=2", "--skip-tags", "gpu"],
              {"dry_run": True, "full_run": True, "tags": "network", "extra_vars": ["a=1", "b=2"],
               "skip_tags": "gpu"}),
    "status": (["--limit", "spark-a", "--json", "-e", "ansible_port=2222"],
               {"limit": "spark-a", "json": True, "extra_vars": ["ansible_port=2222"]}),
    "logs": (["--no-follow", "-n", "5", "--runs-dir", "r"], {"no_follow": True, "lines": 5, "runs_dir": Path("r")}),
    "bench": (["--label", "tp2", "--target", "http://h:1/v1", "--tool", "vllm", "--concurrency", "1,8",
               "--requests", "3", "--max-tokens", "9", "--prompt-tokens", "7", "--prompts", "p.txt", "--processor",
               "tok", "--labbook", "lab.md", "--runs-dir", "r", "--json", "--link", "record", "-e", "a=1"],
              {"label": "tp2", "target": "http://h:1/v1", "tool": "vllm", "concurrency": "1,8", "requests": 3,
               "max_tokens": 9, "prompt_tokens": 7, "prompts": Path("p.txt"), "processor": "tok",
               "labbook": Path("lab.md"), "runs_dir": Path("r"), "json": True, "link": "record",
               "extra_vars": ["a=1"]}),
    "labbook": (["--compare", "two-card-tp", "two-card-pp", "--labbook", "lab.md", "--runs-dir", "r", "--json"],
                {"compare": ["two-card-tp", "two-card-pp"], "labbook": Path("lab.md"), "runs_dir": Path("r"),
                 "json": True}),
    "profiles": ([], {}),
}


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_one_builder_per_command_and_every_command_is_tested() -> None:
    built = []
    for add in cli.COMMANDS:
        sub = argparse.ArgumentParser().add_subparsers()
        add(sub)
        assert len(sub.choices) == 1, f"{add.__name__} adds {list(sub.choices)}"
        built += list(sub.choices)
    assert built == list(subparsers(cli.build_parser())) == list(CASES)


@pytest.mark.parametrize("command", list(CASES))
def test_each_commands_options_parse(command: str) -> None:
    argv, expected = CASES[command]
    args = cli.build_parser().parse_args([command, *argv])
    assert args.command == command
    assert args.func is getattr(cli, f"cmd_{command}")
    assert {key: getattr(args, key) for key in expected} == expected


@pytest.mark.parametrize("command", ["up", "down", "check", "status"])
def test_the_passthrough_defaults_pass_nothing_on(command: str) -> None:
    args = cli.build_parser().parse_args([command])
    assert args.extra_vars == []
    assert getattr(args, "skip_tags", None) is None
    assert getattr(args, "check", False) is False and getattr(args, "diff", False) is False


@pytest.mark.parametrize(("argv", "unknown"), [
    (["check", "--check"], "--check"),  # preflight changes nothing; --dry-run is site.yml --check --diff
    (["check", "--diff"], "--diff"),
    (["status", "--skip-tags", "x"], "--skip-tags"),
    (["status", "--check"], "--check"),
    (["logs", "-e", "a=1"], "-e"),
    (["render", "-e", "a=1"], "-e"),
])
def test_options_a_command_does_not_take_are_usage_errors(argv: list[str], unknown: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(argv)
    assert info.value.code == 2
    assert f"unrecognized arguments: {unknown}" in capsys.readouterr().err


def test_every_option_of_every_command_is_explained() -> None:
    for name, parser in subparsers(cli.build_parser()).items():
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue
            assert action.help and len(action.help) > 10, f"{name} {action.option_strings or action.dest}"


@pytest.mark.parametrize("command", ["up", "down", "check", "status"])
def test_help_says_extra_vars_go_to_ansible_playbook_as_given_and_secrets_are_refused(command: str) -> None:
    text = " ".join(subparsers(cli.build_parser())[command].format_help().split())
    assert "-e VARS, --extra-vars VARS" in text
    assert "These go to ansible-playbook as given" in text
    assert "process list" in text and "refuses" in text and "Secrets go by environment variable" in text
    assert "KEY=VALUE" in text and "@FILE" in text and "repeatable" in text
    if command in ("up", "down"):
        assert "--check" in text and "--diff" in text and "--skip-tags TAGS" in text


def test_help_needs_none_of_the_heavy_imports() -> None:
    """What keeps --help fast: building the parser imports neither Ansible, ansible-runner, pydantic nor rich."""
    code = ("import sys\nfrom hy3spark import cli\ncli.build_parser().format_help()\n"
            "heavy = ('ansible', 'ansible_runner', 'pydantic', 'rich', 'jinja2', 'yaml')\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "[]"


def test_help_answers_well_under_a_second() -> None:
    exe = Path(sys.executable).parent / "hy3spark"
    times = []
    for _ in range(5):
        start = time.perf_counter()
        subprocess.run([str(exe), "--help"], capture_output=True, check=True, timeout=60)
        times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.5, times
