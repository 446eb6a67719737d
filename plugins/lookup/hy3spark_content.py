"""hy3spark_content: one SHA-256 over hy3spark's own Ansible content (roles, playbooks, templates, plugins), or the
names of its roles.

site.yml's drift check keeps the digest in each node's deployment record: after an upgrade of hy3spark (a role or
template changed), the next run runs every role again instead of trusting a record that older code wrote. The role
names give drift the prefixes of every role's inputs without a list that each new role must join.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = """
name: hy3spark_content
short_description: SHA-256 of hy3spark's roles, playbooks, templates and plugins
description:
  - Without a term, one digest over the relative path and bytes of every file under roles/, playbooks/, templates/
    and plugins/, and site.yml, of the checkout or installed collection this plugin lives in (caches and hidden files
    excluded).
  - With the term C(roles), the names of its roles (the directories of roles/ that hold meta/main.yml), sorted.
options:
  _terms:
    description: Nothing for the digest, or C(roles).
    required: false
"""

EXAMPLES = """
- name: The content's digest
  ansible.builtin.debug:
    msg: "{{ lookup('hy3spark.cluster.hy3spark_content') }}"
- name: Every role of the collection
  ansible.builtin.debug:
    msg: "{{ query('hy3spark.cluster.hy3spark_content', 'roles') }}"
"""

RETURN = """
_raw:
  description: The SHA-256 hex digest, or the role names.
  type: list
  elements: str
"""

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("roles", "playbooks", "templates", "plugins")


def content_sha256(root: Path = ROOT) -> str:
    digest = hashlib.sha256()
    files = [root / "site.yml"] + [p for part in PARTS for p in (root / part).rglob("*")]
    for path in sorted(p for p in files if p.is_file() and not _cache(p.relative_to(root))):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _cache(rel: Path) -> bool:
    """Caches that tools leave in the tree (__pycache__, .pytest_cache, .ruff_cache): not content."""
    return any(part == "__pycache__" or part.startswith(".") for part in rel.parts)


def role_names(root: Path = ROOT) -> list[str]:
    return sorted(p.parent.parent.name for p in (root / "roles").glob("*/meta/main.yml"))


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):  # Ansible's plugin signature, untyped
        if not terms:
            return [content_sha256()]
        if list(terms) == ["roles"]:
            return role_names()
        raise AnsibleLookupError(f"hy3spark_content takes no term (the digest) or 'roles', not {list(terms)!r}")
