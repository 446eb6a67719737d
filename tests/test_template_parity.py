"""Deployed == rendered: Ansible's template module and `hy3spark render` produce the same bytes.

The roles deploy templates/*.j2 with `ansible.builtin.template` from the rendered inventory (group_vars
`hy3spark`, host_vars `hy3spark_node`); `hy3spark render` previews them with its own Jinja environment. If the
two ever differ (a Jinja setting, a filter that behaves differently, a YAML round trip through the inventory that
changes a value), the preview lies about what lands on a node. This test renders one spec per built-in profile,
plus a spec full of awkward values, both ways, and compares the files byte for byte. It runs on the controller only:
real `ansible-playbook`, connection local, no containers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from hy3spark.cli import main as hy3spark_main
from hy3spark.spec import available_profiles, load_profile

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "templates"
# The venv's ansible-playbook, next to the interpreter running this test (not whatever is first on PATH).
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"

# Every file template and where `hy3spark render` puts its output: "node" = files/<node>/<path> for each node
# (head_only: the head alone), "cluster" = files/<path> once. Roles deploy the node files to /<path>.
# inventory/*.j2 are not here: they produce the very variables the other templates are rendered from.
PARITY: dict[str, dict[str, object]] = {
    "netplan-fabric.yaml.j2": {"scope": "node", "path": "etc/netplan/60-hy3spark-fabric.yaml"},
    "earlyoom.j2": {"scope": "node", "path": "etc/default/earlyoom"},
    "node.env.j2": {"scope": "node", "path": "etc/hy3spark/node.env"},
    "serve.sh.j2": {"scope": "node", "path": "etc/hy3spark/serve.sh", "head_only": True},
    "ray_non_carry_over_env_vars.json.j2": {
        "scope": "node", "path": "etc/hy3spark/vllm/ray_non_carry_over_env_vars.json", "head_only": True,
    },
    "engine-options.yml.j2": {"scope": "node", "path": "etc/hy3spark/engine-options.yml", "head_only": True},
    "openmpi-hostfile.j2": {"scope": "node", "path": "etc/hy3spark/openmpi-hostfile"},
    "mpi-sshd_config.j2": {"scope": "node", "path": "etc/hy3spark/mpi/sshd_config"},
    "mpi-ssh_config.j2": {"scope": "node", "path": "etc/hy3spark/mpi/ssh_config", "head_only": True},
    "container.json.j2": {"scope": "node", "path": "container.json"},
    "ports.txt.j2": {"scope": "node", "path": "etc/hy3spark/ports.txt"},
    "firewall.nft.j2": {"scope": "node", "path": "etc/hy3spark/firewall.nft"},
    "docker-run.sh.j2": {"scope": "node", "path": "docker-run.sh"},
    "hy3spark-node.service.j2": {"scope": "node", "path": "etc/systemd/system/hy3spark-node.service"},
    "hy3spark-supervisor.service.j2": {
        "scope": "node", "path": "etc/systemd/system/hy3spark-supervisor.service", "head_only": True,
    },
    "supervisor.json.j2": {
        "scope": "node", "path": "usr/local/lib/hy3spark/supervisor/supervisor.json", "head_only": True,
    },
    "pi-models.json.j2": {"scope": "cluster", "path": "pi/models.json"},
    "pi-settings.json.j2": {"scope": "cluster", "path": "pi/settings.json"},
}

PLAYBOOK = textwrap.dedent("""\
    - name: Render the templates exactly as the roles do
      hosts: hy3spark_cluster
      gather_facts: false
      tasks:
        - name: Render each template with ansible.builtin.template
          ansible.builtin.template:
            src: "{{ parity_templates }}/{{ item.src }}"
            dest: "{{ parity_out }}/{{ item.dest }}"
            mode: "0644"
          loop: "{{ parity_jobs[inventory_hostname] }}"
    """)


def _spec_for(profile: str) -> dict[str, object]:
    """The smallest spec a user would write for this profile: one node per rank, the recipe's fabric."""
    serving = load_profile(profile).get("serving", {})
    ranks = int(serving.get("tensor_parallel", 1)) * int(serving.get("pipeline_parallel", 1))
    spec: dict[str, object] = {
        "name": f"parity-{profile}"[:63].rstrip("-").lower().replace(".", "-"),
        "profile": profile,
        "head": {"name": "spark-a", "fabric_ip": "10.0.0.1/24", "ssh_user": "ubuntu"},
        "fabric": {"interfaces": ["enp1s0f1np1"], "hcas": ["rocep1s0f1", "roceP2p1s0f1"], "mtu": 9000},
    }
    if serving.get("launcher") == "native":
        # A one-machine profile (the two-card desktop): every rank on one node, no fabric.
        spec["head"] = {"name": "desk", "ssh_user": "ubuntu", "gpus": ranks}
        del spec["fabric"]
    elif ranks > 1:
        spec["workers"] = [{"name": f"spark-{chr(ord('a') + i)}", "fabric_ip": f"10.0.0.{i + 1}/24",
                            "ssh_user": "ubuntu"} for i in range(1, ranks)]
    return spec


