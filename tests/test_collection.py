"""The repo as the Ansible collection hy3spark.cluster: built with ansible-galaxy, installed, used by full name.

Real ansible-galaxy and ansible-playbook in this venv; the installed copy is used from an empty directory with no
ansible.cfg and only ANSIBLE_COLLECTIONS_PATH set (no ANSIBLE_LIBRARY, ANSIBLE_FILTER_PLUGINS, ANSIBLE_LOOKUP_PLUGINS
or ANSIBLE_ROLES_PATH), so nothing of the checkout can stand in for it. Inside a collection, modules, filters and
lookups resolve by full name only, so the roles and playbooks call every plugin of ours as hy3spark.cluster.NAME; a
checkout resolves that name through its committed link collections/ansible_collections/hy3spark/cluster -> ../../..
A run of hy3spark.cluster.site against live nodes is in the site scenario (molecule/site/tests/test_site.py).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODULES = sorted(p.stem for p in (REPO / "plugins" / "modules").glob("*.py"))
LOOKUPS = sorted(p.stem for p in (REPO / "plugins" / "lookup").glob("*.py"))
PLAYBOOKS = sorted(p.stem for p in (REPO / "playbooks").glob("*.yml"))
FQCN = "hy3spark.cluster."


def _env(collections: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    return {**env, "ANSIBLE_COLLECTIONS_PATH": str(collections), "ANSIBLE_NOCOLOR": "1", "LC_ALL": "C.UTF-8"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(the built tarball, the collections path it was installed into)."""
    work = tmp_path_factory.mktemp("collection")
    build = subprocess.run([BIN / "ansible-galaxy", "collection", "build", "--output-path", str(work), str(REPO)],
                           capture_output=True, text=True, cwd=work)
    assert build.returncode == 0, build.stdout + build.stderr
    (tarball,) = work.glob("hy3spark-cluster-*.tar.gz")
    target = work / "collections"
    install = subprocess.run([BIN / "ansible-galaxy", "collection", "install", "-p", str(target), str(tarball)],
                             capture_output=True, text=True, cwd=work, env=_env(target))
    assert install.returncode == 0, install.stdout + install.stderr
    yield tarball, target


