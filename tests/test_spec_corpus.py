"""Our own adversarial corpus (issue 14, item 8): hostile and sloppy mutations of the shipped examples and of the
profiles they select. Each mutation is a function of an example's text (or its parsed data), so it applies to every
target where its field exists: the three examples as written, and each with its profile written inline (so a
mutation of a profile's field lands in the profile's own data).

Each case is either refused through the real CLI (exit code 3, one message naming the field path, no traceback,
`render --out DIR` leaves DIR absent), or accepted with a sound render (tests/soundness.py) in which the payload's
dangerous part never becomes structure: no YAML/JSON key holds it, a string holding it is the whole payload, no env
line is named by it, and in a shell script it sits inside quotes."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from soundness import assert_sound

from hy3spark.errors import EXIT_SPEC
from hy3spark.render import Output, render_all
from hy3spark.spec import deep_merge, load_profile, load_spec

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = {p.stem: p.read_text() for p in sorted((REPO / "examples").glob("*.yml"))}


def _inline(text: str) -> str:
    """The example with its profile written into the spec: every profile field becomes the user's."""
    data = yaml.safe_load(text)
    merged = deep_merge(load_profile(data.pop("profile")), data)
    return yaml.safe_dump(merged, sort_keys=False)


TARGETS = {**EXAMPLES, **{f"{name}+profile-inline": _inline(text) for name, text in EXAMPLES.items()}}
RAW = "RAWYAMLHERE"  # a placeholder in a dump, replaced by YAML text written as is (`yes`, `.inf`, `!!binary x`)
PWN = "PWN"  # the dangerous part of every accepted payload carries it


def merged_view(text: str) -> dict[str, Any]:
    """What the spec means: the profile it selects, overridden by its own fields."""
    data = yaml.safe_load(text)
    profile = data.get("profile")
    return deep_merge(load_profile(profile), data) if profile else data


# Sections the model fills with defaults when a spec leaves them out: a mutation may add one.
OPTIONAL_SECTIONS = ("ray", "container", "earlyoom", "hardware", "pi")


def _has(data: Any, path: tuple[str | int, ...]) -> bool:
    data = {**{section: {} for section in OPTIONAL_SECTIONS}, **data}
    for key in path:
        if isinstance(key, int):
            if not isinstance(data, list) or len(data) <= key:
                return False
        elif not isinstance(data, dict) or key not in data:
            return False
        data = data[key]
    return True


Mutation = Callable[[str], "str | None"]  # None: the field is not in this target


def set_(path: tuple[str | int, ...], value: Any, *, raw: str | None = None, need: int = 0) -> Mutation:
    """Set the field at `path` (in the user's own file, so it overrides the profile) to `value`, or to the YAML text
    `raw` written as is. Applies where the path's parent exists in the spec's meaning (`need` more levels: where the
    field itself exists)."""

    def mutate(text: str) -> str | None:
        if not _has(merged_view(text), path[:len(path) - 1 + need]):
            return None
        data = yaml.safe_load(text)
        where: Any = data
        for key in path[:-1]:
            where = where[key] if isinstance(key, int) else where.setdefault(key, {})
        where[path[-1]] = RAW if raw is not None else copy.deepcopy(value)
        dumped = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=10**6)
        return dumped.replace(RAW, raw) if raw is not None else dumped

    return mutate


def under_ray(mutate: Mutation) -> Mutation:
    """Only where Ray launches the engine: under the native and mpi launchers Ray's ports are free and a ray section
    is refused as such (tests/test_spec_rules.py holds those rules)."""
    return lambda text: None if merged_view(text).get("serving", {}).get("launcher") in ("native", "mpi") else (
        mutate(text))


def under(engine: str, mutate: Mutation) -> Mutation:
    """Only where `engine` serves: a field or flag of one engine's own (vLLM's flags, its served-name, its key)."""
    return lambda text: mutate(text) if merged_view(text).get("serving", {}).get("engine", "vllm") == engine else None


def add_env(name: str, value: str) -> Mutation:
    return set_(("container", "env", name), value)


def text_sub(pattern: str, replacement: str) -> Mutation:
    """A regex substitution on the example's own text (first match only); applies where the pattern matches."""

    def mutate(text: str) -> str | None:
        new, count = re.subn(pattern, replacement, text, count=1, flags=re.MULTILINE)
        return new if count else None

    return mutate


