"""The spec rules one by one, through parse_spec: each mistake is refused with the field path, the line and a message
that says what to do; each legal edge is accepted. (tests/test_spec_validation.py drives the same rules through
the CLI.)"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from hy3spark.errors import SpecError
from hy3spark.spec import (
    Earlyoom,
    Fabric,
    Hardware,
    Model,
    ModelArch,
    Node,
    Pi,
    Ray,
    SpecModel,
    TrtllmServing,
    VllmServing,
    deep_merge,
    engine_port,
    format_path,
    load_spec,
    mpi_hosts,
    parse_spec,
    profile_description,
)

# A complete two-Spark spec without a profile, so every value a test changes is in the user's file.
BASE: dict[str, Any] = {
    "name": "pair",
    "head": {"name": "spark-a", "fabric_ip": "10.0.0.1/24", "ssh_user": "ops"},
    "workers": [{"name": "spark-b", "fabric_ip": "10.0.0.2/24", "ssh_user": "ops"}],
    "fabric": {"interfaces": ["enp1s0f1np1"], "hcas": ["rocep1s0f1", "roceP2p1s0f1"], "mtu": 9000},
    "image": {"ref": "vllm/vllm-openai:v0.23.0"},
    "model": {
        "repo": "org/model",
        "revision": "0123456789abcdef0123456789abcdef01234567",
        "cache_dir": "/var/lib/hy3spark/hub",
        "size_bytes": 1000,
        "arch": {"num_hidden_layers": 4, "num_key_value_heads": 8, "head_dim": 64, "max_context": 4096},
    },
    "serving": {"served_name": "m", "tensor_parallel": 2, "max_model_len": 4096, "max_num_seqs": 4,
                "api_key_env": "VLLM_API_KEY"},
}


def spec_text(**over: Any) -> str:
    """BASE with `over` merged in (a value of None removes the key), as YAML."""
    data = copy.deepcopy(BASE)
    for key, value in over.items():
        if value is None:
            data.pop(key)
        elif isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = deep_merge(data[key], value)
        else:
            data[key] = value
    return yaml.safe_dump(data, sort_keys=False)


def problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "cluster.yml")
    assert caught.value.source == "cluster.yml"
    return caught.value.problems


def only_problem(text: str) -> str:
    found = problems(text)
    assert len(found) == 1, found
    return found[0]


def at(text: str, fragment: str, source: str = "cluster.yml") -> str:
    """`source:N:` for the first line of `text` that contains `fragment`: where the user would look."""
    number = next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)
    return f"{source}:{number}:"


def node(name: str, ip: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "fabric_ip": ip, "ssh_user": "ops", **extra}


def test_base_is_valid_and_warns_about_nothing() -> None:
    loaded = parse_spec(spec_text(), "cluster.yml")
    assert loaded.warnings == []
    assert loaded.spec.gpu_count == 2 and loaded.spec.multi_node and loaded.spec.verify_transport


# --- nodes --------------------------------------------------------------------------------------------------------
def test_ssh_goes_to_ssh_host_then_mgmt_ip_then_the_fabric_address() -> None:
    workers = [node("spark-b", "10.0.0.2/24", ssh_host="b.lan", mgmt_ip="192.168.1.12"),
               node("spark-c", "10.0.0.3/24", mgmt_ip="192.168.1.13"),
               node("spark-d", "10.0.0.4/24")]
    spec = parse_spec(spec_text(workers=workers, serving={"tensor_parallel": 4}), "c.yml").spec
    assert [n.connect_host for n in spec.nodes] == ["10.0.0.1", "b.lan", "192.168.1.13", "10.0.0.4"]


def test_a_second_worker_with_the_first_workers_name_is_named_by_its_own_path() -> None:
    workers = [node("spark-b", "10.0.0.2/24"), node("spark-b", "10.0.0.3/24")]
    text = spec_text(workers=workers, serving={"tensor_parallel": 1, "pipeline_parallel": 3})
    assert only_problem(text).endswith(
        "workers[1].name: 'spark-b' is already used by workers[0].name; each node needs its own name")


def test_ssh_host_equal_to_another_nodes_fabric_address_is_refused() -> None:
    text = spec_text(workers=[node("spark-b", "10.0.0.2/24", ssh_host="10.0.0.1")])
    assert only_problem(text).endswith(
        "workers[0].ssh_host: '10.0.0.1' is already used by head.fabric_ip; each node needs its own address")


def test_different_names_and_addresses_do_not_collide() -> None:
    # Two nodes may share an ssh_user and a management subnet; the names and addresses differ.
    workers = [node("spark-b", "10.0.0.2/24", mgmt_ip="192.168.1.12")]
    head = node("spark-a", "10.0.0.1/24", mgmt_ip="192.168.1.11")
    spec = parse_spec(spec_text(head=head, workers=workers), "c.yml").spec
    assert [n.connect_host for n in spec.nodes] == ["192.168.1.11", "192.168.1.12"]


def test_worker_with_another_prefix_in_the_same_subnet() -> None:
    assert only_problem(spec_text(workers=[node("spark-b", "10.0.0.2/16")])).endswith(
        "workers[0].fabric_ip: prefix /16 differs from the head's /24; use one prefix on every node")


def test_worker_outside_the_heads_subnet_names_both() -> None:
    text = spec_text(workers=[node("spark-b", "10.0.1.2/24")])
    assert only_problem(text) == (f"{at(text, '10.0.1.2/24')} workers[0].fabric_ip: 10.0.1.2/24 is not in the head's "
                                  "fabric subnet 10.0.0.0/24; all fabric addresses must share one subnet")


@pytest.mark.parametrize(("head_ip", "worker_ip", "bad"), [
    ("127.0.0.1/8", "127.0.0.2/8", "127.0.0.1"),
    ("224.0.0.1/24", "224.0.0.2/24", "224.0.0.1"),
    ("0.0.0.0/0", "10.0.0.2/0", "0.0.0.0"),
])
def test_unusable_fabric_addresses(head_ip: str, worker_ip: str, bad: str) -> None:
    found = problems(spec_text(head=node("spark-a", head_ip), workers=[node("spark-b", worker_ip)]))
    assert any(p.endswith(f"head.fabric_ip: {bad} is not usable as a fabric address (link-local, loopback or "
                          "multicast); give the port a static private address such as 10.0.0.1/24") for p in found)


@pytest.mark.parametrize(("ip", "what"), [("10.0.0.0/24", "10.0.0.0"), ("10.0.0.255/24", "10.0.0.255")])
def test_network_and_broadcast_addresses_are_refused(ip: str, what: str) -> None:
    assert only_problem(spec_text(workers=[node("spark-b", ip)])).endswith(
        f"workers[0].fabric_ip: {what} is the network or broadcast address of 10.0.0.0/24")


def test_a_host_address_next_to_the_broadcast_address_is_fine() -> None:
    spec = parse_spec(spec_text(workers=[node("spark-b", "10.0.0.254/24")]), "c.yml").spec
    assert str(spec.workers[0].fabric_ip.ip) == "10.0.0.254"


def test_management_address_inside_the_fabric_subnet() -> None:
    text = spec_text(workers=[node("spark-b", "10.0.0.2/24", mgmt_ip="10.0.0.20")])
    assert only_problem(text).endswith(
        "workers[0].mgmt_ip: 10.0.0.20 is inside the fabric subnet 10.0.0.0/24; the management network must be a "
        "different subnet")


def test_heads_management_address_inside_the_fabric_subnet() -> None:
    text = spec_text(head=node("spark-a", "10.0.0.1/24", mgmt_ip="10.0.0.10"))
    assert only_problem(text).endswith("head.mgmt_ip: 10.0.0.10 is inside the fabric subnet 10.0.0.0/24; the "
                                       "management network must be a different subnet")


# --- fabric -------------------------------------------------------------------------------------------------------
def test_an_interface_also_listed_as_hca_is_refused() -> None:
    text = spec_text(fabric={"interfaces": ["enp1s0f1np1"], "hcas": ["enp1s0f1np1"]})
    found = problems(text)
    assert found[0].startswith(f"{at(text, '- enp1s0f1np1')} fabric.interfaces[0]: 'enp1s0f1np1' is an RDMA device "
                               "(HCA) name, not the network interface that carries the address; put it under "
                               "fabric.hcas")
    hca_line = [i for i, line in enumerate(text.splitlines(), 1) if "- enp1s0f1np1" in line][1]
    assert found[1] == (f"cluster.yml:{hca_line}: fabric.hcas[0]: 'enp1s0f1np1' does not look like an RDMA device "
                        "name (rocep1s0f1, roceP2p1s0f1, mlx5_0); list the HCAs that `ibdev2netdev` maps to the "
                        "cabled port")
    assert len(found) == 2


@pytest.mark.parametrize("hca", ["rocep1s0f1", "roceP2p1s0f1", "mlx5_0", "ibp1s0"])
def test_rdma_device_names_are_accepted_as_hcas_and_refused_as_interfaces(hca: str) -> None:
    parse_spec(spec_text(fabric={"hcas": [hca, "mlx5_9"]}), "c.yml")
    text = spec_text(fabric={"interfaces": [hca], "hcas": []})
    assert only_problem(text).startswith(f"{at(text, '- ' + hca)} fabric.interfaces[0]: {hca!r} is an RDMA device "
                                         "(HCA) name")


def test_second_hca_that_is_not_an_rdma_name_is_named_by_index() -> None:
    text = spec_text(fabric={"hcas": ["rocep1s0f1", "eth1"]})
    assert only_problem(text).startswith(f"{at(text, '- eth1')} fabric.hcas[1]: 'eth1' does not look like an RDMA "
                                         "device name")


@pytest.mark.parametrize(("names", "message"), [
    (["enp1s0f1np1", "enp1s0f1np1"], "lists a device twice"),
    (["a-name-of-16-chr"], "fabric.interfaces[0]: 'a-name-of-16-chr' is not a network device name (1-15 letters, "
                           "digits, '_', '.', '-'"),
    (["eth 1"], "'eth 1' is not a network device name"),
])
def test_device_lists(names: list[str], message: str) -> None:
    assert message in only_problem(spec_text(fabric={"interfaces": names}))


def test_a_device_name_of_15_characters_is_fine() -> None:
    assert parse_spec(spec_text(fabric={"interfaces": ["a-name-of-15-ch"]}), "c.yml").spec.fabric.interfaces == [
        "a-name-of-15-ch"]


# --- serving ------------------------------------------------------------------------------------------------------
def test_more_pipeline_stages_than_layers() -> None:
    workers = [node(f"spark-{c}", f"10.0.0.{i}/24") for i, c in enumerate("bcde", start=2)]
    text = spec_text(workers=workers, serving={"tensor_parallel": 1, "pipeline_parallel": 5})
    assert only_problem(text).endswith("serving.pipeline_parallel: 5 stages for 4 layers")


def test_as_many_pipeline_stages_as_layers_is_fine() -> None:
    workers = [node(f"spark-{c}", f"10.0.0.{i}/24") for i, c in enumerate("bcd", start=2)]
    spec = parse_spec(spec_text(workers=workers, serving={"tensor_parallel": 1, "pipeline_parallel": 4}), "c").spec
    assert spec.serving.pipeline_parallel == spec.model.arch.num_hidden_layers


def test_tp_times_pp_counts_the_gpus_of_every_node() -> None:
    head = node("spark-a", "10.0.0.1/24", gpus=2)
    assert parse_spec(spec_text(head=head, serving={"tensor_parallel": 1, "pipeline_parallel": 3}), "c").spec
    assert only_problem(spec_text(head=head)).endswith(
        "serving.tensor_parallel: tensor_parallel x pipeline_parallel = 2 x 1 = 2, but the cluster has 3 GPU(s) "
        "(2 node(s)); make the product equal the GPU count")


def test_max_model_len_equal_to_the_context_is_fine() -> None:
    assert parse_spec(spec_text(serving={"max_model_len": 4096}), "c").spec.serving.max_model_len == 4096
    assert only_problem(spec_text(serving={"max_model_len": 4097})).endswith(
        "serving.max_model_len: 4097 is above the model's context of 4096 tokens; use at most 4096")


@pytest.mark.parametrize("port", [6379, 6380, 6381, 20000, 20500, 20999])
def test_serving_port_colliding_with_ray(port: int) -> None:
    assert only_problem(spec_text(serving={"port": port})).endswith(
        f"serving.port: {port} collides with a Ray port; pick another serving.port")


@pytest.mark.parametrize("port", [6378, 6382, 19999, 21000])
def test_serving_ports_next_to_rays_are_fine(port: int) -> None:
    assert parse_spec(spec_text(serving={"port": port}), "c").spec.serving.port == port


def test_ray_ports_must_differ() -> None:
    assert only_problem(spec_text(ray={"port": 7000, "node_manager_port": 7000})).endswith(
        "ray.port: ray.port, ray.node_manager_port and ray.object_manager_port must differ")
    assert only_problem(spec_text(ray={"object_manager_port": 6380})).endswith(
        "ray.port: ray.port, ray.node_manager_port and ray.object_manager_port must differ")


@pytest.mark.parametrize(("low", "high"), [(21000, 21000), (21001, 21000)])
def test_ray_worker_port_range_must_be_a_range(low: int, high: int) -> None:
    found = only_problem(spec_text(ray={"min_worker_port": low, "max_worker_port": high}))
    assert found.startswith("cluster.yml:") and "ray: " in found
    assert found.endswith("min_worker_port must be below max_worker_port")


def test_a_loopback_endpoint_needs_no_key() -> None:
    loaded = parse_spec(spec_text(serving={"api_key_env": None, "host": "127.0.0.1"}), "c")
    assert loaded.spec.serving.api_key_env is None and loaded.warnings == []


def test_an_open_endpoint_on_purpose_is_a_warning() -> None:
    text = spec_text(serving={"api_key_env": None, "open_endpoint": True})
    loaded = parse_spec(text, "c")
    assert loaded.warnings == [f"{at(text, 'open_endpoint', 'c')} serving.open_endpoint: the endpoint on "
                               "0.0.0.0:8888 answers anyone who can reach it, without a key"]


def test_open_endpoint_warns_unless_bound_to_loopback() -> None:
    assert len(parse_spec(spec_text(serving={"open_endpoint": True}), "c").warnings) == 1
    assert parse_spec(spec_text(serving={"open_endpoint": True, "host": "127.0.0.1"}), "c").warnings == []


def test_speculative_config_needs_a_method() -> None:
    assert only_problem(spec_text(serving={"speculative_config": {"num_speculative_tokens": 1}})).endswith(
        "serving.speculative_config: needs a 'method' (for example mtp)")
    spec = parse_spec(spec_text(serving={"speculative_config": {"method": "mtp"}}), "c").spec
    assert spec.serving.speculative_config == {"method": "mtp"}


# --- the engine: serving is a union keyed on serving.engine ------------------------------------------------------
def test_engine_defaults_to_vllm_and_selects_its_section() -> None:
    assert "engine" not in BASE["serving"]
    spec = parse_spec(spec_text(), "c").spec
    assert spec.serving.engine == "vllm" and isinstance(spec.serving, VllmServing)


@pytest.mark.parametrize("engine", ["sglang", "VLLM", 5, "", None])
def test_an_unknown_engine_is_named_with_the_known_ones(engine: Any) -> None:
    text = spec_text(serving={"engine": engine})
    assert only_problem(text) == (f"{at(text, 'engine:')} serving.engine: {engine!r} is not an engine hy3spark "
                                  "knows; use one of: trtllm, vllm")


def test_a_field_of_the_engine_is_named_without_the_engines_tag() -> None:
    text = spec_text(serving={"gpu_memory_utilization": 2})
    assert only_problem(text) == (f"{at(text, 'gpu_memory_utilization')} serving.gpu_memory_utilization: 2: Input "
                                  "should be less than or equal to 1")


def test_serving_that_is_not_a_mapping_is_refused_once() -> None:
    text = spec_text(serving="vllm")
    assert only_problem(text).endswith("serving: must be a mapping of the serving fields (engine:, served_name:, "
                                       "tensor_parallel:, ...)")


@pytest.mark.parametrize(("flag", "field"), [("--tensor-parallel-size", "serving.tensor_parallel"),
                                           ("--pipeline-parallel-size", "serving.pipeline_parallel"),
                                           ("--port", "serving.port"), ("--host", "serving.host")])
def test_extra_args_may_not_set_what_the_spec_derives(flag: str, field: str) -> None:
    for args in ([flag, "4"], [f"{flag}=4"]):
        assert only_problem(spec_text(serving={"extra_args": ["--async-scheduling", *args]})).endswith(
            f"serving.extra_args[1]: '{flag}': it is set from {field}, and a second value here would silently win; "
            f"set {field} instead")


def test_extra_args_of_real_options_that_only_start_like_a_managed_flag_are_fine() -> None:
    args = ["--api-server-count=1", "--hf-overrides={}", "--allowed-origins=*", "--async-scheduling"]
    assert parse_spec(spec_text(serving={"extra_args": args}), "c").spec.serving.extra_args == args


def test_extra_args_that_are_no_vllm_option_are_refused() -> None:
    found = problems(spec_text(serving={"extra_args": ["--port-range=1", "--hostname=x", "--api-key-file=/run/k"]}))
    assert [p.split(": ", 1)[1] for p in found] == [
        f"serving.extra_args[{i}]: '{flag}' is not a `vllm serve` option in vLLM 0.23.0"
        for i, flag in enumerate(["--port-range", "--hostname", "--api-key-file"])]


def test_api_key_flag_without_a_value_is_refused_too() -> None:
    found = only_problem(spec_text(serving={"extra_args": ["--api-key", "abc"]}))
    assert "serving.extra_args[0]: '--api-key': it would put a secret on the process command line" in found
    assert "abc" not in found


def test_verify_transport_defaults_to_multi_node() -> None:
    single = spec_text(workers=[], serving={"tensor_parallel": 1})
    assert parse_spec(single, "c").spec.verify_transport is False
    assert parse_spec(single.replace("  api_key_env:", "  verify_transport: true\n  api_key_env:"),
                      "c").spec.verify_transport is True
    assert parse_spec(spec_text(serving={"verify_transport": False}), "c").spec.verify_transport is False


# --- secrets and env names ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value", "message"), [
    ("token_env", "HF-TOKEN", "model.token_env: 'HF-TOKEN' is not an environment variable name (for example "
                              "HF_TOKEN)"),
    ("token_env", "1TOKEN", "model.token_env: '1TOKEN' is not an environment variable name"),
])
def test_token_env_must_be_a_variable_name(field: str, value: str, message: str) -> None:
    assert message in only_problem(spec_text(model={field: value}))


def test_api_key_env_must_be_a_variable_name_or_a_secret_is_suspected() -> None:
    assert only_problem(spec_text(serving={"api_key_env": "my key"})).endswith(
        "serving.api_key_env: 'my key' is not an environment variable name (for example VLLM_API_KEY)")
    found = only_problem(spec_text(serving={"api_key_env": "sk-abcdefghijklmnop1234"}))
    assert "serving.api_key_env: looks like a secret written inline" in found
    assert "sk-abcdefghijklmnop1234" not in found


@pytest.mark.parametrize(("field", "value"), [("model", "HF_TOKEN"), ("model", "HUGGING_FACE_HUB_TOKEN"),
                                              ("model", "HY3SPARK_HF_TOKEN"), ("serving", "VLLM_API_KEY"),
                                              ("serving", "HY3SPARK_API_KEY")])
def test_a_secret_is_read_from_the_engines_own_names_or_the_operators_hy3spark_names(field: str, value: str) -> None:
    key = "token_env" if field == "model" else "api_key_env"
    loaded = parse_spec(spec_text(**{field: {key: value}}), "c")
    assert getattr(getattr(loaded.spec, field), key) == value


def test_a_spec_cannot_name_another_secret_of_the_controllers() -> None:
    # A copied spec naming AWS_SECRET_ACCESS_KEY would have its value copied to the nodes' secrets file and sent to the
    # hub as a bearer token.
    found = only_problem(spec_text(model={"token_env": "AWS_SECRET_ACCESS_KEY"}))
    assert found.endswith("model.token_env: AWS_SECRET_ACCESS_KEY is not a name a spec may read a secret from: a "
                          "copied spec could otherwise copy any of the controller's secrets to the nodes. Use one of "
                          "HF_TOKEN, HUGGING_FACE_HUB_TOKEN, or a name that starts with HY3SPARK_ (for example export "
                          'HY3SPARK_HF_TOKEN="$AWS_SECRET_ACCESS_KEY" and write HY3SPARK_HF_TOKEN here)'), found


def test_no_token_env_at_all_is_allowed() -> None:
    assert parse_spec(spec_text(model={"token_env": None}), "c").spec.model.token_env is None


def test_a_secret_pasted_into_a_list_is_found_and_not_echoed() -> None:
    secret = "hf_" + "a" * 24
    found = only_problem(spec_text(serving={"extra_args": ["--x", secret]}))
    assert found.startswith("cluster.yml:")
    assert "serving.extra_args[1]: looks like a secret written inline" in found
    assert secret not in found


@pytest.mark.parametrize("key", ["token", "HF_TOKEN", "Password", "api_key"])
def test_secret_keys_are_refused_wherever_they_are(key: str) -> None:
    text = spec_text(container={"env": {key: "x"}})
    assert f"container.env.{key}: secrets are never written in the spec" in only_problem(text)


def test_env_names_of_the_containers() -> None:
    assert "container.env.BAD-NAME: 'BAD-NAME' is not a valid environment variable name" in only_problem(
        spec_text(container={"env": {"OK_NAME": "1", "BAD-NAME": "2"}}))


def test_jinja_in_a_list_item_is_refused() -> None:
    text = spec_text(serving={"extra_args": ["--x", "{% raw %}"]})
    assert only_problem(text).startswith(f"{at(text, '{% raw %}')} serving.extra_args[1]: contains Jinja syntax")


@pytest.mark.parametrize("mark", ["{{", "{%", "{#"])
def test_every_jinja_mark_is_refused(mark: str) -> None:
    assert "contains Jinja syntax" in only_problem(spec_text(serving={"served_name": f"m{mark}x"}))


# --- model --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dir", ["relative/hub", "/", "//"])
def test_cache_dir_must_be_absolute_and_below_root(cache_dir: str) -> None:
    assert f"model.cache_dir: {cache_dir!r} must be an absolute path below /" in only_problem(
        spec_text(model={"cache_dir": cache_dir}))


def test_cache_dir_loses_its_trailing_slash_and_gives_the_repo_dir() -> None:
    model = parse_spec(spec_text(model={"cache_dir": "/srv/hub/"}), "c").spec.model
    assert model.cache_dir == "/srv/hub"
    assert model.repo_dir == "/srv/hub/models--org--model"


# --- messages, lines and warnings ---------------------------------------------------------------------------------
def test_several_problems_are_all_reported_with_their_lines() -> None:
    text = spec_text(workers=[node("spark-b", "10.0.0.1/24")], serving={"max_model_len": 5000})
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "cluster.yml")
    worker_line = [i for i, line in enumerate(text.splitlines(), 1) if "10.0.0.1/24" in line][1]  # after the head's
    assert caught.value.problems == [
        f"cluster.yml:{worker_line}: workers[0].fabric_ip: 10.0.0.1 is the head's address; each node needs its own "
        "fabric_ip, for example 10.0.0.2/24",
        f"{at(text, 'max_model_len')} serving.max_model_len: 5000 is above the model's context of 4096 tokens; use "
        "at most 4096",
    ]
    assert str(caught.value).startswith(f"2 problems in cluster.yml:\n  - cluster.yml:{worker_line}: ")


def test_a_value_from_the_profile_is_reported_as_such() -> None:
    text = "name: x\nprofile: hy3-295b-nvfp4-tp2\nhead: {name: a, fabric_ip: 10.0.0.1/24}\n" \
           "fabric: {interfaces: [eth1]}\n"
    found = only_problem(text)
    # Hy3 at TP 2 on one GPU: the profile's tensor_parallel is not in the user's file, so no line.
    assert found.startswith("cluster.yml (value from profile hy3-295b-nvfp4-tp2): serving.tensor_parallel: ")


def test_a_missing_field_is_required_and_a_wrong_boolean_is_not_quoted() -> None:
    assert only_problem(spec_text(image=None)) == "cluster.yml: image: is required"
    found = only_problem(spec_text(serving={"trust_remote_code": [1]}))
    assert found.startswith("cluster.yml:") and "serving.trust_remote_code: Input should be a valid boolean" in found


def test_a_value_of_the_wrong_kind_is_quoted() -> None:
    assert only_problem(spec_text(serving={"max_num_seqs": "many"})).endswith(
        "serving.max_num_seqs: 'many': Input should be a valid integer")


def test_a_spec_that_is_not_a_mapping() -> None:
    assert only_problem("- a\n- b\n") == "cluster.yml:1: the spec must be a YAML mapping (name:, profile:, head:, ...)"


@pytest.mark.parametrize(("mtu", "warned"), [(1500, True), (8999, True), (9000, False), (9216, False)])
def test_mtu_below_9000_on_a_multi_node_fabric_warns(mtu: int, warned: bool) -> None:
    text = spec_text(fabric={"mtu": mtu})
    warnings = parse_spec(text, "c").warnings
    warning = f"{at(text, 'mtu:', 'c')} fabric.mtu: {mtu} is below 9000; RoCE throughput drops with standard frames"
    assert warnings == ([warning] if warned else [])


def test_single_node_warns_about_neither_mtu_nor_one_hca() -> None:
    text = spec_text(workers=[], serving={"tensor_parallel": 1}, fabric={"mtu": 1500, "hcas": ["rocep1s0f1"]})
    assert parse_spec(text, "c").warnings == []


def test_a_tag_instead_of_a_sha_warns_with_its_line() -> None:
    text = spec_text(model={"revision": "v1.0"})
    warnings = parse_spec(text, "c").warnings
    assert warnings == [f"{at(text, 'revision:', 'c')} model.revision: 'v1.0' is not a commit sha; a branch or tag "
                        "can move under you: pin the 40-character sha the hub shows"]


def test_format_path() -> None:
    assert format_path(("workers", 1, "fabric_ip")) == "workers[1].fabric_ip"
    assert format_path(("fabric", "hcas", 0)) == "fabric.hcas[0]"
    assert format_path(()) == ""


def test_deep_merge_replaces_lists_and_keeps_both_sides_intact() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    over = {"a": {"c": [3]}, "e": {"f": 1}}
    merged = deep_merge(base, over)
    assert merged == {"a": {"b": 1, "c": [3]}, "d": 1, "e": {"f": 1}}
    merged["a"]["c"].append(4)
    merged["e"]["f"] = 2
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": 1} and over == {"a": {"c": [3]}, "e": {"f": 1}}


def test_load_spec_refuses_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert caught.value.problems == [f"{path}: the spec is not UTF-8 text (byte 9)"]


def test_load_spec_hashes_the_bytes_and_remembers_the_path(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yml"
    path.write_text(spec_text())
    loaded = load_spec(path)
    assert loaded.path == str(path.resolve())
    assert loaded.sha256 == __import__("hashlib").sha256(path.read_bytes()).hexdigest()
    embedded = load_spec(None)
    assert embedded.path is None and embedded.source == "<embedded default-cluster.yml>"


def test_a_secret_check_goes_on_after_a_reference_left_out() -> None:
    # No token_env at all must not end the check before serving.api_key_env.
    assert only_problem(spec_text(model={"token_env": None}, serving={"api_key_env": "my key"})).endswith(
        "serving.api_key_env: 'my key' is not an environment variable name (for example VLLM_API_KEY)")


@pytest.mark.parametrize("prefix", [16, 25])
def test_a_worker_inside_the_heads_subnet_with_a_shorter_or_longer_prefix(prefix: int) -> None:
    assert only_problem(spec_text(workers=[node("spark-b", f"10.0.0.2/{prefix}")])).endswith(
        f"workers[0].fabric_ip: prefix /{prefix} differs from the head's /24; use one prefix on every node")


def test_divisors_offered_for_an_odd_kv_head_count() -> None:
    text = spec_text(model={"arch": {"num_key_value_heads": 3}})
    assert only_problem(text).endswith(
        "serving.tensor_parallel: 2 does not divide the model's 3 KV heads; use one of [1, 3] (and pipeline_parallel "
        "for the rest)")


def test_malformed_yaml_further_down_reports_its_line() -> None:
    text = spec_text().replace("  ssh_user: ops\nworkers", "  ssh_user: [ops\nworkers")
    found = only_problem(text)
    assert found.startswith("cluster.yml:") and "malformed YAML" in found
    text = "name: x\nhead:\n  name: a\n  fabric_ip: 10.0.0.1/24\n bad: indent\n"
    # libyaml's wording ("did not find expected key"), where the mapping that the indent broke starts.
    found = only_problem(text)
    assert found.startswith("cluster.yml:5: malformed YAML: ")
    assert found.endswith("(while parsing a block mapping that starts at line 1)")


def test_an_explicit_tag_is_refused_at_its_line() -> None:
    # SafeLoader would refuse to build this one, but only after composing it; the strict loader refuses every tag.
    assert only_problem("name: !!python/name:os.system x\n") == (
        "cluster.yml:1: name: the YAML tag !!python/name:os.system is not accepted: the spec takes plain text, "
        "numbers, true/false, lists and mappings (quote a value to keep it as text)")


def test_a_profile_value_inside_a_section_the_user_wrote_gets_that_sections_line() -> None:
    text = ("name: x\nprofile: hy3-295b-nvfp4-tp2\nhead: {name: a, fabric_ip: 10.0.0.1/24}\n"
            "fabric: {interfaces: [eth1]}\nserving:\n  max_num_seqs: 4\n")
    assert only_problem(text).startswith("cluster.yml:5: serving.tensor_parallel: tensor_parallel x pipeline_parallel "
                                         "= 2 x 1 = 2, but the cluster has 1 GPU(s)")


def test_profiles_describe_themselves() -> None:
    assert profile_description("hy3-295b-nvfp4-tp2").startswith("Tencent Hy3 (295B MoE")


def test_parse_spec_without_a_file_hash_hashes_the_text() -> None:
    text = spec_text()
    assert parse_spec(text, "c").sha256 == __import__("hashlib").sha256(text.encode()).hexdigest()
    assert parse_spec(text, "c", sha256="ab" * 32).sha256 == "ab" * 32


def test_the_defaults_a_user_gets_by_leaving_fields_out() -> None:
    data = copy.deepcopy(BASE)
    for section, key in (("fabric", "mtu"), ("head", "ssh_user"), ("model", "token_env")):
        data[section].pop(key, None)
    del data["workers"][0]["ssh_user"]
    loaded = parse_spec(yaml.safe_dump(data), "c")
    spec = loaded.spec
    assert loaded.warnings == []
    assert [(n.gpus, n.ssh_user) for n in spec.nodes] == [(1, "ubuntu"), (1, "ubuntu")]
    assert spec.fabric.mtu == 9000
    s = spec.serving
    assert (str(s.host), s.port, s.pipeline_parallel, s.health_timeout_s, s.gpu_memory_utilization, s.overhead_gib,
            s.kv_cache_dtype) == ("0.0.0.0", 8888, 1, 1800, 0.9, 3.0, "auto")
    r = spec.ray
    assert (r.port, r.node_manager_port, r.object_manager_port, r.min_worker_port, r.max_worker_port,
            r.dashboard) == (6379, 6380, 6381, 20000, 20999, "off")
    arch = spec.model.arch
    assert (arch.dtype_bytes, arch.mtp_layers, arch.sliding_window_layers) == (2, 0, 0)
    assert (spec.container.gpus, spec.container.name_prefix) == (True, "hy3spark")
    assert (spec.earlyoom.policy, spec.earlyoom.mem_percent, spec.earlyoom.swap_percent) == ("protect", 4, 100)
    assert (spec.pi.reasoning, spec.pi.max_tokens) == (True, 32768)
    assert (s.enable_auto_tool_choice, s.trust_remote_code, s.enforce_eager, s.open_endpoint) == (False,) * 4
    assert spec.hardware.total_memory_gib == 121.69
    assert spec.model.token_env == "HF_TOKEN"


# --- every bound of every numeric field: the bound is accepted, one past it is refused with the field path --------
MODELS: dict[str, type[SpecModel]] = {"head": Node, "fabric": Fabric, "model": Model, "serving": VllmServing,
                                      "ray": Ray, "earlyoom": Earlyoom, "pi": Pi, "hardware": Hardware}
BOUNDS = [
    (("head", "gpus"), 1, 8),
    (("fabric", "mtu"), 576, 9216),
    (("model", "size_bytes"), 1, None),
    (("model", "arch", "num_hidden_layers"), 1, None),
    (("model", "arch", "num_key_value_heads"), 1, None),
    (("model", "arch", "head_dim"), 1, None),
    (("model", "arch", "num_attention_heads"), 1, None),
    (("model", "arch", "mtp_layers"), 0, None),
    (("model", "arch", "sliding_window"), 1, None),
    (("model", "arch", "sliding_window_layers"), 0, None),
    (("model", "arch", "max_context"), 1, None),
    (("serving", "port"), 1, 65535),
    (("serving", "tensor_parallel"), 1, None),
    (("serving", "pipeline_parallel"), 1, None),
    (("serving", "max_model_len"), 16, None),
    (("serving", "max_num_seqs"), 1, None),
    (("serving", "health_timeout_s"), 10, None),
    (("serving", "overhead_gib"), 0, None),
    (("ray", "port"), 1, 65535),
    (("ray", "object_store_memory_bytes"), 78643200, None),
    (("ray", "node_manager_port"), 1, 65535),
    (("ray", "object_manager_port"), 1, 65535),
    (("ray", "min_worker_port"), 1024, None),  # its top is below max_worker_port's: see the range test
    (("ray", "max_worker_port"), None, 65535),  # its bottom is above min_worker_port's: see the range test
    (("earlyoom", "mem_percent"), 1, 50),
    (("earlyoom", "swap_percent"), 1, 100),
    (("pi", "max_tokens"), 1, None),
]


def _set(data: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(data)
    where = data
    for key in path[:-1]:
        where = where.setdefault(key, {})
    where[path[-1]] = value
    return data


def _accepts(path: tuple[str, ...], value: Any) -> None:
    """The field's own model takes the value (a whole spec may refuse it for another reason, e.g. TP x PP)."""
    model = ModelArch if path[:2] == ("model", "arch") else MODELS[path[0]]
    inner = path[2:] if model is ModelArch else path[1:]
    section = BASE.get(path[0], {})
    base = section["arch"] if model is ModelArch else section
    built = model.model_validate(_set(base, inner, value))
    for key in inner:
        built = getattr(built, key)
    assert built == value


