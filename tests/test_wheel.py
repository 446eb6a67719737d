"""The wheel, as a user gets it: built from the repo, installed into a fresh venv, run from an empty directory.

One venv for the module (building and installing take most of this file's time; ansible alone is 250 MB of
collections), made by tests/wheel_venv.py: the dependencies come from PyPI once and are kept as wheels in
.cache/wheel-test/, so a later run installs offline. What is proved: every subpackage and the Ansible content are in
the wheel; the installed CLI renders, validates and plans what the checkout does, byte for byte; nothing it uses or
prints points back at the checkout; the shipped ansible.cfg works from inside the package; run records go to
$XDG_STATE_HOME/hy3spark. The same install runs `hy3spark up` and `down` against a live two-node cluster in the site
scenario (molecule/site/tests/test_site.py).
"""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from wheel_venv import Installed, clean_env, installed_wheel

from hy3spark import content, runner

REPO = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
EXAMPLE = "hy3-two-spark.yml"
# Where the wheel puts the content: the collection hy3spark.cluster under a collections path of its own, so that the
# roles' full plugin names (hy3spark.cluster.hy3spark_secret) resolve to the shipped plugins.
SHIPPED = Path("hy3spark", "_content", "ansible_collections", "hy3spark", "cluster")


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    with installed_wheel() as done:
        yield done