def append(added: str) -> Mutation:
    return lambda text: text + ("" if text.endswith("\n") else "\n") + added


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # the class of issue 14 it belongs to
    mutate: Mutation
    field: str | None  # refused: the field path the message names; None: accepted
    payload: str = ""  # accepted: the value as written (its dangerous part carries PWN)
    is_name: bool = False  # accepted: the payload is a name, so it may be a mapping key in a rendered file


def refuse(id: str, kind: str, mutate: Mutation, field: str) -> Case:
    return Case(id, kind, mutate, field)


def accept(id: str, kind: str, path: tuple[str | int, ...], value: Any, payload: str, is_name: bool = False,
           mutate: Mutation | None = None) -> Case:
    return Case(id, kind, mutate or set_(path, value), None, payload, is_name)


INJECT = "\nansible_connection: local\n" + PWN + ": 1"
SECRET = "hf_" + "Q" * 30

CASES = [
    # Inventory injection: values that land in inventory/hosts.yml and host_vars
    refuse("ssh-host-newline-yaml", "inventory", set_(("head", "ssh_host"), "a.lan" + INJECT), "head.ssh_host"),
    refuse("ssh-host-option", "inventory", set_(("head", "ssh_host"), "-oProxyCommand=touch /tmp/" + PWN),
           "head.ssh_host"),
    refuse("ssh-host-flow-mapping", "inventory", set_(("head", "ssh_host"), "{ansible_connection: local}"),
           "head.ssh_host"),
    refuse("ssh-host-as-mapping", "inventory", set_(("head", "ssh_host"), {"ansible_connection": "local"}),
           "head.ssh_host"),
    refuse("worker-ssh-host-newline", "inventory", set_(("workers", 0, "ssh_host"), "b.lan" + INJECT),
           "workers[0].ssh_host"),
    refuse("ssh-user-newline-yaml", "inventory", set_(("head", "ssh_user"), "ubuntu" + INJECT), "head.ssh_user"),
    refuse("ssh-user-become", "inventory", set_(("head", "ssh_user"), "root\nansible_become: true"),
           "head.ssh_user"),
    refuse("worker-ssh-user-option", "inventory", set_(("workers", 0, "ssh_user"), "-oX", need=1),
           "workers[0].ssh_user"),
    refuse("node-name-no", "inventory", set_(("head", "name"), "no"), "head.name"),
    refuse("node-name-null", "inventory", set_(("head", "name"), "null"), "head.name"),
    refuse("node-name-number", "inventory", set_(("head", "name"), "0x1f"), "head.name"),
    refuse("node-name-colon", "inventory", set_(("head", "name"), "spark-a: {ansible_connection: local}"),
           "head.name"),
    refuse("worker-name-newline", "inventory", set_(("workers", 0, "name"), "spark-b" + INJECT, need=1),
           "workers[0].name"),
    refuse("mgmt-ip-yaml-bool", "inventory", set_(("head", "mgmt_ip"), None, raw="yes"), "head.mgmt_ip"),
    refuse("mgmt-ip-integer", "inventory", set_(("head", "mgmt_ip"), 3232235786), "head.mgmt_ip"),
    refuse("fabric-ip-yaml-bool", "inventory", set_(("head", "fabric_ip"), True), "head.fabric_ip"),
    refuse("serving-host-yaml-bool", "inventory", set_(("serving", "host"), None, raw="off"), "serving.host"),
    refuse("mgmt-ip-text", "inventory", set_(("head", "mgmt_ip"), "192.168.1.10" + INJECT), "head.mgmt_ip"),
    refuse("cluster-name-payload", "inventory", set_(("name",), "x" + INJECT), "name"),
    refuse("cluster-name-space", "inventory", set_(("name",), "hy3 pair; touch /tmp/" + PWN), "name"),
    accept("ssh-host-capitals-trailing-dot", "inventory", ("head", "ssh_host"), "Spark-A.PWN.", "Spark-A.PWN."),
    accept("ssh-host-ipv6", "inventory", ("head", "ssh_host"), "fd00::10", "fd00::10"),
    accept("node-name-leading-digit", "inventory", ("head", "name"), "1pwn", "1pwn", is_name=True),
    # Env-file injection: values that land in node.env
    refuse("cache-dir-newline", "env-file", set_(("model", "cache_dir"), "/srv/hub\nLD_PRELOAD=/tmp/" + PWN),
           "model.cache_dir"),
    refuse("env-value-newline", "env-file", add_env("FOO", "1\nLD_PRELOAD=/tmp/" + PWN), "container.env.FOO"),
    refuse("env-value-carriage-return", "env-file", add_env("FOO", "1\rLD_PRELOAD=/x"), "container.env.FOO"),
    refuse("env-value-line-separator", "env-file", add_env("FOO", "1\u2028LD_PRELOAD=/x"), "container.env.FOO"),
    refuse("label-paragraph-separator", "env-file", set_(("pi", "model_label"), "Hy3\u2029x: y"), "pi.model_label"),
    refuse("env-value-nul", "env-file", add_env("FOO", "1\x00"), "container.env.FOO"),
    refuse("env-key-newline", "env-file", add_env("FOO=1\nLD_PRELOAD", "/tmp/" + PWN), "container.env"),
    refuse("env-key-equals", "env-file", add_env("A=B", "1"), "container.env"),
    refuse("env-key-space", "env-file", add_env("A B", "1"), "container.env"),
    refuse("env-key-leading-digit", "env-file", add_env("1A", "1"), "container.env.1A"),
    refuse("env-value-number", "env-file", set_(("container", "env", "FOO"), None, raw="1"), "container.env.FOO"),
    refuse("env-value-mapping", "env-file", add_env("FOO", {"a": "b"}), "container.env.FOO"),
    refuse("owned-vllm-host-ip", "env-file", add_env("VLLM_HOST_IP", "10.0.0.1"), "container.env.VLLM_HOST_IP"),
    refuse("owned-socket-ifname", "env-file", add_env("NCCL_SOCKET_IFNAME", "eth9"),
           "container.env.NCCL_SOCKET_IFNAME"),
    refuse("owned-nccl-ib", "env-file", add_env("NCCL_IB_GID_INDEX", "3"), "container.env.NCCL_IB_GID_INDEX"),
    refuse("owned-master-addr", "env-file", add_env("MASTER_ADDR", "10.0.0.9"), "container.env.MASTER_ADDR"),
    refuse("owned-ompi", "env-file", add_env("OMPI_MCA_btl", "self"), "container.env.OMPI_MCA_btl"),
    refuse("owned-ucx", "env-file", add_env("UCX_NET_DEVICES", "eth9"), "container.env.UCX_NET_DEVICES"),
    refuse("owned-hf-cache", "env-file", add_env("HF_HUB_CACHE", "/tmp"), "container.env.HF_HUB_CACHE"),
    refuse("secret-api-key-env", "env-file", add_env("VLLM_API_KEY", "abc"), "container.env.VLLM_API_KEY"),
    refuse("secret-named-env", "env-file", add_env("MY_PASSWORD", "abc"), "container.env"),
    refuse("secret-shaped-env-value", "env-file", add_env("FOO", SECRET), "container.env.FOO"),
    refuse("ld-preload-lowercase-trailing", "env-file", add_env("FOO\n", "1"), "container.env"),
    accept("env-value-shell-payload", "env-file", ("container", "env", "FOO"),
           "$(touch /tmp/PWN) `id` 'x' \"y\" ; z", "$(touch /tmp/PWN) `id` 'x' \"y\" ; z"),
    accept("env-value-equals-and-tabs", "env-file", ("container", "env", "FOO"), "a=b\tc=PWN", "a=b\tc=PWN"),
    accept("env-name-lowercase", "env-file", ("container", "env", "RAY_memory_PWN"), "1", "RAY_memory_PWN",
           is_name=True),
    # Jinja past the guard
    refuse("jinja-in-value", "jinja", set_(("serving", "served_name"), "{{ lookup('pipe', 'id') }}"),
           "serving.served_name"),
    refuse("jinja-in-env-value", "jinja", add_env("FOO", "{{ lookup('pipe', 'touch /tmp/" + PWN + "') }}"),
           "container.env.FOO"),
    refuse("jinja-in-env-key", "jinja", add_env("{{ lookup('pipe', 'id') }}", "1"), "container.env"),
    refuse("jinja-statement-in-label", "jinja", set_(("pi", "model_label"), "{% for x in y %}"), "pi.model_label"),
    refuse("jinja-comment-in-provider-name", "jinja", set_(("pi", "provider_name"), "{# x #}"), "pi.provider_name"),
    refuse("jinja-in-thinking-map-key", "jinja", set_(("pi", "thinking_level_map"), {"{{ x }}": "low"}),
           "pi.thinking_level_map"),
    refuse("binary-tag-revision", "jinja", set_(("model", "revision"), None, raw="!!binary e3sgeCB9fQ=="),
           "model.revision"),
    refuse("jinja-in-speculative-config", "jinja",
           set_(("serving", "speculative_config", "method"), "{{ x }}", need=1), "serving.speculative_config"),
    # Engine-argument smuggling through serving.extra_args
    refuse("extra-api-key-underscore", "engine-args", set_(("serving", "extra_args"), ["--api_key=abc"]),
           "serving.extra_args"),
    refuse("extra-hf-token", "engine-args", set_(("serving", "extra_args"), ["--hf-token=abc"]), "serving.extra_args"),
    refuse("extra-tp-alias", "engine-args", set_(("serving", "extra_args"), ["-tp", "4"]), "serving.extra_args"),
    refuse("extra-tp-abbrev", "engine-args", set_(("serving", "extra_args"), ["--tensor-parallel", "4"]),
           "serving.extra_args"),
    refuse("extra-port", "engine-args", set_(("serving", "extra_args"), ["--port=22"]), "serving.extra_args"),
    refuse("extra-host", "engine-args", set_(("serving", "extra_args"), ["--host", "0.0.0.0"]), "serving.extra_args"),
    refuse("extra-model", "engine-args", set_(("serving", "extra_args"), ["--model", "evil/model"]),
           "serving.extra_args"),
    refuse("extra-config-file", "engine-args", set_(("serving", "extra_args"), ["--config", "/tmp/x.yaml"]),
           "serving.extra_args"),
    refuse("extra-unknown", "engine-args", set_(("serving", "extra_args"), ["--no-such-flag"]), "serving.extra_args"),
    refuse("extra-bare-value", "engine-args", set_(("serving", "extra_args"), ["; touch /tmp/" + PWN]),
           "serving.extra_args"),
    refuse("extra-newline", "engine-args", set_(("serving", "extra_args"), ["--enable-prefix-caching\n--api-key"]),
           "serving.extra_args[0]"),
    refuse("extra-twice", "engine-args",
           set_(("serving", "extra_args"), ["--enable-prefix-caching", "--enable-prefix-caching"]),
           "serving.extra_args"),
    refuse("extra-not-a-list", "engine-args", set_(("serving", "extra_args"), "--enable-prefix-caching"),
           "serving.extra_args"),
    refuse("extra-secret-value", "engine-args", set_(("serving", "extra_args"), ["--seed", SECRET]),
           "serving.extra_args"),
    accept("extra-value-shell-payload", "engine-args", ("serving", "extra_args"),
           ["--override-generation-config", '{"x": "$(touch /tmp/PWN)"}'], '{"x": "$(touch /tmp/PWN)"}',
           mutate=under("vllm", set_(("serving", "extra_args"),
                                     ["--override-generation-config", '{"x": "$(touch /tmp/PWN)"}']))),
    accept("trtllm-extra-value-shell-payload", "engine-args", ("serving", "extra_args"),
           ["--chat_template", "$(touch /tmp/PWN) {x}"], "$(touch /tmp/PWN) {x}",
           mutate=under("trtllm", set_(("serving", "extra_args"), ["--chat_template", "$(touch /tmp/PWN) {x}"]))),
    refuse("trtllm-extra-tp-size", "engine-args", under("trtllm", set_(("serving", "extra_args"), ["--tp_size", "4"])),
           "serving.extra_args"),
    refuse("trtllm-extra-unknown", "engine-args", under("trtllm", set_(("serving", "extra_args"), ["--api_key=x"])),
           "serving.extra_args"),
    # Silent last-wins: a key twice, at any level
    refuse("duplicate-top-level", "last-wins", append("name: other\n"), "name"),
    refuse("duplicate-serving", "last-wins", append("serving:\n  port: 9000\n"), "serving"),
    refuse("duplicate-head-fabric-ip", "last-wins",
           text_sub(r"^(  fabric_ip: 10\.0\.0\.1/24.*)$", r"\1\n  fabric_ip: 10.0.0.9/24"), "head.fabric_ip"),
    refuse("duplicate-worker-ssh-user", "last-wins",
           text_sub(r"^(    ssh_user: ubuntu.*)$", r"\1\n    ssh_user: root"), "workers[0].ssh_user"),
    refuse("duplicate-flow-key", "last-wins",
           text_sub(r"^  interfaces: \[(.*)\]", r"  interfaces: [\1]\n  mtu: 1500\n  mtu: 9000"), "fabric.mtu"),
    refuse("duplicate-env-key", "last-wins", set_(("container", "env"), None, raw="{FOO: a, FOO: b}"),
           "container.env.FOO"),
    refuse("duplicate-with-quotes", "last-wins", append("'name': other\n"), "name"),
    # Resource exhaustion and crashes
    refuse("alias-bomb", "exhaustion",
           append("b0: &b0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
               f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 9)}]\n" for i in range(1, 10))), "b0"),
    refuse("anchor-on-field", "exhaustion", text_sub(r"^  interfaces: \[", "  interfaces: &i ["), "fabric.interfaces"),
    refuse("merge-key", "exhaustion", text_sub(r"^(head:)$", r"\1\n  <<: {gpus: 2}"), "head"),
    refuse("memory-inf", "exhaustion", set_(("hardware", "total_memory_gib"), None, raw=".inf"),
           "hardware.total_memory_gib"),
    refuse("memory-nan", "exhaustion", set_(("hardware", "total_memory_gib"), None, raw=".nan"),
           "hardware.total_memory_gib"),
    refuse("memory-overflow-literal", "exhaustion", set_(("hardware", "total_memory_gib"), None, raw="1.0e+999"),
           "hardware.total_memory_gib"),
    refuse("memory-huge", "exhaustion", set_(("hardware", "total_memory_gib"), 1e300), "hardware.total_memory_gib"),
    refuse("size-bytes-huge-int", "exhaustion", set_(("model", "size_bytes"), 10**40), "model.size_bytes"),
    refuse("max-model-len-huge", "exhaustion", set_(("serving", "max_model_len"), 2**63), "serving.max_model_len"),
    refuse("date-in-speculative-config", "exhaustion",
           set_(("serving", "speculative_config"), {"method": "mtp", "when": {"a": [1, {2: "x"}]}}),
           "serving.speculative_config"),
    refuse("deep-nesting", "exhaustion", set_(("serving", "speculative_config"), None, raw="[" * 40 + "]" * 40),
           "serving.speculative_config"),
    refuse("two-documents", "exhaustion", append("---\nname: other\n"), "a second YAML document (---)"),  # no field
    # Paths and names
    refuse("profile-path", "paths", text_sub(r"^profile: (.*)$", r"profile: ./\1.yml"), "profile"),
    refuse("profile-absolute", "paths", text_sub(r"^profile: (.*)$", r"profile: /tmp/\1"), "profile"),
    refuse("profile-parent", "paths", text_sub(r"^profile: (.*)$", r"profile: ../profiles/\1"), "profile"),
    refuse("profile-unknown-case", "paths", text_sub(r"^profile: (.*)$", r"profile: HY3"), "profile"),
    refuse("profile-not-a-string", "paths", text_sub(r"^profile: (.*)$", r"profile: [\1]"), "profile"),
    refuse("revision-dotdot", "paths", set_(("model", "revision"), "../../etc"), "model.revision"),
    refuse("revision-range", "paths", set_(("model", "revision"), "main..dev"), "model.revision"),
    refuse("cache-dir-dotdot", "paths", set_(("model", "cache_dir"), "/var/lib/../../etc"), "model.cache_dir"),
    refuse("cache-dir-relative", "paths", set_(("model", "cache_dir"), "hub"), "model.cache_dir"),
    refuse("cache-dir-volume-split", "paths", set_(("model", "cache_dir"), "/srv/hub:/etc"), "model.cache_dir"),
    refuse("interface-dotdot", "paths", set_(("fabric", "interfaces"), [".."]), "fabric.interfaces[0]"),
    refuse("interface-slash", "paths", set_(("fabric", "interfaces"), ["../../x"]), "fabric.interfaces[0]"),
    refuse("hca-newline", "paths", set_(("fabric", "hcas"), ["rocep1s0f1\nx"]), "fabric.hcas[0]"),
    refuse("repo-dotdot", "paths", set_(("model", "repo"), "org/../x"), "model.repo"),
    refuse("image-ref-option", "paths", set_(("image", "ref"), "--privileged"), "image.ref"),
    refuse("image-digest-short", "paths", set_(("image", "digest"), "sha256:" + "0" * 63), "image.digest"),
    refuse("gpus-yes", "paths", set_(("head", "gpus"), None, raw="yes"), "head.gpus"),
    refuse("gpus-quoted", "paths", set_(("head", "gpus"), "2"), "head.gpus"),
    refuse("port-quoted", "paths", set_(("serving", "port"), "8888"), "serving.port"),
    refuse("bool-as-word", "paths", set_(("serving", "trust_remote_code"), "yes"), "serving.trust_remote_code"),
    refuse("prefix-shell", "paths", set_(("container", "name_prefix"), "hy3; touch /tmp/" + PWN),
           "container.name_prefix"),
    refuse("ray-version-shell", "paths", set_(("ray", "version"), "2.60.0; rm -rf /"), "ray.version"),
    refuse("unknown-field", "paths", set_(("head", "ansible_connection"), "local"), "head.ansible_connection"),
    refuse("secret-inline-token-env", "paths", set_(("model", "token_env"), SECRET), "model.token_env"),
    accept("revision-tag", "paths", ("model", "revision"), "v1.0-PWN", "v1.0-PWN"),
    # Policy
    refuse("earlyoom-prefer-engine", "policy", set_(("earlyoom", "prefer"), ["vllm|ray|python3"]), "earlyoom.prefer"),
    refuse("earlyoom-prefer-raylet", "policy", set_(("earlyoom", "prefer"), ["rayl.*"]), "earlyoom.prefer"),
    refuse("earlyoom-quote", "policy", set_(("earlyoom", "avoid"), ['x"; touch /tmp/' + PWN]), "earlyoom.avoid"),
    refuse("earlyoom-bad-regex", "policy", set_(("earlyoom", "avoid"), ["(unclosed"]), "earlyoom.avoid"),
    refuse("earlyoom-backslash", "policy", set_(("earlyoom", "prefer"), ["a\\"]), "earlyoom.prefer"),
    refuse("serving-port-ssh", "policy", set_(("serving", "port"), 22), "serving.port"),
    refuse("serving-port-ray", "policy", under_ray(set_(("serving", "port"), 6379)), "serving.port"),
    refuse("serving-port-dashboard", "policy", under_ray(lambda t: set_(("ray", "dashboard"), "localhost")(
        set_(("serving", "port"), 8265)(t) or t)), "serving.port"),
    refuse("open-endpoint-no-key", "policy", under("vllm", lambda t: set_(("serving", "host"), "0.0.0.0")(
        set_(("serving", "api_key_env"), None)(t) or t)), "serving.api_key_env"),
    # trtllm-serve checks no key: hy3spark's API front checks it, and trtllm-serve listens behind it on engine_port.
    # Without a key every address is refused as vLLM's is, unless open_endpoint says so.
    refuse("trtllm-open-without-saying-so", "policy", under("trtllm", set_(("serving", "api_key_env"), None)),
           "serving.api_key_env"),
    refuse("trtllm-engine-port-mpi", "policy", under("trtllm", set_(("serving", "engine_port"), 2233)),
           "serving.engine_port"),
    refuse("trtllm-engine-port-api", "policy", under("trtllm", set_(("serving", "engine_port"), 8355)),
           "serving.engine_port"),
    refuse("trtllm-mpi-port-ssh", "policy", under("trtllm", set_(("serving", "mpi_port"), 22)), "serving.mpi_port"),
    refuse("trtllm-vllm-field", "policy", under("trtllm", set_(("serving", "kv_cache_dtype"), "fp8")),
           "serving.kv_cache_dtype"),
    refuse("gpu-mem-util-above-one", "policy", set_(("serving", "gpu_memory_utilization"), 1.5),
           "serving.gpu_memory_utilization"),
    accept("earlyoom-prefer-browser", "policy", ("earlyoom", "prefer"), ["chrome", "^PWN$"], "^PWN$"),
    # Others found while building the corpus: look-alikes, shapes and cross-field collisions
    refuse("node-name-homoglyph", "others", set_(("head", "name"), "sp\u0430rk-a"), "head.name"),
    refuse("ssh-user-nbsp", "others", set_(("head", "ssh_user"), "ubuntu\u00a0"), "head.ssh_user"),
    refuse("served-name-non-ascii", "others", set_(("serving", "served_name"), "m\u00f6del"), "serving.served_name"),
    refuse("thinking-map-non-ascii", "others", set_(("pi", "thinking_level_map"), {"off": "\u00f1"}),
           "pi.thinking_level_map.off"),
    refuse("worker-named-as-head", "others", set_(("workers", 0, "name"), "spark-a", need=1), "workers[0].name"),
    refuse("worker-with-head-address", "others", set_(("workers", 0, "fabric_ip"), "10.0.0.1/24", need=1),
           "workers[0].fabric_ip"),
    refuse("engine-unknown", "others", set_(("serving", "engine"), "sglang"), "serving.engine"),
    refuse("workers-as-mapping", "others", set_(("workers",), {"name": "x"}, need=1), "workers"),
    refuse("head-as-list", "others", set_(("head",), ["spark-a"]), "head"),
    refuse("speculative-non-string-key", "others", set_(("serving", "speculative_config"), None, raw="{true: 1}"),
           "serving.speculative_config"),
    refuse("shm-size-shell", "others", set_(("container", "shm_size"), "1g; rm -rf /"), "container.shm_size"),
    refuse("extra-download-dir-underscore", "others", set_(("serving", "extra_args"), ["--download_dir=/tmp"]),
           "serving.extra_args[0]"),
    refuse("extra-served-name-abbrev", "others", set_(("serving", "extra_args"), ["--served-model", "x"]),
           "serving.extra_args[0]"),
    refuse("earlyoom-prefer-char-class", "others", set_(("earlyoom", "prefer"), ["[r]ay"]), "earlyoom.prefer[0]"),
    refuse("earlyoom-prefer-escapes-group", "others", set_(("earlyoom", "prefer"), ["a)|(.*"]), "earlyoom.prefer"),
    refuse("ray-ports-collide", "others", under_ray(set_(("ray", "node_manager_port"), 6379)), "ray"),
    refuse("ray-worker-range-over-serving", "others", under_ray(set_(("ray", "min_worker_port"), 8000)),
           "serving.port"),
    refuse("mtu-below-minimum", "others", set_(("fabric", "mtu"), 575), "fabric.mtu"),
    refuse("tp-not-gpu-count", "others", set_(("serving", "tensor_parallel"), 3), "serving.tensor_parallel"),
    accept("bom-at-start", "others", (), None, "", mutate=lambda t: "\ufeff" + t),
    accept("another-packaged-profile", "others", (), None, "",
           mutate=text_sub(r"^profile: hy3-295b-nvfp4-tp2$", "profile: llama31-405b-awq-tp2")),
    accept("env-value-non-ascii", "others", ("container", "env", "FOO"), "\u65e5\u672c PWN \u2603",
           "\u65e5\u672c PWN \u2603"),
    accept("env-value-long", "others", ("container", "env", "FOO"), "x" * 100_000 + "PWN", "x" * 100_000 + "PWN"),
    # Over-strict: valid values stay accepted
    accept("fabric-slash-31", "over-strict", (), None, "", mutate=lambda t: text_sub(
        r"10\.0\.0\.2/24", "10.0.0.1/31")(text_sub(r"10\.0\.0\.1/24", "10.0.0.0/31")(t) or "") or None),
    accept("label-with-quotes", "over-strict", ("pi", "model_label"), "Hy3 \"x\": {ansible_connection: local} 'PWN'",
           "Hy3 \"x\": {ansible_connection: local} 'PWN'"),
    accept("provider-name-yaml-ish", "over-strict", ("pi", "provider_name"), "- PWN: [x]", "- PWN: [x]"),
    accept("served-name-colon", "over-strict", ("serving", "served_name"), "org:model-PWN", "org:model-PWN",
           mutate=under("vllm", set_(("serving", "served_name"), "org:model-PWN"))),
]

