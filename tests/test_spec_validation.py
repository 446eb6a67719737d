"""One test per validation rule: the message names the field (and line), the exit code is 3, nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from hy3spark.errors import EXIT_SPEC

BASE = """\
name: pair
profile: hy3-295b-nvfp4-tp2
head:
  name: spark-a
  fabric_ip: 10.0.0.1/24
  ssh_user: ops
workers:
  - name: spark-b
    fabric_ip: 10.0.0.2/24
    ssh_user: ops
fabric:
  interfaces: [enp1s0f1np1]
  hcas: [rocep1s0f1, roceP2p1s0f1]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yml"
    path.write_text(text)
    return path


def assert_rejected(cli, tmp_path: Path, text: str, *needles: str) -> str:
    """Validate and render --out must both fail with the message, exit 3, and leave no output behind."""
    spec = write(tmp_path, text)
    out_dir = tmp_path / "out"
    for argv in (("validate", str(spec)), ("render", str(spec), "--out", str(out_dir))):
        result = cli(*argv)
        assert result.code == EXIT_SPEC, result
        assert result.out == ""
        for needle in needles:
            assert needle in result.err, f"{needle!r} not in {result.err!r}"
        assert "Traceback" not in result.err
    assert not out_dir.exists(), "a rejected spec must not write anything"
    return result.err


def test_base_spec_is_valid(cli, tmp_path: Path) -> None:
    result = cli("validate", str(write(tmp_path, BASE)))
    assert result.code == 0
    assert "2 node(s), 2 GPU(s), vllm TP=2 PP=1" in result.out


def test_duplicate_node_names(cli, tmp_path: Path) -> None:
    err = assert_rejected(cli, tmp_path, BASE.replace("name: spark-b", "name: spark-a"),
                          "workers[0].name: 'spark-a' is already used by head", "cluster.yml:8:")
    assert err.startswith("error: ")


def test_worker_with_the_heads_fabric_address(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, BASE.replace("10.0.0.2/24", "10.0.0.1/24"),
                    "cluster.yml:9: workers[0].fabric_ip: 10.0.0.1 is the head's address; each node needs its own")


def test_duplicate_management_addresses(cli, tmp_path: Path) -> None:
    text = BASE.replace("  ssh_user: ops\nworkers", "  ssh_user: ops\n  mgmt_ip: 192.168.1.10\nworkers")
    text = text.replace("    ssh_user: ops\nfabric", "    ssh_user: ops\n    mgmt_ip: 192.168.1.10\nfabric")
    assert_rejected(cli, tmp_path, text, "workers[0].mgmt_ip: '192.168.1.10' is already used by head")


def test_fabric_addresses_in_different_subnets(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, BASE.replace("10.0.0.2/24", "10.0.1.2/24"),
                    "workers[0].fabric_ip: 10.0.1.2/24 is not in the head's fabric subnet 10.0.0.0/24")


def test_link_local_fabric_address(cli, tmp_path: Path) -> None:
    text = BASE.replace("10.0.0.1/24", "169.254.3.1/16").replace("10.0.0.2/24", "169.254.3.2/16")
    assert_rejected(cli, tmp_path, text, "head.fabric_ip: 169.254.3.1 is not usable as a fabric address")


def test_socket_interface_named_by_its_rdma_device(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, BASE.replace("interfaces: [enp1s0f1np1]", "interfaces: [rocep1s0f1]"),
                    "cluster.yml:12: fabric.interfaces[0]: 'rocep1s0f1' is an RDMA device (HCA) name",
                    "ibdev2netdev")


def test_tp_times_pp_must_equal_gpu_count(cli, tmp_path: Path) -> None:
    text = BASE + "serving:\n  tensor_parallel: 4\n"
    assert_rejected(cli, tmp_path, text, "cluster.yml:15: serving.tensor_parallel: tensor_parallel x "
                    "pipeline_parallel = 4 x 1 = 4, but the cluster has 2 GPU(s)")