def test_galaxy_version_is_the_package_version() -> None:
    galaxy = yaml.safe_load((REPO / "galaxy.yml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert (galaxy["namespace"], galaxy["name"]) == ("hy3spark", "cluster")
    assert galaxy["version"] == project["version"]


def test_the_tarball_holds_the_collection_and_nothing_else(installed: tuple[Path, Path]) -> None:
    tarball, _ = installed
    with tarfile.open(tarball) as archive:
        tops = {name.split("/")[0] for name in archive.getnames()}
        names = set(archive.getnames())
    assert {"roles", "playbooks", "plugins", "templates", "meta", "MANIFEST.json", "FILES.json"} <= tops
    assert not tops & {"hy3spark", "tests", "molecule", ".venv", ".cache", "inventory", "bench", "scripts", "runs"}
    assert [t for t in tops if t.endswith(".egg-info")] == [], "the Python package's metadata is not the collection's"
    # The checkout's link collections/ansible_collections/hy3spark/cluster -> ../../.. stays out (a loop inside it).
    assert (REPO / "collections/ansible_collections/hy3spark/cluster").resolve() == REPO
    assert "collections" not in tops
    with tarfile.open(tarball) as archive:
        assert [m.name for m in archive.getmembers() if m.issym() or m.islnk()] == []
    assert "plugins/module_utils/earlyoom.py" in names
    assert {f"plugins/modules/{m}.py" for m in MODULES} <= names
    assert {f"playbooks/{p}.yml" for p in PLAYBOOKS} <= names
    # A role inside a collection may not carry plugins of its own: every module and filter is the collection's.
    assert not [n for n in names if "/library/" in n or "/filter_plugins/" in n]


@pytest.mark.parametrize("module", MODULES)
def test_ansible_doc_shows_every_module_by_full_name(installed: tuple[Path, Path], module: str,
                                                    tmp_path: Path) -> None:
    _, collections = installed
    doc = subprocess.run([BIN / "ansible-doc", "-t", "module", f"hy3spark.cluster.{module}"], capture_output=True,
                         text=True, cwd=tmp_path, env=_env(collections))
    assert doc.returncode == 0, doc.stderr
    assert f"hy3spark.cluster.{module}" in doc.stdout
    assert str(collections) in doc.stdout  # the installed copy, not the checkout
    assert "OPTIONS" in doc.stdout and "[WARNING]" not in doc.stderr


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_every_playbook_resolves_by_full_name(installed: tuple[Path, Path], playbook: str, tmp_path: Path) -> None:
    _, collections = installed
    check = subprocess.run(
        [BIN / "ansible-playbook", f"hy3spark.cluster.{playbook}", "-i", str(REPO / "inventory"), "--syntax-check"],
        capture_output=True, text=True, cwd=tmp_path, env=_env(collections))
    assert check.returncode == 0, check.stdout + check.stderr
    assert str(collections / "ansible_collections/hy3spark/cluster/playbooks" / f"{playbook}.yml") in check.stdout


def test_the_installed_plugins_run_by_full_name_with_nothing_of_the_checkout(installed: tuple[Path, Path],
                                                                            tmp_path: Path) -> None:
    """Beyond --syntax-check (which resolves modules, not lookups or filters): a lookup, the preflight filter (which
    imports the shared module_utils on the controller) and a module (shipped to the node with that module_utils)
    from the installed copy, on localhost, from an empty directory."""
    _, collections = installed
    installed_root = collections / "ansible_collections/hy3spark/cluster"
    conf = tmp_path / "earlyoom"
    conf.write_text("EARLYOOM_ARGS=\"-m 3 --prefer '(vllm|ray)'\"\n")
    play = tmp_path / "play.yml"
    play.write_text(f"""
- name: Use the installed collection's plugins
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Read the installed content's digest
      ansible.builtin.debug:
        msg: "digest {{{{ lookup('hy3spark.cluster.hy3spark_content') }}}}"
    - name: Judge an earlyoom probe
      ansible.builtin.debug:
        msg: "pid {{{{ {{'rc': 0, 'stdout': 'Main PID: 42'}} | hy3spark.cluster.preflight_main_pid }}}}"
    - name: Inspect an earlyoom file
      hy3spark.cluster.hy3spark_earlyoom_info:
        path: {conf}
        managed_marker: not ours
        protect_names: [vllm]
      register: found
    - name: Print what the module read
      ansible.builtin.debug:
        msg: >-
          argv {{{{ found.config.argv | join(' ') }}}}
          at risk {{{{ found.at_risk | map(attribute='name') | join(',') }}}}
""")
    run = subprocess.run([BIN / "ansible-playbook", "-i", "localhost,", "-c", "local", "-v",
                          "-e", f"ansible_python_interpreter={sys.executable}", str(play)],
                         capture_output=True, text=True, cwd=tmp_path, env=_env(collections), timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    sys.path.insert(0, str(REPO / "plugins" / "lookup"))
    try:
        from hy3spark_content import content_sha256
    finally:
        sys.path.remove(str(REPO / "plugins" / "lookup"))
    assert f"digest {content_sha256(installed_root)}" in out
    assert content_sha256(installed_root) == content_sha256(REPO), "the tarball carries every file the digest covers"
    assert "pid 42" in out, out
    assert "argv -m 3 --prefer (vllm|ray) at risk vllm" in out, out


# --- every reference to a plugin of ours uses the full name ----------------------------------------------------------
def _filter_names() -> list[str]:
    """The names each filter file's FilterModule.filters() returns (read from the source: the keys of its dict)."""
    names: list[str] = []
    for path in sorted((REPO / "plugins" / "filter").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "filters":
                names += [k.value for d in ast.walk(node) if isinstance(d, ast.Dict) for k in d.keys
                          if isinstance(k, ast.Constant)]
    return names


FILTERS = _filter_names()
# A plugin of ours named without the collection: the task key of a module, the first argument of lookup/query, a
# filter after a pipe or passed by name to map/select. (?<![\w.]) makes hy3spark.cluster.NAME no match.
_SHORT = [re.compile(rf"^\s*(?:- )?{m}:|\b(?:action|module):\s*{m}\b", re.M) for m in MODULES]
_SHORT += [re.compile(rf"\b(?:lookup|query|q)\(\s*['\"]{n}['\"]|^\s*with_{n}:", re.M) for n in LOOKUPS]
_SHORT += [re.compile(rf"\|\s*(?<![\w.]){f}\b|\b(?:map|select|reject)\(\s*['\"]{f}['\"]") for f in FILTERS]


def _ansible_files() -> list[Path]:
    """The YAML and templates Ansible reads: roles, playbooks, site.yml and the Molecule scenarios' playbooks."""
    files = [REPO / "site.yml"]
    for tree in ("roles", "playbooks", "molecule"):
        files += [p for p in (REPO / tree).rglob("*") if p.suffix in (".yml", ".yaml", ".j2")
                  and ".rendered" not in p.parts]
    return sorted(files)


def _short_names(text: str) -> list[str]:
    return [m.group(0).strip() for rx in _SHORT for m in rx.finditer(text)]


def test_every_plugin_of_ours_is_named_by_its_full_name() -> None:
    assert len(MODULES) >= 4 and len(LOOKUPS) >= 2 and len(FILTERS) >= 15, (MODULES, LOOKUPS, FILTERS)
    found = {str(p.relative_to(REPO)): _short_names(p.read_text()) for p in _ansible_files()}
    assert {path: names for path, names in found.items() if names} == {}


def test_the_short_name_scan_sees_every_full_name_it_guards() -> None:
    """The scan can fail: each full-name reference in the files, with the collection prefix taken off, is caught."""
    text = "\n".join(p.read_text() for p in _ansible_files())
    used = set(re.findall(rf"{re.escape(FQCN)}(\w+)", text))
    assert set(MODULES) | set(LOOKUPS) <= used, "every module and lookup is used by the roles or playbooks"
    assert len(used & set(FILTERS)) >= 15
    plugins = set(MODULES) | set(LOOKUPS) | set(FILTERS)
    for path in _ansible_files():
        original = path.read_text()
        references = [n for n in re.findall(rf"{re.escape(FQCN)}(\w+)", original) if n in plugins]
        assert len(_short_names(original.replace(FQCN, ""))) == len(references), path


def test_the_checkout_finds_the_collection_through_its_link_not_plugin_paths() -> None:
    cfg = (REPO / "ansible.cfg").read_text()
    assert not re.search(r"^\s*(library|filter_plugins|lookup_plugins)\s*=", cfg, re.M)
    assert re.search(r"^collections_path = collections:", cfg, re.M)
    molecule_env = yaml.safe_load((REPO / ".config/molecule/config.yml").read_text())["provisioner"]["env"]
    assert not {"ANSIBLE_LIBRARY", "ANSIBLE_FILTER_PLUGINS", "ANSIBLE_LOOKUP_PLUGINS"} & set(molecule_env)
    assert molecule_env["ANSIBLE_COLLECTIONS_PATH"] == "${MOLECULE_PROJECT_DIRECTORY}/collections"
    link = REPO / "collections/ansible_collections/hy3spark/cluster"
    assert link.is_symlink() and os.readlink(link) == "../../.." and link.resolve() == REPO
