"""image scenario: what a user relies on after the image role ran on a head and two workers.

prepare.yml pushed a tiny engine image to the registry on the head (and removed the head's copy), left image-w1
without it, and gave image-w2 a different image under the same tag. converge streamed to image-w1 (spec:
worker_source stream) and had image-w2 pull (role input). Idempotence and check mode ran after that, so the
transfer counts below also prove that a run where everything already matches moves nothing.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest
from scenario import ansible_node as node

HEAD, W1, W2 = "image-head", "image-w1", "image-w2"
NODES = (HEAD, W1, W2)
FABRIC_IP = {HEAD: "10.94.0.10", W1: "10.94.0.11", W2: "10.94.0.12"}
REF = "10.94.0.10:5000/hy3spark/engine:test"
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"


def inspect(name: str, ref: str = REF) -> dict:
    return json.loads(node(name).check_output(f"docker image inspect {ref}"))[0]


def image_events(name: str) -> list[str]:
    """Image actions (pull, load, import, tag, untag, ...) since the engine started (prepare restarted it)."""
    out = node(name).check_output(
        "docker events --since 2000-01-01T00:00:00 --until \"$(date +%s)\" --filter type=image --format '{{.Action}}'")
    return out.split()


def registry_config_digest() -> str:
    """The config digest of the registry's manifest for the tag: the image ID a pull gives."""
    code = (
        "import json, urllib.request\n"
        f"r = urllib.request.Request('http://{REF.split('/')[0]}/v2/hy3spark/engine/manifests/test',"
        f" headers={{'Accept': '{MANIFEST_V2}'}})\n"
        "print(json.load(urllib.request.urlopen(r))['config']['digest'])\n"
    )
    return node(HEAD).check_output(f"python3 -c {shlex.quote(code)}").strip()


@pytest.mark.parametrize("name", NODES)
def test_every_node_holds_the_registry_image(name: str) -> None:
    assert inspect(name)["Id"] == registry_config_digest()


@pytest.mark.parametrize("name", NODES)
def test_image_architecture_matches_the_node(name: str) -> None:
    machine = node(name).check_output("uname -m").strip()
    assert inspect(name)["Architecture"] == ARCH.get(machine, machine)


def test_head_pulled_once_from_the_registry() -> None:
    events = image_events(HEAD)
    assert events.count("pull") == 1, events
    assert "load" not in events


def test_w1_got_one_stream_from_the_head_over_the_fabric() -> None:
    events = image_events(W1)
    assert events.count("load") == 1, events
    assert "pull" not in events
    log = node(W1).check_output("journalctl -u ssh.service --no-pager -o cat")
    assert f"Accepted publickey for ubuntu from {FABRIC_IP[HEAD]} " in log


def test_w2_replaced_the_stale_image_by_pulling() -> None:
    stale = node(W2).file("/root/stale-image-id").content_string.strip()
    assert stale.startswith("sha256:") and stale != registry_config_digest()
    assert inspect(W2)["Id"] != stale
    events = image_events(W2)
    assert events.count("pull") == 1, events
    assert "load" not in events


def test_registry_served_the_head_and_w2_only() -> None:
    log = node(HEAD).check_output("journalctl -u docker-registry.service --no-pager -o cat")

    def served(ip: str) -> bool:
        return re.search(rf'remoteaddr="?{re.escape(ip)}:', log) is not None

    assert served(FABRIC_IP[HEAD])
    assert served(FABRIC_IP[W2])
    assert not served(FABRIC_IP[W1]), "image-w1 was to be streamed from the head, not pulled"