def test_tp_must_divide_kv_heads(cli, tmp_path: Path) -> None:
    # Three Sparks at TP 3: the GPU count matches, but Hy3's 8 KV heads do not split three ways.
    text = BASE.replace("fabric:\n", "  - name: spark-c\n    fabric_ip: 10.0.0.3/24\n    ssh_user: ops\nfabric:\n")
    text += "serving:\n  tensor_parallel: 3\n"
    assert_rejected(cli, tmp_path, text, "serving.tensor_parallel: 3 does not divide the model's 8 KV heads; "
                    "use one of [1, 2, 4, 8]")


def test_unknown_profile(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, BASE.replace("hy3-295b-nvfp4-tp2", "hy4-nope"),
                    "cluster.yml:2: profile: unknown profile 'hy4-nope'; available: gpt-oss-120b-single, "
                    "hy3-295b-nvfp4-tp2, llama31-405b-awq-tp2")


def test_unknown_field(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, BASE.replace("  ssh_user: ops\nworkers", "  ssh_usr: ops\nworkers"),
                    "cluster.yml:6: head.ssh_usr: unknown field")


def test_port_out_of_range(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, BASE + "serving:\n  port: 70000\n",
                    "cluster.yml:15: serving.port: 70000: Input should be less than or equal to 65535")


def test_max_model_len_above_context(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, BASE + "serving:\n  max_model_len: 300000\n",
                    "serving.max_model_len: 300000 is above the model's context of 262144 tokens")


@pytest.mark.parametrize("value", ["0", "1.2", "-0.5"])
def test_gpu_memory_utilization_outside_0_1(cli, tmp_path: Path, value: str) -> None:
    assert_rejected(cli, tmp_path, BASE + f"serving:\n  gpu_memory_utilization: {value}\n",
                    "cluster.yml:15: serving.gpu_memory_utilization:")


def test_secret_written_inline_as_a_key(cli, tmp_path: Path) -> None:
    err = assert_rejected(cli, tmp_path, BASE + "model:\n  hf_token: hf_abcdefghijklmnopqrstuvwxyz0123\n",
                          "cluster.yml:15: model.hf_token: secrets are never written in the spec")
    assert "hf_abcdefghijklmnopqrstuvwxyz0123" not in err, "the error must not echo the secret"


def test_secret_written_inline_in_a_reference(cli, tmp_path: Path) -> None:
    err = assert_rejected(cli, tmp_path, BASE + "model:\n  token_env: hf_abcdefghijklmnopqrstuvwxyz0123\n",
                          "model.token_env: looks like a secret written inline")
    assert "hf_abcdefghijklmnopqrstuvwxyz0123" not in err


def test_api_key_on_the_command_line(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, BASE + "serving:\n  extra_args: [--api-key=abc]\n",
                    "cluster.yml:15: serving.extra_args[0]: '--api-key': it would put a secret on the process "
                    "command line")


def test_open_endpoint_must_be_explicit(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, BASE + "serving:\n  api_key_env: null\n",
                    "serving.api_key_env: the endpoint listens on 0.0.0.0:8888 with no API key")


def test_different_ssh_users(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, BASE.replace("    ssh_user: ops", "    ssh_user: bob"),
                    "workers[0].ssh_user: 'bob' differs from head.ssh_user 'ops'")


def test_malformed_yaml_reports_the_line(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, BASE.replace("  ssh_user: ops\nworkers", "  ssh_user: [ops\nworkers"),
                    "cluster.yml:", "malformed YAML")
    err = assert_rejected(cli, tmp_path, "name: x\n  bad: indent\n", "malformed YAML")
    assert "cluster.yml:2:" in err


def test_several_problems_are_all_reported(cli, tmp_path: Path) -> None:
    text = BASE.replace("10.0.0.2/24", "10.0.0.1/24") + "serving:\n  max_model_len: 300000\n"
    err = assert_rejected(cli, tmp_path, text, "2 problems in", "is the head's address",
                          "is above the model's context")
    assert err.count("\n  - ") == 2


