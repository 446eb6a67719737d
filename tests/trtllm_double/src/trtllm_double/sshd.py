"""`trtllm-double-sshd`: the container's entrypoint mode for MPI, an sshd on the MPI port (what NVIDIA's
trtllm-mn-entrypoint.sh sets up in the release image), in the foreground so it holds the container.

    trtllm-double-sshd [--port 2233] [--host-key FILE]... [--authorized-keys FILE]

Defaults from the environment: TRTLLM_SSH_PORT (2233), TRTLLM_SSH_HOST_KEYS (colon-separated, default
/etc/trtllm-ssh/ssh_host_ed25519_key) and TRTLLM_SSH_AUTHORIZED_KEYS (/etc/trtllm-ssh/authorized_keys): the
deployment mounts its per-cluster files there. They are copied to root-owned 0600 files (sshd's StrictModes
refuses group- or world-readable ones, and a bind mount keeps the host's owner and mode). Key-only root login,
no passwords, nothing generated here: a container without the mounted keys fails, naming the missing file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

RUNTIME = Path("/run/trtllm-ssh")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trtllm-double-sshd", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("TRTLLM_SSH_PORT", "2233")))
    parser.add_argument("--host-key", action="append", default=None)
    parser.add_argument("--authorized-keys",
                        default=os.environ.get("TRTLLM_SSH_AUTHORIZED_KEYS", "/etc/trtllm-ssh/authorized_keys"))
    args = parser.parse_args(argv)
    host_keys = args.host_key or os.environ.get(
        "TRTLLM_SSH_HOST_KEYS", "/etc/trtllm-ssh/ssh_host_ed25519_key").split(":")
    for path in [*host_keys, args.authorized_keys]:
        if not Path(path).is_file():
            print(f"trtllm-double-sshd: error: {path} is missing (mount the cluster's MPI SSH files)",
                  file=sys.stderr)
            return 1
    RUNTIME.mkdir(mode=0o700, parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    copied = []
    for i, path in enumerate(host_keys):
        target = RUNTIME / f"host_key_{i}"
        shutil.copyfile(path, target)
        os.chmod(target, 0o600)
        copied.append(target)
    authorized = RUNTIME / "authorized_keys"
    shutil.copyfile(args.authorized_keys, authorized)
    os.chmod(authorized, 0o600)
    config = RUNTIME / "sshd_config"
    config.write_text("".join(f"HostKey {key}\n" for key in copied) + f"""Port {args.port}
AuthorizedKeysFile {authorized}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes yes
PidFile /run/trtllm-ssh/sshd.pid
""")
    os.execv("/usr/sbin/sshd", ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)])


if __name__ == "__main__":
    sys.exit(main())