@pytest.mark.parametrize(("path", "low", "high"), BOUNDS, ids=lambda v: ".".join(v) if isinstance(v, tuple) else None)
def test_numeric_bounds(path: tuple[str, ...], low: int | None, high: int | None) -> None:
    field = format_path(path)
    if low is not None:
        _accepts(path, low)
        assert only_problem(yaml.safe_dump(_set(BASE, path, low - 1))).endswith(
            f"{field}: {low - 1}: Input should be greater than or equal to {low}")
    if high is not None:
        _accepts(path, high)
        assert only_problem(yaml.safe_dump(_set(BASE, path, high + 1))).endswith(
            f"{field}: {high + 1}: Input should be less than or equal to {high}")


def test_the_ray_worker_port_range_is_judged_as_a_range_at_its_ends() -> None:
    for low, high in ((65535, 65535), (1024, 1024)):
        assert only_problem(spec_text(ray={"min_worker_port": low, "max_worker_port": high})).endswith(
            "ray: min_worker_port must be below max_worker_port")
    assert Ray(min_worker_port=1024, max_worker_port=1025).min_worker_port == 1024
    assert Ray(min_worker_port=65534, max_worker_port=65535).max_worker_port == 65535


@pytest.mark.parametrize(("path", "value", "message"), [
    (("serving", "gpu_memory_utilization"), 0, "Input should be greater than 0"),
    (("serving", "gpu_memory_utilization"), 1.01, "Input should be less than or equal to 1"),
    (("hardware", "total_memory_gib"), 0, "Input should be greater than 0"),
    (("serving", "overhead_gib"), -0.5, "Input should be greater than or equal to 0"),
])
def test_fractional_bounds(path: tuple[str, ...], value: float, message: str) -> None:
    assert only_problem(yaml.safe_dump(_set(BASE, path, value))).endswith(f"{format_path(path)}: {value}: {message}")