def _awkward_spec() -> dict[str, object]:
    """Values that break naive templating: YAML 1.1 booleans, numbers as strings, quotes, $, spaces, non-ASCII."""
    spec = _spec_for("hy3-295b-nvfp4-tp2")
    spec["name"] = "parity-awkward"
    spec["head"] = {"name": "head-0", "fabric_ip": "192.168.100.10/24", "ssh_user": "dgx",
                    "mgmt_ip": "172.16.0.10", "ssh_host": "spark-head.example"}
    spec["workers"] = [{"name": "worker-1", "fabric_ip": "192.168.100.11/24", "ssh_user": "dgx",
                        "mgmt_ip": "172.16.0.11"}]
    spec["fabric"] = {"interfaces": ["enp1s0f1np1", "enP2p1s0f1np1"], "hcas": ["rocep1s0f1", "roceP2p1s0f1"],
                      "mtu": 9000}
    spec["container"] = {
        "name_prefix": "hy3_x",
        "shm_size": "16g",
        "env": {
            "RAY_memory_usage_threshold": "0.99",
            "FLAG_OFF": "off", "FLAG_YES": "yes", "FLAG_NULL": "null", "OCTAL": "0755", "FLOATISH": "1e3",
            "WITH_SPACES": "a b  c", "QUOTES": "it's \"quoted\"", "DOLLAR": "$HOME and ${PATH}",
            "UNICODE": "Grüße — 東京",
        },
    }
    spec["serving"] = {"served_name": "hy3:latest", "port": 9443, "host": "127.0.0.1",
                       "extra_args": ["--override-generation-config", '{"temperature": 0.6, "note": "ü"}']}
    spec["ray"] = {"dashboard": "localhost", "object_store_memory_bytes": 8589934592}
    # Both families fenced, one each: the firewall's split of api_allow into ip and ip6 sets, rendered both ways.
    spec["firewall"] = {"api_allow": ["192.168.100.0/24", "2001:db8::/32"]}
    spec["earlyoom"] = {"mem_percent": 6, "swap_percent": 50, "avoid": ["vllm", "ray::.*", "VLLM::.*"],
                        "prefer": ["chrome"]}
    spec["pi"] = {"model_label": "Hy3 — zwei Sparks", "thinking_level_map": {"off": "no_think", "on": "high"},
                  "reasoning_kwarg": "reasoning_effort"}
    return spec


SPECS = {**{p: _spec_for(p) for p in available_profiles()}, "awkward-values": _awkward_spec()}
# A value that looks like Jinja would diverge (Ansible templates inventory strings): the spec rejects it, see
# tests/test_spec_validation.py::test_jinja_syntax_in_a_value.


