"""Every role declares what it manages (roles/<role>/meta/state.yml), and declares all of it.

drift observes exactly what the roles declare (plugins/lookup/hy3spark_state.py): whatever a role manages and does
not declare, a re-run in sync would never look at, so never repair. This file reads every task of every role (blocks
and loops included), finds each task whose module manages a file, directory, container, unit, image or model, works
out its target with Ansible's own templating for every node of every example spec, and fails when no role's
declaration on that spec covers it. Declarations are templated the way drift's lookup templates them (the role's
defaults under the host's variables), here from the context hy3spark renders for the spec.

What a static reading cannot reach: the targets of `command`/`shell` tasks (the scenarios check what those change),
and a task's `when` (a target counts as covered when some node's declaration lists it). Values that a run gathers
before it writes (the deploying user's passwd entry, the earlyoom config found) are stood in for by RUNTIME below;
a target that needs any other unknown value fails the test, naming it.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import subprocess
import sys
from collections import ChainMap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleError
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar
from collection_plugins import plugin

from hy3spark.context import build_context
from hy3spark.spec import load_spec

REPO = Path(__file__).resolve().parent.parent
ROLES = sorted(p.parent.parent.name for p in (REPO / "roles").glob("*/meta/main.yml"))
EXAMPLES = sorted((REPO / "examples").glob("*.yml"))
HOME = "/home/{user}"

state_lookup = plugin("lookup", "hy3spark_state")

# module -> (kind, the option naming the target). Kinds: file (a path; a directory counts too), user_file (relative
# to the user's home), container, unit, image, model.
MANAGES: dict[str, tuple[str, str]] = {
    "ansible.builtin.template": ("file", "dest"),
    "ansible.builtin.copy": ("file", "dest"),
    "ansible.builtin.file": ("file", "path"),
    "ansible.builtin.lineinfile": ("file", "path"),
    "ansible.builtin.blockinfile": ("file", "path"),
    "ansible.builtin.known_hosts": ("file", "path"),
    "community.crypto.openssh_keypair": ("file", "path"),
    "ansible.posix.authorized_key": ("user_file", "path"),
    "ansible.builtin.pip": ("file", "virtualenv"),
    "community.docker.docker_container": ("container", "name"),
    "ansible.builtin.systemd_service": ("unit", "name"),
    "ansible.builtin.systemd": ("unit", "name"),
    "ansible.builtin.service": ("unit", "name"),
    "community.docker.docker_image_pull": ("image", "name"),
    "community.docker.docker_image": ("image", "name"),
    "community.docker.docker_image_load": ("image", "path"),
    "hy3spark.cluster.hy3spark_model_pipeline": ("model", "cache_dir"),
    "hy3spark.cluster.hy3spark_model_files": ("file", "state_file"),
    "hy3spark.cluster.hy3spark_drift": ("file", "record"),
}
# Modules that change nothing on a node, or nothing of the kinds above (apt: packages; their units and files are
# declared), or whose effect is not readable from their arguments (command, shell), or that structure the tasks.
OTHER = {
    "ansible.builtin.apt",
    "ansible.builtin.assert",
    "ansible.builtin.async_status",
    "ansible.builtin.command",
    "ansible.builtin.debug",
    "ansible.builtin.fail",
    "ansible.builtin.find",
    "ansible.builtin.getent",
    "ansible.builtin.meta",
    "ansible.builtin.set_fact",
    "ansible.builtin.setup",
    "ansible.builtin.shell",
    "ansible.builtin.slurp",
    "ansible.builtin.stat",
    "ansible.builtin.uri",
    "ansible.builtin.wait_for",
    "ansible.builtin.import_tasks",
    "ansible.builtin.include_tasks",
    "ansible.builtin.import_role",
    "ansible.builtin.include_role",
    "ansible.builtin.include_vars",
    "ansible.builtin.pause",
    "community.docker.docker_container_info",
    "community.docker.docker_host_info",
    "community.docker.docker_image_info",
    "hy3spark.cluster.hy3spark_earlyoom_info",
}
# Task keywords: everything else in a task is its module.
KEYWORDS = {
    "name",
    "when",
    "register",
    "loop",
    "loop_control",
    "vars",
    "tags",
    "become",
    "become_user",
    "changed_when",
    "failed_when",
    "check_mode",
    "no_log",
    "run_once",
    "delegate_to",
    "delegate_facts",
    "ignore_errors",
    "until",
    "retries",
    "delay",
    "async",
    "poll",
    "environment",
    "notify",
    "listen",
    "args",
    "diff",
    "throttle",
    "timeout",
    "any_errors_fatal",
    "ignore_unreachable",
    "module_defaults",
    "collections",
    "debugger",
    "connection",
    "action",
    "local_action",
    "with_items",
    "with_dict",
    "block",
    "rescue",
    "always",
}
# Values a run gathers before the tasks that write (registered results), for one node. The deploying user's passwd
# entry (ansible.builtin.getent in network/tasks/ssh.yml) is made per spec in host_vars: home is /home/<ssh_user>.
RUNTIME: dict[str, Any] = {
    # hy3spark_earlyoom_info (earlyoom/tasks/inspect.yml): a config of another tool was found.
    "__earlyoom_found": {
        "config": {"exists": True, "provenance": "apt", "sha1": "0" * 40},
        "package": {"installed": True},
    },
    "ansible_check_mode": False,
}


def tasks(items: list[dict[str, Any]] | None, inherited: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict]]:
    """Every task in a task list, blocks opened, with the vars of the blocks around it."""
    for task in items or []:
        scope = {**inherited, **(task.get("vars") or {})}
        if "block" in task:
            for part in ("block", "rescue", "always"):
                yield from tasks(task.get(part), scope)
        else:
            yield task, scope


def module_of(task: dict[str, Any]) -> str:
    (module,) = [key for key in task if key not in KEYWORDS]
    return module


def role_tasks(role: str) -> Iterator[tuple[Path, dict[str, Any], dict]]:
    loader = DataLoader()
    for path in sorted((REPO / "roles" / role / "tasks").rglob("*.yml")):
        for task, scope in tasks(loader.load_from_file(str(path), trusted_as_template=True), {}):
            yield path, task, scope


def load(role: str, part: str) -> dict[str, Any]:
    path = REPO / "roles" / role / part / "main.yml"
    return (DataLoader().load_from_file(str(path), trusted_as_template=True) or {}) if path.is_file() else {}


def host_vars(example: Path | None) -> dict[str, dict[str, Any]]:
    context = build_context(load_spec(example))
    nodes = context["nodes"]
    group = {"hy3spark": context["hy3spark"], "ansible_play_hosts_all": list(nodes), "groups": {"all": list(nodes)}}
    facts = {
        "getent_passwd": {
            node["ssh_user"]: ["x", "1000", "1000", "", HOME.format(user=node["ssh_user"]), "/bin/bash"]
            for node in nodes.values()
        }
    }
    out = {
        name: {**group, "inventory_hostname": name, "hy3spark_node": node, "ansible_facts": facts}
        for name, node in nodes.items()
    }
    hostvars = {name: {**v} for name, v in out.items()}
    for v in out.values():
        v["hostvars"] = hostvars
    return out


def templar(variables: ChainMap) -> Templar:
    return Templar(loader=DataLoader(), variables=variables)


def declared(example: Path | None) -> dict[str, dict[str, Any]]:
    """Each node's merged declaration, as drift's lookup makes it."""
    out = {}
    for host, hv in host_vars(example).items():
        per_role = {}
        for role in ROLES:
            path = REPO / "roles" / role / "meta" / "state.yml"
            declaration = DataLoader().load_from_file(str(path), trusted_as_template=True) or {}
            per_role[role] = templar(ChainMap(hv, load(role, "defaults"))).template(declaration)
        out[host] = state_lookup.merge(per_role)
    return out


def engine_runs(path: Path, host_vars: dict[str, Any]) -> bool:
    """An engine's own task files (tasks/engines/<engine>/) run only under that engine (tasks/engine.yml chooses them
    by hy3spark.engine.name)."""
    parts = path.relative_to(REPO).parts
    if "engines" not in parts[:-1] or parts[parts.index("engines") - 1] != "tasks":
        return True
    return parts[parts.index("engines") + 1] == host_vars["hy3spark"]["engine"]["name"]


# A launcher's own role runs only under that launcher (playbooks/site.yml chooses its play by
# hy3spark.engine.launcher); its targets may name what only that launcher has (hy3spark.mpi's paths).
LAUNCHER_ROLES = {"mpi_node": "mpi"}


def launcher_runs(role: str, host_vars: dict[str, Any]) -> bool:
    return LAUNCHER_ROLES.get(role, host_vars["hy3spark"]["engine"]["launcher"]) == host_vars["hy3spark"]["engine"][
        "launcher"]


def targets(example: Path) -> Iterator[tuple[str, str, str, str, str]]:
    """(host, role, where, kind, target) for every task that manages something, on every node."""
    for host, hv in host_vars(example).items():
        for role in ROLES:
            if not launcher_runs(role, hv):
                continue
            variables_of_role = [load(role, "vars"), hv, RUNTIME, load(role, "defaults")]
            for path, task, scope in role_tasks(role):
                module = module_of(task)
                if module in OTHER or not engine_runs(path, hv):
                    continue
                assert module in MANAGES, (
                    f"{path.relative_to(REPO)}: task {task.get('name')!r} uses {module}, which this test does not "
                    "know: add it to MANAGES (with the option naming what it manages) or to OTHER"
                )
                args = task[module] or {}
                if args.get("state") == "absent":
                    continue
                kind, option = MANAGES[module]
                where = f"{path.relative_to(REPO)}: {task.get('name')}"
                base = ChainMap(scope, *variables_of_role)
                items = templar(base).template(task["loop"]) if "loop" in task else [None]
                loop_var = (task.get("loop_control") or {}).get("loop_var", "item")
                for item in items:
                    t = templar(ChainMap({loop_var: item}, base) if "loop" in task else base)
                    try:
                        value = t.template(args.get(option, ".ssh/authorized_keys" if kind == "user_file" else None))
                        if module == "hy3spark.cluster.hy3spark_model_pipeline":
                            repo = t.template(args["repo"])
                            value = f"{value.rstrip('/')}/models--{repo.replace('/', '--')}"
                    except AnsibleError as exc:
                        pytest.fail(
                            f"{where}: its target does not template on {host} ({exc}); if it needs a value "
                            "a run gathers, stand it in for in RUNTIME"
                        )
                    if value is None:
                        continue
                    yield host, role, where, kind, str(value)
                    if module == "community.crypto.openssh_keypair":
                        yield host, role, where, kind, f"{value}.pub"


def covered(kind: str, target: str, watch: dict[str, Any], home: str) -> bool:
    if kind == "user_file":
        return target in watch["user_files"]
    if kind == "container":
        return target in watch["containers"]
    if kind == "unit":
        return target in watch["units"]
    if kind == "image":
        return target in watch["images"]
    if kind == "model":
        return target in watch["models"]
    user = [posixpath.join(home, p) for p in watch["user_files"]]
    exact = watch["files"] + user + watch["trees"] + watch["models"] + [u["path"] for u in watch["unwatched"]]
    under = watch["trees"] + watch["models"] + [u["path"] for u in watch["unwatched"]]
    target = posixpath.normpath(target)
    return target in exact or any(target.startswith(root.rstrip("/") + "/") for root in under)


@pytest.mark.parametrize("role", ROLES)
def test_every_role_declares_its_state(role: str) -> None:
    assert (REPO / "roles" / role / "meta" / "state.yml").is_file(), (
        f"roles/{role}/meta/state.yml is missing: say what the role manages (or `{{}}` and why it manages nothing)"
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_managed_target_is_declared(example: Path) -> None:
    watches = declared(example)
    users = {host: hv["hy3spark_node"]["ssh_user"] for host, hv in host_vars(example).items()}
    found = list(targets(example))
    assert {kind for *_, kind, _ in found} >= {"file", "user_file", "container", "unit", "model"}, found
    missing = sorted(
        {
            f"{where}: {kind} {target}"
            for host, _, where, kind, target in found
            if not any(covered(kind, target, w, HOME.format(user=users[host])) for w in watches.values())
        }
    )
    assert missing == [], "managed but declared by no role (add them to the role's meta/state.yml):\n" + "\n".join(
        missing
    )


def test_drift_declares_nothing_of_other_roles() -> None:
    """drift's inputs and internals name no other role's variable and no path of their own: what it observes comes
    from the declarations alone."""
    text = "\n".join((REPO / "roles" / "drift" / part / "main.yml").read_text() for part in ("defaults", "vars"))
    named = [role for role in ROLES if role != "drift" and f"{role}_" in text]
    assert named == [], named
    assert "/etc/" not in text and "/var/" not in text and "/usr/" not in text


def test_the_lookup_in_ansible_gives_what_this_test_reads(tmp_path: Path) -> None:
    """The real lookup, run by Ansible on the rendered inventory of the embedded default, returns for each node the
    declaration this file checks targets against (so the precedence it templates with is the one checked here)."""
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "hy3spark", "render", "--out", str(out)], check=True, capture_output=True)
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_STDOUT_CALLBACK": "json",
        "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1",
    }
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible"),
            "all",
            "-i",
            str(out / "inventory"),
            "-c",
            "local",
            "-m",
            "ansible.builtin.debug",
            "-a",
            "msg={{ lookup('hy3spark.cluster.hy3spark_state') }}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    hosts = json.loads(result.stdout)["plays"][0]["tasks"][0]["hosts"]
    expected = declared(None)
    assert {host: answer["msg"] for host, answer in hosts.items()} == expected


@pytest.mark.parametrize(
    ("declarations", "says"),
    [
        ({"r": {"file": ["/x"]}}, "roles/r/meta/state.yml: file is not a kind of state"),
        ({"r": {"files": "/x"}}, "roles/r/meta/state.yml: files must be a list"),
        ({"r": {"units": ["a", ""]}}, "roles/r/meta/state.yml: units holds an empty entry"),
        (
            {"r": {"health": "http://a/health"}, "s": {"health": "http://b/health"}},
            "roles/s/meta/state.yml: health: another role already declared the health URL",
        ),
        ({"r": ["files"]}, "roles/r/meta/state.yml must be a mapping of kinds"),
    ],
)
def test_a_bad_declaration_names_the_role_and_the_kind(declarations: dict, says: str) -> None:
    with pytest.raises(AnsibleError, match=re.escape(says)):
        state_lookup.merge(declarations)


def test_declarations_merge_in_role_order_without_repeats() -> None:
    watch = state_lookup.merge(
        {"a": {"files": ["/x", "/y"], "health": ""}, "b": {"files": ["/y", "/z"], "health": "http://h/health"}, "c": {}}
    )
    assert watch["files"] == ["/x", "/y", "/z"]
    assert watch["health"] == "http://h/health"
    assert watch["roles"] == ["a", "b", "c"]
    assert watch["units"] == []