def test_fractional_values_at_their_bounds_are_fine() -> None:
    _accepts(("serving", "gpu_memory_utilization"), 1)
    _accepts(("serving", "gpu_memory_utilization"), 0.01)
    _accepts(("hardware", "total_memory_gib"), 0.5)
    _accepts(("serving", "overhead_gib"), 0.5)


def test_empty_interfaces_and_revision_are_refused() -> None:
    assert only_problem(spec_text(fabric={"interfaces": []})).endswith(
        "fabric.interfaces: List should have at least 1 item after validation, not 0")
    assert only_problem(spec_text(model={"revision": ""})).endswith(
        "model.revision: '': String should have at least 1 character")
    assert parse_spec(spec_text(model={"revision": "x"}), "c").spec.model.revision == "x"


def test_a_loaded_spec_cannot_be_changed_by_the_code_that_renders_from_it() -> None:
    spec = parse_spec(spec_text(), "c").spec
    for obj, attr in ((spec, "name"), (spec.serving, "port"), (spec.head, "fabric_ip")):
        with pytest.raises(ValidationError, match="frozen"):
            setattr(obj, attr, None)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_dtype_bytes_of_real_dtypes_are_accepted(size: int) -> None:
    _accepts(("model", "arch", "dtype_bytes"), size)


