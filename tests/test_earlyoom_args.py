"""plugins/module_utils/earlyoom.py: the one reading of /etc/default/earlyoom that the module hy3spark_earlyoom_info
(on a node) and the preflight filter (on the controller) share.

Imported by full name, as Ansible imports it for both: the checkout's link
collections/ansible_collections/hy3spark/cluster -> the repo makes `ansible_collections.hy3spark.cluster` importable.
The filter's own tests (roles/preflight/tests/unit) cover the systemd quoting cases through the same functions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from collection_plugins import plugin

REPO = Path(__file__).resolve().parent.parent
eo = plugin("module_utils", "earlyoom")
module = plugin("modules", "hy3spark_earlyoom_info")
MARKER = "Managed by hy3spark from the cluster spec; edit the spec and re-render instead of this file."
SPARKRUN_PREFER = "(vllm|VLLM|sglang|llama-server|llama-cli|trtllm|tritonserver|ray|python3|python)"
# What each file gives: (the value systemd's EnvironmentFile= yields, the argv earlyoom gets, a quoting problem).
CASES = {
    "ours": (f'# {MARKER}\nEARLYOOM_ARGS="-r 3600 -m 4 --avoid ^(vllm|ray) --prefer ^(chrome|code)$"\n',
             "-r 3600 -m 4 --avoid ^(vllm|ray) --prefer ^(chrome|code)$",
             ["-r", "3600", "-m", "4", "--avoid", "^(vllm|ray)", "--prefer", "^(chrome|code)$"], None),
    "sparkrun": (f"# Configured by: sparkrun setup earlyoom\nEARLYOOM_ARGS=\"-m 3 --prefer '{SPARKRUN_PREFER}'\"\n",
                 f"-m 3 --prefer '{SPARKRUN_PREFER}'", ["-m", "3", "--prefer", SPARKRUN_PREFER], None),
    # systemd keeps what follows the closing quote, a `#` included: it is no comment there.
    "trailing text": ('export EARLYOOM_ARGS="-r 60"  # a comment\n', "-r 60  # a comment",
                      ["-r", "60", "#", "a", "comment"], None),
    "unquoted": ("EARLYOOM_ARGS=-m 3 --prefer (vllm|python)\n", "-m 3 --prefer (vllm|python)",
                 ["-m", "3", "--prefer", "(vllm|python)"], None),
    "last line wins": ("EARLYOOM_ARGS=-m 1\n# EARLYOOM_ARGS=-m 9\nEARLYOOM_ARGS='-m 2'\n", "-m 2", ["-m", "2"], None),
    "unclosed file quote": ('EARLYOOM_ARGS="-m 3 -s 5\n', "-m 3 -s 5", ["-m", "3", "-s", "5"], eo.UNBALANCED),
    "unclosed value quote": ("EARLYOOM_ARGS=\"-m 3 --prefer '(a\"\n", "-m 3 --prefer '(a",
                             ["-m", "3", "--prefer", "'(a"], eo.UNBALANCED),
}


def test_the_module_and_the_filter_use_this_parser_and_no_copy_of_their_own() -> None:
    assert plugin("filter", "preflight").earlyoom_args is eo
    assert (module.assignment, module.env_file_value, module.split_args, module.option) == (
        eo.assignment, eo.env_file_value, eo.split_args, eo.option)
    for path in ("plugins/filter/preflight.py", "plugins/modules/hy3spark_earlyoom_info.py"):
        text = (REPO / path).read_text()
        assert "EARLYOOM_ARGS=" not in text.replace("EARLYOOM_ARGS={", ""), f"{path} parses the file itself"
        assert "shlex" not in text, f"{path} splits arguments itself"


@pytest.mark.parametrize("name", CASES)
def test_the_parser_reads_the_file_as_systemd_hands_it_to_earlyoom(name: str) -> None:
    text, value, argv, problem = CASES[name]
    raw = eo.assignment(text)
    assert raw is not None
    assert eo.env_file_value(raw) == value
    assert eo.split_args(value) == argv == eo.file_args(text)
    assert eo.quoting_problem(raw) == problem


@pytest.mark.parametrize("name", CASES)
def test_the_module_reports_what_the_parser_reads(name: str, tmp_path: Path) -> None:
    text, value, argv, problem = CASES[name]
    path = tmp_path / "earlyoom"
    path.write_text(text)
    info = module._config(str(path), MARKER, {"conffile_md5": None})
    assert (info["args"], info["argv"], info["problems"]) == (value, argv, [problem] if problem else [])
    assert info["provenance"] == {"ours": "hy3spark", "sparkrun": "sparkrun"}.get(name, "unknown")


def test_a_file_without_earlyoom_args() -> None:
    assert eo.assignment("# EARLYOOM_ARGS=-m 5\nOTHER=1\n") is None
    assert eo.file_args("") is None
    assert eo.file_args("EARLYOOM_ARGS=\n") == []


def test_option_takes_the_last_value_of_either_form() -> None:
    assert eo.option(["--prefer", "a", "--prefer=b=c"], "--prefer") == "b=c"
    assert eo.option(["--prefer=b", "--prefer", "a"], "--prefer") == "a"
    assert eo.option(["-m", "3", "--prefer"], "--prefer") is None
    assert eo.option(["--preferred", "a"], "--prefer") is None


def test_an_unclosed_quote_is_found_on_a_line_of_any_length() -> None:
    """A long --avoid list (hundreds of characters) with its closing quote lost: still named."""
    words = " ".join(f"proc{i}" for i in range(60))
    raw = f'"-m 3 --avoid {words}'
    assert len(raw) > 300
    assert eo.quoting_problem(raw) == eo.UNBALANCED
    assert eo.quoting_problem(raw + '"') is None