def test_missing_spec_file(cli, tmp_path: Path) -> None:
    result = cli("validate", str(tmp_path / "nope.yml"))
    assert result.code == EXIT_SPEC
    assert "cannot read the spec: No such file or directory" in result.err


def test_profile_values_are_reported_as_such(cli, tmp_path: Path) -> None:
    result = cli("validate", str(write(tmp_path, BASE)))
    assert "(value from profile hy3-295b-nvfp4-tp2): model.revision: 'main' is not a commit sha" in result.err


def test_one_rdma_twin_warns(cli, tmp_path: Path) -> None:
    result = cli("validate", str(write(tmp_path, BASE.replace("[rocep1s0f1, roceP2p1s0f1]", "[rocep1s0f1]"))))
    assert result.code == 0
    assert "fabric.hcas: only one RoCE device listed" in result.err


def test_jinja_syntax_in_a_value(cli, tmp_path: Path) -> None:
    """Ansible templates every inventory string: a preview would not be what lands on the node."""
    assert_rejected(cli, tmp_path, BASE + "container:\n  env:\n    BANNER: '{{ not_a_var }}'\n",
                    "cluster.yml:16: container.env.BANNER: contains Jinja syntax")


# --- duplicate names and addresses among all the nodes (issue 18) ---------------------------------------------------
# Four nodes, so that duplicates past the first worker show: line 12 is workers[1].fabric_ip, line 15 workers[2]'s.
FOUR = """\
name: four
profile: hy3-295b-nvfp4-tp2
head:
  name: spark-a
  fabric_ip: 10.0.0.1/24
  ssh_user: ops
workers:
  - name: spark-b
    fabric_ip: 10.0.0.2/24
    ssh_user: ops
  - name: spark-c
    fabric_ip: 10.0.0.3/24
    ssh_user: ops
  - name: spark-d
    fabric_ip: 10.0.0.4/24
    ssh_user: ops
fabric:
  interfaces: [enp1s0f1np1]
  hcas: [rocep1s0f1, roceP2p1s0f1]
serving:
  tensor_parallel: 2
  pipeline_parallel: 2
"""


def with_node_lines(text: str, node: str, *lines: str) -> str:
    """`text` with `lines` added to the node named `node`, right after its name line."""
    indent = "  " if node == "spark-a" else "    "
    head, sep, rest = text.partition(f"name: {node}\n")
    return head + sep + "".join(f"{indent}{line}\n" for line in lines) + rest


def test_four_node_spec_is_valid(cli, tmp_path: Path) -> None:
    result = cli("validate", str(write(tmp_path, FOUR)))
    assert result.code == 0, result.err
    assert "4 node(s), 4 GPU(s), vllm TP=2 PP=2" in result.out


def test_two_workers_sharing_a_fabric_address(cli, tmp_path: Path) -> None:
    err = assert_rejected(cli, tmp_path, FOUR.replace("10.0.0.3/24", "10.0.0.2/24"),
                          "cluster.yml:12: workers[1].fabric_ip: '10.0.0.2' is already used by workers[0].fabric_ip; "
                          "each node needs its own fabric_ip, for example 10.0.0.3/24")
    assert err.count("\n") == 1, "one problem, on the second of the two"


def test_a_duplicate_fabric_address_past_the_first_worker(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, FOUR.replace("10.0.0.4/24", "10.0.0.3/24"),
                    "cluster.yml:15: workers[2].fabric_ip: '10.0.0.3' is already used by workers[1].fabric_ip; "
                    "each node needs its own fabric_ip, for example 10.0.0.4/24")


def test_a_later_worker_with_the_heads_fabric_address(cli, tmp_path: Path) -> None:
    assert_rejected(cli, tmp_path, FOUR.replace("10.0.0.4/24", "10.0.0.1/24"),
                    "cluster.yml:15: workers[2].fabric_ip: 10.0.0.1 is the head's address; each node needs its own "
                    "fabric_ip, for example 10.0.0.4/24")


