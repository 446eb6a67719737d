"""hy3spark_content: one SHA-256 over hy3spark's own Ansible content (roles, playbooks, templates, plugins).

site.yml's drift check keeps it in each node's deployment record: after an upgrade of hy3spark (a role or template
changed), the next run runs every role again instead of trusting a record that older code wrote.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ansible.plugins.lookup import LookupBase

DOCUMENTATION = """
name: hy3spark_content
short_description: SHA-256 of hy3spark's roles, playbooks, templates and plugins
description:
  - One digest over the relative path and bytes of every file under roles/, playbooks/, templates/ and plugins/,
    and site.yml, of the checkout this plugin lives in (caches and hidden files excluded).
options: {}
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


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        return [content_sha256()]
