"""No value can change a rendered file's structure: every interpolation in templates/ goes through a serialiser.

The test parses each template with Jinja (the AST, not a regex) and looks at every `{{ ... }}` it outputs. The last
filter applied must be a serialiser for the file's format, from the allowlists below; anything else, a bare
`{{ value }}` above all, fails with the template, line and what would be allowed there. Comments are their own
context: a comment ends only at a line break, so there the serialiser is `one_line`, which refuses line breaks (and
`quote` or `to_json` would not do there, nor would `one_line` anywhere else).

What each serialiser guarantees, whatever the value:
- `to_json`, `to_nice_json`: a JSON value, which is also a YAML flow value (JSON strings never hold a raw line
  break; non-ASCII is escaped), so a node named `no` stays the string "no" and a newline cannot start a YAML key;
- `to_nice_yaml`: a YAML document, for a whole mapping at the start of a line;
- `quote`: one shell word; `map('quote') | join(' ')` words joined by a space (the separator is checked too);
- `hy3spark.cluster.env_key`, `hy3spark.cluster.env_value`: an env file's NAME and its one-line value (the
  collection's plugins/filter/serialisers.py, which hy3spark render loads as well); in secrets.env, which bash
  sources, `env_value(name) | quote`: one line, one shell word.

The secrets file is no template file (vllm_serve writes it from a Jinja block in its vars, the secrets lookup needs
the controller), so that block is walked as well.

A value that is not a spec value (a loop index, a constant) may be emitted bare only through ALLOW_BARE, with the
reason written there. It is empty today: every interpolation is serialised, constants included (it costs nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from jinja2 import Environment, nodes

from hy3spark.errors import SpecError
from hy3spark.render import render_all, serialisers
from hy3spark.spec import load_spec

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "templates"
FQCN = "hy3spark.cluster."

# A template's output format, by the name it renders to (the template name without .j2).
FORMAT_BY_SUFFIX = {".yaml": "yaml", ".yml": "yaml", ".json": "json", ".sh": "sh", ".env": "env",
                    ".service": "systemd"}
FORMAT_BY_NAME = {
    "earlyoom.j2": "env",  # /etc/default/earlyoom: systemd's EnvironmentFile= of earlyoom.service
    "openmpi-hostfile.j2": "hostfile",  # Open MPI's hostfile: one `HOST slots=N` line per node, `#` comments
    # OpenSSH's configs (the mpi launcher's): `Keyword arguments` lines, `#` comments.
    "mpi-sshd_config.j2": "ssh",
    "mpi-ssh_config.j2": "ssh",
    # The port table (hy3spark/ports.py): `PORT/tcp bind ADDR from REACH: what (field)` lines, `#` comments.
    "ports.txt.j2": "text",
    # hy3spark's nftables script (roles/firewall): nft's own grammar, `#` comments.
    "firewall.nft.j2": "nft",
}
# Per format, the filter chains an interpolation may end in, outermost first: ("quote", "x") is `x | quote`.
SERIALISERS: dict[str, set[tuple[str, ...]]] = {
    "yaml": {("to_json",), ("to_nice_json",), ("to_nice_yaml",)},
    "json": {("to_json",), ("to_nice_json",)},
    "sh": {("quote",)},
    "env": {(f"{FQCN}env_key",), (f"{FQCN}env_value",)},
    # An env file that bash sources (secrets.env, `set -a; . file`): one NAME=value line each, the value a shell word.
    "sourced-env": {(f"{FQCN}env_key",), ("quote", f"{FQCN}env_value")},
    # Open MPI splits a hostfile line at blanks: a host is one line (one_line) and one word (quote).
    "hostfile": {("quote", f"{FQCN}one_line")},
    # OpenSSH reads a keyword's arguments to the end of its line (one_line); its quoting is not the shell's, so no
    # `quote`: what lands there is an address the spec's grammar allows or a path of hy3spark's, neither with a blank.
    # A number is one word (int).
    "ssh": {(f"{FQCN}one_line",), ("int",)},
    # A line-oriented text file read by people and by tests/soundness.py: text on one line, numbers as ints.
    "text": {(f"{FQCN}one_line",), ("int",)},
    # nftables: an address or network through nft_address (ipaddress's canonical text: digits, '.', ':', '/', hex
    # letters; nothing nft reads as a separator, a brace or a statement), a name through nft_name (letters, digits,
    # '_', '.', '-': one token, and inside "..." nothing that ends the quotes, which have no escapes, or makes a
    # wildcard), a port through int. No to_json or quote: nft's strings are not JSON's or the shell's.
    "nft": {(f"{FQCN}nft_address",), (f"{FQCN}nft_name",), ("int",)},
    # A systemd unit (docs/restarts.md): each value one word systemd reads literally (systemd_word: no blank, quote,
    # backslash, $ or %, so it is neither split, unquoted, expanded nor a specifier), `#` comments.
    "systemd": {(f"{FQCN}systemd_word",)},
}
# formats with `#` line comments (JSON has none)
COMMENTS = {"yaml", "sh", "env", "sourced-env", "hostfile", "ssh", "text", "nft", "systemd"}
COMMENT_SERIALISERS = {(f"{FQCN}one_line",)}
# ("templates/<name>", dotted name) -> why it may be emitted without a serialiser. Only values no spec can set.
ALLOW_BARE: dict[tuple[str, str], str] = {}
LINE_BREAKS = serialisers().LINE_BREAKS


def file_format(template: str) -> str:
    if template in FORMAT_BY_NAME:
        return FORMAT_BY_NAME[template]
    suffix = Path(template.removesuffix(".j2")).suffix
    if suffix not in FORMAT_BY_SUFFIX:
        raise AssertionError(f"templates/{template}: no known format; add it to FORMAT_BY_NAME with its reader")
    return FORMAT_BY_SUFFIX[suffix]


@dataclass(frozen=True)
class Interpolation:
    line: int
    expr: nodes.Expr
    in_comment: bool


def interpolations(source: str) -> Iterator[Interpolation]:
    """Every `{{ ... }}` the template outputs, in document order, with whether it sits in a `#` line comment."""
    ast = Environment(trim_blocks=True, keep_trailing_newline=True).parse(source)
    current = [""]  # the text of the line being written, up to the interpolation

    def walk(node: nodes.Node) -> Iterator[Interpolation]:
        for child in node.iter_child_nodes():
            if isinstance(child, nodes.Output):
                for part in child.nodes:
                    if isinstance(part, nodes.TemplateData):
                        text = current[0] + part.data
                        current[0] = text.rsplit("\n", 1)[-1]
                    else:
                        yield Interpolation(part.lineno, part, current[0].lstrip().startswith("#"))
                        current[0] += "x"  # something was written on this line
            else:
                yield from walk(child)

    yield from walk(ast)


def dotted(expr: nodes.Expr) -> str | None:
    if isinstance(expr, nodes.Name):
        return expr.name
    if isinstance(expr, nodes.Getattr):
        base = dotted(expr.node)
        return f"{base}.{expr.attr}" if base else None
    return None


def filters(expr: nodes.Expr) -> tuple[str, ...]:
    """The filters an expression ends in, outermost first; `map('F') | join(sep)` counts as F (each item through F,
    joined by a separator that is no line break)."""
    names: list[str] = []
    while isinstance(expr, nodes.Filter) and expr.node is not None:
        mapped, sep = expr.node, expr.args[0] if expr.args else nodes.Const("")
        if (expr.name == "join" and isinstance(mapped, nodes.Filter) and mapped.name == "map"
                and mapped.node is not None and len(mapped.args) == 1 and isinstance(mapped.args[0], nodes.Const)
                and isinstance(sep, nodes.Const) and not any(c in LINE_BREAKS for c in str(sep.value))):
            names.append(str(mapped.args[0].value))
            expr = mapped.node
            continue
        names.append(expr.name)
        expr = expr.node
    return tuple(names)


def unserialised(template: str, source: str, fmt: str | None = None) -> list[str]:
    """One line per interpolation that does not end in a serialiser for where it is."""
    fmt = fmt or file_format(template)
    problems = []
    for found in interpolations(source):
        comment = found.in_comment and fmt in COMMENTS
        allowed = COMMENT_SERIALISERS if comment else SERIALISERS[fmt]
        name = dotted(found.expr)
        if name and (template, name) in ALLOW_BARE:
            continue
        used = filters(found.expr)
        if not any(used[:len(chain)] == chain for chain in allowed):
            where = f"a {fmt} comment" if comment else f"{fmt}"
            what = f"ends in filter {used[0]!r}" if used else "has no serialiser"
            ends = sorted(" | ".join(reversed(chain)) for chain in allowed)
            problems.append(f"{template}:{found.line}: an interpolation that {what}; in {where} it must end in "
                            f"one of {ends}")
    return problems


def templates() -> list[str]:
    return sorted(p.relative_to(TEMPLATES).as_posix() for p in TEMPLATES.rglob("*.j2"))


def test_every_template_has_a_known_format() -> None:
    assert {t: file_format(t) for t in templates()}  # raises on an unknown one
    assert "inventory/hosts.yml.j2" in templates() and "node.env.j2" in templates()


@pytest.mark.parametrize("template", templates())
def test_every_interpolation_ends_in_a_serialiser(template: str) -> None:
    problems = unserialised(f"templates/{template}", (TEMPLATES / template).read_text(), file_format(template))
    assert not problems, "\n".join(problems)


def test_the_secrets_file_serialises_every_value() -> None:
    """secrets.env is written by vllm_serve from a Jinja block in its vars (the lookup needs the controller)."""
    block = yaml.safe_load((REPO / "roles/vllm_serve/vars/main.yml").read_text())["__vllm_serve_secrets"]
    assert "vllm_serve_secret_env" in block
    problems = unserialised("roles/vllm_serve/vars/main.yml:__vllm_serve_secrets", block, "sourced-env")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("template", "source", "expected"), [
    # The defects this test exists for: a bare value in YAML (the inventory injection), in an env file, in shell.
    ("hosts.yml.j2", "all:\n  hosts:\n    {{ name }}:\n      ansible_user: {{ user | to_json }}\n",
     "hosts.yml.j2:3: an interpolation that has no serialiser; in yaml it must end in one of"),
    ("node.env.j2", "{% for k, v in env.items() %}\n{{ k | hy3spark.cluster.env_key }}={{ v }}\n{% endfor %}\n",
     "node.env.j2:2: an interpolation that has no serialiser"),
    ("serve.sh.j2", "#!/bin/bash\nexec {{ argv | join(' ') }}\n",
     "serve.sh.j2:2: an interpolation that ends in filter 'join'; in sh it must end in one of ['quote']"),
    # A serialiser of the wrong format, or one applied before something that undoes it.
    ("x.json.j2", "{{ data | to_nice_yaml }}\n", "ends in filter 'to_nice_yaml'; in json"),
    ("x.sh.j2", "echo {{ (word | quote) ~ suffix }}\n", "has no serialiser; in sh"),
    ("x.sh.j2", "echo {{ word | quote | upper }}\n", "ends in filter 'upper'"),
    ("x.sh.j2", "echo {{ words | map('quote') | join('\\n') }}\n", "ends in filter 'join'"),
    # In a comment only one_line will do, and one_line will not do outside one.
    ("x.sh.j2", "# built for {{ name | quote }}\n",
     "in a sh comment it must end in one of ['hy3spark.cluster.one_line']"),
    ("x.yml.j2", "# {{ a | hy3spark.cluster.one_line }}\nkey: {{ b | hy3spark.cluster.one_line }}\n",
     "x.yml.j2:2: an interpolation that ends in filter 'hy3spark.cluster.one_line'; in yaml"),
    # A chain: in a file bash sources, quote alone lets a newline through (a second line); env_value must come first.
    ("secrets.env", "{{ k | hy3spark.cluster.env_key }}={{ v | quote }}\n",
     "in sourced-env it must end in one of ['hy3spark.cluster.env_key', 'hy3spark.cluster.env_value | quote']"),
    ("secrets.env", "{{ k | hy3spark.cluster.env_key }}={{ v | quote | hy3spark.cluster.env_value(k) }}\n",
     "ends in filter 'hy3spark.cluster.env_value'; in sourced-env"),
    # A loop index is not a spec value, but still needs its ALLOW_BARE entry.
    ("x.yml.j2", "{% for i in items %}\nn{{ loop.index }}: {{ i | to_json }}\n{% endfor %}\n", "x.yml.j2:2:"),
])
def test_the_walk_finds_an_unserialised_interpolation(template: str, source: str, expected: str) -> None:
    problems = unserialised(template, source, "sourced-env" if template == "secrets.env" else None)
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_walk_accepts_serialised_interpolations_and_allowed_bare_names(monkeypatch: pytest.MonkeyPatch) -> None:
    source = ("#!/bin/sh\n# {{ name | hy3spark.cluster.one_line }}\n{% if x %}\nrun {{ a | quote }} "
              "{{ argv | map('quote') | join(' ') }}\n{% endif %}\n")
    assert unserialised("x.sh.j2", source) == []
    assert unserialised("s.env", "A={{ v | hy3spark.cluster.env_value('A') | quote }}\n", "sourced-env") == []
    monkeypatch.setitem(ALLOW_BARE, ("x.yml.j2", "loop.index"), "a counter, not a spec value")
    assert unserialised("x.yml.j2", "{% for i in items %}\nn{{ loop.index }}: {{ i | to_json }}\n{% endfor %}\n") == []
    with pytest.raises(AssertionError, match="no known format"):
        unserialised("x.conf.j2", "{{ a }}\n")


# --- the serialisers themselves ------------------------------------------------------------------------------------
FILTERS = serialisers()


@pytest.mark.parametrize("value", ["a\nLD_PRELOAD=/tmp/x.so", "a\rb", "a\x00b", "a\u2028b", "a\x85b", "a\vb"])
def test_env_value_and_one_line_refuse_every_line_break(value: str) -> None:
    with pytest.raises(FILTERS.UnsafeValue, match=r"^MY_KEY: the value holds .* a value must be one line$"):
        FILTERS.env_value(value, "MY_KEY")
    with pytest.raises(FILTERS.UnsafeValue, match=r"^node name: "):
        FILTERS.one_line(value, "node name")


def test_env_value_passes_one_line_values_through_unchanged() -> None:
    for value in ("", "it's \"quoted\"", "$HOME and ${PATH}", "a b  c", "Grüße — 東京", "=rocep1s0f1"):
        assert FILTERS.env_value(value, "K") == value
    assert FILTERS.env_value(9000, "K") == "9000"
    with pytest.raises(FILTERS.UnsafeValue, match="K: NoneType is not text"):
        FILTERS.env_value(None, "K")
    with pytest.raises(FILTERS.UnsafeValue, match="K: list is not text"):
        FILTERS.env_value(["a"], "K")


def test_env_value_quoted_refuses_what_would_end_its_quotes() -> None:
    assert FILTERS.env_value("-m 5 --prefer ^(chrome)$", "EARLYOOM_ARGS", quoted=True) == '"-m 5 --prefer ^(chrome)$"'
    for bad in ('a"b', "a\\b", "a`b"):
        with pytest.raises(FILTERS.UnsafeValue, match=r"^EARLYOOM_ARGS: .* would end or escape its double quotes"):
            FILTERS.env_value(bad, "EARLYOOM_ARGS", quoted=True)


@pytest.mark.parametrize("name", ["A B", "1X", "X\n", "X=Y", "", "É", 3])
def test_env_key_refuses_what_is_not_a_variable_name(name: object) -> None:
    with pytest.raises(FILTERS.UnsafeValue, match="is not \\[A-Za-z_\\]"):
        FILTERS.env_key(name)
    assert FILTERS.env_key("RAY_memory_monitor_refresh_ms") == "RAY_memory_monitor_refresh_ms"


def test_render_refuses_an_unsafe_value_that_validation_let_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last line of defence: render raises a SpecError naming the key, and nothing is rendered."""
    from hy3spark import render

    loaded = load_spec(None)
    real = render.build_context

    def hostile(arg: object) -> dict:
        ctx = real(arg)  # type: ignore[arg-type]
        ctx["nodes"]["spark-b"]["env"]["HF_HUB_CACHE"] = "/x\nLD_PRELOAD=/tmp/evil.so"
        return ctx  # type: ignore[return-value]

    monkeypatch.setattr(render, "build_context", hostile)
    with pytest.raises(SpecError) as exc:
        render_all(loaded)
    assert exc.value.exit_code == 3
    assert "HF_HUB_CACHE: the value holds '\\n'" in str(exc.value) and "templates/node.env.j2" in str(exc.value)