def test_every_duplicate_fabric_address_is_reported(cli, tmp_path: Path) -> None:
    text = FOUR.replace("10.0.0.3/24", "10.0.0.2/24").replace("10.0.0.4/24", "10.0.0.2/24")
    assert_rejected(cli, tmp_path, text, "2 problems in",
                    "cluster.yml:12: workers[1].fabric_ip: '10.0.0.2' is already used by workers[0].fabric_ip; each "
                    "node needs its own fabric_ip, for example 10.0.0.3/24",
                    "cluster.yml:15: workers[2].fabric_ip: '10.0.0.2' is already used by workers[0].fabric_ip; each "
                    "node needs its own fabric_ip, for example 10.0.0.4/24")


@pytest.mark.parametrize(("name", "first"), [("spark-c", "workers[1].name"), ("spark-a", "head.name"),
                                             ("spark-b", "workers[0].name")])
def test_duplicate_node_names_past_the_first_worker(cli, tmp_path: Path, name: str, first: str) -> None:
    assert_rejected(cli, tmp_path, FOUR.replace("name: spark-d", f"name: {name}"),
                    f"cluster.yml:14: workers[2].name: '{name}' is already used by {first}; each node needs its own "
                    "name")


def test_duplicate_management_addresses_when_ssh_host_is_set(cli, tmp_path: Path) -> None:
    """ssh_host is what Ansible connects to; the mgmt_ip beside it is still that machine's own LAN address."""
    text = with_node_lines(FOUR, "spark-c", "mgmt_ip: 192.168.1.12", "ssh_host: spark-c.lan")
    text = with_node_lines(text, "spark-d", "mgmt_ip: 192.168.1.12", "ssh_host: spark-d.lan")
    assert_rejected(cli, tmp_path, text,
                    "cluster.yml:17: workers[2].mgmt_ip: '192.168.1.12' is already used by workers[1].mgmt_ip; "
                    "each node needs its own mgmt_ip")


def test_duplicate_ssh_hosts_whatever_their_case(cli, tmp_path: Path) -> None:
    text = with_node_lines(FOUR, "spark-b", "ssh_host: Spark-B.lan")
    text = with_node_lines(text, "spark-d", "ssh_host: spark-b.lan.")
    assert_rejected(cli, tmp_path, text,
                    "cluster.yml:16: workers[2].ssh_host: 'spark-b.lan.' is already used by workers[0].ssh_host; "
                    "each node needs its own ssh_host")


def test_ssh_host_naming_another_nodes_management_address(cli, tmp_path: Path) -> None:
    text = with_node_lines(FOUR, "spark-c", "mgmt_ip: 192.168.1.12", "ssh_host: spark-c.lan")
    text = with_node_lines(text, "spark-d", "ssh_host: 192.168.1.12")
    assert_rejected(cli, tmp_path, text,
                    "cluster.yml:17: workers[2].ssh_host: '192.168.1.12' is already used by workers[1].mgmt_ip; "
                    "each node needs its own address")


def test_ssh_host_naming_another_nodes_fabric_address(cli, tmp_path: Path) -> None:
    text = with_node_lines(FOUR, "spark-d", "ssh_host: 10.0.0.3")
    assert_rejected(cli, tmp_path, text,
                    "cluster.yml:15: workers[2].ssh_host: '10.0.0.3' is already used by workers[1].fabric_ip; "
                    "each node needs its own address")


def test_a_node_may_give_its_own_address_twice(cli, tmp_path: Path) -> None:
    """ssh_host equal to the node's own mgmt_ip or fabric address is no duplicate."""
    text = with_node_lines(FOUR, "spark-a", "mgmt_ip: 192.168.1.10", "ssh_host: 192.168.1.10")
    text = with_node_lines(text, "spark-b", "ssh_host: 10.0.0.2")
    result = cli("validate", str(write(tmp_path, text)))
    assert result.code == 0, result.err
