"""Image recipes for the test harness: what goes into each local Docker image.

A recipe is data (Debian packages, files, a setup script run in a chroot, `docker import` changes) plus an optional
host-side hook. `images.py` turns it into `hy3spark/<name>:<hash>`, where the hash covers this data and the builder's
own source, so an image is rebuilt exactly when its recipe or the builder changes.

To add an image: write a function returning a `Recipe` and add it to `RECIPES`. Its tag is then exported to
Molecule as `HY3SPARK_<NAME>_IMAGE` (see images.env_var).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


class Chroot(Protocol):
    """What a host-side hook gets: the rootfs and a way to run a script inside it."""

    rootfs: Path

    def run(self, script: str) -> None: ...


@dataclass(frozen=True)
class Recipe:
    name: str
    packages: tuple[str, ...]
    # path inside the image -> content; written before `setup` runs
    files: dict[str, str] = field(default_factory=dict)
    # POSIX sh run in the rootfs (chroot, /proc mounted, no services started, clean environment)
    setup: str = ""
    # `docker import --change` instructions
    changes: tuple[str, ...] = ()
    suite: str = "bookworm"
    # host-side step after `setup` (e.g. install wheels downloaded on the host); its source is part of the hash
    hook: Callable[[Chroot], None] | None = None

    def fingerprint(self) -> str:
        data = {
            "name": self.name,
            "suite": self.suite,
            "packages": sorted(self.packages),
            "files": self.files,
            "setup": self.setup,
            "changes": list(self.changes),
            "hook": inspect.getsource(self.hook) if self.hook else None,
        }
        return json.dumps(data, sort_keys=True)


# Enough for Ansible (python3, python3-apt; python3-requests is what community.docker's modules talk to the
# engine with), for the roles' real dependencies (earlyoom, netplan's `netplan generate`, rsync over ssh) and for
# a person poking around (procps, less).
SYSTEMD_NODE_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "python3-apt",
    "python3-requests",
    "iproute2",
    "iputils-ping",
    "openssh-server",
    "openssh-client",
    "rsync",
    "sudo",
    "ca-certificates",
    "earlyoom",
    "netplan.io",
    "udev",  # `netplan apply` runs udevadm (test-builtin, trigger, settle): the network scenario applies for real
    "procps",
    "less",
    "python3-venv",  # model_sync: the head's huggingface_hub venv (ansible.builtin.pip, python3 -m venv)
    "nftables",  # roles/firewall: nft loads hy3spark's table (the role installs it on a node that lacks it)
)

SYSTEMD_NODE_SETUP = """\
# Each container gets its own machine-id (systemd makes one at boot when the file is empty; it would copy the
# one debootstrap left in /var/lib/dbus otherwise) and its own SSH host keys (see the ssh.service drop-in).
: > /etc/machine-id
rm -f /var/lib/dbus/machine-id
ln -s /etc/machine-id /var/lib/dbus/machine-id
rm -f /etc/ssh/ssh_host_*
# apt's timers would run apt-get update in the middle of a test and hold the dpkg lock.
systemctl mask apt-daily.timer apt-daily-upgrade.timer
rm -f /var/cache/apt/archives/*.deb
"""

SYSTEMD_NODE_FILES = {
    "/etc/systemd/system/ssh.service.d/host-keys.conf": """\
# hy3spark test image: host keys are made at first start, so containers of one image don't share them.
[Service]
ExecStartPre=
ExecStartPre=/usr/bin/ssh-keygen -A
ExecStartPre=/usr/sbin/sshd -t
""",
}

SYSTEMD_NODE_CHANGES = (
    "ENV container=docker",
    'CMD ["/lib/systemd/systemd"]',
)


def node() -> Recipe:
    """A DGX Spark stand-in for roles that need systemd but no container engine."""
    return Recipe(
        name="node",
        packages=SYSTEMD_NODE_PACKAGES,
        files=SYSTEMD_NODE_FILES,
        setup=SYSTEMD_NODE_SETUP,
        changes=SYSTEMD_NODE_CHANGES,
    )


# The node's inner Docker engine: overlay2 needs /var/lib/docker on a volume (not on the container's own overlay
# root); the systemd cgroup driver nests inner containers under the node's cgroup; the node's network is the
# scenario's, so the inner engine keeps its hands off iptables and makes no bridge (inner containers use
# --network host, as on a Spark).
DOCKER_DAEMON_JSON = """\
{
  "storage-driver": "overlay2",
  "exec-opts": ["native.cgroupdriver=systemd"],
  "iptables": false,
  "bridge": "none"
}
"""


def dnode() -> Recipe:
    """A node with its own Docker engine, to run the Ray head/worker containers as a Spark does."""
    return Recipe(
        name="dnode",
        packages=(*SYSTEMD_NODE_PACKAGES, "docker.io", "docker-registry"),  # image scenario: a real local registry
        files={**SYSTEMD_NODE_FILES, "/etc/docker/daemon.json": DOCKER_DAEMON_JSON},
        setup=SYSTEMD_NODE_SETUP,
        changes=SYSTEMD_NODE_CHANGES,
    )


RECIPES: tuple[Callable[[], Recipe], ...] = (node, dnode)

# Images with a builder script of their own, run after the recipes above with `--env-file FILE` (and `--force`):
# each reuses its tag when present and writes only its own HY3SPARK_<NAME>_IMAGE line into FILE (holding
# .cache/images.lock while it does: images.py runs it after releasing that lock). Paths are
# relative to the repository root; a missing script is skipped.
EXTERNAL_BUILDERS: tuple[str, ...] = ("tests/engine_double/build-image", "tests/trtllm_double/build-image")
