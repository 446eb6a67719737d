"""hy3spark_state: what the collection's roles manage on the node at hand, gathered from each role's declaration.

Each role says what it manages in one file, `roles/<role>/meta/state.yml` (files, directory trees, the deploying
user's SSH files, interfaces, units, images, containers, processes, models, nftables tables, the health URL, and
what it manages but
leaves uncompared, with why). The drift role observes exactly that on every node: it restates no role's paths, and a
new role is watched as soon as it declares its state. tests/test_role_state.py fails when a role's tasks manage a
file, directory, container or unit that its declaration does not list.

A declaration is templated per host against the role's own defaults (its inputs, overridden as usual by the
inventory and extra vars) and the host's variables: drift runs before any role, so a declaration reads inputs and
the inventory's `hy3spark` context, never a role's internals (vars/main.yml) or facts a role gathers.
"""

from __future__ import annotations

from collections import ChainMap
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = """
name: hy3spark_state
short_description: What hy3spark's roles manage on a host, from each role's meta/state.yml
description:
  - Templates every role's C(meta/state.yml) of the collection this plugin lives in (or only the roles named as
    terms) against the role's defaults and the host's variables, and merges them into one watch for the
    hy3spark_drift module.
  - List kinds (files, trees, user_files, interfaces, units, images, containers, processes, models, nft_tables,
    unwatched) are
    concatenated in role order without repeats; health is the one non-empty URL.
  - A declaration with an unknown kind, or a kind of the wrong type, fails naming the role and the kind.
options:
  _terms:
    description: Role names; none means every role of the collection.
    required: false
"""

EXAMPLES = """
- name: What every role manages on this node
  ansible.builtin.debug:
    msg: "{{ lookup('hy3spark.cluster.hy3spark_state') }}"
- name: What the network role manages
  ansible.builtin.debug:
    msg: "{{ lookup('hy3spark.cluster.hy3spark_state', 'network') }}"
"""

RETURN = """
_raw:
  description: One dict, the merged watch (each kind a list, health a string), plus C(roles), the roles that
    declared state.
  type: list
  elements: dict
"""

ROOT = Path(__file__).resolve().parents[2]
DECLARATION = Path("meta", "state.yml")
# Kind -> what one entry is. `unwatched`: managed, deliberately not compared (entries {path, why}).
LISTS = (
    "files",
    "trees",
    "user_files",
    "interfaces",
    "units",
    "images",
    "containers",
    "processes",
    "models",
    "nft_tables",
    "unwatched",
)
KINDS = (*LISTS, "health")


def declared_roles(root: Path = ROOT) -> list[str]:
    return sorted(p.parent.parent.name for p in (root / "roles").glob(f"*/{DECLARATION}"))


def merge(declarations: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The roles' templated declarations (role -> kinds) as one watch, checked kind by kind."""
    watch: dict[str, Any] = {kind: [] for kind in LISTS}
    watch["health"] = ""
    for role, declared in declarations.items():
        if not isinstance(declared, dict):
            raise AnsibleLookupError(f"roles/{role}/{DECLARATION} must be a mapping of kinds, not {declared!r}")
        for kind, value in declared.items():
            where = f"roles/{role}/{DECLARATION}: {kind}"
            if kind not in KINDS:
                raise AnsibleLookupError(f"{where} is not a kind of state; the kinds are {', '.join(KINDS)}")
            if kind == "health":
                if not isinstance(value, str):
                    raise AnsibleLookupError(f"{where} must be a URL or '', not {value!r}")
                if value and watch["health"]:
                    raise AnsibleLookupError(f"{where}: another role already declared the health URL")
                watch["health"] = watch["health"] or value
                continue
            if not isinstance(value, list):
                raise AnsibleLookupError(f"{where} must be a list, not {value!r}")
            for entry in value:
                if entry in (None, ""):
                    raise AnsibleLookupError(f"{where} holds an empty entry (an input that templated to nothing)")
                if entry not in watch[kind]:
                    watch[kind].append(entry)
    watch["roles"] = list(declarations)
    return watch


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):  # Ansible's plugin signature, untyped
        roles = list(terms) or declared_roles()
        declarations = {}
        for role in roles:
            path = ROOT / "roles" / role / DECLARATION
            if not path.is_file():
                raise AnsibleLookupError(f"role {role!r} declares no state: {path} does not exist")
            declared = self._loader.load_from_file(str(path), trusted_as_template=True) or {}
            defaults_file = ROOT / "roles" / role / "defaults" / "main.yml"
            defaults = (
                self._loader.load_from_file(str(defaults_file), trusted_as_template=True) or {}
                if defaults_file.is_file()
                else {}
            )
            # The role's defaults rank below everything the host has (inventory, play and extra vars), as in a play.
            templar = self._templar.copy_with_new_env(available_variables=ChainMap(dict(variables or {}), defaults))
            try:
                declarations[role] = templar.template(declared)
            except Exception as exc:  # Ansible's templating errors have no common base worth naming
                raise AnsibleLookupError(f"roles/{role}/{DECLARATION} does not template: {exc}") from exc
        return [merge(declarations)]
