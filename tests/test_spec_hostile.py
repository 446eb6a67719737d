"""Hostile and sloppy values (issue 14): each typed grammar, owned key, secret shape and policy rule refuses with the
field path and the line, and takes the legal edges. A table through parse_spec, a few through the real CLI (exit 3, no
traceback, nothing written), and the inventory rendered for accepted edge values parses back to the same strings."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_spec_rules import BASE

from hy3spark.errors import EXIT_SPEC, SpecError
from hy3spark.render import render_all
from hy3spark.spec import parse_spec

# BASE: the complete two-Spark spec without a profile that the rule tests use, so that every value a case changes
# is in the user's file.
SECRET = "hf_" + "Q" * 30


def mutated(*changes: tuple[tuple[str | int, ...], Any]) -> str:
    data = copy.deepcopy(BASE)
    for path, value in changes:
        where: Any = data
        for key in path[:-1]:
            where = where.setdefault(key, {}) if isinstance(key, str) else where[key]
        where[path[-1]] = value
    return yaml.safe_dump(data, sort_keys=False)


def refused(text: str) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "cluster.yml")
    return caught.value.problems


# (rule, path, value, the field named in the message, what the message says)
HOSTILE = [
    # node names: RFC 1123 labels that YAML reads back as the same string
    ("node-name", ("head", "name"), "no", "head.name", "YAML reads it as bool False"),
    ("node-name", ("head", "name"), "true", "head.name", "YAML reads it as bool True"),
    ("node-name", ("head", "name"), "123", "head.name", "YAML reads it as int 123"),
    ("node-name", ("head", "name"), "null", "head.name", "YAML reads it as NoneType"),
    ("node-name", ("workers", 0, "name"), "2024-01-01", "workers[0].name", "YAML reads it as date"),
    ("node-name", ("head", "name"), "spark-", "head.name", "is not a host name label"),
    ("node-name", ("head", "name"), "Spark_A", "head.name", "is not a host name label"),
    ("node-name", ("head", "name"), "a\nb", "head.name", "is not a host name label"),
    # SSH hosts: an address or a host name; never an option
    ("ssh-host", ("head", "ssh_host"), "-oProxyCommand=touch /tmp/x", "head.ssh_host", "is neither an IP address"),
    ("ssh-host", ("head", "ssh_host"), "a.lan\nansible_connection: local", "head.ssh_host", "is neither"),
    ("ssh-host", ("head", "ssh_host"), "a b", "head.ssh_host", "is neither an IP address nor a host name"),
    ("ssh-host", ("head", "ssh_host"), "999.1.1.1", "head.ssh_host", "is neither an IP address nor a host name"),
    ("ssh-host", ("head", "ssh_host"), "on", "head.ssh_host", "YAML reads it as bool True"),
    ("ssh-host", ("head", "ssh_host"), "1:2:3:4:5:6:7:8", "head.ssh_host", "YAML reads it as int"),
    # SSH users: POSIX user names
    ("ssh-user", ("head", "ssh_user"), "root\nansible_become: true", "head.ssh_user", "is not a POSIX user name"),
    ("ssh-user", ("head", "ssh_user"), "-oX", "head.ssh_user", "is not a POSIX user name"),
    ("ssh-user", ("head", "ssh_user"), "0day", "head.ssh_user", "is not a POSIX user name"),
    ("ssh-user", ("head", "ssh_user"), "no", "head.ssh_user", "YAML reads it as bool False"),
    # environment variable names and values
    ("env-name", ("container", "env"), {"A\n": "1"}, "container.env.'A\\n'", "is not a valid environment variable"),
    ("env-name", ("container", "env"), {"1A": "1"}, "container.env.1A", "is not a valid environment variable name"),
    ("env-value", ("container", "env"), {"A": "1\nLD_PRELOAD=/x.so"}, "container.env.A", "holds a newline"),
    ("env-value", ("container", "env"), {"A": "1\x00"}, "container.env.A", "holds a newline, NUL"),
    ("env-value", ("container", "env"), {"A": "1\u2028B=2"}, "container.env.A", "holds a newline, NUL"),
    ("env-value", ("container", "env"), {"A": "1\x85"}, "container.env.A", "holds a newline, NUL"),
    ("env-ref", ("model", "token_env"), "HF_TOKEN\n", "model.token_env", "is not an environment variable name"),
    ("env-ref", ("serving", "api_key_env"), "vllm_api_key", "serving.api_key_env", "is not an environment variable"),
    # interfaces: netdev names
    ("netdev", ("fabric", "interfaces"), [".."], "fabric.interfaces[0]", "is not a network device name"),
    ("netdev", ("fabric", "interfaces"), ["."], "fabric.interfaces[0]", "is not a network device name"),
    ("netdev", ("fabric", "interfaces"), ["eth0/1"], "fabric.interfaces[0]", "is not a network device name"),
    ("netdev", ("fabric", "interfaces"), ["eth0:1"], "fabric.interfaces[0]", "is not a network device name"),
    ("netdev", ("fabric", "interfaces"), ["-eth0"], "fabric.interfaces[0]", "is not a network device name"),
    ("netdev", ("fabric", "hcas"), ["mlx5_0\n"], "fabric.hcas[0]", "is not a network device name"),
    # paths
    ("abs-path", ("model", "cache_dir"), "/srv/../etc", "model.cache_dir", "is not a normalised absolute path"),
    ("abs-path", ("model", "cache_dir"), "/srv/./hub", "model.cache_dir", "is not a normalised absolute path"),
    ("abs-path", ("model", "cache_dir"), "/srv//hub", "model.cache_dir", "is not a normalised absolute path"),
    ("abs-path", ("model", "cache_dir"), "/srv/hub\nLD_PRELOAD=/x", "model.cache_dir", "is not a normalised"),
    ("abs-path", ("model", "cache_dir"), "/srv/hub:/etc", "model.cache_dir", "is not a normalised absolute path"),
    ("abs-path", ("model", "cache_dir"), "/srv/my hub", "model.cache_dir", "is not a normalised absolute path"),
    # image references (OCI)
    ("image-ref", ("image", "ref"), "vllm/vllm-openai", "image.ref", "is not an OCI image reference name:tag"),
    ("image-ref", ("image", "ref"), "VLLM/engine:1", "image.ref", "is not an OCI image reference"),
    ("image-ref", ("image", "ref"), "a/b:-tag", "image.ref", "is not an OCI image reference"),
    ("image-ref", ("image", "ref"), "a//b:1", "image.ref", "is not an OCI image reference"),
    ("image-ref", ("image", "ref"), "a/b:1@sha256:" + "0" * 64, "image.ref", "is not an OCI image reference"),
    ("image-digest", ("image", "digest"), "sha256:" + "0" * 63, "image.digest", "String should match pattern"),
    ("image-digest", ("image", "digest"), "sha256:" + "0" * 64 + "\n", "image.digest", "String should match"),
    # revisions
    ("revision", ("model", "revision"), "../../etc", "model.revision", "is neither a 40-character commit sha"),
    ("revision", ("model", "revision"), "main..dev", "model.revision", "is neither"),
    ("revision", ("model", "revision"), "-x", "model.revision", "is neither"),
    ("revision", ("model", "revision"), "v1.lock", "model.revision", "is neither"),
    ("revision", ("model", "revision"), "a b", "model.revision", "is neither"),
    ("revision", ("model", "revision"), "ref@{1}", "model.revision", "is neither"),
    ("hf-repo", ("model", "repo"), "org/../x", "model.repo", "is not a Hugging Face repo id"),
    ("hf-repo", ("model", "repo"), "org/a--b", "model.repo", "is not a Hugging Face repo id"),
    # strict booleans and integers, finite numbers in range
    ("strict-int", ("head", "gpus"), True, "head.gpus", "(YAML reads yes/no/on/off/true/false as booleans)"),
    ("strict-int", ("head", "gpus"), "2", "head.gpus", "'2': Input should be a valid integer, not a quoted string"),
    ("strict-int", ("serving", "port"), "8888", "serving.port", "write the value without quotes"),
    ("strict-int", ("serving", "max_num_seqs"), 4.0, "serving.max_num_seqs", "Input should be a valid integer"),
    ("strict-int", ("model", "arch", "dtype_bytes"), True, "model.arch.dtype_bytes", "must be a number"),
    ("strict-bool", ("serving", "trust_remote_code"), "yes", "serving.trust_remote_code", "valid boolean"),
    ("strict-bool", ("serving", "enforce_eager"), 1, "serving.enforce_eager", "Input should be a valid boolean"),
    ("strict-float", ("serving", "gpu_memory_utilization"), "0.9", "serving.gpu_memory_utilization", "quotes"),
    # addresses are read laxly from text only: a YAML boolean or integer is no address (`mgmt_ip: yes` was 0.0.0.1)
    ("address", ("head", "mgmt_ip"), True, "head.mgmt_ip", "must be an address written as text"),
    ("address", ("head", "mgmt_ip"), 3232235786, "head.mgmt_ip", "must be an address written as text"),
    ("address", ("serving", "host"), False, "serving.host", "must be an address written as text"),
    ("address", ("head", "fabric_ip"), True, "head.fabric_ip", "must be an address with prefix written as text"),
    ("address", ("workers", 0, "fabric_ip"), 167772162, "workers[0].fabric_ip", "must be an address with prefix"),
    ("finite", ("hardware", "total_memory_gib"), 1e300, "hardware.total_memory_gib", "less than or equal to 4096"),
    ("finite", ("serving", "overhead_gib"), 1e9, "serving.overhead_gib", "less than or equal to 1024"),
    ("finite", ("model", "size_bytes"), 10**30, "model.size_bytes", "less than or equal to"),
    ("json", ("serving", "speculative_config"), {"method": "mtp", "x": [1, "2", {3: "y"}]},
     "serving.speculative_config.x[2]", "the key 3 is read by YAML as a number, not a name"),
    # other strings that reach a command line or a file
    ("served-name", ("serving", "served_name"), "-x", "serving.served_name", "String should match pattern"),
    ("ident", ("serving", "tool_call_parser"), "--x", "serving.tool_call_parser", "is not a name"),
    ("ident", ("pi", "provider"), "a b", "pi.provider", "is not a name"),
    ("text", ("pi", "model_label"), "Hy3\n  x: y", "pi.model_label", "must be one line"),
    ("text", ("pi", "model_label"), "Hy3\u2029x: y", "pi.model_label", "must be one line"),
    ("version", ("ray", "version"), "2.60.0; rm -rf /", "ray.version", "is not a version"),
    ("extra-args", ("serving", "extra_args"), ["--enable-prefix-caching\n--api-key"], "serving.extra_args[0]",
     "holds a newline"),
    # owned keys and secrets
    ("owned-env", ("container", "env"), {"VLLM_HOST_IP": "10.0.0.1"}, "container.env.VLLM_HOST_IP",
     "is derived per node by hy3spark"),
    ("owned-env", ("container", "env"), {"NCCL_SOCKET_IFNAME": "eth9"}, "container.env.NCCL_SOCKET_IFNAME",
     "is derived per node"),
    ("owned-env", ("container", "env"), {"GLOO_SOCKET_IFNAME": "eth9"}, "container.env.GLOO_SOCKET_IFNAME",
     "is derived per node"),
    ("owned-env", ("container", "env"), {"NCCL_IB_HCA": "mlx5_9"}, "container.env.NCCL_IB_HCA", "is derived"),
    ("owned-env", ("container", "env"), {"UCX_NET_DEVICES": "eth9"}, "container.env.UCX_NET_DEVICES", "derived"),
    ("owned-env", ("container", "env"), {"MASTER_ADDR": "10.0.0.9"}, "container.env.MASTER_ADDR", "is derived"),
    ("owned-env", ("container", "env"), {"OMPI_MCA_btl": "self"}, "container.env.OMPI_MCA_btl", "is derived"),
    ("owned-env", ("container", "env"), {"HF_HUB_OFFLINE": "0"}, "container.env.HF_HUB_OFFLINE", "is derived"),
    ("owned-env", ("container", "env"), {"NCCL_DEBUG": "WARN"}, "container.env.NCCL_DEBUG",
     "set by the NCCL transport gate"),
    ("secret", ("container", "env"), {"VLLM_API_KEY": "x"}, "container.env.VLLM_API_KEY", "secrets are never written"),
    ("secret", ("container", "env"), {"HF_TOKEN": "x"}, "container.env.HF_TOKEN", "secrets are never written"),
    ("secret", ("container", "env"), {"HUGGING_FACE_HUB_TOKEN": "x"}, "container.env.HUGGING_FACE_HUB_TOKEN",
     "secrets are never written"),
    ("secret", ("container", "env"), {"AWS_SECRET_ACCESS_KEY": "x"}, "container.env.AWS_SECRET_ACCESS_KEY",
     "secrets are never written"),
    ("secret", ("container", "env"), {"AUTH": f"Bearer {SECRET}"}, "container.env.AUTH", "looks like a secret"),
    ("secret", ("serving", "extra_args"), [f"--api_key={SECRET}"], "serving.extra_args[0]", "looks like a secret"),
    ("secret", ("pi", "model_label"), "sk-" + "x" * 20, "pi.model_label", "looks like a secret"),
    ("secret", ("serving", "served_name"), "nvapi-" + "x" * 30, "serving.served_name", "looks like a secret"),
    ("secret", ("model", "repo"), "org/ghp_" + "x" * 36, "model.repo", "looks like a secret"),
    ("secret", ("container", "env"), {SECRET: "1"}, "container.env", "a key looks like a secret"),
    ("json", ("serving", "speculative_config"), {"method": "mtp", "{{ lookup('pipe', 'id') }}": 1},
     "serving.speculative_config", "is not a config field name"),
    ("extra-args", ("serving", "extra_args"), ["--api_key=abc"], "serving.extra_args[0]", "is vLLM's --api-key"),
    ("extra-args", ("serving", "extra_args"), ["--hf-token=abc"], "serving.extra_args[0]", "would put a secret"),
    ("extra-args", ("serving", "extra_args"), ["-tp", "4"], "serving.extra_args[0]", "serving.tensor_parallel"),
    ("extra-args", ("serving", "extra_args"), ["--max-num"], "serving.extra_args[0]", "is ambiguous"),
    ("extra-args", ("serving", "extra_args"), ["--swap-space", "4"], "serving.extra_args[0]", "is not a `vllm serve`"),
    # policy
    ("earlyoom-prefer", ("earlyoom", "prefer"), ["chrome", "vllm|ray|python3"], "earlyoom.prefer[1]",
     "matches vllm, ray, python3: earlyoom would kill the engine or Ray first"),
    ("earlyoom-prefer", ("earlyoom", "prefer"), [".*"], "earlyoom.prefer[0]", "matches vllm"),
    ("earlyoom-prefer", ("earlyoom", "prefer"), ["ray::.*"], "earlyoom.prefer[0]", "matches ray::IDLE"),
    ("earlyoom-prefer", ("earlyoom", "prefer"), ["py.*"], "earlyoom.prefer[0]", "matches python3, python"),
    ("earlyoom-prefer", ("earlyoom", "prefer"), ["python3.12"], "earlyoom.prefer[0]", "matches python3.12"),
    ("earlyoom-prefer", ("earlyoom", "prefer"), ["pt_main_thread"], "earlyoom.prefer[0]", "matches pt_main_thread"),
    ("secret-source", ("model", "token_env"), "AWS_SECRET_ACCESS_KEY", "model.token_env",
     "AWS_SECRET_ACCESS_KEY is not a name a spec may read a secret from"),
    ("secret-source", ("serving", "api_key_env"), "GITHUB_TOKEN", "serving.api_key_env",
     "Use one of VLLM_API_KEY, or a name that starts with HY3SPARK_"),
    ("secret-source", ("model", "token_env"), "VLLM_API_KEY", "model.token_env",
     "Use one of HF_TOKEN, HUGGING_FACE_HUB_TOKEN, or a name that starts with HY3SPARK_"),
    ("earlyoom-pattern", ("earlyoom", "prefer"), ["chrome'"], "earlyoom.prefer[0]", "would break the quoting"),
    ("earlyoom-pattern", ("earlyoom", "prefer"), ['a"b'], "earlyoom.prefer[0]", "would break the quoting"),
    ("earlyoom-pattern", ("earlyoom", "avoid"), ["vllm\\"], "earlyoom.avoid[0]", "a backslash"),
    ("earlyoom-pattern", ("earlyoom", "avoid"), ["vllm\nEARLYOOM_ARGS=x"], "earlyoom.avoid[0]", "would break"),
    ("earlyoom-pattern", ("earlyoom", "avoid"), ["a b"], "earlyoom.avoid[0]", "holds whitespace"),
    ("earlyoom-pattern", ("earlyoom", "prefer"), ["(chrome"], "earlyoom.prefer[0]", "is not a valid regular"),
    ("earlyoom-pattern", ("earlyoom", "prefer"), ["(?i)chrome"], "earlyoom.prefer[0]", "Python-only regex syntax"),
    ("earlyoom-pattern", ("earlyoom", "prefer"), [""], "earlyoom.prefer[0]", "must be a non-empty pattern"),
    ("serving-port", ("serving", "port"), 22, "serving.port", "22 is SSH's port"),
    ("serving-port", ("serving", "port"), 10001, "serving.port", "Ray's client server port"),
    ("serving-port", ("serving", "port"), 6379, "serving.port", "collides with a Ray port"),
    ("fabric-ipv6", ("head", "fabric_ip"), "fd00::1/64", "head.fabric_ip", "IPv6 fabric addresses are refused on"),
]


@pytest.mark.parametrize(("rule", "path", "value", "field", "message"), HOSTILE,
                         ids=[f"{c[0]}:{c[1][-1]}={c[2]!r}"[:80] for c in HOSTILE])
def test_hostile_values_are_refused_with_the_field_and_its_line(rule: str, path: tuple, value: Any, field: str,
                                                                  message: str) -> None:
    found = refused(mutated((path, value)))
    hits = [p for p in found if f" {field}: " in p and message in p]
    assert hits, found
    assert hits[0].startswith("cluster.yml:") and hits[0].split(":")[1].isdigit(), "the line is named"
    if rule == "secret":
        assert all(SECRET not in p and "x" * 20 not in p for p in found), "a secret is never echoed"


def test_the_dashboard_port_is_refused_only_while_the_dashboard_is_on() -> None:
    parse_spec(mutated((("serving", "port"), 8265)), "c")
    found = refused(mutated((("serving", "port"), 8265), (("ray",), {"dashboard": "localhost"})))
    assert found == [f"cluster.yml:{_line(found)}: serving.port: 8265 is Ray's dashboard port, and ray.dashboard is "
                     "localhost; pick another serving.port"]


def test_the_engines_own_process_title_is_protected_too() -> None:
    assert "matches vllm" in refused(mutated((("earlyoom", "prefer"), ["vll."])))[0]


def test_the_transport_gates_variables_are_free_when_the_gate_is_off() -> None:
    text = mutated((("serving", "verify_transport"), False), (("container",), {"env": {"NCCL_DEBUG": "WARN"}}))
    assert parse_spec(text, "c").spec.container.env == {"NCCL_DEBUG": "WARN"}


def _line(found: list[str]) -> str:
    return found[0].split(":")[1]


# Legal edges: each is accepted (and, where it lands in the inventory, reads back unchanged).
VALID = [
    (("head", "name"), "a"),
    (("head", "name"), "1a"),
    (("head", "name"), "spark-01"),
    (("head", "name"), "a" * 63),
    (("head", "ssh_host"), "spark-a.lan."),
    (("head", "ssh_host"), "192.168.1.10"),
    (("head", "ssh_host"), "fd00::10"),
    (("head", "ssh_host"), "Spark-A.Example.COM"),
    (("container", "name_prefix"), "a" * 48),
    (("container", "env"), {"RAY_memory_usage_threshold": "0.99", "TZ": "Europe/Paris", "OPTS": "a=b c\td"}),
    (("fabric", "interfaces"), ["enP2p1s0f1np1"]),
    (("fabric", "interfaces"), ["bond0.100"]),
    (("model", "cache_dir"), "/srv/hf.cache/hub-2"),
    (("model", "cache_dir"), "/srv/.cache/huggingface/hub/"),
    (("model", "revision"), "v1.0"),
    (("model", "revision"), "refs/pr/12"),
    (("model", "repo"), "meta-llama/Llama-3.1-405B"),
    (("image", "ref"), "localhost:5000/engine:test"),
    (("image", "ref"), "10.94.0.10:5000/hy3spark/engine:test"),
    (("image", "ref"), "[fd00::1]:5000/a/b__c:V1.2-rc_3"),
    (("image", "digest"), "sha256:" + "0123456789abcdef" * 4),
    (("serving", "speculative_config"), {"method": "mtp", "num_speculative_tokens": 2, "x": [1.5, None, True]}),
    (("serving", "extra_args"), ["--enable-prefix-caching", "--max-num-partial-prefills", "2", "--seed", "-1"]),
    (("serving", "gpu_memory_utilization"), 1),
    (("earlyoom", "prefer"), ["chrom(e|ium)", "firefox", "code", "Web Content".replace(" ", "")]),
    (("serving", "port"), 8265),
    (("ray", "version"), "2.60.0"),
]


@pytest.mark.parametrize(("path", "value"), VALID, ids=[f"{p[-1]}={v!r}"[:60] for p, v in VALID])
def test_legal_edges_are_accepted(path: tuple, value: Any) -> None:
    parse_spec(mutated((path, value)), "cluster.yml")


def test_a_point_to_point_31_is_accepted() -> None:
    """RFC 3021: on a /31 both addresses are hosts; there is no network or broadcast address."""
    text = mutated((("head", "fabric_ip"), "10.0.0.0/31"), (("workers", 0, "fabric_ip"), "10.0.0.1/31"))
    spec = parse_spec(text, "c").spec
    assert [str(n.fabric_ip) for n in spec.nodes] == ["10.0.0.0/31", "10.0.0.1/31"]
    files = {o.path: o.content for o in render_all(parse_spec(text, "c"))}
    assert "10.0.0.0/31" in files["files/spark-a/etc/netplan/60-hy3spark-fabric.yaml"]


def test_a_third_node_does_not_fit_on_a_31() -> None:
    workers = [{"name": "spark-b", "fabric_ip": "10.0.0.1/31"}, {"name": "spark-c", "fabric_ip": "10.0.0.2/31"}]
    text = mutated((("head", "fabric_ip"), "10.0.0.0/31"), (("workers",), workers),
                   (("serving", "tensor_parallel"), 1), (("serving", "pipeline_parallel"), 3))
    assert any("workers[1].fabric_ip: 10.0.0.2/31 is not in the head's fabric subnet 10.0.0.0/31" in p
               for p in refused(text))


def test_inventory_values_read_back_as_written() -> None:
    """Every accepted name, host and user lands in hosts.yml as the same string."""
    head = {"name": "1a", "fabric_ip": "10.0.0.1/24", "ssh_user": "dgx.admin", "ssh_host": "fd00::10"}
    worker = {"name": "spark-01", "fabric_ip": "10.0.0.2/24", "ssh_user": "dgx.admin", "ssh_host": "b.lan."}
    files = {o.path: o.content for o in render_all(parse_spec(mutated((("head",), head), (("workers",), [worker])),
                                                              "c"))}
    hosts = yaml.safe_load(files["inventory/hosts.yml"])["all"]["children"]
    assert hosts["hy3spark_head"]["hosts"] == {"1a": {"ansible_host": "fd00::10", "ansible_user": "dgx.admin"}}
    assert hosts["hy3spark_workers"]["hosts"] == {"spark-01": {"ansible_host": "b.lan.", "ansible_user": "dgx.admin"}}


def test_env_values_land_as_one_line_each() -> None:
    text = mutated((("container", "env"), {"OPTS": "a=b c\td", "TZ": "UTC"}))
    files = {o.path: o.content for o in render_all(parse_spec(text, "c"))}
    env = [line for line in files["files/spark-a/etc/hy3spark/node.env"].splitlines() if not line.startswith("#")]
    assert "OPTS=a=b c\td" in env and "TZ=UTC" in env
    assert all("=" in line for line in env)


# --- through the real CLI: exit 3, the field and its line, no traceback, nothing written --------------------------
CLI_CASES = [
    ((("head", "ssh_host"), "a\nansible_connection: local"), "head.ssh_host"),
    ((("container", "env"), {"VLLM_HOST_IP": "10.0.0.1"}), "container.env.VLLM_HOST_IP"),
    ((("serving", "extra_args"), ["--api_key=abc"]), "serving.extra_args[0]"),
    ((("earlyoom", "prefer"), ["vllm|ray|python3"]), "earlyoom.prefer[0]"),
    ((("head", "gpus"), True), "head.gpus"),
    ((("serving", "port"), 22), "serving.port"),
]


@pytest.mark.parametrize(("change", "field"), CLI_CASES, ids=[f for _, f in CLI_CASES])
def test_the_cli_refuses_with_exit_3(cli, tmp_path: Path, change: tuple, field: str) -> None:
    spec = tmp_path / "cluster.yml"
    spec.write_text(mutated(change))
    out = tmp_path / "out"
    for argv in (("validate", str(spec)), ("render", str(spec), "--out", str(out)),
                 ("render", str(spec), "--format", "json")):
        result = cli(*argv)
        assert result.code == EXIT_SPEC, result
        assert result.out == "" and "Traceback" not in result.err
        assert "cluster.yml:" in result.err and f" {field}: " in result.err
        assert result.err.count("\n") == 1, "one message"
    assert not out.exists()


def test_the_cli_renders_an_accepted_edge(cli, tmp_path: Path) -> None:
    spec = tmp_path / "cluster.yml"
    spec.write_text(mutated((("head", "fabric_ip"), "10.0.0.0/31"), (("workers", 0, "fabric_ip"), "10.0.0.1/31")))
    result = cli("render", str(spec), "--format", "json")
    assert result.code == 0, result.err
    assert "10.0.0.1/31" in json.dumps(json.loads(result.out))
