"""Where hy3spark's files are: its Ansible content and the per-user state its runs leave. Nothing else guesses.

The content is what ansible-runner runs and `render` renders: site.yml, ansible.cfg, roles/, playbooks/, plugins/,
templates/ and examples/, laid out as in the repo. It lives in one of two places:
- a wheel install: inside the package, `hy3spark/_content/` (pyproject.toml maps the repo's top level there);
- a checkout (the editable install scripts/bootstrap makes, or the source tree on sys.path): the checkout itself,
  the package's parent directory, so an edited role or template counts without a reinstall.
The shipped copy wins when both could answer: a package that carries its content uses that content.
"""

from __future__ import annotations

import os
from pathlib import Path

from hy3spark import __version__
from hy3spark.errors import Hy3SparkError

PACKAGE = Path(__file__).resolve().parent
SHIPPED = PACKAGE / "_content"
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