def test_a_hostile_value_stays_one_string_in_the_inventory() -> None:
    """The inventory injection of issue 14, rendered past validation: the host gets no new connection variable,
    and names that YAML 1.1 reads as booleans or numbers stay strings."""
    from hy3spark.render import environment

    evil = "10.0.0.9\n          ansible_connection: local"
    group = {"managed": "m", "cluster": "c", "node_order": ["no", "1.5"], "workers": ["1.5"]}
    nodes_ = {"no": {"role": "head", "ssh_host": evil, "ssh_user": "0755"},
              "1.5": {"role": "worker", "ssh_host": "on", "ssh_user": "null"}}
    text = environment().get_template("inventory/hosts.yml.j2").render(hy3spark=group, nodes=nodes_)
    children = yaml.safe_load(text)["all"]["children"]
    assert children["hy3spark_head"]["hosts"] == {"no": {"ansible_host": evil, "ansible_user": "0755"}}
    assert children["hy3spark_workers"]["hosts"] == {"1.5": {"ansible_host": "on", "ansible_user": "null"}}


def test_the_nft_serialisers_pass_addresses_and_names_and_refuse_the_rest() -> None:
    assert FILTERS.nft_address("10.0.0.1", "peer") == "10.0.0.1"
    assert [FILTERS.nft_address(n) for n in ("0.0.0.0/0", "::/0", "2001:db8::/32")] == ["0.0.0.0/0", "::/0",
                                                                                          "2001:db8::/32"]
    assert FILTERS.nft_name("enP2p1s0f1np1", "iface") == "enP2p1s0f1np1"
    for bad in ("10.0.0.1 } accept", "10.0.0.1/8", "10.0.0.0/24\ndrop", "any", 7):
        with pytest.raises(FILTERS.UnsafeValue, match=r"^peer: "):
            FILTERS.nft_address(bad, "peer")
    for bad in ('eth0" accept', "eth*", "-x", "a b", "eth0;drop", "", "a\\b"):
        with pytest.raises(FILTERS.UnsafeValue, match=r"^iface: "):
            FILTERS.nft_name(bad, "iface")


def test_systemd_word_passes_literal_words_and_refuses_what_systemd_would_read_otherwise() -> None:
    for word in ("hy3-head", "10.95.0.11", "/usr/local/lib/hy3spark/supervisor.json", "hy3spark-node.service"):
        assert FILTERS.systemd_word(word, "unit") == word
    # split (blank), unquoted ('"), unescaped (\), expanded ($), a specifier (%), a command separator (;), a comment
    # (#), an Exec prefix (- @ : + !), a line break, no text at all.
    for bad in ("a b", 'a"b', "a'b", "a\\b", "$HOME", "%n", "a;b", "#x", "-x", "@x", ":x", "+x", "!x", "a\nb", "",
                None):
        with pytest.raises(FILTERS.UnsafeValue, match=r"^unit: "):
            FILTERS.systemd_word(bad, "unit")