IDS = [case.id for case in CASES]
assert len(set(IDS)) == len(IDS), "case ids must be unique"


def _targets(case: Case) -> list[tuple[str, str]]:
    found = [(name, mutated) for name, text in TARGETS.items() if (mutated := case.mutate(text)) is not None]
    assert found, f"{case.id}: the mutation applies to no example"
    return found


def _quote_state(text: str) -> list[str]:
    """For each character of a shell script, the quoting it sits in: '' (none), "'", '"' or '#' (a comment): a
    rough POSIX reader, enough for the scripts the templates write."""
    state, out, escaped, comment, previous = "", [], False, False, "\n"
    for ch in text:
        out.append("#" if comment else state)
        if comment:
            comment = ch != "\n"
        elif escaped:
            escaped = False
        elif state == "" and ch == "#" and previous in " \t\n;":
            comment = True
        elif state == "'":
            state = "" if ch == "'" else state
        elif ch == "\\":
            escaped = True
        elif state == '"':
            state = "" if ch == '"' else state
        elif ch in "'\"":
            state = ch
        previous = ch
    return out


def _strings(data: Any) -> list[tuple[bool, str]]:
    """Every string in parsed YAML/JSON, with whether it is a mapping key."""
    if isinstance(data, dict):
        return [pair for key, value in data.items() for pair in [(True, str(key)), *_strings(value)]]
    if isinstance(data, list):
        return [pair for item in data for pair in _strings(item)]
    return [(False, data)] if isinstance(data, str) else []