@pytest.fixture
def empty(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def checkout_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The same command from the checkout's own install (the editable one), for comparison."""
    return subprocess.run([sys.executable, "-m", "hy3spark", *argv], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


def test_the_package_and_its_content_are_installed_and_the_checkout_is_not_used(installed: Installed,
                                                                                 empty: Path) -> None:
    report = installed.python(
        "import sys, hy3spark, hy3spark.engines, hy3spark.engines.vllm\n"
        "from hy3spark import content\n"
        "print(hy3spark.__file__, content.root(), content.checkout(), sep='\\n')\n"
        "print(*sys.path, sep='\\n')", cwd=empty)
    package_file, root, checkout, *path = report.splitlines()
    site = installed.site_packages
    assert Path(package_file) == site / "hy3spark" / "__init__.py"
    assert Path(root) == site / SHIPPED
    assert checkout == "None"
    assert [p for p in path if p.startswith(str(REPO))] == []
    shipped = Path(root)
    for name in ("site.yml", "ansible.cfg", "galaxy.yml", "meta/runtime.yml", "plugins/lookup/hy3spark_secret.py",
                 "plugins/module_utils/earlyoom.py", "templates/serve.sh.j2"):
        assert (shipped / name).is_file(), name
    roles = sorted(p.name for p in (REPO / "roles").iterdir() if (p / "tasks" / "main.yml").is_file())
    assert roles and sorted(p.name for p in (shipped / "roles").iterdir()) == roles
    for role in roles:
        assert (shipped / "roles" / role / "tasks" / "main.yml").is_file(), role
    for sub in ("playbooks", "examples"):
        names = sorted(p.name for p in (REPO / sub).glob("*.yml"))
        assert sorted(p.name for p in (shipped / sub).glob("*.yml")) == names, sub
    profiles = sorted(p.name for p in (REPO / "hy3spark" / "profiles").glob("*.yml"))
    assert sorted(p.name for p in (site / "hy3spark" / "profiles").glob("*.yml")) == profiles
    assert (site / "hy3spark" / "default-cluster.yml").is_file()
    leaks = [str(p) for p in (site / "hy3spark").rglob("*")
             if p.is_file() and p.suffix != ".pyc" and str(REPO).encode() in p.read_bytes()]
    assert leaks == []


def test_version_names_the_package_and_the_content(installed: Installed, empty: Path) -> None:
    proc = installed.run("--version", cwd=empty)
    assert proc.returncode == 0, proc.stderr
    site = installed.site_packages
    package, shipped = proc.stdout.splitlines()
    assert package == f"hy3spark {VERSION}"
    # The content's own version (the collection's, once galaxy.yml exists) is the same one a checkout reports.
    here = checkout_cli("--version", cwd=empty).stdout.splitlines()[1]
    assert shipped == f"{here.split(' (')[0]} (installed: {site / SHIPPED})"


@pytest.mark.parametrize("argv", [("render",), ("validate",), ("plan",), ("profiles",), ("render", "--format", "json")])
def test_commands_from_an_empty_directory_match_the_checkout(installed: Installed, empty: Path,
                                                             argv: tuple[str, ...]) -> None:
    proc = installed.run(*argv, cwd=empty)
    assert proc.returncode == 0, proc.stderr
    assert str(REPO) not in proc.stdout + proc.stderr
    same = checkout_cli(*argv, cwd=empty)
    assert (proc.returncode, proc.stdout, proc.stderr) == (same.returncode, same.stdout, same.stderr)
    assert list(empty.iterdir()) == []  # a preview writes nothing


def test_the_shipped_example_renders_as_the_checkout_renders_it(installed: Installed, empty: Path) -> None:
    shipped = Path(installed.python("from hy3spark import content; print(content.path('examples'))", cwd=empty))
    shutil.copy(shipped / EXAMPLE, empty / "cluster.yml")  # the rendered group_vars name the spec's absolute path
    for side, run in (("wheel", installed.run), ("checkout", checkout_cli)):
        for argv in (("validate", "cluster.yml"), ("plan", "cluster.yml"), ("render", "cluster.yml", "--out", side)):
            proc = run(*argv, cwd=empty)
            assert proc.returncode == 0, f"{side} {argv}: {proc.stderr}"
            assert str(REPO) not in proc.stdout + proc.stderr
    wheel, checkout = empty / "wheel", empty / "checkout"
    files = sorted(str(p.relative_to(wheel)) for p in wheel.rglob("*") if p.is_file())
    assert "inventory/hosts.yml" in files and "files/spark-a/etc/hy3spark/serve.sh" in files
    assert files == sorted(str(p.relative_to(checkout)) for p in checkout.rglob("*") if p.is_file())
    _same, differ, missing = filecmp.cmpfiles(wheel, checkout, files, shallow=False)
    assert (differ, missing) == ([], [])
    assert [f for f in files if (wheel / f).stat().st_mode != (checkout / f).stat().st_mode] == []


def test_the_shipped_ansible_cfg_works_from_inside_the_package(installed: Installed, empty: Path) -> None:
    """Only ANSIBLE_CONFIG is given: roles_path and collections_path in it resolve against its own directory, and the
    syntax check resolves every module the roles name by full name to the shipped copy."""
    shipped = Path(installed.python("from hy3spark import content; print(content.root())", cwd=empty))
    playbooks = [str(shipped / "site.yml"), *sorted(str(p) for p in (shipped / "playbooks").glob("*.yml"))]
    env = {**installed.env, "ANSIBLE_CONFIG": str(shipped / "ansible.cfg")}
    proc = subprocess.run([str(installed.venv / "bin" / "ansible-playbook"), "--syntax-check", "-i", "localhost,",
                           *playbooks], cwd=empty, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert str(REPO) not in proc.stdout + proc.stderr
    envvars = installed.python("from hy3spark.runner import ansible_envvars; import json; "
                               "print(json.dumps(ansible_envvars()))", cwd=empty)
    for key, rel in (("ANSIBLE_CONFIG", "ansible.cfg"), ("ANSIBLE_ROLES_PATH", "roles")):
        assert f'"{key}": "{shipped / rel}"' in envvars
    assert f'"ANSIBLE_COLLECTIONS_PATH": "{shipped.parents[2]}"' in envvars
    # A lookup (which --syntax-check does not resolve) found by full name in the shipped copy, both ways.
    for variables in ({"ANSIBLE_CONFIG": str(shipped / "ansible.cfg")}, json.loads(envvars)):
        doc = subprocess.run([str(installed.venv / "bin" / "ansible-doc"), "-t", "lookup",
                              "hy3spark.cluster.hy3spark_secret"], cwd=empty, env={**installed.env, **variables},
                             capture_output=True, text=True, timeout=120)
        assert doc.returncode == 0, doc.stderr
        assert str(shipped / "plugins" / "lookup" / "hy3spark_secret.py") in doc.stdout


def test_runs_go_to_xdg_state_home_and_runs_dir_wins(installed: Installed, empty: Path) -> None:
    code = ("from hy3spark import cli\n"
            "for argv in (['status'], ['up', '--runs-dir', 'mine'], ['bench']):\n"
            "    print(cli._runs_dir(cli.build_parser().parse_args(argv)))")
    default, chosen, bench = installed.python(code, cwd=empty).splitlines()
    assert default == bench == str(installed.home / "state" / "hy3spark")
    assert chosen == str(empty / "mine")
    unset = {k: v for k, v in installed.env.items() if k != "XDG_STATE_HOME"}
    proc = subprocess.run([str(installed.venv / "bin" / "python"), "-c",
                           "from hy3spark import content; print(content.default_runs_dir())"],
                          cwd=empty, env=unset, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == str(installed.home / ".local" / "state" / "hy3spark")


# --- the checkout side: the editable install keeps using the checkout's files -------------------------------------
def test_a_checkout_uses_its_own_content_and_runs_dir() -> None:
    assert content.root() == REPO
    assert content.checkout() == REPO
    assert content.default_runs_dir() == REPO / "runs"
    assert runner.ansible_envvars()["ANSIBLE_CONFIG"] == str(REPO / "ansible.cfg")


def test_xdg_state_home_must_be_absolute(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(content, "checkout", lambda: None)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")  # invalid per the XDG spec: ignored
    assert content.default_runs_dir() == tmp_path / ".local" / "state" / "hy3spark"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "s"))
    assert content.default_runs_dir() == tmp_path / "s" / "hy3spark"