def test_dtype_bytes_of_three_is_refused() -> None:
    assert only_problem(spec_text(model={"arch": {"dtype_bytes": 3}})).endswith(
        "model.arch.dtype_bytes: 3: Input should be 1, 2 or 4")


def test_a_problem_of_the_third_worker_names_it() -> None:
    workers = [node("spark-b", "10.0.0.2/24"), node("spark-c", "10.0.0.3/24"), node("spark-d", "10.0.0.3/24")]
    text = spec_text(workers=workers, serving={"tensor_parallel": 1, "pipeline_parallel": 4})
    assert "workers[2].fabric_ip: '10.0.0.3' is already used by workers[1].fabric_ip; " in only_problem(text)


def test_a_worker_user_that_sorts_after_the_heads_is_refused_too() -> None:
    assert only_problem(spec_text(workers=[node("spark-b", "10.0.0.2/24", ssh_user="zed")])).endswith(
        "workers[0].ssh_user: 'zed' differs from head.ssh_user 'ops'; the head streams the image and model to workers "
        "as its own user, so use one user on every node")


def test_no_hca_listed_is_not_the_one_twin_warning() -> None:
    assert parse_spec(spec_text(fabric={"hcas": []}), "c").warnings == []
    text = spec_text(fabric={"hcas": ["rocep1s0f1"]})
    assert parse_spec(text, "c").warnings == [
        f"{at(text, 'hcas:', 'c')} fabric.hcas: only one RoCE device listed; a cabled Spark port has two twins (e.g. "
        "rocep1s0f1,roceP2p1s0f1) and NCCL runs at about half speed on one"]


