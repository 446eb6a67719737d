"""The strict loader (hy3spark/strict_yaml.py) and profiles by name, through the real CLI: every hostile spec is
refused by `validate` and `render --out` with exit code 3, one message naming the line and the field, no traceback,
and no output directory. Timings are bench/validate_hostile.py's business, not a test's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hy3spark.errors import EXIT_SPEC
from hy3spark.spec import available_profiles, load_profile
from hy3spark.strict_yaml import MAX_BYTES

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = (REPO / "examples" / "hy3-two-spark.yml").read_text()
AVAILABLE = f"available: {', '.join(available_profiles())}"


def line_of(text: str, needle: str) -> int:
    return text[:text.index(needle)].count("\n") + 1


def after(text: str, needle: str, added: str) -> str:
    """The text with `added` (whole lines) inserted after the line holding `needle`."""
    at = text.index("\n", text.index(needle)) + 1
    return text[:at] + added + text[at:]


def refused(cli, tmp_path: Path, content: str | bytes, *needles: str) -> str:
    spec = tmp_path / "cluster.yml"
    if isinstance(content, bytes):
        spec.write_bytes(content)
    else:
        spec.write_text(content)
    out_dir = tmp_path / "out"
    for argv in (("validate", str(spec)), ("render", str(spec), "--out", str(out_dir))):
        result = cli(*argv)
        assert result.code == EXIT_SPEC, result
        assert result.out == ""
        assert result.err.count("\n") == 1 and result.err.startswith(f"error: {spec}"), result.err
        for needle in needles:
            assert needle.replace("SPEC", str(spec)) in result.err, f"{needle!r} not in {result.err!r}"
        assert "Traceback" not in result.err
    assert not out_dir.exists(), "a refused spec must not write anything"
    return result.err


def test_the_example_is_accepted(cli, tmp_path: Path) -> None:
    (tmp_path / "cluster.yml").write_text(EXAMPLE)
    assert cli("validate", str(tmp_path / "cluster.yml")).code == 0


def test_a_duplicate_top_level_key_names_both_lines(cli, tmp_path: Path) -> None:
    text = EXAMPLE + "serving:\n  port: 9000\n"
    first, second = line_of(text, "\nserving:") + 1, text.count("\n") - 1
    refused(cli, tmp_path, text, f"SPEC:{second}: serving: duplicate key (first at line {first}); YAML would "
                                 "silently keep the last one: write the key once")


def test_a_duplicate_nested_key_names_both_lines(cli, tmp_path: Path) -> None:
    text = after(EXAMPLE, "fabric_ip: 10.0.0.1/24", "  fabric_ip: 10.0.0.9/24\n")
    first = line_of(text, "fabric_ip: 10.0.0.1/24")
    refused(cli, tmp_path, text, f"SPEC:{first + 1}: head.fabric_ip: duplicate key (first at line {first})")
    text = after(EXAMPLE, "fabric_ip: 10.0.0.2/24", "    fabric_ip: 10.0.0.1/24\n")
    first = line_of(text, "fabric_ip: 10.0.0.2/24")
    refused(cli, tmp_path, text, f"SPEC:{first + 1}: workers[0].fabric_ip: duplicate key (first at line {first})")


def test_duplicate_keys_in_a_flow_mapping_too(cli, tmp_path: Path) -> None:
    text = EXAMPLE.replace("  api_key_env: VLLM_API_KEY ", "  speculative_config: {method: mtp, method: eagle}\n"
                                                          "  api_key_env: VLLM_API_KEY ")
    line = line_of(text, "speculative_config")
    refused(cli, tmp_path, text, f"SPEC:{line}: serving.speculative_config.method: duplicate key (first at line "
                                 f"{line})")


BOMB = "".join(f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 9)}]\n" for i in range(1, 10))


def test_an_alias_bomb_is_refused_at_its_first_anchor(cli, tmp_path: Path) -> None:
    text = EXAMPLE + "b0: &b0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + BOMB
    refused(cli, tmp_path, text, f"SPEC:{EXAMPLE.count(chr(10)) + 1}: b0: YAML anchors and aliases (&b0, *b0) "
                                 "are not accepted: write each value out in full")


def test_an_alias_bomb_through_the_module_entry_point(tmp_path: Path) -> None:
    # Before the strict loader: about 15 s, then a MemoryError traceback from the line-number walk.
    spec = tmp_path / "cluster.yml"
    spec.write_text(EXAMPLE + "b0: &b0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + BOMB)
    proc = subprocess.run([sys.executable, "-m", "hy3spark", "validate", str(spec)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_SPEC
    assert "YAML anchors and aliases" in proc.stderr and "Traceback" not in proc.stderr


def test_a_harmless_looking_anchor_is_refused_too(cli, tmp_path: Path) -> None:
    text = EXAMPLE.replace("  interfaces: [enp1s0f1np1]", "  interfaces: &ifs [enp1s0f1np1]")
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, '&ifs')}: fabric.interfaces: YAML anchors and aliases (&ifs, "
                                 "*ifs) are not accepted")
    text = EXAMPLE.replace("  mtu: 9000", "  mtu: *undefined")
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, '*undefined')}: fabric.mtu: YAML anchors and aliases")


def test_a_merge_key_is_refused(cli, tmp_path: Path) -> None:
    text = after(EXAMPLE, "fabric_ip: 10.0.0.2/24", "    <<: {gpus: 1}\n")
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, '<<')}: workers[0]: merge keys (<<) are not accepted")


@pytest.mark.parametrize(("old", "new", "path", "tag"), [
    ("  revision: main", "  revision: !!binary bWFpbg==", "model.revision", "!!binary"),
    ("name: hy3-pair", "name: !!python/object/apply:os.system [echo owned]", "name", "!!python/object/apply:os.system"),
    ("name: hy3-pair", "name: !!python/name:os.system x", "name", "!!python/name:os.system"),
    ("  interfaces: [enp1s0f1np1]", "  interfaces: !!set {enp1s0f1np1}", "fabric.interfaces", "!!set"),
    ("  mtu: 9000", "  mtu: !!str 9000", "fabric.mtu", "!!str"),
    ("  mtu: 9000", "  mtu: !custom 9000", "fabric.mtu", "!custom"),
])
def test_explicit_tags_are_refused(cli, tmp_path: Path, old: str, new: str, path: str, tag: str) -> None:
    text = EXAMPLE.replace(old, new)
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, new)}: {path}: the YAML tag {tag} is not accepted: the spec "
                                 "takes plain text, numbers, true/false, lists and mappings")


def test_a_date_looking_value_stays_the_text_written(cli, tmp_path: Path) -> None:
    # SafeLoader made it a datetime.date: render died with a TypeError in the JSON of speculative_config.
    text = EXAMPLE.replace("  api_key_env: VLLM_API_KEY ", "  speculative_config: {method: mtp, "
                                                          "num_speculative_tokens: 1, note: 2024-01-01}\n"
                                                          "  api_key_env: VLLM_API_KEY ")
    spec = tmp_path / "cluster.yml"
    spec.write_text(text.replace("  revision: main", "  revision: 2024-01-01"))
    result = cli("render", str(spec), "--out", str(tmp_path / "out"))
    assert result.code == 0, result
    assert "Traceback" not in result.err
    assert "model.revision: '2024-01-01' is not a commit sha" in result.err  # a string, judged as a revision
    serve = (tmp_path / "out" / "files" / "spark-a" / "etc" / "hy3spark" / "serve.sh").read_text()
    assert "--revision 2024-01-01 " in serve and '"note":"2024-01-01"' in serve


@pytest.mark.parametrize("value", [".inf", "-.inf", "+.Inf", ".nan", ".NaN", "1.0e+999"])
def test_non_finite_numbers_are_refused(cli, tmp_path: Path, value: str) -> None:
    text = EXAMPLE + f"hardware:\n  total_memory_gib: {value}\n"
    refused(cli, tmp_path, text, f"SPEC:{text.count(chr(10))}: hardware.total_memory_gib: {value} is not a finite "
                                 "number; write a finite number")


def test_inf_through_render_of_the_module_entry_point(tmp_path: Path) -> None:
    # Before: validate passed and render died with an OverflowError traceback.
    spec = tmp_path / "cluster.yml"
    spec.write_text(EXAMPLE + "hardware:\n  total_memory_gib: .inf\n")
    proc = subprocess.run([sys.executable, "-m", "hy3spark", "render", str(spec), "--out", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_SPEC
    assert proc.stderr == f"error: {spec}:{EXAMPLE.count(chr(10)) + 2}: hardware.total_memory_gib: .inf is not a " \
                          "finite number; write a finite number\n"
    assert not (tmp_path / "out").exists()


def test_an_integer_of_thousands_of_digits_is_refused(cli, tmp_path: Path) -> None:
    text = EXAMPLE.replace("  mtu: 9000", "  mtu: " + "9" * 5000)
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, '  mtu: ')}: fabric.mtu: 99999999999999999999... is not a "
                                 "number hy3spark can read")


def padded(text: str, size: int) -> bytes:
    """The text with a trailing comment that makes it exactly `size` bytes."""
    data = text.encode()
    return data + b"#" + b"x" * (size - len(data) - 2) + b"\n"


def test_a_spec_over_1_mib_is_refused_before_parsing(cli, tmp_path: Path) -> None:
    # The excess is a malformed line: a parse would say so; the size check comes first.
    refused(cli, tmp_path, padded(EXAMPLE + "name: [\n", MAX_BYTES + 1),
            "error: SPEC: the spec is 1,048,577 bytes; the limit is 1 MiB (1,048,576 bytes), and a cluster spec is a "
            "few kilobytes")


def test_a_spec_of_exactly_1_mib_is_read(cli, tmp_path: Path) -> None:
    spec = tmp_path / "cluster.yml"
    spec.write_bytes(padded(EXAMPLE, MAX_BYTES))
    assert spec.stat().st_size == MAX_BYTES
    assert cli("validate", str(spec)).code == 0


def test_text_over_1_mib_is_refused_by_the_loader_itself() -> None:
    from hy3spark.errors import SpecError
    from hy3spark.spec import parse_spec

    with pytest.raises(SpecError) as caught:
        parse_spec(EXAMPLE + "#" + "\u00e9" * MAX_BYTES, "cluster.yml")  # 2 bytes a character in UTF-8
    size = len(EXAMPLE.encode()) + 1 + 2 * MAX_BYTES
    assert caught.value.problems == [f"cluster.yml: the spec is {size:,} bytes; the limit is 1 MiB (1,048,576 "
                                     "bytes), and a cluster spec is a few kilobytes"]


def test_a_spec_that_is_not_utf8(cli, tmp_path: Path) -> None:
    data = EXAMPLE.encode().replace(b"name: hy3-pair", b"name: caf\xe9")
    refused(cli, tmp_path, data, f"error: SPEC: the spec is not UTF-8 text (byte {data.index(b'caf') + 3})")


def test_a_control_character(cli, tmp_path: Path) -> None:
    text = EXAMPLE.replace("name: hy3-pair", "name: hy3\x00pair")
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, 'name: hy3')}: malformed YAML: character #x0000 is not allowed")


def test_a_second_document(cli, tmp_path: Path) -> None:
    text = EXAMPLE + "---\nname: other\n"
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, '---')}: a second YAML document (---): the spec is one "
                                 "document")


def nested(depth: int) -> str:
    return EXAMPLE.replace("  api_key_env: VLLM_API_KEY ", "  speculative_config: " + "[" * depth + "]" * depth +
                           "\n  api_key_env: VLLM_API_KEY ")


def test_nesting_deeper_than_a_spec_needs(cli, tmp_path: Path) -> None:
    # The limit keeps every recursive walk after the loader (secrets, Jinja, merge, pydantic) far from Python's.
    text = nested(50)
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, 'speculative_config')}: serving.speculative_config"
                                 + "[0]" * 18 + ": nested more than 20 levels deep")
    # Far deeper, libyaml's own limit speaks first (PyYAML's parser, where libyaml is missing, reaches ours).
    refused(cli, tmp_path, nested(100_000), f"SPEC:{line_of(text, 'speculative_config')}: ")


def test_more_values_than_a_spec_has(cli, tmp_path: Path) -> None:
    # 1 MiB of short entries is 140,000 values: the count, not the size, bounds what the later steps walk.
    text = EXAMPLE + "container:\n  env:\n" + "".join(f"    K{i:05d}: v\n" for i in range(6000))
    refused(cli, tmp_path, text, ": container.env.K0", ": the spec holds more than 10,000 values (keys, items and "
                                                        "scalars); a cluster spec has a few hundred")


def test_a_list_as_a_mapping_key(cli, tmp_path: Path) -> None:
    text = EXAMPLE + "? [a, b]\n: c\n"
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, '? [a')}: (top level): a mapping key must be a plain value")


@pytest.mark.parametrize(("key", "kind"), [("1", "number"), ("yes", "boolean"), ("null", "null"), ("2.5", "number")])
def test_a_key_yaml_reads_as_a_number_or_boolean(cli, tmp_path: Path, key: str, kind: str) -> None:
    # Once this was pydantic's "Keys should be strings", blamed on the profile.
    text = EXAMPLE + f"{key}: x\n"
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, f'{key}: x')}: (top level): the key {key} is read by "
                                 f"YAML as a {kind}, not a name")
    nested = after(EXAMPLE, "  api_key_env", f"  {key}: 3\n")
    refused(cli, tmp_path, nested, f"SPEC:{line_of(nested, f'  {key}: 3')}: serving: the key {key} is read by "
                                   f"YAML as a {kind}")


def test_a_quoted_key_is_text_and_then_an_unknown_field(cli, tmp_path: Path) -> None:
    text = EXAMPLE + "'1': x\n"
    err = refused(cli, tmp_path, text, "1")
    assert "is read by YAML" not in err


def test_a_tab_in_the_indentation_names_the_field_and_says_spaces(cli, tmp_path: Path) -> None:
    text = after(EXAMPLE, "  api_key_env", "\tport: 8000\n")
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, chr(9) + 'port')}: serving: malformed YAML",
            "YAML indents with spaces only: replace the tab at the start of the line with spaces")
    listed = EXAMPLE.replace("\nworkers:\n  - ", "\nworkers:\n\t- ", 1)
    assert listed != EXAMPLE
    refused(cli, tmp_path, listed, f"SPEC:{line_of(listed, chr(9) + '- ')}: workers: malformed YAML",
            "YAML indents with spaces only")


@pytest.mark.parametrize("profile", ["../x", "/tmp/p", "a/b", "..\\x", "~/p", ".hidden", "hy3-295b-nvfp4-tp2.yml",
                                     "../profiles/hy3-295b-nvfp4-tp2"])
def test_a_profile_is_chosen_by_name_never_by_path(cli, tmp_path: Path, profile: str) -> None:
    text = EXAMPLE.replace("profile: hy3-295b-nvfp4-tp2", f"profile: '{profile}'")
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, 'profile:')}: profile: {profile!r} looks like a path; a "
                                 f"profile is chosen by name, never by path: {AVAILABLE}")


def test_a_profile_file_an_attacker_wrote_is_never_read(cli, tmp_path: Path) -> None:
    evil = tmp_path / "evil.yml"
    evil.write_text("description: x\nimage: {ref: 'evil/image:latest'}\n")
    for profile in (str(tmp_path / "evil"), f"../../../../../../..{tmp_path}/evil"):
        text = EXAMPLE.replace("profile: hy3-295b-nvfp4-tp2", f"profile: {profile}")
        err = refused(cli, tmp_path, text, "looks like a path", AVAILABLE)
        assert "evil/image" not in err


@pytest.mark.parametrize(("value", "message"), [
    ("hy4-nope", f"unknown profile 'hy4-nope'; {AVAILABLE}"),
    ("[hy3-295b-nvfp4-tp2]", f"must be the name of a packaged profile; {AVAILABLE}"),
    ("1", f"must be the name of a packaged profile; {AVAILABLE}"),
])
def test_a_profile_that_is_not_a_packaged_name(cli, tmp_path: Path, value: str, message: str) -> None:
    text = EXAMPLE.replace("profile: hy3-295b-nvfp4-tp2", f"profile: {value}")
    refused(cli, tmp_path, text, f"SPEC:{line_of(text, 'profile:')}: profile: {message}")


def test_every_packaged_profile_loads_through_the_strict_loader() -> None:
    for name in available_profiles():
        assert load_profile(name)["serving"], name
