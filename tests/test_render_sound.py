"""Every example's render is sound (tests/soundness.py), and the check itself fails on each kind of unsound file."""

from __future__ import annotations

import pytest
from golden import cases
from soundness import assert_sound, problems

from hy3spark.render import render_all
from hy3spark.spec import load_spec

CASES = cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_example_renders_sound_files(name: str) -> None:
    loaded = load_spec(CASES[name])
    outputs = render_all(loaded)
    # .yaml is the fabric's netplan file: none on one machine without a fabric (the two-card desktop).
    kinds = {"yml", "json", "sh", "env"} | ({"yaml"} if loaded.spec.fabric is not None else set())
    assert {o.path.rsplit(".", 1)[-1] for o in outputs} >= kinds
    assert_sound(outputs)


@pytest.mark.parametrize(("path", "text", "expected"), [
    ("inventory/hosts.yml", "all:\n  hosts:\n    a: {ansible_host: x\n", "not YAML"),
    ("inventory/hosts.yml", "a:\n  ansible_host: x\n  ansible_host: y\n", "key 'ansible_host' given twice"),
    ("inventory/hosts.yml", "a: 1\n---\nb: 2\n", "2 YAML documents"),
    ("files/pi/models.json", '{"a": 1, "a": 2}', "key(s) given twice: ['a']"),
    ("files/pi/models.json", '{"a": 1,}', "not JSON"),
    ("files/a/docker-run.sh", "#!/bin/sh\ndocker run 'x\n", "bash -n"),
    ("files/a/etc/hy3spark/node.env", "# c\nA=1\nLD_PRELOAD /x.so\n", "node.env:3: not a NAME=value line"),
    ("files/a/etc/hy3spark/node.env", "A=1\r\n", "carriage return"),
    ("files/a/etc/default/earlyoom", 'EARLYOOM_ARGS="-m 5"\n-r 1\n', "earlyoom:2: not a NAME=value line"),
])
def test_the_check_finds_an_unsound_file(path: str, text: str, expected: str) -> None:
    found = problems(path, text)
    assert len(found) == 1 and expected in found[0], found
    with pytest.raises(AssertionError, match="unsound render"):
        assert_sound({path: text})


def test_the_check_refuses_a_file_it_cannot_judge() -> None:
    with pytest.raises(AssertionError, match="no soundness check knows this file's format"):
        assert_sound({"files/a/etc/something.conf": "x = 1\n"})