def test_load_spec_of_a_missing_file_says_it_cannot_read_it(tmp_path: Path) -> None:
    path = tmp_path / "nope.yml"
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert caught.value.problems == [f"{path}: cannot read the spec: No such file or directory"]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("min_worker_port", 65536, "Input should be less than or equal to 65535"),
    ("max_worker_port", 1023, "Input should be greater than or equal to 1024"),
])
def test_ray_worker_ports_outside_their_own_bounds_say_so(field: str, value: int, message: str) -> None:
    # Not the range rule's message: the port itself is out of bounds.
    assert only_problem(spec_text(ray={field: value})).endswith(f"ray.{field}: {value}: {message}")


def test_a_management_address_that_is_another_nodes_ssh_host_is_an_address_clash() -> None:
    head = node("spark-a", "10.0.0.1/24", ssh_host="192.168.1.10")
    worker = node("spark-b", "10.0.0.2/24", mgmt_ip="192.168.1.10")
    assert only_problem(spec_text(head=head, workers=[worker])).endswith(
        "workers[0].mgmt_ip: '192.168.1.10' is already used by head.ssh_host; each node needs its own address")


# --- the launcher (serving.launcher: ray | native) ------------------------------------------------------------------
def single_text(**serving: Any) -> str:
    data = copy.deepcopy(BASE)
    data.pop("workers")
    data["head"]["gpus"] = 2
    data["serving"].update(serving)
    return yaml.safe_dump(data, sort_keys=False)