def _python_render(spec_file: Path, out: Path) -> None:
    assert hy3spark_main(["render", str(spec_file), "--out", str(out)]) == 0


def _jobs(python_out: Path, nodes: list[str], head: str) -> tuple[dict[str, list[dict[str, str]]], list[str]]:
    """Per inventory host, the (template, output path) pairs; and every files/ output the Python side wrote."""
    jobs: dict[str, list[dict[str, str]]] = {n: [] for n in nodes}
    for src, where in PARITY.items():
        if where["scope"] == "cluster":
            targets = [(head, f"files/{where['path']}")]
        else:
            chosen = [head] if where.get("head_only") else nodes
            targets = [(n, f"files/{n}/{where['path']}") for n in chosen]
        for host, dest in targets:
            # A template the Python side skipped for this spec (earlyoom.j2 under policy stop) is skipped here too.
            if (python_out / dest).is_file():
                jobs[host].append({"src": src, "dest": dest})
    written = sorted(str(p.relative_to(python_out)) for p in (python_out / "files").rglob("*") if p.is_file())
    return jobs, written


def test_every_template_is_covered() -> None:
    """A new template without a parity entry would silently escape this test."""
    on_disk = {p.name for p in TEMPLATES.glob("*.j2")}
    assert on_disk == set(PARITY), f"templates/ and PARITY differ: {sorted(on_disk ^ set(PARITY))}"


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_ansible_template_matches_python_render(spec_name: str, tmp_path: Path) -> None:
    assert ANSIBLE_PLAYBOOK.is_file(), f"{ANSIBLE_PLAYBOOK} not found: install the dev extra into this venv"
    spec = SPECS[spec_name]
    spec_file = tmp_path / "cluster.yml"
    spec_file.write_text(yaml.safe_dump(spec, sort_keys=False, allow_unicode=True), encoding="utf-8")
    python_out = tmp_path / "python"
    _python_render(spec_file, python_out)

    nodes = [spec["head"]["name"], *(w["name"] for w in spec.get("workers", []))]  # type: ignore[index,union-attr]
    jobs, written = _jobs(python_out, nodes, nodes[0])
    covered = sorted(job["dest"] for host_jobs in jobs.values() for job in host_jobs)
    assert covered == written, "hy3spark render wrote files this test does not compare (or the reverse)"

    ansible_out = tmp_path / "ansible"
    for dest in written:  # the directories, made here: one module run per file is what the test is about
        (ansible_out / dest).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "parity.yml").write_text(PLAYBOOK)
    (tmp_path / "vars.json").write_text(json.dumps({
        "parity_jobs": jobs,
        "parity_out": str(ansible_out),
        "parity_templates": str(TEMPLATES),
        # Every host is rendered here, on the controller; the inventory's ansible_host stays untouched otherwise.
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
    }))
    env = {**os.environ, "LC_ALL": "C.UTF-8", "ANSIBLE_NOCOLOR": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"), "ANSIBLE_REMOTE_TEMP": str(tmp_path / "ansible-tmp"),
           "ANSIBLE_CONFIG": str(tmp_path / "none.cfg"),
           # The templates call the collection's serialisers by full name (hy3spark.cluster.env_value): the
           # checkout's link makes the repo the collection hy3spark.cluster, as ansible.cfg's collections_path does.
           "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections")}
    proc = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(python_out / "inventory" / "hosts.yml"), "-e", f"@{tmp_path / 'vars.json'}",
         str(tmp_path / "parity.yml")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, f"ansible-playbook failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    for dest in written:
        expected = (python_out / dest).read_bytes()
        actual = (ansible_out / dest).read_bytes()
        assert actual == expected, (
            f"{spec_name}: {dest} differs between ansible.builtin.template and hy3spark render\n"
            f"--- render\n{expected.decode(errors='replace')}\n--- ansible\n{actual.decode(errors='replace')}"
        )
