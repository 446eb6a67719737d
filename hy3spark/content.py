"""Where hy3spark's files are: its Ansible content and the per-user state its runs leave. Nothing else guesses.

The content is what ansible-runner runs and `render` renders: site.yml, ansible.cfg, roles/, playbooks/, plugins/,
templates/ and examples/, laid out as in the repo. It lives in one of two places:
- a wheel install: inside the package, `hy3spark/_content/ansible_collections/hy3spark/cluster/` (pyproject.toml
  maps the repo's top level there);
- a checkout (the editable install scripts/bootstrap makes, or the source tree on sys.path): the checkout itself,
  the package's parent directory, so an edited role or template counts without a reinstall.
The shipped copy wins when both could answer: a package that carries its content uses that content.

The content is also the Ansible collection hy3spark.cluster, and its roles call their modules, filters and lookups
by full name (hy3spark.cluster.hy3spark_secret), so Ansible must find it as a collection: `collections()` is the
directory to name in ANSIBLE_COLLECTIONS_PATH. A wheel ships the content at a path shaped like an installed
collection for that reason (a wheel cannot carry a symlink reliably, and a link made at run time in the user's
state directory would be state to repair whenever the venv moves, invisible to a plain `ansible-playbook` with the
shipped ansible.cfg); a checkout has the committed link collections/ansible_collections/hy3spark/cluster -> ../../..
"""

from __future__ import annotations

import os
from pathlib import Path

from hy3spark import __version__
from hy3spark.errors import Hy3SparkError

PACKAGE = Path(__file__).resolve().parent
SHIPPED_COLLECTIONS = PACKAGE / "_content"
SHIPPED = SHIPPED_COLLECTIONS / "ansible_collections" / "hy3spark" / "cluster"
# Where a collections path puts hy3spark.cluster, below the path itself.
COLLECTION = Path("ansible_collections", "hy3spark", "cluster")
# What makes a directory hy3spark's content: the playbook every deployment runs, and the roles it runs.
_MARKERS = ("site.yml", "roles")


def _holds_content(root: Path) -> bool:
    return all((root / marker).exists() for marker in _MARKERS)


def root() -> Path:
    """The directory holding site.yml, ansible.cfg, roles/, playbooks/, plugins/, templates/ and examples/."""
    for candidate in (SHIPPED, PACKAGE.parent):
        if _holds_content(candidate):
            return candidate
    raise Hy3SparkError(f"hy3spark's Ansible content is missing: neither {SHIPPED} (a wheel install) nor "
                        f"{PACKAGE.parent} (a checkout) holds site.yml and roles/; reinstall the wheel, or run "
                        "hy3spark from a checkout (scripts/bootstrap)")


def path(*parts: str) -> Path:
    """A file or directory of the content, e.g. `path("roles")`, `path("playbooks", "teardown.yml")`."""
    return root().joinpath(*parts)


def collections() -> Path:
    """The collections path that makes `hy3spark.cluster` this content: the wheel's `hy3spark/_content/`, or a
    checkout's `collections/` (its link ansible_collections/hy3spark/cluster points back at the checkout)."""
    found = root()
    where = SHIPPED_COLLECTIONS if found == SHIPPED else found / "collections"
    if not (where / COLLECTION).is_dir() or (where / COLLECTION).resolve() != found.resolve():
        raise Hy3SparkError(f"{where / COLLECTION} does not lead to hy3spark's content {found}, so Ansible cannot find "
                            "the collection hy3spark.cluster the roles call by full name; in a checkout, restore the "
                            "committed link (git checkout -- collections), else reinstall the wheel")
    return where


def checkout() -> Path | None:
    """The checkout hy3spark runs from, or None when it runs from an installed wheel."""
    found = root()
    return None if found == SHIPPED else found


def _xdg(variable: str, fallback: str) -> Path:
    # The XDG base directory spec: a relative path in the variable is invalid and is ignored.
    value = os.environ.get(variable, "")
    return Path(value) if os.path.isabs(value) else Path.home() / fallback


def default_runs_dir() -> Path:
    """Run records, ansible-runner artifacts, the per-run inventories and the lab notebook: `runs/` in a checkout
    (beside the code that made them), else `$XDG_STATE_HOME/hy3spark`. State, not data: they are the history of
    this user's runs on this machine (logs, records), worth keeping across restarts but not a document to carry
    elsewhere, which is what the spec and the rendered files are."""
    repo = checkout()
    return repo / "runs" if repo else _xdg("XDG_STATE_HOME", ".local/state") / "hy3spark"


def default_bench_venv() -> Path:
    """guidellm's own venv: `.cache/bench-venv` in a checkout (scripts/bench-venv makes it), else under
    `$XDG_CACHE_HOME/hy3spark`: it can be rebuilt from its pins at any time."""
    repo = checkout()
    return repo / ".cache" / "bench-venv" if repo else _xdg("XDG_CACHE_HOME", ".cache") / "hy3spark" / "bench-venv"


def version_text() -> str:
    """`hy3spark --version`: the package's version and the content's, and where that content is."""
    import yaml

    found = root()
    galaxy = found / "galaxy.yml"
    if galaxy.is_file():  # the content as an Ansible collection: its own name and version
        meta = yaml.safe_load(galaxy.read_text()) or {}
        content = f"collection {meta.get('namespace')}.{meta.get('name')} {meta.get('version')}"
    else:  # the content ships in the same wheel as the package, so it carries the package's version
        content = f"content {__version__}"
    where = "checkout" if checkout() else "installed"
    return f"hy3spark {__version__}\n{content} ({where}: {found})"
