"""Render invariants: what must hold in every render, whatever tests/golden/ says.

A golden only says "nothing changed", and a golden regenerated over a bug says the bug is right. These tests say
"what was rendered is right" for every example spec, the embedded default, the Molecule scenarios' specs and
generated variations of them. Expectations come from the spec itself (the user's YAML merged over the profile's,
read here with plain YAML, plus the documented defaults) and from the files on the other side of each contract (the
vllm_serve role's secrets file, earlyoom's process titles), never from hy3spark's own context builder.

Everything is rendered through the CLI, as a user runs it (`hy3spark render SPEC --format json` and `--out DIR`),
with fake secret values in the environment: none may land anywhere.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import ipaddress
import json
import os
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pytest
import yaml

from hy3spark.cli import main as hy3spark_main

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "hy3spark" / "profiles"
# Where the vllm_serve role writes the 0600 secrets file the serve script sources: the names in it are the names
# under which the secrets live in the engine's environment, whatever the spec calls them on the controller.
SECRETS_TEMPLATE = REPO / "roles" / "vllm_serve" / "vars" / "main.yml"

# The documented defaults (README "The cluster spec"; hy3spark/spec.py) for what neither the spec nor the profile sets.
DEFAULT_MTU = 9000
DEFAULT_PORT = 8888
DEFAULT_HOST = "0.0.0.0"
DEFAULT_RAY_PORT = 6379
DEFAULT_TOKEN_ENV = "HF_TOKEN"
DEFAULT_PREFER = ["chrome", "chromium", "firefox", "code"]

# Process titles of the engine and Ray as earlyoom matches them: /proc/PID/comm, cut to 15 characters. vLLM retitles
# its processes (VLLM::EngineCore, VLLM::Worker_TP0), Ray its workers (ray::IDLE, ray::RayWorkerWrapper).
ENGINE_TITLES = [t[:15] for t in (
    "vllm", "VLLM::APIServer", "VLLM::EngineCore", "VLLM::EngineCoreProc_0", "VLLM::Worker_TP0_DP0", "ray",
    "raylet", "gcs_server", "ray::IDLE", "ray::RayWorkerWrapper", "ray::RayWorkerWrapper.execute_method", "python",
    "python3", "python3.12", "trtllm-serve", "mpirun",
)]

# The host variables an inventory entry may carry: how to reach the node, nothing about what runs there.
CONNECTION_VARS = {"ansible_host", "ansible_port", "ansible_user", "ansible_ssh_common_args",
                   "ansible_ssh_extra_args", "ansible_ssh_private_key_file", "ansible_python_interpreter"}
ENV_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SECRET_FLAGS = ("--api-key", "--api_key", "--hf-token", "--hf_token", "--token")


# --- the cases ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    text: str  # the spec as the user wrote it
    path: Path | None  # the file to render; None with text: a generated variation, written to a temporary file
    default: bool = False  # the embedded default: `hy3spark render` with no SPEC


def _variations() -> dict[str, str]:
    """Specs a user could write that no example covers, derived from the examples."""
    pair = yaml.safe_load((REPO / "examples" / "hy3-two-spark.yml").read_text())
    single = yaml.safe_load((REPO / "examples" / "gpt-oss-single.yml").read_text())
    desktop = yaml.safe_load((REPO / "examples" / "two-card-tp.yml").read_text())
    trtllm = yaml.safe_load((REPO / "examples" / "pair-trtllm-235b.yml").read_text())

    def worker(letter: str, index: int) -> dict[str, Any]:
        return {"name": f"spark-{letter}", "fabric_ip": f"10.0.0.{index}/24", "mgmt_ip": f"192.168.1.{9 + index}",
                "ssh_user": "ubuntu"}

    def vary(base: dict[str, Any], **sections: dict[str, Any] | list[Any] | str) -> str:
        spec = copy.deepcopy(base)
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(spec.get(key), dict):
                spec[key].update(value)
            else:
                spec[key] = value
        return yaml.safe_dump(spec, sort_keys=False)

    return {
        "four-sparks-tp4": vary(pair, workers=[*pair["workers"], worker("c", 3), worker("d", 4)],
                                serving={"tensor_parallel": 4}),
        "three-sparks-pp3": vary(pair, workers=[*pair["workers"], worker("c", 3)],
                                 serving={"tensor_parallel": 1, "pipeline_parallel": 3}),
        "renamed-secrets": vary(pair, serving={"api_key_env": "HY3SPARK_SERVE_KEY"},
                                model={"token_env": "HY3SPARK_HUB_TOKEN"}),
        "no-hub-token": vary(pair, model={"token_env": None}),
        "open-endpoint": vary(pair, serving={"api_key_env": None, "open_endpoint": True}),
        "host-loopback": vary(pair, serving={"host": "127.0.0.1", "api_key_env": None}),
        "host-mgmt-port-9000": vary(pair, serving={"host": "192.168.1.10", "port": 9000}),
        "host-fabric": vary(pair, serving={"host": "10.0.0.1"}),
        "earlyoom-stop": vary(pair, earlyoom={"policy": "stop"}),
        "firewall-off": vary(pair, firewall="off"),
        "firewall-api-allow": vary(pair, firewall={"api_allow": ["192.168.1.0/24", "2001:db8::/32"]}),
        "earlyoom-leave": vary(pair, earlyoom={"policy": "leave"}),
        "earlyoom-own-lists": vary(pair, earlyoom={"policy": "protect", "prefer": ["chrome", "slack", "thunderbird"],
                                                   "avoid": ["vllm", "VLLM", "ray", "raylet", "gcs_server", "python3",
                                                             "python", "trtllm-serve", "mpirun", "jupyter"]}),
        "two-fabric-ports-mtu-4000": vary(pair, fabric={"interfaces": ["enp1s0f1np1", "enP2p1s0f1np1"],
                                                        "mtu": 4000}),
        "other-subnet-and-ports": vary(
            pair, head={**pair["head"], "fabric_ip": "172.16.5.1/30", "mgmt_ip": "10.1.0.10"},
            workers=[{**pair["workers"][0], "fabric_ip": "172.16.5.2/30", "mgmt_ip": "10.1.0.11"}],
            ray={"port": 6500, "node_manager_port": 6501, "object_manager_port": 6502, "dashboard": "localhost"}),
        "ssh-hosts-no-mgmt": vary(pair, head={"name": "spark-a", "fabric_ip": "10.0.0.1/24", "ssh_host": "a.lan"},
                                  workers=[{"name": "spark-b", "fabric_ip": "10.0.0.2/24"}]),
        "container-env": vary(pair, container={"env": {"NCCL_NET_GDR_LEVEL": "SYS", "TZ": "UTC"}}),
        "single-no-mgmt": vary(single, head={"name": "solo", "fabric_ip": "10.9.0.5/24", "ssh_user": "dgx"}),
        "single-two-gpus": vary(single, head={**single["head"], "gpus": 2}, serving={"tensor_parallel": 2}),
        "native-pair": vary(pair, serving={"launcher": "native"}),
        "native-four-sparks-tp2-pp2-port": vary(pair, workers=[*pair["workers"], worker("c", 3), worker("d", 4)],
                                                serving={"launcher": "native", "tensor_parallel": 2,
                                                         "pipeline_parallel": 2, "master_port": 29600}),
        "native-single-two-gpus-pp2": vary(single, head={**single["head"], "gpus": 2},
                                           serving={"launcher": "native", "tensor_parallel": 1,
                                                    "pipeline_parallel": 2}),
        # No fabric (one machine): the client URL is the node's mgmt_ip, else its ssh_host, else loopback.
        "desktop-binds-all-mgmt": vary(desktop, head={"name": "desk", "mgmt_ip": "192.168.1.50", "gpus": 2},
                                       serving={"host": "0.0.0.0", "api_key_env": "VLLM_API_KEY"}),
        "desktop-binds-all-no-address": vary(desktop, head={"name": "desk", "gpus": 2},
                                             serving={"host": "0.0.0.0", "api_key_env": "VLLM_API_KEY"}),
        "trtllm-loopback-no-token-port": vary(trtllm, serving={"host": "127.0.0.1", "open_endpoint": False,
                                                               "mpi_port": 2299, "port": 9000},
                                              model={"token_env": None}),
        # The API front answers on 8355 with a key, trtllm-serve behind it on a port of the spec's choosing.
        "trtllm-engine-port": vary(trtllm, serving={"engine_port": 18355}),
        "trtllm-open-no-key": vary(trtllm, serving={"api_key_env": None, "open_endpoint": True}),
        # One node under mpi, no fabric: the hostfile lists localhost (mpirun starts the rank itself).
        "trtllm-single-no-fabric": vary({**{k: v for k, v in trtllm.items() if k not in ("workers", "fabric")},
                                         "head": {"name": "solo", "mgmt_ip": "192.168.1.10"}},
                                        serving={"tensor_parallel": 1}),
        "single-api-key": vary(single, serving={"host": "0.0.0.0", "api_key_env": "HY3SPARK_SOLO_KEY"},
                               earlyoom={"policy": "stop"}),
    }


def _cases() -> dict[str, Case]:
    default = REPO / "hy3spark" / "default-cluster.yml"
    found = {"default": Case(default.read_text(), None, default=True)}
    for path in sorted((REPO / "examples").glob("*.yml")):
        found[f"example-{path.stem}"] = Case(path.read_text(), path)
    for path in sorted((REPO / "molecule").glob("*/cluster.yml")):
        found[f"molecule-{path.parent.name}"] = Case(path.read_text(), path)
    for name, text in _variations().items():
        found[f"vary-{name}"] = Case(text, None)
    return found


CASES = _cases()
NAMES = sorted(CASES)


# --- the oracle: the spec as written, merged over its profile ------------------------------------------------------
def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass(frozen=True)
class Node:
    name: str
    ip: str | None  # the fabric address without prefix; None with no fabric (one machine)
    cidr: str | None
    connect: str  # where Ansible connects: ssh_host, else mgmt_ip, else the fabric address, else 127.0.0.1
    ssh_user: str
    gpus: int
    head: bool

    @property
    def addresses(self) -> set[str]:
        return {a for a in (self.ip, self.connect) if a}


@dataclass(frozen=True)
class Expect:
    spec: dict[str, Any]  # merged
    nodes: list[Node]

    @property
    def head(self) -> Node:
        return self.nodes[0]

    def get(self, dotted: str, default: Any = None) -> Any:
        value: Any = self.spec
        for part in dotted.split("."):
            if not isinstance(value, dict) or part not in value:
                return default
            value = value[part]
        return value

    @property
    def fabric(self) -> bool:
        return self.spec.get("fabric") is not None

    @property
    def interfaces(self) -> list[str]:
        return list(self.spec["fabric"]["interfaces"]) if self.fabric else []

    @property
    def hcas(self) -> list[str]:
        return list(self.get("fabric.hcas", []))

    @property
    def api_key_env(self) -> str | None:
        return self.get("serving.api_key_env")

    @property
    def token_env(self) -> str | None:
        return self.get("model.token_env", DEFAULT_TOKEN_ENV)

    @property
    def ray_launcher(self) -> bool:
        # Every launcher today is Ray; issue 13 adds a choice, and only the Ray one needs the Ray flags checked here.
        return self.get("serving.launcher", "ray") == "ray"

    @property
    def trtllm(self) -> bool:
        """TensorRT-LLM under the mpi launcher (issue 12): its own launch line, options file and hostfile."""
        return self.get("serving.engine", "vllm") == "trtllm"

    @property
    def served_name(self) -> str:
        # trtllm-serve has no served-name flag: it reports the model under its repo id.
        return self.get("serving.served_name") or self.spec["model"]["repo"]


def expect(case: Case) -> Expect:
    spec = yaml.safe_load(case.text)
    if spec.get("profile"):
        profile = yaml.safe_load((PROFILES / f"{spec['profile']}.yml").read_text())
        profile.pop("description", None)
        spec = _merge(profile, spec)
    nodes = []
    for i, raw in enumerate([spec["head"], *spec.get("workers", [])]):
        cidr = ipaddress.IPv4Interface(raw["fabric_ip"]) if raw.get("fabric_ip") else None
        connect = raw.get("ssh_host") or raw.get("mgmt_ip") or (str(cidr.ip) if cidr else "127.0.0.1")
        nodes.append(Node(raw["name"], str(cidr.ip) if cidr else None, str(cidr) if cidr else None, str(connect),
                          raw.get("ssh_user", "ubuntu"), raw.get("gpus", 1), i == 0))
    return Expect(spec, nodes)


def engine_secret_names() -> set[str]:
    """Every variable an engine may read a secret from (hy3spark/engines: each engine's secret_names)."""
    from hy3spark.engines import SECRET_NAMES

    return set(SECRET_NAMES)


def fake_secrets(ex: Expect) -> dict[str, str]:
    """A distinctive value for every variable that could hold a secret during the render."""
    names = {"VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "RAY_AUTH_TOKEN", *engine_secret_names()}
    names |= {n for n in (ex.api_key_env, ex.token_env) if n}
    return {name: f"s3cret-{name.lower()}-Zq7xK2vW" for name in sorted(names)}


# --- rendering, as a user does ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rendered:
    files: dict[str, str]  # `render --format json`: path -> content
    modes: dict[str, int]
    written: dict[str, str]  # what `render --out DIR` wrote, its manifest included
    written_modes: dict[str, int]
    output: str  # everything both commands printed
    secrets: dict[str, str]


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = hy3spark_main(list(argv))
    return code, out.getvalue(), err.getvalue()


@functools.cache
def rendered(name: str) -> Rendered:
    case = CASES[name]
    secrets = fake_secrets(expect(case))
    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ, secrets):
        spec_args: list[str] = []
        if case.path is not None:
            spec_args = [str(case.path)]
        elif not case.default:
            (Path(tmp) / "cluster.yml").write_text(case.text)
            spec_args = [str(Path(tmp) / "cluster.yml")]
        code, shown, warned = _cli("render", *spec_args, "--format", "json")
        assert code == 0, warned
        data = json.loads(shown)
        out = Path(tmp) / "out"
        code, printed, complained = _cli("render", *spec_args, "--out", str(out))
        assert code == 0, complained
        disk = [p for p in out.rglob("*") if p.is_file()]
        return Rendered(
            files={f["path"]: f["content"] for f in data["files"]},
            modes={f["path"]: int(f["mode"], 8) for f in data["files"]},
            written={p.relative_to(out).as_posix(): p.read_text() for p in disk},
            written_modes={p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in disk},
            output=shown + warned + printed + complained,
            secrets=secrets,
        )


def node_env(r: Rendered, node: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in r.files[f"files/{node}/etc/hy3spark/node.env"].splitlines():
        if line.startswith("#") or not line:
            continue
        match = ENV_LINE.match(line)
        assert match, f"{node}: node.env line {line!r} is not KEY=VALUE"
        assert match[1] not in env, f"{node}: {match[1]} is set twice in node.env"
        env[match[1]] = match[2]
    return env


def flag_values(argv: list[str], flag: str) -> list[str]:
    """Every value given to `flag`, in its `--flag value` and `--flag=value` forms."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    return values + [a.split("=", 1)[1] for a in argv if a.startswith(f"{flag}=")]


def serve_argv(r: Rendered, head: str) -> list[str]:
    script = r.files[f"files/{head}/etc/hy3spark/serve.sh"]
    lines = [line for line in script.splitlines() if line.startswith("exec ") and not line.startswith("exec >")]
    assert len(lines) == 1, f"serve.sh must end in one `exec ENGINE ...` line, found {lines}"
    return shlex.split(lines[0])[1:]


# --- the invariants -------------------------------------------------------------------------------------------------
def test_the_cases_cover_what_the_invariants_branch_on() -> None:
    """Guard the generator: every policy, single and multi node, every serving.host kind, renamed secrets."""
    exps = [expect(c) for c in CASES.values()]
    assert {e.get("earlyoom.policy", "protect") for e in exps} == {"protect", "stop", "leave"}
    assert {len(e.nodes) for e in exps} >= {1, 2, 3, 4, 5}
    assert {e.fabric for e in exps} == {True, False}, "specs with and without a fabric"
    assert {e.get("serving.host", DEFAULT_HOST) for e in exps} >= {"0.0.0.0", "127.0.0.1", "192.168.1.10", "10.0.0.1"}
    assert {e.api_key_env for e in exps} >= {None, "VLLM_API_KEY", "HY3SPARK_SERVE_KEY"}
    assert {e.token_env for e in exps} >= {None, "HF_TOKEN", "HY3SPARK_HUB_TOKEN"}
    assert len(CASES) >= 4 + 8 + 15


def test_the_engine_receives_its_secrets_as_vllm_api_key_and_hf_token() -> None:
    """The oracle below takes the names from the engines; the role's secrets file must write exactly the engine's
    map (hy3spark.secrets), so a secret an engine adds later, a Ray token say, is then required in the non-carry-over
    list without a test edit."""
    assert engine_secret_names() >= {"VLLM_API_KEY", "HF_TOKEN"}
    block = yaml.safe_load(SECRETS_TEMPLATE.read_text())["__vllm_serve_secrets"]
    assert "{% for name, source in vllm_serve_secret_env.items() %}" in block
    line = "{{ name | hy3spark.cluster.env_key }}={{ value | hy3spark.cluster.env_value(name) | quote }}"
    assert line in block and not re.search(r"^\s*[A-Z_]+=", block, flags=re.MULTILINE)
    defaults = yaml.safe_load((REPO / "roles" / "vllm_serve" / "defaults" / "main.yml").read_text())
    assert defaults["vllm_serve_secret_env"] == "{{ hy3spark.secrets }}"


@pytest.mark.parametrize("name", NAMES)
def test_secrets_and_per_node_settings_stay_off_the_workers(name: str) -> None:
    """vLLM's Ray executor copies the driver's environment to every worker unless $VLLM_CONFIG_ROOT/
    ray_non_carry_over_env_vars.json names the variable: the API key and hub token would reach every worker's Ray
    runtime env (kept in Ray's GCS), and the head's own address and interfaces would override the workers'."""
    ex, r = expect(CASES[name]), rendered(name)
    if ex.trtllm:
        check_mpirun_passes_names_only(ex, r)
        return
    head_env = node_env(r, ex.head.name)
    listed_at = f"files/{ex.head.name}{head_env['VLLM_CONFIG_ROOT']}/ray_non_carry_over_env_vars.json"
    assert listed_at in r.files, f"the list must sit in the head's VLLM_CONFIG_ROOT ({head_env['VLLM_CONFIG_ROOT']})"
    listed = json.loads(r.files[listed_at])
    assert isinstance(listed, list) and all(isinstance(n, str) for n in listed)

    missing_secrets = engine_secret_names() - set(listed)
    assert not missing_secrets, f"secrets the serve script exports would be copied to every worker: {missing_secrets}"

    envs = {n.name: node_env(r, n.name) for n in ex.nodes}
    per_node = {"VLLM_HOST_IP"} if ex.fabric else set()  # no fabric: no node address is set at all
    for env in envs.values():
        for key, value in env.items():
            named_devices = set(re.split(r"[=,:\s]+", value)) & {*ex.interfaces, *ex.hcas}
            differs = len({e.get(key) for e in envs.values()}) > 1
            if named_devices or differs:
                per_node.add(key)
    assert per_node - set(listed) == set(), "per-node settings the head would impose on its workers"
    if ex.fabric:
        assert {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} <= per_node, "the oracle must see the socket interfaces"


def check_mpirun_passes_names_only(ex: Expect, r: Rendered) -> None:
    """No Ray carries the head's environment over under mpi, and no carry-over list is written: mpirun's `-x NAME`
    passes the head's value of NAME to every rank, so only names whose value is the same on every node are passed,
    and only as names (a value on the command line would show in `ps`)."""
    assert not [p for p in r.files if p.endswith("ray_non_carry_over_env_vars.json")]
    argv = serve_argv(r, ex.head.name)
    passed = flag_values(argv[:argv.index("trtllm-llmapi-launch")], "-x")
    assert passed and all(ENV_NAME.fullmatch(n) for n in passed), f"-x takes names only: {passed}"
    envs = [node_env(r, n.name) for n in ex.nodes]
    secrets = engine_secret_names()
    for n in passed:
        if n in secrets:
            assert all(n not in env for env in envs), f"{n} is a secret: from the secrets file, never node.env"
            continue
        assert len({env.get(n) for env in envs}) == 1, f"-x {n} would give every rank the head's value"
        assert not n.startswith("OMPI_"), "mpirun's own settings reach the ranks without -x"
    assert set(passed) >= {"NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES"} if ex.fabric else True
    assert set(passed) & secrets == {n for n in ("HF_TOKEN",) if ex.token_env}


@pytest.mark.parametrize("name", NAMES)
def test_no_secret_value_reaches_any_rendered_file(name: str) -> None:
    r = rendered(name)
    for var, value in r.secrets.items():
        for path, content in {**r.files, **r.written}.items():
            assert value not in content, f"the value of ${var} is in {path}"
        assert value not in r.output, f"the value of ${var} was printed by render"


@pytest.mark.parametrize("name", NAMES)
def test_each_node_env_is_its_own(name: str) -> None:
    ex, r = expect(CASES[name]), rendered(name)
    if not ex.fabric:  # one machine: nothing names an interface or an address; the ranks meet over loopback
        for node in ex.nodes:
            env = node_env(r, node.name)
            fabric_keys = {k for k in env if k in ("VLLM_HOST_IP", "MASTER_ADDR", "UCX_NET_DEVICES")
                           or k.endswith("_SOCKET_IFNAME") or k.startswith(("NCCL_IB_", "OMPI_MCA_"))}
            if ex.trtllm:  # Open MPI's hostfile and its one rank per node name no fabric
                fabric_keys -= {"OMPI_MCA_orte_default_hostfile", "OMPI_MCA_rmaps_ppr_n_pernode"}
            assert not fabric_keys, f"{node.name}: fabric settings without a fabric: {fabric_keys}"
            assert env["HF_HUB_OFFLINE"] == "1" and r.modes[f"files/{node.name}/etc/hy3spark/node.env"] == 0o600
        return
    iface = ex.interfaces[0]
    if ex.trtllm:
        check_mpi_node_env(ex, r, iface)
        return
    own_ips = []
    for node in ex.nodes:
        env = node_env(r, node.name)
        assert env["VLLM_HOST_IP"] == node.ip, f"{node.name}: VLLM_HOST_IP must be its own fabric address"
        assert env["MASTER_ADDR"] == ex.head.ip
        for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES"):
            assert env[key] == iface, f"{node.name}: {key} must be the fabric port {iface}"
        if ex.hcas:
            assert env["NCCL_IB_HCA"] == "=" + ",".join(ex.hcas), "both RoCE twins, matched exactly"
        else:
            assert "NCCL_IB_HCA" not in env
        assert env["RAY_memory_monitor_refresh_ms"] == "0", "Ray's memory monitor would kill ranks at 95%"
        for key, value in (ex.get("container.env") or {}).items():
            assert env[key] == str(value), f"{node.name}: container.env {key} is the spec's"
        leaked = (engine_secret_names() | {ex.api_key_env, ex.token_env}) & set(env)
        assert not leaked, f"{node.name}: node.env reaches `docker inspect`, it must not name secrets: {leaked}"
        others = {n.ip for n in ex.nodes if n.name != node.name}
        assert env["VLLM_HOST_IP"] not in others
        assert r.modes[f"files/{node.name}/etc/hy3spark/node.env"] == 0o600
        own_ips.append(env["VLLM_HOST_IP"])
    assert len(set(own_ips)) == len(ex.nodes)


def check_mpi_node_env(ex: Expect, r: Rendered, iface: str) -> None:
    """NVIDIA's two-Spark environment: the fabric netdev for UCX, NCCL and Open MPI's TCP transport, the hostfile
    where the container has it, one rank per node; no Ray, no address of the node's own (mpirun has the hostfile)."""
    for node in ex.nodes:
        env = node_env(r, node.name)
        for key in ("NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES", "OMPI_MCA_btl_tcp_if_include"):
            assert env[key] == iface, f"{node.name}: {key} must be the fabric port {iface}"
        assert env["OMPI_MCA_orte_default_hostfile"] == "/etc/openmpi-hostfile"
        assert env["OMPI_MCA_rmaps_ppr_n_pernode"] == "1"
        if ex.hcas:
            assert env["NCCL_IB_HCA"] == "=" + ",".join(ex.hcas), "both RoCE twins, matched exactly"
        assert not [k for k in env if k.startswith("RAY_") or k.startswith("VLLM_")], "no Ray, no vLLM here"
        leaked = (engine_secret_names() | {ex.api_key_env, ex.token_env}) & set(env)
        assert not leaked, f"{node.name}: node.env reaches `docker inspect`, it must not name secrets: {leaked}"
        assert r.modes[f"files/{node.name}/etc/hy3spark/node.env"] == 0o600


@pytest.mark.parametrize("name", NAMES)
def test_netplan_configures_the_fabric_port_and_nothing_else(name: str) -> None:
    ex, r = expect(CASES[name]), rendered(name)
    mtu = ex.get("fabric.mtu", DEFAULT_MTU)
    if not ex.fabric:
        assert not [p for p in r.files if "/etc/netplan/" in p], "no fabric: nothing for netplan to configure"
        return
    for node in ex.nodes:
        path = f"files/{node.name}/etc/netplan/60-hy3spark-fabric.yaml"
        plan = yaml.safe_load(r.files[path])
        assert set(plan) == {"network"} and set(plan["network"]) == {"version", "ethernets"}
        ethernets = plan["network"]["ethernets"]
        assert list(ethernets) == ex.interfaces, "only the spec's fabric ports: management interfaces keep theirs"
        first, *rest = ex.interfaces
        assert ethernets[first]["addresses"] == [node.cidr]
        for iface in ex.interfaces:
            assert ethernets[iface]["mtu"] == mtu
            assert ethernets[iface]["dhcp4"] is False and ethernets[iface]["dhcp6"] is False
        for iface in rest:
            assert "addresses" not in ethernets[iface], "the address goes on the first fabric port only"
        for other in ({n.ip for n in ex.nodes} - {node.ip}) | ({node.connect} - {node.ip}):
            named = re.search(rf"(?<![\w.]){re.escape(other)}(?![\w.])", r.files[path])
            assert not named, f"{node.name}: netplan names {other}, not only its own fabric address"
        assert r.modes[path] == 0o600 and r.written_modes[path] == 0o600, "netplan warns about readable files"


@pytest.mark.parametrize("name", NAMES)
def test_earlyoom_never_prefers_the_engine_and_always_avoids_it(name: str) -> None:
    ex, r = expect(CASES[name]), rendered(name)
    policy = ex.get("earlyoom.policy", "protect")
    paths = {f"files/{n.name}/etc/default/earlyoom" for n in ex.nodes}
    if policy != "protect":
        assert not paths & set(r.files), f"policy {policy}: hy3spark writes no earlyoom config"
        return
    for path in paths:
        lines = [line for line in r.files[path].splitlines() if line.startswith("EARLYOOM_ARGS=")]
        assert len(lines) == 1
        value = lines[0].removeprefix("EARLYOOM_ARGS=")
        assert value.startswith('"') and value.endswith('"') and value.count('"') == 2
        args = value[1:-1].split()  # systemd splits $EARLYOOM_ARGS at whitespace
        assert args.count("--avoid") == 1 and args.count("--prefer") == 1
        # earlyoom compiles these as POSIX extended regexes: for ^, $, | and plain names Python's re agrees.
        avoid = re.compile(args[args.index("--avoid") + 1])
        prefer = re.compile(args[args.index("--prefer") + 1])
        for title in ENGINE_TITLES:
            assert not prefer.search(title), f"{path}: --prefer matches {title!r}: earlyoom would kill the engine first"
            assert avoid.search(title), f"{path}: --avoid misses {title!r}"
        for wanted in ex.get("earlyoom.prefer", DEFAULT_PREFER):
            assert prefer.search(wanted), f"{path}: --prefer lost the spec's {wanted!r}"


@pytest.mark.parametrize("name", NAMES)
def test_pi_points_at_the_heads_api_with_the_served_name(name: str) -> None:
    ex, r = expect(CASES[name]), rendered(name)
    served, port = ex.served_name, ex.get("serving.port", DEFAULT_PORT)
    host = ex.get("serving.host", DEFAULT_HOST)
    models = json.loads(r.files["files/pi/models.json"])
    settings = json.loads(r.files["files/pi/settings.json"])
    assert len(models["providers"]) == 1
    (provider, entry), = models["providers"].items()
    url = urlsplit(entry["baseUrl"])
    assert (url.scheme, url.port, url.path) == ("http", port, "/v1")
    if ipaddress.IPv4Address(host).is_unspecified:
        workers = set().union(*(n.addresses for n in ex.nodes if not n.head))
        if ex.fabric:
            assert url.hostname in ex.head.addresses - workers, f"{url.hostname} is not the head's address"
        else:  # the head's LAN address first (what a client elsewhere reaches), then ssh_host, else loopback
            head = ex.spec["head"]
            assert url.hostname == (head.get("mgmt_ip") or head.get("ssh_host") or "127.0.0.1")
    else:
        assert url.hostname == host, "the endpoint listens on serving.host only"
    assert entry["apiKey"] == (ex.api_key_env or "none"), "Pi reads the key from the variable named here"
    assert [m["id"] for m in entry["models"]] == [served]
    assert entry["models"][0]["contextWindow"] == ex.spec["serving"]["max_model_len"]
    assert settings["defaultProvider"] == provider and settings["defaultModel"] == served


def _keys(data: Any) -> set[str]:
    if isinstance(data, dict):
        return {str(k) for k in data} | set().union(*(_keys(v) for v in data.values()))
    if isinstance(data, list):
        return set().union(*(_keys(v) for v in data))
    return set()


@pytest.mark.parametrize("name", NAMES)
def test_inventory_hosts_carry_connection_only(name: str) -> None:
    """hosts.yml says how to reach each node; what runs there lives in group_vars (the cluster) and host_vars
    (`hy3spark_node`, one per node). An `ansible_connection` or a stray variable would change where tasks run."""
    ex, r = expect(CASES[name]), rendered(name)
    inventory = {p: c for p, c in r.files.items() if p.startswith("inventory/")}
    assert set(inventory) == {"inventory/hosts.yml", "inventory/group_vars/all/hy3spark.yml",
                              *(f"inventory/host_vars/{n.name}.yml" for n in ex.nodes)}
    for path, content in inventory.items():
        assert "{{" not in content and "{%" not in content, f"{path}: Ansible would template this inventory text"

    hosts = yaml.safe_load(inventory["inventory/hosts.yml"])
    assert set(hosts) == {"all"} and set(hosts["all"]) == {"children"}
    groups = hosts["all"]["children"]
    assert set(groups) == {"hy3spark_head", "hy3spark_workers", "hy3spark_cluster"}
    assert groups["hy3spark_cluster"] == {"children": {"hy3spark_head": None, "hy3spark_workers": None}}
    assert set(groups["hy3spark_head"]) == {"hosts"} and set(groups["hy3spark_workers"]) == {"hosts"}
    # Keys compared as parsed: a node name YAML reads as a boolean or a number would not match its string.
    assert list(groups["hy3spark_head"]["hosts"]) == [ex.head.name], "the head, alone, by its name"
    assert list(groups["hy3spark_workers"]["hosts"] or {}) == [n.name for n in ex.nodes[1:]], "workers in order"
    entries = {**groups["hy3spark_head"]["hosts"], **(groups["hy3spark_workers"]["hosts"] or {})}
    for node in ex.nodes:
        entry = entries[node.name]
        assert set(entry) <= CONNECTION_VARS, f"{node.name}: {set(entry) - CONNECTION_VARS} is not a connection var"
        assert entry["ansible_host"] == node.connect and entry["ansible_user"] == node.ssh_user

    for node in ex.nodes:
        host_vars = yaml.safe_load(inventory[f"inventory/host_vars/{node.name}.yml"])
        assert set(host_vars) == {"hy3spark_node"}, "host_vars hold the node's own data, one variable"
        assert host_vars["hy3spark_node"]["name"] == node.name
        assert host_vars["hy3spark_node"]["role"] == ("head" if node.head else "worker")
        assert not {k for k in _keys(host_vars) if k.startswith("ansible_")}, "no connection override in host_vars"
    group_vars = yaml.safe_load(inventory["inventory/group_vars/all/hy3spark.yml"])
    assert set(group_vars) == {"hy3spark"}
    assert not {k for k in _keys(group_vars) if k.startswith("ansible_")}


@pytest.mark.parametrize("name", NAMES)
def test_group_vars_hold_the_specs_cluster_in_order(name: str) -> None:
    ex, r = expect(CASES[name]), rendered(name)
    cluster = yaml.safe_load(r.files["inventory/group_vars/all/hy3spark.yml"])["hy3spark"]
    assert cluster["cluster"] == ex.spec["name"]
    assert cluster["node_order"] == [n.name for n in ex.nodes]
    assert cluster["head"] == ex.head.name and cluster["workers"] == [n.name for n in ex.nodes[1:]]
    assert cluster["node_count"] == len(ex.nodes) and cluster["gpu_count"] == sum(n.gpus for n in ex.nodes)
    if ex.fabric:
        assert cluster["fabric"]["interfaces"] == ex.interfaces
        assert cluster["fabric"]["mtu"] == ex.get("fabric.mtu", DEFAULT_MTU)
        assert cluster["fabric"]["head_ip"] == ex.head.ip
    else:
        assert cluster["fabric"] is None, "the roles read `hy3spark.fabric is none` as: no fabric to configure"
    serving = cluster["serving"]
    assert serving["served_name"] == ex.served_name
    assert serving["port"] == ex.get("serving.port", DEFAULT_PORT)
    assert serving["api_key_env"] == ex.api_key_env and cluster["model"]["token_env"] == ex.token_env
    assert cluster["ray"]["address"] == (f"{ex.head.ip}:{ex.get('ray.port', DEFAULT_RAY_PORT)}" if ex.fabric
                                         else None)
    assert cluster["earlyoom"]["policy"] == ex.get("earlyoom.policy", "protect")
    for node in ex.nodes:
        own = yaml.safe_load(r.files[f"inventory/host_vars/{node.name}.yml"])["hy3spark_node"]
        assert (own["fabric_ip"], own["fabric_cidr"], own["ssh_host"], own["gpus"]) == (
            node.ip, node.cidr, node.connect, node.gpus)


@pytest.mark.parametrize("name", NAMES)
def test_serve_command_is_the_specs_and_carries_no_secret(name: str) -> None:
    ex, r = expect(CASES[name]), rendered(name)
    if ex.trtllm:
        check_mpirun_launch(ex, r)
        return
    serving = ex.spec["serving"]
    tp, pp = serving["tensor_parallel"], serving.get("pipeline_parallel", 1)
    if ex.ray_launcher:  # Ray places the ranks: only the head runs the engine
        assert not any(p.endswith("/serve.sh") for p in r.files if not p.startswith(f"files/{ex.head.name}/"))
    argv = serve_argv(r, ex.head.name)
    assert argv[:3] == ["vllm", "serve", ex.spec["model"]["repo"]]
    assert flag_values(argv, "--revision") == [str(ex.spec["model"]["revision"])]
    assert flag_values(argv, "--served-model-name") == [serving["served_name"]]
    assert flag_values(argv, "--tensor-parallel-size") == [str(tp)] and "-tp" not in argv
    assert flag_values(argv, "--pipeline-parallel-size") in ([str(pp)], [] if pp == 1 else [str(pp)])
    assert tp * pp == sum(n.gpus for n in ex.nodes), "every GPU of the cluster is a rank"
    assert flag_values(argv, "--port") == [str(ex.get("serving.port", DEFAULT_PORT))]
    host = ex.get("serving.host", DEFAULT_HOST)
    assert flag_values(argv, "--host") in ([host], [] if host == DEFAULT_HOST else [host])
    if ex.ray_launcher:
        assert flag_values(argv, "--distributed-executor-backend") == ["ray"], "an image default could pick mp"
        assert not {"--nnodes", "--node-rank", "--headless", "--master-addr"} & set(argv)
    else:
        assert flag_values(argv, "--distributed-executor-backend") == ["mp"], "no Ray under the native launcher"
        if len(ex.nodes) == 1:
            assert not {"--nnodes", "--node-rank", "--headless", "--master-addr", "--master-port"} & set(argv)
        else:
            # Every node runs the same command; the head is rank 0 and serves, the others are --headless ranks
            # that meet the head at its fabric address.
            for rank, node in enumerate(ex.nodes):
                mine = serve_argv(r, node.name)
                assert flag_values(mine, "--nnodes") == [str(len(ex.nodes))]
                assert flag_values(mine, "--node-rank") == [str(rank)]
                assert flag_values(mine, "--master-addr") == [ex.head.ip]
                assert flag_values(mine, "--master-port") == [str(ex.get("serving.master_port", 29501))]
                assert ("--headless" in mine) is (rank > 0)
                rest = [a for a in mine if a != "--headless"]
                assert rest[:rest.index("--node-rank")] == argv[:argv.index("--node-rank")]
            assert tp * pp % len(ex.nodes) == 0, "vLLM runs as many ranks on every node"
    smuggled = [a for a in argv if a.split("=", 1)[0] in SECRET_FLAGS]
    assert not smuggled, f"a secret flag on the engine's command line (visible in ps): {smuggled}"

    script = r.files[f"files/{ex.head.name}/etc/hy3spark/serve.sh"]
    check_secrets_come_on_stdin(script, "exec vllm")
    for path in (f"files/{ex.head.name}/etc/hy3spark/serve.sh", *(f"files/{n.name}/docker-run.sh" for n in ex.nodes)):
        shell = r.files[path].splitlines()[0].removeprefix("#!")
        assert shell in ("/bin/sh", "/bin/bash"), f"{path}: shebang {shell!r}"
        proc = subprocess.run([shell, "-n"], input=r.files[path], capture_output=True, text=True)
        assert proc.returncode == 0, f"{path}: {proc.stderr}"
        assert r.modes[path] == 0o755


def check_mpirun_launch(ex: Expect, r: Rendered) -> None:
    """`mpirun ... trtllm-llmapi-launch trtllm-serve <repo> --tp_size N ... --port P --host H` on the head only,
    the hostfile of fabric addresses on every node, the options file beside the script."""
    serving = ex.spec["serving"]
    tp, pp = serving["tensor_parallel"], serving.get("pipeline_parallel", 1)
    assert not any(p.endswith("/serve.sh") for p in r.files if not p.startswith(f"files/{ex.head.name}/"))
    argv = serve_argv(r, ex.head.name)
    assert argv[0] == "mpirun"
    launch = argv.index("trtllm-llmapi-launch")
    assert argv[launch + 1:launch + 3] == ["trtllm-serve", ex.spec["model"]["repo"]]
    engine = argv[launch + 1:]
    assert flag_values(engine, "--tp_size") == [str(tp)] and tp * pp == sum(n.gpus for n in ex.nodes)
    assert flag_values(engine, "--revision") == [str(ex.spec["model"]["revision"])]
    assert flag_values(engine, "--max_batch_size") == [str(serving["max_num_seqs"])]
    assert flag_values(engine, "--max_seq_len") == [str(serving["max_model_len"])]
    script = r.files[f"files/{ex.head.name}/etc/hy3spark/serve.sh"]
    if ex.api_key_env:  # trtllm-serve checks no key: the API front answers on the port, trtllm-serve behind it
        behind = serving.get("engine_port", serving["port"] + 1)
        assert flag_values(engine, "--port") == [str(behind)] and flag_values(engine, "--host") == ["127.0.0.1"]
        front = (f"python3 /etc/hy3spark/api-front.py --listen {serving.get('host', DEFAULT_HOST)}:{serving['port']} "
                 f"--upstream 127.0.0.1:{behind} --key-env HY3SPARK_API_KEY &\nunset HY3SPARK_API_KEY\nexec mpirun ")
        assert front in script, "the front starts before mpirun, and mpirun (so every rank) starts without the key"
        assert "HY3SPARK_API_KEY" not in flag_values(argv[:launch], "-x")
    else:
        assert flag_values(engine, "--port") == [str(serving["port"])]
        assert flag_values(engine, "--host") == [serving.get("host", DEFAULT_HOST)], "trtllm-serve's default: localhost"
        assert "api-front" not in script
    assert flag_values(argv[:launch], "plm_rsh_args") == [f"-p {serving.get('mpi_port', 2233)} "
                                                          "-F /etc/hy3spark/mpi/ssh_config"]
    options = flag_values(engine, "--extra_llm_api_options")
    assert options == ["/etc/hy3spark/engine-options.yml"]
    loaded = yaml.safe_load(r.files[f"files/{ex.head.name}{options[0]}"])
    assert set(loaded) == {"print_iter_log", "kv_cache_config", "cuda_graph_config"}
    wanted = serving["kv_cache_config"]["free_gpu_memory_fraction"]
    assert loaded["kv_cache_config"]["free_gpu_memory_fraction"] == wanted
    smuggled = [a for a in argv if a.split("=", 1)[0] in SECRET_FLAGS]
    assert not smuggled, f"a secret flag on the engine's command line (visible in ps): {smuggled}"
    for node in ex.nodes:
        hostfile = r.files[f"files/{node.name}/etc/hy3spark/openmpi-hostfile"]
        hosts = [line for line in hostfile.splitlines() if line and not line.startswith("#")]
        assert hosts == [f"{n.ip or 'localhost'} slots=1" for n in ex.nodes], "fabric addresses, one slot each"
    check_secrets_come_on_stdin(script, "exec mpirun")


def check_secrets_come_on_stdin(script: str, engine: str) -> None:
    """The serve script reads the secrets from its stdin before the log's tee starts, and exports them after it,
    before it execs the engine; it never names a file that holds them (tests/test_serve_script.py runs it)."""
    read, tee = script.index("secrets=$(cat)"), script.index("exec > >(tee -a ")
    exported = script.index('set -a\n  eval "$secrets"\n  set +a')
    assert read < tee < exported < script.index("unset secrets") < script.index(engine)
    assert ". /etc/" not in script and "secrets.env" not in script.split("set -euo pipefail", 1)[1]


def check_ray_command(ex: Any, node: Any, command: list[str], ray_port: str) -> None:
    # Unless ray.metrics asks for Ray's Prometheus servers as Ray binds them, `ray start` runs with the loopback
    # sitecustomize's directory first on PYTHONPATH (the image's own PYTHONPATH kept behind it).
    prefix = [] if ex.get("ray.metrics", False) else [
        "/bin/sh", "-c", 'PYTHONPATH="/etc/hy3spark/ray-python${PYTHONPATH:+:$PYTHONPATH}" exec "$0" "$@"']
    assert command[:len(prefix)] == prefix and command[len(prefix):][:2] == ["ray", "start"], command
    assert flag_values(command, "--node-ip-address") == [node.ip]
    assert flag_values(command, "--num-gpus") == [str(node.gpus)]
    if node.head:
        assert "--head" in command and flag_values(command, "--port") == [ray_port]
        assert "--address" not in command
        dashboard = ex.get("ray.dashboard", "off")
        assert ("--include-dashboard=false" in command) is (dashboard == "off"), "ShadowRay: dashboard off"
        if dashboard != "off":
            assert flag_values(command, "--dashboard-host") == ["127.0.0.1"]
    else:
        assert "--head" not in command
        assert flag_values(command, "--address") == [f"{ex.head.ip}:{ray_port}"]


@pytest.mark.parametrize("name", NAMES)
def test_containers_join_the_head_and_take_no_secret(name: str) -> None:
    ex, r = expect(CASES[name]), rendered(name)
    ray_port = str(ex.get("ray.port", DEFAULT_RAY_PORT))
    secret_names = engine_secret_names() | {n for n in (ex.api_key_env, ex.token_env) if n}
    for node in ex.nodes:
        container = json.loads(r.files[f"files/{node.name}/container.json"])
        command = container["command"]
        assert "env" not in container, "env: values show in `docker inspect`; only the non-secret env file"
        assert container["env_file"] == "/etc/hy3spark/node.env"
        secrets = PurePosixPath("/etc/hy3spark-secrets/secrets.env")
        sources = [PurePosixPath(v.split(":")[0]) for v in container["volumes"]]
        assert not [s for s in sources if s == secrets or s in secrets.parents], "no container mounts the secrets"
        assert f"files/{node.name}{container['env_file']}" in r.files
        if ex.trtllm:
            port = ex.get("serving.mpi_port", 2233)
            assert command[:2] == ["/bin/sh", "-c"] and f"exec /usr/sbin/sshd -D -e -p {port} " in command[2]
            assert "/etc/hy3spark/openmpi-hostfile:/etc/openmpi-hostfile:ro" in container["volumes"]
        elif not ex.ray_launcher:
            assert command == ["sleep", "infinity"], "the native launcher's container holds the node, runs no Ray"
        else:
            check_ray_command(ex, node, command, ray_port)

        run = r.files[f"files/{node.name}/docker-run.sh"]

        lines = [line for line in run.splitlines() if line.startswith("docker run ")]
        assert len(lines) == 1
        argv = shlex.split(lines[0])
        assert not [a for a in argv if a in ("-e", "--env") or a.startswith("--env=")], "secrets never in env flags"
        assert flag_values(argv, "--env-file") == [container["env_file"]]
        assert argv[argv.index(container["image"]) + 1:] == command, "docker-run.sh and container.json agree"
        for text in (run, r.files[f"files/{node.name}/container.json"]):
            assert not secret_names & set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)), "no secret variable named"
            assert "secrets.env" not in text


@pytest.mark.parametrize("name", NAMES)
def test_render_writes_exactly_what_it_previews(name: str) -> None:
    """`--out` writes the files `render` shows, with their modes, plus its manifest; nothing else and no other
    node's files (a removed worker leaves nothing behind)."""
    ex, r = expect(CASES[name]), rendered(name)
    per_node = {"etc/hy3spark/node.env": 0o600, "container.json": 0o644, "docker-run.sh": 0o755,
                "etc/hy3spark/ports.txt": 0o644}
    if ex.fabric:
        per_node["etc/netplan/60-hy3spark-fabric.yaml"] = 0o600
    if ex.get("earlyoom.policy", "protect") == "protect":
        per_node["etc/default/earlyoom"] = 0o644
    if ex.get("firewall", {}) not in (False, "off") and ex.get("firewall.enabled", True):
        per_node["etc/hy3spark/firewall.nft"] = 0o644
    head_only = {"etc/hy3spark/serve.sh": 0o755, "etc/hy3spark/vllm/ray_non_carry_over_env_vars.json": 0o644}
    if ex.trtllm:  # the options file instead of vLLM's carry-over list; the hostfile on every node
        head_only = {"etc/hy3spark/serve.sh": 0o755, "etc/hy3spark/engine-options.yml": 0o644}
        per_node["etc/hy3spark/openmpi-hostfile"] = 0o644
        per_node["etc/hy3spark/mpi/sshd_config"] = 0o644  # the MPI sshd's; mpirun's ssh config on the head
        head_only["etc/hy3spark/mpi/ssh_config"] = 0o644
    # docs/restarts.md: every node's boot unit; the supervisor on the head under a launcher with a gate (Ray).
    if ex.get("restarts", {}) not in (False, "off") and ex.get("restarts.enabled", True):
        per_node["etc/systemd/system/hy3spark-node.service"] = 0o644
        if ex.ray_launcher:
            head_only = {**head_only, "etc/systemd/system/hy3spark-supervisor.service": 0o644,
                         "usr/local/lib/hy3spark/supervisor/supervisor.json": 0o644}
    want = {"files/pi/models.json": 0o644, "files/pi/settings.json": 0o644, "inventory/hosts.yml": 0o644,
            "inventory/group_vars/all/hy3spark.yml": 0o644}
    for node in ex.nodes:
        want[f"inventory/host_vars/{node.name}.yml"] = 0o644
        for rel, mode in {**per_node, **(head_only if node.head else {})}.items():
            want[f"files/{node.name}/{rel}"] = mode
        if not ex.ray_launcher and not ex.trtllm:  # the native launcher runs the engine on every node
            want[f"files/{node.name}/etc/hy3spark/serve.sh"] = 0o755
    assert r.modes == want
    manifest = ".hy3spark-render.json"
    assert json.loads(r.written[manifest])["files"] == sorted(want)
    assert {p: c for p, c in r.written.items() if p != manifest} == r.files
    assert {p: m for p, m in r.written_modes.items() if p != manifest} == want