def test_ray_is_the_default_launcher_and_native_is_a_choice() -> None:
    assert parse_spec(spec_text(), "c").spec.serving.launcher == "ray"
    native = parse_spec(spec_text(serving={"launcher": "native"}), "c").spec.serving
    assert (native.launcher, native.master_port) == ("native", None)


def test_an_unknown_launcher_names_the_choices() -> None:
    assert only_problem(spec_text(serving={"launcher": "slurm"})).endswith(
        "serving.launcher: 'slurm' is not a launcher of vllm, which runs under ray or native (the launchers by "
        "engine: trtllm: mpi; vllm: ray, native)")


def test_native_world_size_must_divide_by_the_nodes() -> None:
    data = copy.deepcopy(BASE)
    data["workers"].append({"name": "spark-c", "fabric_ip": "10.0.0.3/24", "ssh_user": "ops", "gpus": 2})
    data["serving"].update(launcher="native", tensor_parallel=4)
    text = yaml.safe_dump(data, sort_keys=False)
    assert only_problem(text).endswith(
        "serving.tensor_parallel: the world size tensor_parallel x pipeline_parallel = 4 does not divide by the 3 "
        "nodes; vLLM's native multi-node runs the same number of ranks on every node")
    # Under Ray the same uneven cluster is fine: Ray places one rank per advertised GPU.
    data["serving"]["launcher"] = "ray"
    assert parse_spec(yaml.safe_dump(data, sort_keys=False), "c").spec.gpu_count == 4


def test_the_master_port_collides_with_nothing() -> None:
    assert only_problem(spec_text(serving={"launcher": "native", "master_port": 8888, "port": 8888})).endswith(
        "serving.master_port: 8888 collides with serving.port; pick another serving.master_port")
    assert only_problem(spec_text(serving={"launcher": "native", "master_port": 22})).endswith(
        "serving.master_port: 22: Input should be greater than or equal to 1024")


def test_the_master_port_belongs_to_native_on_several_nodes() -> None:
    assert only_problem(spec_text(serving={"master_port": 29501})).endswith(
        "serving.master_port: only the native launcher has a master port; set serving.launcher: native, or remove "
        "master_port")
    assert only_problem(single_text(launcher="native", master_port=29501)).endswith(
        "serving.master_port: one node needs no rendezvous: the master port is for native on several nodes; remove "
        "it")


def test_ray_fields_under_native_are_an_error() -> None:
    found = only_problem(spec_text(serving={"launcher": "native"}, ray={"port": 6379}))
    assert found.endswith("ray: the native launcher starts no Ray: the ray section has no effect under "
                          "serving.launcher: native; remove it (or set serving.launcher: ray)")


def test_native_frees_the_ray_ports_for_the_api() -> None:
    assert "collides with a Ray port" in only_problem(spec_text(serving={"port": 6379}))
    assert parse_spec(spec_text(serving={"launcher": "native", "port": 6379}), "c").spec.serving.port == 6379


def test_native_on_one_machine_binds_loopback_unless_told() -> None:
    alone = parse_spec(single_text(launcher="native", api_key_env=None), "c").spec.serving
    assert str(alone.host) == "127.0.0.1"
    told = parse_spec(single_text(launcher="native", host="0.0.0.0"), "c").spec.serving
    assert str(told.host) == "0.0.0.0"
    # A pair, or Ray on one node, keeps the default of every address (with its API key).
    assert str(parse_spec(single_text(), "c").spec.serving.host) == "0.0.0.0"
    assert str(parse_spec(spec_text(serving={"launcher": "native"}), "c").spec.serving.host) == "0.0.0.0"


# --- no fabric: one machine, no cabled port (the two-card desktop) -------------------------------------------------
def desktop_text(**over: Any) -> str:
    """One node, two GPUs, no fabric section and no fabric_ip, the native launcher; `over` as in spec_text."""
    data = copy.deepcopy(BASE)
    data.pop("workers")
    data.pop("fabric")
    data["head"] = {"name": "desk", "ssh_user": "ops", "gpus": 2}
    data["serving"].update(launcher="native")
    for key, value in over.items():
        if value is None:
            data.pop(key, None)
        elif isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = deep_merge(data[key], value)
        else:
            data[key] = value
    return yaml.safe_dump(data, sort_keys=False)


def test_one_machine_needs_no_fabric_and_is_reached_on_loopback() -> None:
    spec = parse_spec(desktop_text(), "c").spec
    assert spec.fabric is None and spec.head.fabric_ip is None
    assert spec.head.connect_host == "127.0.0.1"  # no address at all: the machine the controller runs on
    assert str(spec.serving.host) == "127.0.0.1"


def test_workers_need_the_fabric_where_the_ranks_meet() -> None:
    text = spec_text(fabric=None)
    assert only_problem(text) == (
        "cluster.yml: fabric: is required with workers: the ranks on different nodes meet over the cabled port; "
        "name its netdev(s) in fabric.interfaces")


def test_workers_need_every_nodes_fabric_address() -> None:
    text = spec_text(workers=[{"name": "spark-b", "ssh_user": "ops", "mgmt_ip": "192.168.1.11"}])
    assert only_problem(text) == (
        f"{at(text, 'spark-b')} workers[0].fabric_ip: is required with workers: the ranks meet over the fabric, so "
        "every node needs its own address on it, such as 10.0.0.1/24")
    head_only = spec_text(head={"name": "spark-a", "ssh_user": "ops"})
    data = yaml.safe_load(head_only)
    data["head"].pop("fabric_ip")
    text = yaml.safe_dump(data, sort_keys=False)
    assert only_problem(text).endswith("head.fabric_ip: is required with workers: the ranks meet over the fabric, "
                                       "so every node needs its own address on it, such as 10.0.0.1/24")


def test_a_fabric_needs_the_nodes_address_on_it() -> None:
    text = desktop_text(fabric={"interfaces": ["enp1s0f1np1"]})
    assert only_problem(text).endswith(
        "head.fabric_ip: is required when fabric is set: the netplan file puts this node's own address (such as "
        "10.0.0.1/24) on fabric.interfaces; or remove fabric on a single machine")


def test_a_fabric_address_needs_a_fabric() -> None:
    text = desktop_text(head={"name": "desk", "ssh_user": "ops", "gpus": 2, "fabric_ip": "10.0.0.1/24"})
    assert only_problem(text).endswith(
        "head.fabric_ip: there is no fabric section to put this address on; add fabric (its interfaces) or remove "
        "fabric_ip")


