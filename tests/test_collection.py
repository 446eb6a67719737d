"""The repo as the Ansible collection hy3spark.cluster: built with ansible-galaxy, installed, used by full name.

Real ansible-galaxy and ansible-playbook in this venv; the installed copy is used from an empty directory with no
ansible.cfg and only ANSIBLE_COLLECTIONS_PATH set, so nothing of the checkout can stand in for it. A run of
hy3spark.cluster.site against live nodes is in the site scenario (molecule/site/tests/test_site.py).
"""

from __future__ import annotations

import os
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
PLAYBOOKS = sorted(p.stem for p in (REPO / "playbooks").glob("*.yml"))


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