SHELL_SAFE = re.compile(r"[A-Za-z0-9_./:=@%+,^$-]+")


def assert_payload_inert(outputs: list[Output], case: Case) -> None:
    """The payload's dangerous part (it carries PWN) is data wherever it lands, never structure: in YAML and JSON a
    string that holds it holds the whole payload (and is no key, unless the payload is a name); in a shell script
    it is single-quoted (or needs no quotes); in an env file it names no variable."""
    payload, marker = case.payload, case.payload and ("PWN" if "PWN" in case.payload else case.payload)
    if not payload:
        return
    assert any(marker in out.content for out in outputs), f"the payload {payload!r} reached no file: a vacuous case"
    for out in outputs:
        if marker not in out.content:
            continue
        if out.path.endswith((".yml", ".yaml", ".json")):
            parsed = json.loads(out.content) if out.path.endswith(".json") else yaml.safe_load(out.content)
            for is_key, text in _strings(parsed):
                if marker in text:
                    assert payload in text, f"{out.path}: the payload was split: {text!r}"
                    assert case.is_name or not is_key, f"{out.path}: the payload became a key: {text!r}"
        elif out.path.endswith(".sh"):
            states = _quote_state(out.content)
            for found in re.finditer(re.escape(marker), out.content):
                assert states[found.start()] == "'" or SHELL_SAFE.fullmatch(payload), (
                    f"{out.path}: the payload is not single-quoted: {out.content[found.start() - 40:found.end()]!r}")
        else:
            for line in out.content.splitlines():
                if marker in line and not case.is_name:
                    assert marker not in line.split("=", 1)[0], f"{out.path}: the payload named a variable: {line!r}"