def test_no_fabric_needs_the_native_launcher() -> None:
    text = desktop_text(serving={"launcher": "ray", "host": "127.0.0.1"})
    assert only_problem(text) == (
        f"{at(text, 'launcher')} serving.launcher: ray needs a fabric: Ray starts on the node's fabric address (ray "
        "start --node-ip-address); with no fabric set serving.launcher: native (one machine: vLLM's mp executor, "
        "no Ray)")


@pytest.mark.parametrize("example", ["two-card-tp", "two-card-pp"])
def test_the_desktop_examples_differ_only_in_the_split(example: str) -> None:
    root = Path(__file__).resolve().parent.parent / "examples"
    tp, pp = (yaml.safe_load((root / f"two-card-{s}.yml").read_text()) for s in ("tp", "pp"))
    assert {k: v for k, v in tp.items() if k not in ("name", "serving")} == {
        k: v for k, v in pp.items() if k not in ("name", "serving")}
    split = {"tensor_parallel", "pipeline_parallel"}
    assert {k: v for k, v in tp["serving"].items() if k not in split} == {
        k: v for k, v in pp["serving"].items() if k not in split}
    assert (tp["serving"]["tensor_parallel"], tp["serving"]["pipeline_parallel"]) == (2, 1)
    assert (pp["serving"]["tensor_parallel"], pp["serving"]["pipeline_parallel"]) == (1, 2)
    spec = load_spec(root / f"{example}.yml").spec
    assert spec.fabric is None and spec.gpu_count == 2 and spec.serving.launcher == "native"
    described = profile_description("qwen3-32b-awq-two-card")
    assert "a 70B AWQ" in described and "does not fit at useful context on 2x24 GB" in described


# --- TensorRT-LLM under the mpi launcher (issue 12) ----------------------------------------------------------------
# BASE's pair with TensorRT-LLM's section: loopback (trtllm-serve checks no key), the API on NVIDIA's port 8355.
TRTLLM: dict[str, Any] = {"engine": "trtllm", "tensor_parallel": 2, "max_model_len": 4096, "max_num_seqs": 4,
                          "host": "127.0.0.1", "port": 8355}


def trtllm_text(serving: dict[str, Any] | None = None, head: dict[str, Any] | None = None, **over: Any) -> str:
    data = yaml.safe_load(spec_text(**over))
    data["serving"] = {**TRTLLM, **(serving or {})}
    data["head"] = head or data["head"]
    return yaml.safe_dump(data, sort_keys=False)


def test_trtllm_selects_its_section_under_mpi_and_serves_the_repo_name() -> None:
    spec = parse_spec(trtllm_text(), "c").spec
    assert isinstance(spec.serving, TrtllmServing) and spec.serving.launcher == "mpi" and spec.serving.mpi_port == 2233
    # trtllm-serve has no served-name flag: clients use the repo id, which fills served_name.
    assert spec.serving.served_name == spec.model.repo == "org/model"
    assert mpi_hosts(spec) == ["10.0.0.1", "10.0.0.2"]


@pytest.mark.parametrize(("field", "value"), [("kv_cache_dtype", "fp8"), ("gpu_memory_utilization", 0.8),
                                              ("speculative_config", {"method": "mtp"}), ("master_port", 29501),
                                              ("max_num_batched_tokens", 2048), ("tool_call_parser", "hermes")])
def test_a_vllm_field_under_trtllm_is_refused_as_vllms(field: str, value: Any) -> None:
    text = trtllm_text({field: value})
    assert only_problem(text) == (f"{at(text, field)} serving.{field}: a vllm field; serving.engine is trtllm, whose "
                                  f"section has no {field} (docs/engines.md): remove it, or set serving.engine: vllm")


def test_a_trtllm_field_under_vllm_is_refused_as_trtllms() -> None:
    text = spec_text(serving={"max_num_tokens": 8192})
    assert only_problem(text).endswith("serving.max_num_tokens: a trtllm field; serving.engine is vllm, whose section "
                                       "has no max_num_tokens (docs/engines.md): remove it, or set serving.engine: "
                                       "trtllm")


def test_each_engine_refuses_the_others_launcher() -> None:
    by_engine = "(the launchers by engine: trtllm: mpi; vllm: ray, native)"
    text = trtllm_text({"launcher": "ray"})
    assert only_problem(text) == (f"{at(text, 'launcher')} serving.launcher: 'ray' is not a launcher of trtllm, "
                                  f"which runs under mpi {by_engine}")
    text = spec_text(serving={"launcher": "mpi"})
    assert only_problem(text) == (f"{at(text, 'launcher')} serving.launcher: 'mpi' is not a launcher of vllm, which "
                                  f"runs under ray or native {by_engine}")


def test_trtllm_tp_size_must_be_the_gpu_count() -> None:
    text = trtllm_text({"tensor_parallel": 4})
    assert only_problem(text) == (
        f"{at(text, 'tensor_parallel')} serving.tensor_parallel: tensor_parallel x pipeline_parallel (trtllm-serve's "
        "--tp_size x --pp_size) = 4 x 1 = 4, but the cluster has 2 GPU(s) (2 node(s)); make the product equal the GPU "
        "count")


def test_the_mpi_launcher_runs_one_rank_per_node() -> None:
    text = trtllm_text(head={**BASE["head"], "gpus": 2}, workers=[])
    assert only_problem(text).endswith("head.gpus: 2: the mpi launcher starts one rank per node (slots=1 in the "
                                       "hostfile, OMPI_MCA_rmaps_ppr_n_pernode=1), so every node must have 1 GPU")


@pytest.mark.parametrize(("port", "message"), [
    (22, "22 is SSH's port on the node, which Ansible reaches the nodes on; the container's sshd shares the host's "
         "network, so pick another serving.mpi_port (NVIDIA's is 2233)"),
    (8355, "8355 collides with serving.port, where trtllm-serve's API listens; pick another serving.mpi_port"),
])
def test_the_mpi_port_may_not_be_ssh_or_the_api(port: int, message: str) -> None:
    text = trtllm_text({"mpi_port": port})
    assert only_problem(text) == f"{at(text, 'mpi_port')} serving.mpi_port: {message}"


def test_the_api_port_may_not_be_the_mpi_port_either_way_round() -> None:
    assert only_problem(trtllm_text({"port": 2233})).endswith(
        "serving.mpi_port: 2233 collides with serving.port, where trtllm-serve's API listens; pick another "
        "serving.mpi_port")
    assert only_problem(trtllm_text({"port": 22})).endswith("serving.port: 22 is SSH's port, which Ansible reaches "
                                                            "the nodes on; pick another serving.port")


def test_under_mpi_rays_ports_are_free_and_a_ray_section_is_refused() -> None:
    assert parse_spec(trtllm_text({"port": 6379}), "c").spec.serving.port == 6379
    text = trtllm_text(ray={"port": 7000})
    assert only_problem(text) == (f"{at(text, 'ray:')} ray: the mpi launcher starts no Ray: the ray section has no "
                                  "effect under serving.launcher: mpi; remove it")


def test_trtllm_takes_an_api_key_through_the_api_front_and_the_open_endpoint_is_said_out_loud() -> None:
    """trtllm-serve checks no key (NVIDIA/TensorRT-LLM#9950): with api_key_env set, hy3spark's API front answers on
    serving.port and trtllm-serve listens behind it on serving.port + 1; without a key the rule is vLLM's."""
    spec = parse_spec(trtllm_text({"host": "0.0.0.0", "api_key_env": "HY3SPARK_API_KEY"}), "c").spec
    assert spec.serving.api_key_env == "HY3SPARK_API_KEY" and engine_port(spec) == 8356
    assert engine_port(parse_spec(trtllm_text(), "c").spec) is None  # no key: trtllm-serve on serving.port itself
    assert engine_port(parse_spec(spec_text(), "c").spec) is None  # vLLM checks its key itself
    text = trtllm_text({"host": "0.0.0.0"})
    assert only_problem(text).endswith(
        "serving.api_key_env: the endpoint listens on 0.0.0.0:8355 with no API key; set serving.api_key_env to the "
        "name of an environment variable holding the key, bind serving.host to 127.0.0.1, or set "
        "serving.open_endpoint: true to serve without a key on purpose")
    assert len(parse_spec(trtllm_text({"host": "0.0.0.0", "open_endpoint": True}), "c").warnings) == 1


