"""The test harness itself: image tags follow their recipes, and every Molecule scenario fits the harness.

The scenario checks turn mistakes that Molecule lets through silently, or that only break when scenarios run one
after another (or side by side), into a failing test with the scenario's name in it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from pathlib import Path
from typing import Any

import images
import pytest
import yaml
from recipes import RECIPES, Recipe

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(p.parent.name for p in (REPO / "molecule").glob("*/molecule.yml"))


def load_scenario(name: str) -> dict[str, Any]:
    data = yaml.safe_load((REPO / "molecule" / name / "molecule.yml").read_text())
    assert isinstance(data, dict), f"molecule/{name}/molecule.yml is not a mapping"
    return data


def recipe(name: str) -> Recipe:
    return next(r for r in (make() for make in RECIPES) if r.name == name)


def test_tag_is_stable_and_names_the_recipe() -> None:
    node = recipe("node")
    assert images.image_tag(node) == images.image_tag(recipe("node"))
    assert images.image_tag(node).startswith("hy3spark/node:")
    assert images.env_var(node) == "HY3SPARK_NODE_IMAGE"


@pytest.mark.parametrize(
    "change",
    [
        {"packages": ("systemd", "python3")},
        {"setup": "true\n"},
        {"files": {"/etc/x": "y\n"}},
        {"changes": ("ENV a=b",)},
    ],
)
def test_tag_changes_with_the_recipe(change: dict[str, Any]) -> None:
    node = recipe("node")
    assert images.image_tag(dataclasses.replace(node, **change)) != images.image_tag(node)


def test_package_order_does_not_change_the_tag() -> None:
    node = recipe("node")
    shuffled = dataclasses.replace(node, packages=tuple(reversed(node.packages)))
    assert images.image_tag(shuffled) == images.image_tag(node)


def test_env_file_keeps_lines_of_external_builders(tmp_path: Path) -> None:
    env = tmp_path / "images.env"
    env.write_text("HY3SPARK_NODE_IMAGE=hy3spark/node:old\nHY3SPARK_SERVING_IMAGE=hy3spark/serving:abc\n")
    recipes = [make() for make in RECIPES]
    images.write_env(env, recipes)
    lines = env.read_text().splitlines()
    assert "HY3SPARK_SERVING_IMAGE=hy3spark/serving:abc" in lines
    assert f"HY3SPARK_NODE_IMAGE={images.image_tag(recipe('node'))}" in lines
    assert len(lines) == len(recipes) + 1


def test_every_recipe_has_a_distinct_env_var() -> None:
    names = [images.env_var(make()) for make in RECIPES]
    assert len(names) == len(set(names))


def test_there_are_scenarios() -> None:
    assert SCENARIOS, "no molecule/*/molecule.yml found"


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_env_merges_with_the_base_config(name: str) -> None:
    # Molecule 26 moves provisioner.env to ansible.env after merging the base config: a scenario's ansible.env
    # would be replaced by the base's provisioner.env, losing the scenario's variables without a word.
    ansible = load_scenario(name).get("ansible") or {}
    assert "env" not in ansible, f"molecule/{name}: put env under provisioner.env (see .config/molecule/config.yml)"


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_platforms_boot_local_systemd_images(name: str) -> None:
    for platform in load_scenario(name).get("platforms", []):
        where = f"molecule/{name}: platform {platform.get('name')}"
        assert platform.get("pre_build_image") is True, f"{where}: needs pre_build_image: true (no registry here)"
        assert platform.get("pull") is False, f"{where}: needs pull: false (no registry here)"
        assert not platform.get("privileged"), f"{where}: --privileged fails on these hosts; use capabilities"
        if str(platform.get("image", "")).startswith("${HY3SPARK_"):
            assert platform.get("command") == "/lib/systemd/systemd", f"{where}: command must boot systemd"
            assert platform.get("cgroupns_mode") == "host", f"{where}: needs cgroupns_mode: host"


@pytest.mark.parametrize("name", SCENARIOS)
def test_anonymous_volumes_go_with_their_container(name: str) -> None:
    # Molecule's destroy keeps volumes unless told otherwise: an anonymous /var/lib/docker would leak the inner
    # engine's images (hundreds of MB) on every run.
    for platform in load_scenario(name).get("platforms", []):
        anonymous = [v for v in platform.get("volumes", []) if ":" not in v]
        if anonymous:
            assert platform.get("keep_volumes") is False, (
                f"molecule/{name}: platform {platform.get('name')} mounts anonymous volume(s) {anonymous}; "
                "add keep_volumes: false"
            )


def test_platform_names_are_unique_across_scenarios() -> None:
    # `molecule destroy` removes containers by name: a shared name lets one scenario destroy another's node.
    seen: dict[str, str] = {}
    for name in SCENARIOS:
        for platform in load_scenario(name).get("platforms", []):
            other = seen.setdefault(platform["name"], name)
            assert other == name, f"platform {platform['name']} is in both molecule/{other} and molecule/{name}"


def test_pinned_subnets_do_not_overlap_across_scenarios() -> None:
    # A network left behind by a killed run, or a scenario running beside this one, fails `docker network create`
    # with "Pool overlaps" when two scenarios pin overlapping subnets.
    seen: list[tuple[ipaddress.IPv4Network, str, str]] = []
    for name in SCENARIOS:
        networks: dict[str, ipaddress.IPv4Network] = {}
        for platform in load_scenario(name).get("platforms", []):
            for network in platform.get("docker_networks", []):
                for ipam in network.get("ipam_config", []):
                    if "subnet" in ipam:
                        networks[network["name"]] = ipaddress.IPv4Network(ipam["subnet"])
        for net_name, subnet in networks.items():
            for other_subnet, other_scenario, other_net in seen:
                assert not subnet.overlaps(other_subnet), (
                    f"molecule/{name} network {net_name} ({subnet}) overlaps "
                    f"molecule/{other_scenario} network {other_net} ({other_subnet})"
                )
            seen.append((subnet, name, net_name))