@pytest.mark.parametrize("case", [c for c in CASES if c.field is not None], ids=lambda c: f"{c.kind}-{c.id}")
def test_a_hostile_mutation_is_refused(cli, tmp_path: Path, case: Case) -> None:
    for index, (target, mutated) in enumerate(_targets(case)):
        spec = tmp_path / f"{target}.yml"
        spec.write_text(mutated)
        out_dir = tmp_path / f"out-{target}"
        commands = [("render", str(spec), "--out", str(out_dir))] + ([("validate", str(spec))] if index == 0 else [])
        for argv in commands:
            result = cli(*argv)
            assert result.code == EXIT_SPEC, f"{target}: {argv[0]} exit {result.code}: {result}"
            assert result.err.startswith("error: ") and str(spec) in result.err, result
            assert result.out == "", result
            assert "Traceback" not in result.err, result.err
            assert f"{case.field}" in result.err, f"{target}: {case.field!r} not named in {result.err!r}"
        assert not out_dir.exists(), f"{target}: a refused spec wrote {out_dir}"


@pytest.mark.parametrize("case", [c for c in CASES if c.field is None], ids=lambda c: f"{c.kind}-{c.id}")
def test_a_sloppy_but_valid_mutation_renders_sound(tmp_path: Path, case: Case) -> None:
    for target, mutated in _targets(case):
        spec = tmp_path / f"{target}.yml"
        spec.write_text(mutated)
        outputs = render_all(load_spec(spec))
        assert_sound(outputs)
        assert_payload_inert(outputs, case)


def test_the_corpus_covers_every_class_of_the_issue() -> None:
    kinds = {case.kind for case in CASES}
    assert kinds >= {"inventory", "env-file", "jinja", "engine-args", "last-wins", "exhaustion", "paths", "policy",
                     "over-strict", "others"}
    assert len(CASES) >= 80


@pytest.mark.parametrize("case_id", ["ssh-host-newline-yaml", "env-key-newline", "alias-bomb", "memory-inf",
                                     "profile-path", "extra-api-key-underscore"])
def test_refusals_through_the_module_entry_point(tmp_path: Path, case_id: str) -> None:
    case = next(c for c in CASES if c.id == case_id)
    _, mutated = _targets(case)[0]
    spec = tmp_path / "cluster.yml"
    spec.write_text(mutated)
    out_dir = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "hy3spark", "render", str(spec), "--out", str(out_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_SPEC, proc
    assert case.field and case.field in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not out_dir.exists()