def test_the_engine_port_behind_the_api_front() -> None:
    keyed = {"api_key_env": "VLLM_API_KEY"}
    assert engine_port(parse_spec(trtllm_text({**keyed, "engine_port": 9000}), "c").spec) == 9000
    # Ray's ports are free under mpi (no Ray runs), as they are for serving.port.
    assert engine_port(parse_spec(trtllm_text({**keyed, "engine_port": 6379}), "c").spec) == 6379
    text = trtllm_text({"engine_port": 9000})
    assert only_problem(text) == (
        f"{at(text, 'engine_port')} serving.engine_port: only the API front, which runs when serving.api_key_env is "
        "set, moves trtllm-serve to another port; remove engine_port (without a key trtllm-serve listens on "
        "serving.port itself)")
    text = trtllm_text({**keyed, "engine_port": 8355})
    assert only_problem(text) == (f"{at(text, 'engine_port')} serving.engine_port: 8355 is serving.port, where the "
                                  "API front answers; pick another serving.engine_port for trtllm-serve behind it")
    text = trtllm_text({**keyed, "engine_port": 2233})
    assert only_problem(text) == (f"{at(text, 'engine_port')} serving.engine_port: 2233 is serving.mpi_port, where "
                                  "the mpi launcher's sshd listens; pick another serving.engine_port")
    assert only_problem(trtllm_text({**keyed, "port": 2232})).endswith(
        "serving.port: trtllm-serve listens behind the API front on serving.port + 1 by default, and 2233 is "
        "serving.mpi_port; set serving.engine_port to a free port")
    assert only_problem(trtllm_text({**keyed, "port": 65535})).endswith(
        "serving.port: trtllm-serve listens behind the API front on serving.port + 1 by default, and 65536 is no "
        "port; set serving.engine_port to a free port")
    assert "serving.engine_port" in only_problem(trtllm_text({**keyed, "engine_port": 22}))  # the field's bound
    assert only_problem(spec_text(serving={"engine_port": 9000})).endswith(
        "serving.engine_port: a trtllm field; serving.engine is vllm, whose section has no engine_port "
        "(docs/engines.md): remove it, or set serving.engine: trtllm")


def test_trtllm_serves_under_the_repo_name_only() -> None:
    text = trtllm_text({"served_name": "qwen"})
    assert only_problem(text) == (f"{at(text, 'served_name')} serving.served_name: 'qwen': trtllm-serve has no "
                                  "served-name flag and reports the model as 'org/model' (model.repo); remove "
                                  "served_name (it defaults to model.repo)")
    assert parse_spec(trtllm_text({"served_name": "org/model"}), "c").spec.serving.served_name == "org/model"


def test_the_hostfile_holds_fabric_addresses_only() -> None:
    """The hostfile is built from fabric_ip alone; a management address can reach it only as some node's fabric
    address, and the address rules refuse that: another node's mgmt_ip, or a node's own mgmt_ip (not in the fabric
    subnet, where its fabric address is)."""
    head = {**BASE["head"], "mgmt_ip": "192.168.1.10"}
    worker = node("spark-b", "192.168.1.10/24", mgmt_ip="192.168.1.11")
    assert "workers[0].fabric_ip: '192.168.1.10' is already used by head.mgmt_ip" in "\n".join(
        problems(trtllm_text(head=head, workers=[worker])))
    own = node("spark-b", "10.0.0.2/24", mgmt_ip="10.0.0.2")
    assert only_problem(trtllm_text(workers=[own])).endswith(
        "workers[0].mgmt_ip: 10.0.0.2 is inside the fabric subnet 10.0.0.0/24; the management network must be a "
        "different subnet")
    spec = parse_spec(trtllm_text(head=head, workers=[node("spark-b", "10.0.0.2/24", mgmt_ip="192.168.1.11",
                                                           ssh_host="b.lan")]), "c").spec
    assert mpi_hosts(spec) == ["10.0.0.1", "10.0.0.2"]


def test_one_node_without_a_fabric_lists_localhost_never_its_lan_address() -> None:
    text = trtllm_text({"tensor_parallel": 1}, head={"name": "solo", "mgmt_ip": "192.168.1.10"}, workers=[],
                       fabric=None)
    spec = parse_spec(text, "c").spec
    assert spec.fabric is None and mpi_hosts(spec) == ["localhost"]
    with_fabric = parse_spec(trtllm_text({"tensor_parallel": 1}, workers=[]), "c").spec
    assert mpi_hosts(with_fabric) == ["10.0.0.1"]


@pytest.mark.parametrize(("args", "message"), [
    (["--tp_size", "4"], "'--tp_size': it is set from serving.tensor_parallel, and a second value here would "
                         "silently win; set serving.tensor_parallel instead"),
    (["--max_batch_size=8"], "'--max_batch_size': it is set from serving.max_num_seqs"),
    (["--extra_llm_api_options", "/tmp/x.yml"], "'--extra_llm_api_options': it is set from serving.kv_cache_config"),
    (["--config", "/tmp/x.yml"], "'--config': it is set from serving.kv_cache_config"),
    (["--kv_cache_free_gpu_memory_fraction", "0.5"], "'--kv_cache_free_gpu_memory_fraction': it is set from "
                                                     "serving.kv_cache_config.free_gpu_memory_fraction"),
    (["--gpus_per_node", "2"], "'--gpus_per_node': the mpi launcher decides how many ranks run where"),
    (["--api_key", "abc"], "'--api_key' is not a trtllm-serve option in the table of "
                           "nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc5 (hy3spark/engines/trtllm_flags.json)"),
    (["--tensor-parallel-size", "2"], "'--tensor-parallel-size' is not a trtllm-serve option"),
    (["--tp", "2"], "'--tp' is not a trtllm-serve option"),
    (["--server_role", "context"], "'--server_role' is for disaggregated serving, which hy3spark does not deploy"),
    (["--trust_remote_code=yes"], "'--trust_remote_code' is a flag and takes no value"),
    (["--log_level"], "'--log_level' needs a value"),
    (["other/model"], "'other/model' is a second model argument: trtllm-serve takes one, model.repo"),
])
def test_trtllm_extra_args_are_read_against_trtllm_serves_table(args: list[str], message: str) -> None:
    found = only_problem(trtllm_text({"extra_args": args}))
    assert "serving.extra_args[0]: " + message in found, found
    assert "abc" not in found


def test_trtllm_extra_args_of_real_options_pass() -> None:
    args = ["--trust_remote_code", "--log_level", "debug", "--ep_size=2", "--enable_chunked_prefill"]
    assert parse_spec(trtllm_text({"extra_args": args}), "c").spec.serving.extra_args == args


def test_the_options_file_fields_are_checked_where_they_are() -> None:
    text = trtllm_text({"kv_cache_config": {"free_gpu_memory_fraction": 1.5}})
    assert only_problem(text).endswith("serving.kv_cache_config.free_gpu_memory_fraction: 1.5: Input should be less "
                                       "than or equal to 1")
    assert only_problem(trtllm_text({"kv_cache_config": {"dtype": "fp8_e4m3"}})).endswith(
        "serving.kv_cache_config.dtype: 'fp8_e4m3': Input should be 'auto' or 'fp8'")
    assert only_problem(trtllm_text({"cuda_graph_config": {"padding": True}})).endswith(
        "serving.cuda_graph_config.padding: unknown field; check the spelling (see README 'The cluster spec' for "
        "every field)")
    assert parse_spec(trtllm_text({"cuda_graph_config": None}), "c").spec.serving.cuda_graph_config is None
