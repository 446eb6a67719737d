"""Judge the preflight probes and format the report.

The role's tasks only probe (read-only commands and modules, failures captured). Each filter here turns one probe's
raw result into result rows, so every judgement lives in plain Python that roles/preflight/tests/unit tests without a
cluster. A row is a dict:

    node      inventory name, or "controller" for checks that run on the Ansible controller
    check     stable id: interface, address, mtu, ping, ping_mtu, ssh, docker, image_arch, disk, hca, earlyoom,
              gpu, gpu_link, ray_dashboard, api_key, spec_sha256, reachable
    target    the peer or HCA the check is about ("" when the check is about the node itself)
    status    pass | fail | warn | info | skip   (only fail stops the play; skip is never a pass)
    expected  what the spec asks for
    found     what the node has
    fix       how to fix it ("" when there is nothing to do)
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# The earlyoom argument parser the module hy3spark_earlyoom_info uses as well: one reading of the file for both.
from ansible_collections.hy3spark.cluster.plugins.module_utils import earlyoom as earlyoom_args

STATUSES = ("fail", "warn", "skip", "info", "pass")
# ansible_facts.architecture -> the name docker image inspect reports.
DOCKER_ARCH = {"aarch64": "arm64", "arm64": "arm64", "x86_64": "amd64", "amd64": "amd64", "armv7l": "arm",
               "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}
CONTROLLER = "controller"

Row = dict[str, str]


def row(node: str, check: str, status: str, expected: str, found: str, fix: str = "", target: str = "") -> Row:
    if status not in STATUSES:
        raise ValueError(f"unknown status {status!r}")
    return {"node": node, "check": check, "target": target, "status": status, "expected": expected,
            "found": found, "fix": fix}


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return "\n".join(str(v) for v in value)
    return str(value)


def _first_line(*texts: Any) -> str:
    for text in texts:
        for line in _text(text).splitlines():
            if line.strip():
                return line.strip()
    return ""


def _missing_command(probe: Mapping[str, Any]) -> bool:
    """The command module reports a missing executable as a failed task with rc = errno (ENOENT: 2) and, from
    ansible-core 2.19 on, msg "Error executing command." (older cores put the OSError text in msg)."""
    msg = _text(probe.get("msg"))
    if probe.get("rc") == 127 or "No such file or directory" in msg:
        return not probe.get("stdout")
    return probe.get("rc") == 2 and msg.startswith("Error executing command")


def _human_bytes(n: int) -> str:
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


# ---------------------------------------------------------------------------------------------------------------
# Fabric: the interface, its address and MTU (one `ip -j addr show` on the node)
# ---------------------------------------------------------------------------------------------------------------
def _inet(link: Mapping[str, Any]) -> list[str]:
    return [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", []) if a.get("family") == "inet"]


def fabric(probe: Mapping[str, Any], node: str, interface: str, cidr: str, mtu: int) -> list[Row]:
    mtu = int(mtu)
    if probe.get("rc") != 0:
        why = _first_line(probe.get("stderr"), probe.get("msg")) or "ip failed"
        return [row(node, c, "fail", e, f"cannot list interfaces: {why}", "install iproute2 (ip) on the node")
                for c, e in (("interface", f"{interface} present and up"), ("address", cidr), ("mtu", str(mtu)))]
    links = json.loads(probe.get("stdout") or "[]")
    by_name = {link.get("ifname"): link for link in links}
    ip = cidr.split("/")[0]
    elsewhere = [name for name, link in by_name.items() if name != interface
                 and any(a.split("/")[0] == ip for a in _inet(link))]
    link = by_name.get(interface)
    if link is None:
        present = ", ".join(sorted(n for n in by_name if n != "lo")) or "none"
        hint = f"; {ip} is on {', '.join(elsewhere)}" if elsewhere else ""
        rows = [row(node, "interface", "fail", f"{interface} present and up", f"no interface {interface} "
                    f"(present: {present}){hint}",
                    "set fabric.interfaces[0] to the cabled port's netdev (ibdev2netdev shows the pairing)")]
        reason = f"interface {interface} absent"
        return [*rows, row(node, "address", "skip", cidr, reason), row(node, "mtu", "skip", str(mtu), reason)]

    rows: list[Row] = []
    flags = set(link.get("flags", []))
    oper = link.get("operstate", "UNKNOWN")
    up_expected = f"{interface} present and up"
    if "UP" not in flags:
        rows.append(row(node, "interface", "fail", up_expected, f"{interface} administratively down ({oper})",
                        f"bring it up: run the network role (netplan), or `sudo ip link set {interface} up`"))
    elif oper == "UP" or (oper == "UNKNOWN" and "LOWER_UP" in flags):
        rows.append(row(node, "interface", "pass", up_expected, f"{interface} {oper}"))
    else:
        rows.append(row(node, "interface", "fail", up_expected, f"{interface} {oper}, no carrier",
                        "check the cable and that the peer's port is up"))

    addrs = _inet(link)
    shown = ", ".join(addrs) or "no IPv4 address"
    if cidr in addrs:
        rows.append(row(node, "address", "pass", cidr, shown))
    else:
        same_ip = [a for a in addrs if a.split("/")[0] == ip]
        if same_ip:
            found = f"{shown} (prefix differs)"
        elif elsewhere:
            found = f"{shown}; {ip} is on {', '.join(elsewhere)}"
        else:
            found = shown
        link_local = [a for a in addrs if a.startswith("169.254.")]
        if link_local:
            found += " (link-local only: no static address was applied)"
        rows.append(row(node, "address", "fail", f"{cidr} on {interface}", found,
                        f"give {interface} its own address {cidr}: run the network role (netplan), and make sure "
                        "no other port carries an address in the fabric subnet"))

    found_mtu = int(link.get("mtu", 0))
    if found_mtu == mtu:
        rows.append(row(node, "mtu", "pass", str(mtu), str(found_mtu)))
    else:
        rows.append(row(node, "mtu", "fail", str(mtu), str(found_mtu),
                        f"set mtu: {mtu} for {interface} (network role / netplan) on every node and the switch, "
                        "or set fabric.mtu to what the whole path supports"))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# No fabric in the spec (one machine, no cabled port): the fabric checks are skipped, and say so
# ---------------------------------------------------------------------------------------------------------------
NO_FABRIC = "no fabric in the spec"


def no_fabric(node: str) -> list[Row]:
    return [row(node, check, "skip", "a fabric port (spec fabric section)", NO_FABRIC)
            for check in ("interface", "address", "mtu", "hca")]


# ---------------------------------------------------------------------------------------------------------------
# Ping over the fabric, plain and don't-fragment at MTU-28
# ---------------------------------------------------------------------------------------------------------------
_RECEIVED = re.compile(r"(\d+) packets transmitted, (\d+) received")


def ping(results: Mapping[str, Any] | Sequence[Mapping[str, Any]], node: str, src_ip: str, mtu: int,
         jumbo: bool = False) -> list[Row]:
    items = results.get("results", []) if isinstance(results, Mapping) else results
    mtu = int(mtu)
    size = mtu - 28
    check = "ping_mtu" if jumbo else "ping"
    rows: list[Row] = []
    for res in items:
        peer, peer_ip = res["item"]["name"], res["item"]["fabric_ip"]
        expected = (f"{size}-byte don't-fragment ping {src_ip} -> {peer_ip} answered" if jumbo
                    else f"{peer_ip} answers from {src_ip}")
        if res.get("skipped"):
            rows.append(row(node, check, "skip", expected, f"MTU {mtu}: no jumbo frames to test", target=peer))
            continue
        out = _text(res.get("stdout"))
        err = _text(res.get("stderr")) + _text(res.get("msg"))
        stats = _RECEIVED.search(out)
        if res.get("rc") == 0:
            found = f"{stats.group(2)}/{stats.group(1)} replies" if stats else "replies"
            rows.append(row(node, check, "pass", expected, found, target=peer))
            continue
        if _missing_command(res):
            found, fix = "ping not installed", "install iputils-ping"
        elif "Cannot assign requested address" in err or "bind" in err.lower():
            found = f"cannot send from {src_ip}: the address is not on this node"
            fix = "fix this node's address first (see its address row)"
        elif jumbo and "too long" in err:
            local = re.search(r"mtu[= ](\d+)", err)
            found = f"message too long: a local hop has MTU {local.group(1) if local else '< ' + str(mtu)}"
            fix = f"set mtu {mtu} on the fabric interface of both nodes (network role)"
        elif jumbo:
            found = f"no reply to {size}-byte frames" + (f" ({stats.group(2)}/{stats.group(1)})" if stats else "")
            fix = (f"a hop on the path drops frames above its MTU: set mtu {mtu} on {peer}'s fabric interface and "
                   "on any switch between them")
        else:
            found = "no reply" + (f" ({stats.group(2)}/{stats.group(1)})" if stats else "")
            detail = _first_line(res.get("stderr"))
            if detail:
                found += f": {detail}"
            fix = (f"check both ends (their interface and address rows): this node's fabric interface, and that "
                   f"{peer} is up, cabled and carries {peer_ip}")
        rows.append(row(node, check, "fail", expected, found, fix, target=peer))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# SSH from the head to each worker over the fabric, BatchMode, pinned host keys
# ---------------------------------------------------------------------------------------------------------------
def ssh(results: Mapping[str, Any] | Sequence[Mapping[str, Any]], node: str, known_hosts: str) -> list[Row]:
    items = results.get("results", []) if isinstance(results, Mapping) else results
    pinned = known_hosts or "~/.ssh/known_hosts"
    rows: list[Row] = []
    for res in items:
        peer, ip, user = res["item"]["name"], res["item"]["fabric_ip"], res["item"]["ssh_user"]
        expected = f"{user}@{ip} without a password, host key pinned"
        if res.get("rc") == 0:
            rows.append(row(node, "ssh", "pass", expected, "logged in (BatchMode, strict host key)", target=peer))
            continue
        err = _text(res.get("stderr")) + "\n" + _text(res.get("msg"))
        if _missing_command(res):
            found, fix = "ssh client not installed", "install openssh-client"
        elif "REMOTE HOST IDENTIFICATION HAS CHANGED" in err:
            found = f"host key mismatch: {ip} presents a key other than the one pinned in {pinned}"
            fix = (f"if {peer} was reinstalled, verify its new fingerprint and re-pin it (run the network role); "
                   "otherwise something else answers on that address")
        elif "Host key verification failed" in err or "host key is known" in err:
            found = f"host key unknown: {ip} is not pinned in {pinned}"
            fix = (f"pin {peer}'s host key for {ip} in {pinned} on the head: run the network role (it reads the key "
                   "on the worker itself); never turn host key checking off")
        elif "Permission denied" in err:
            found = f"permission denied: {user}@{ip} does not accept the head's key"
            fix = (f"add {user}'s public key on the head to {user}@{peer}:~/.ssh/authorized_keys "
                   "(the network role distributes it)")
        elif "Cannot assign requested address" in err:
            found = "cannot connect from this node's fabric address: it is not on this node"
            fix = "fix the head's address first (see its address row)"
        elif "Connection refused" in err:
            found = f"connection refused: no sshd listening on {ip}:22"
            fix = f"start sshd on {peer} and let it listen on the fabric address"
        elif re.search(r"timed out|No route to host|Network is unreachable", err):
            found = f"unreachable: {_first_line(res.get('stderr')) or 'timeout'}"
            fix = f"fix the fabric path to {peer} first (see the ping rows)"
        else:
            found = _first_line(res.get("stderr"), res.get("msg")) or f"ssh exited {res.get('rc')}"
            fix = f"run `ssh -o BatchMode=yes {user}@{ip} true` on the head and fix what it reports"
        rows.append(row(node, "ssh", "fail", expected, found, fix, target=peer))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Docker: usable by the deploying user, and the image's architecture
# ---------------------------------------------------------------------------------------------------------------
def docker_usable(probe: Mapping[str, Any]) -> bool:
    return probe.get("rc") == 0


def docker(probe: Mapping[str, Any], node: str, user: str) -> list[Row]:
    expected = f"docker usable by {user} without sudo"
    if probe.get("rc") == 0:
        version = re.search(r"Server:.*?Version:\s+(\S+)", _text(probe.get("stdout")), re.S)
        return [row(node, "docker", "pass", expected, f"engine {version.group(1)}" if version else "engine answers")]
    err = _text(probe.get("stderr")) + _text(probe.get("msg"))
    if _missing_command(probe):
        found, fix = "docker not installed", "install Docker (DGX OS ships it: apt install docker.io or docker-ce)"
    elif "permission denied" in err.lower():
        found = f"permission denied on the docker socket: {user} is not in the docker group"
        fix = (f"sudo usermod -aG docker {user}, then start a new login session (Ansible: reset the SSH "
               "connection, ControlPersist keeps the old groups)")
    elif "Cannot connect to the Docker daemon" in err or "Is the docker daemon running" in err:
        found, fix = "the Docker daemon is not running", "sudo systemctl enable --now docker"
    else:
        found, fix = _first_line(err) or f"docker exited {probe.get('rc')}", "run `docker version` as the user"
    return [row(node, "docker", "fail", expected, found, fix)]


def image_arch(probe: Mapping[str, Any], node: str, ref: str, arch: str) -> list[Row]:
    want = DOCKER_ARCH.get(arch, arch)
    expected = f"{ref} built for {want} ({arch})"
    if probe.get("skipped"):
        return [row(node, "image_arch", "skip", expected, "docker not usable (see the docker row)")]
    if probe.get("rc") != 0:
        err = _text(probe.get("stderr"))
        if "No such image" in err or "No such object" in err:
            return [row(node, "image_arch", "skip", expected, "image absent (the image role pulls or streams it)")]
        return [row(node, "image_arch", "fail", expected, _first_line(err) or "docker image inspect failed",
                    f"run `docker image inspect {ref}` and fix what it reports")]
    info = json.loads(probe.get("stdout") or "[]")
    got = info[0].get("Architecture", "unknown") if info else "unknown"
    variant = info[0].get("Variant") if info else None
    shown = f"{got}/{variant}" if variant else got
    if got == want:
        return [row(node, "image_arch", "pass", expected, shown)]
    return [row(node, "image_arch", "fail", expected, f"{shown}: it cannot run on this {arch} node",
                f"use an image built for linux/{want} (a multi-arch tag or one built on a Spark), then remove "
                f"this one: docker image rm {ref}")]


# ---------------------------------------------------------------------------------------------------------------
# Disk: free space at the model cache (or its nearest existing parent), counting what is already there
# ---------------------------------------------------------------------------------------------------------------
def disk(probe: Mapping[str, Any], node: str, cache_dir: str, size_bytes: int) -> list[Row]:
    size = int(size_bytes)
    lines = _text(probe.get("stdout")).splitlines()
    path, avail, mount, present = "", None, "", 0
    for i, line in enumerate(lines):
        if line.startswith("path="):
            path = line[5:]
        elif line.startswith("Filesystem") and i + 1 < len(lines):
            fields = lines[i + 1].split()
            if len(fields) >= 6 and fields[3].isdigit():
                avail, mount = int(fields[3]), " ".join(fields[5:])
        elif re.match(r"^\d+\t", line):
            present = int(line.split("\t", 1)[0])
    need = max(size - present, 0)
    expected = f">= {_human_bytes(need)} free for {cache_dir}"
    if present:
        expected += f" (model {_human_bytes(size)}, {_human_bytes(present)} already there)"
    if probe.get("rc") != 0 or avail is None:
        why = _first_line(probe.get("stderr"), probe.get("msg")) or "df gave no answer"
        return [row(node, "disk", "fail", expected, f"cannot measure free space: {why}",
                    f"check that {cache_dir} (or a parent) is readable by the deploying user")]
    where = path if path == cache_dir else f"{path} (nearest existing parent)"
    found = f"{_human_bytes(avail)} free on {mount} at {where}"
    if avail >= need:
        return [row(node, "disk", "pass", expected, found)]
    return [row(node, "disk", "fail", expected, found,
                f"free {_human_bytes(need - avail)} on {mount}, or point model.cache_dir at a larger disk "
                "(the same path on every node)")]


# ---------------------------------------------------------------------------------------------------------------
# RoCE HCAs: they exist and sit on the port that carries the fabric address
# ---------------------------------------------------------------------------------------------------------------
_IBDEV_LINE = re.compile(r"^(\S+) port (\d+) ==> (\S+) \((\w+)\)")


def _files_by_path(grep: Mapping[str, Any]) -> dict[str, str]:
    """`grep -H . f1 f2 ...` output -> {path: first line}."""
    out: dict[str, str] = {}
    for line in _text(grep.get("stdout")).splitlines():
        path, sep, value = line.partition(":")
        if sep and path not in out:
            out[path] = value.strip()
    return out


def hca_netdevs(find: Mapping[str, Any], ibdev: Mapping[str, Any], sysfs_root: str) -> dict[str, list[str]]:
    """HCA -> netdevs, from ibdev2netdev when it ran, else from <root>/class/infiniband/<hca>/device/net/."""
    pairs: dict[str, list[str]] = {}
    if ibdev and ibdev.get("rc") == 0 and not ibdev.get("skipped"):
        for line in _text(ibdev.get("stdout")).splitlines():
            m = _IBDEV_LINE.match(line.strip())
            if m:
                pairs.setdefault(m.group(1), []).append(m.group(3))
        return pairs
    base = sysfs_root.rstrip("/") + "/class/infiniband/"
    for f in (find or {}).get("files", []):
        path = f["path"]
        if not path.startswith(base):
            continue
        parts = path[len(base):].split("/")
        if len(parts) == 1:
            pairs.setdefault(parts[0], [])
        elif len(parts) == 4 and parts[1:3] == ["device", "net"]:
            pairs.setdefault(parts[0], []).append(parts[3])
    return {k: sorted(v) for k, v in pairs.items()}


def hca_find_paths(sysfs_root: str, hcas: Sequence[str]) -> list[str]:
    """Where the RDMA devices and each listed HCA's netdevs are in sysfs."""
    base = sysfs_root.rstrip("/") + "/class/infiniband"
    return [base] + [f"{base}/{h}/device/net" for h in hcas]


def hca_attr_paths(find: Mapping[str, Any], ibdev: Mapping[str, Any], sysfs_root: str,
                   interfaces: Sequence[str], hcas: Sequence[str]) -> list[str]:
    """The files the HCA judgement reads: each netdev's phys_port_name and each listed HCA's port state."""
    root = sysfs_root.rstrip("/")
    netdevs = list(interfaces)
    for devs in hca_netdevs(find, ibdev, sysfs_root).values():
        netdevs.extend(n for n in devs if n not in netdevs)
    return ([f"{root}/class/net/{n}/phys_port_name" for n in netdevs]
            + [f"{root}/class/infiniband/{h}/ports/1/state" for h in hcas])


def hca(present: Mapping[str, Any], find: Mapping[str, Any], ibdev: Mapping[str, Any], attrs: Mapping[str, Any],
        node: str, hcas: Sequence[str], interfaces: Sequence[str], sysfs_root: str) -> list[Row]:
    root = sysfs_root.rstrip("/")
    fabric_if = interfaces[0]
    ib_dir = f"{root}/class/infiniband"
    simulated = "" if root == "/sys" else f" [sysfs root {root}]"
    has_ibdev = bool(ibdev) and ibdev.get("rc") == 0 and not ibdev.get("skipped")
    if not present.get("stat", {}).get("exists") and not has_ibdev:
        return [row(node, "hca", "skip", ", ".join(hcas) or "no HCAs listed",
                    f"no RDMA devices ({ib_dir} absent)")]
    pairs = hca_netdevs(find, ibdev, sysfs_root)
    values = _files_by_path(attrs)

    def port_of(netdev: str) -> str:
        return values.get(f"{root}/class/net/{netdev}/phys_port_name", "")

    fabric_port = port_of(fabric_if)
    if not hcas:
        found = "; ".join(f"{h} -> {', '.join(n) or '?'}" for h, n in sorted(pairs.items())) or "none"
        return [row(node, "hca", "warn", "fabric.hcas lists the cabled port's RoCE devices", found + simulated,
                    "list both twins of the cabled port in fabric.hcas (ibdev2netdev): without NCCL_IB_HCA, NCCL "
                    "picks devices itself, possibly on the wrong port")]
    rows: list[Row] = []
    port_text = f" (port {fabric_port})" if fabric_port else ""
    for name in hcas:
        expected = f"{name} on {fabric_if}{port_text}, the port carrying the fabric address"
        if name not in pairs:
            listed = ", ".join(sorted(pairs)) or "none"
            rows.append(row(node, "hca", "fail", expected, f"no HCA {name} (present: {listed}){simulated}",
                            "copy the names ibdev2netdev maps to the fabric interface into fabric.hcas",
                            target=name))
            continue
        netdevs = pairs[name]
        state = values.get(f"{root}/class/infiniband/{name}/ports/1/state", "")
        on_port = [n for n in netdevs if n in interfaces or (fabric_port and port_of(n) == fabric_port)]
        shown = ", ".join(f"{n} ({port_of(n)})" if port_of(n) else n for n in netdevs) or "no netdev"
        found = f"{name} -> {shown}" + (f", {state}" if state else "") + simulated
        if not on_port:
            other = ", ".join(netdevs) or "no netdev"
            rows.append(row(node, "hca", "fail", expected, found,
                            f"{name} belongs to {other}, not to {fabric_if}: list the HCAs that ibdev2netdev maps to "
                            f"{fabric_if}{port_text} (both twins) in fabric.hcas", target=name))
        elif state and "ACTIVE" not in state:
            rows.append(row(node, "hca", "fail", expected, found,
                            f"{name}'s port is not ACTIVE: check the cable and the link of {', '.join(on_port)}",
                            target=name))
        else:
            rows.append(row(node, "hca", "pass", expected, found, target=name))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# earlyoom: the policy in force, where it came from, and whether it would shoot the engine
# ---------------------------------------------------------------------------------------------------------------
def _b64(slurp: Mapping[str, Any] | None) -> str | None:
    if not slurp or slurp.get("skipped") or slurp.get("failed") or "content" not in slurp:
        return None
    return base64.b64decode(slurp["content"]).decode("utf-8", "replace")


def _provenance(text: str, managed: str) -> str:
    head = [line for line in text.splitlines()[:12] if line.startswith("#")]
    for line in head:
        if managed and managed in line:
            return "hy3spark (managed header)"
    for line in head:
        m = re.match(r"#\s*Configured by:\s*(.+)$", line)
        if m:
            return m.group(1).strip()
    if any("Default settings for earlyoom" in line for line in head):
        return "the earlyoom package's default file"
    return "unknown (no provenance header)"


def _matches(pattern: str | None, names: Iterable[str]) -> list[str]:
    if not pattern:
        return []
    try:
        rx = re.compile(pattern)
    except re.error:
        return []
    return [n for n in names if rx.search(n)]


def main_pid(status: Mapping[str, Any]) -> int:
    """The Main PID line of `systemctl status UNIT`; 0 when the unit is not running."""
    m = re.search(r"Main PID: (\d+)", _text(status.get("stdout")))
    return int(m.group(1)) if m and status.get("rc") == 0 else 0


def earlyoom(conf: Mapping[str, Any], status: Mapping[str, Any], cmdline: Mapping[str, Any] | None, node: str,
             policy: str, managed: str, names: Sequence[str], conf_path: str = "/etc/default/earlyoom") -> list[Row]:
    names = list(names)
    expected = f"--prefer matches none of {', '.join(names)}; --avoid protects them"
    text = _b64(conf)
    running = None
    raw = _b64(cmdline)
    if raw:
        running = [a for a in raw.split("\0") if a][1:]
    if text is None and running is None:
        return [row(node, "earlyoom", "info", expected,
                    f"earlyoom not installed/running ({conf_path} absent); spec policy: {policy}")]
    file_args = earlyoom_args.file_args(text) if text is not None else None
    args = running if running is not None else (file_args or [])
    origin = _provenance(text, managed) if text is not None else "no config file"
    prefer, avoid = earlyoom_args.option(args, "--prefer"), earlyoom_args.option(args, "--avoid")
    killed, avoided = _matches(prefer, names), _matches(avoid, names)
    state = "running" if running is not None else "not running"
    parts = [f"{state}; config from: {origin}",
             f"--prefer {prefer!s} would kill first: {', '.join(killed) or 'none of them'}" if prefer
             else "no --prefer",
             f"--avoid protects: {', '.join(avoided) or 'none of them'}" if avoid else "no --avoid"]
    if running is not None and file_args is not None and file_args != running:
        parts.append(f"the running earlyoom's args differ from {conf_path} (restart pending)")
    found = "; ".join(parts)
    if killed:
        if policy == "leave":
            return [row(node, "earlyoom", "fail", expected, found,
                        "set earlyoom.policy: protect (the earlyoom role rewrites the policy) or remove the "
                        f"inference processes from --prefer in {conf_path} and restart earlyoom")]
        action = "replaces this policy" if policy == "protect" else "stops earlyoom"
        return [row(node, "earlyoom", "warn", expected, found,
                    f"policy {policy}: the earlyoom role {action}; run it before serving")]
    unprotected = [n for n in names if n not in avoided]
    if unprotected and policy != "stop":
        where = ("earlyoom.avoid in the spec (entries are regexes: VLLM::.*, ray::.* cover the process titles), "
                 "then run the earlyoom role") if policy == "protect" else f"--avoid in {conf_path}"
        return [row(node, "earlyoom", "warn", expected, found,
                    f"add {', '.join(unprotected)} to {where}")]
    return [row(node, "earlyoom", "pass", expected, found)]


# ---------------------------------------------------------------------------------------------------------------
# GPU, security posture, stale inventory
# ---------------------------------------------------------------------------------------------------------------
def gpu(probe: Mapping[str, Any], node: str, gpus: int) -> list[Row]:
    gpus = int(gpus)
    expected = f"nvidia-smi -L lists {gpus} GPU(s)"
    if _missing_command(probe):
        return [row(node, "gpu", "skip", expected, "nvidia-smi not found")]
    out = _text(probe.get("stdout"))
    listed = [line for line in out.splitlines() if re.match(r"^GPU \d+:", line)]
    if probe.get("rc") != 0:
        return [row(node, "gpu", "fail", expected, _first_line(out, probe.get("stderr")) or "nvidia-smi failed",
                    "the driver does not answer: check `nvidia-smi`, a pending reboot after a driver update, or a "
                    "crashed process holding the GPU")]
    found = f"{len(listed)} GPU(s)" + (f": {listed[0].split(' (UUID')[0]}" if listed else "")
    if len(listed) >= gpus:
        return [row(node, "gpu", "pass", expected, found)]
    return [row(node, "gpu", "fail", expected, found, "check the driver and `nvidia-smi -L`; fix gpus: in the spec")]


# ---------------------------------------------------------------------------------------------------------------
# GPU link: each GPU's negotiated PCIe generation and width (current and max) and the GPU-to-GPU topology. The
# reading is a fact of its own (preflight_gpu_link): the serving role's run record keeps it, and `hy3spark bench`
# takes it again under load through the same query (the current values drop at idle).
# ---------------------------------------------------------------------------------------------------------------
_GPU_LINK_FIELDS = ("memory_total_mib", "pcie_gen_current", "pcie_width_current", "pcie_gen_max", "pcie_width_max")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _smi_number(text: str) -> int | None:
    """A number nvidia-smi printed, or None for an absent reading: it writes those in brackets ("[N/A]" on GB10's
    unified memory, "[Not Supported]", "[Unknown Error]")."""
    text = text.strip()
    if not text or text.startswith("[") or text.upper() == "N/A":
        return None
    m = re.match(r"^(\d+)", text)  # nounits is asked for; a unit left on ("24564 MiB") is dropped
    return int(m.group(1)) if m else None


def parse_gpu_query(text: str) -> list[dict[str, Any]]:
    """`nvidia-smi --query-gpu=index,name,<_GPU_LINK_FIELDS> --format=csv,noheader,nounits` (the role's
    __preflight_gpu_link_query, in this order): one GPU per line, ", " between
    fields. The name is taken as everything between the index and the last five fields (a name may hold a comma)."""
    gpus = []
    for line in _text(text).splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 7 or not parts[0].isdigit():
            continue
        values = parts[-5:]
        gpu: dict[str, Any] = {"index": int(parts[0]), "name": ", ".join(parts[1:-5])}
        gpu.update({k: _smi_number(v) for k, v in zip(_GPU_LINK_FIELDS, values, strict=True)})
        gpus.append(gpu)
    return gpus


def parse_topo(text: str) -> dict[str, str]:
    """`nvidia-smi topo -m`: the GPU-to-GPU cells of the matrix, "GPU0-GPU1": "PHB" (each pair once). Columns are
    tab-separated under a header that starts with a tab; a terminal gets the header underlined (ANSI), dropped here.
    One GPU (a Spark) gives {}."""
    header: list[str] = []
    links: dict[str, str] = {}
    for raw in _ANSI.sub("", _text(text)).splitlines():
        cells = [c.strip() for c in raw.split("\t")]
        if not header:
            if len(cells) > 1 and not cells[0] and re.fullmatch(r"GPU\d+", cells[1]):
                header = cells
            continue
        if not re.fullmatch(r"GPU\d+", cells[0]):
            if not raw.strip() or raw.lstrip().startswith("Legend"):
                break
            continue
        for col, value in zip(header[1:], cells[1:], strict=False):
            if re.fullmatch(r"GPU\d+", col) and col != cells[0] and value and value != "X":
                pair = "-".join(sorted((cells[0], col), key=lambda g: int(g[3:])))
                links.setdefault(pair, value)
    return links


def gpu_link_reading(query: Mapping[str, Any], topo: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The fact: {status: read|skipped|failed, reason, gpus: [{index, name, memory_total_mib,
    pcie_gen_current, pcie_width_current, pcie_gen_max, pcie_width_max}], topo: {"GPU0-GPU1": "PHB"} or None}.
    An absent reading ([N/A], [Not Supported]) is None, never an error. skipped: no nvidia-smi (test nodes).
    No timestamp: the run record that keeps the fact must not change when nothing else did."""
    reading: dict[str, Any] = {"status": "read", "reason": "", "gpus": [], "topo": None}
    if _missing_command(query):
        return {**reading, "status": "skipped", "reason": "nvidia-smi not found"}
    out = _text(query.get("stdout"))
    if query.get("rc") != 0:
        return {**reading, "status": "failed",
                "reason": _first_line(out, query.get("stderr"), query.get("msg")) or "nvidia-smi failed"}
    reading["gpus"] = parse_gpu_query(out)
    if topo and topo.get("rc") == 0:
        reading["topo"] = parse_topo(_text(topo.get("stdout")))
    return reading


def _gen_width(gen: int | None, width: int | None) -> str:
    return f"gen{gen if gen is not None else '?'} x{width if width is not None else '?'}"


def gpu_link_text(gpu: Mapping[str, Any]) -> str:
    """GPU0 gen4 x16 of gen4 x16; or the absent reading said as such."""
    values = [gpu.get(k) for k in _GPU_LINK_FIELDS[1:]]
    if all(v is None for v in values):
        return f"GPU{gpu.get('index')} no PCIe link reported ([N/A])"
    return (f"GPU{gpu.get('index')} {_gen_width(values[0], values[1])} of {_gen_width(values[2], values[3])}")


def gpu_link(reading: Mapping[str, Any], node: str) -> list[Row]:
    expected = "each GPU's PCIe link at its full width (the generation drops at idle; bench reads it under load)"
    status = reading.get("status")
    if status == "skipped":
        return [row(node, "gpu_link", "skip", expected, reading.get("reason") or "not read")]
    if status != "read":
        return [row(node, "gpu_link", "warn", expected, reading.get("reason") or "nvidia-smi failed",
                    "nvidia-smi does not answer the PCIe query: see `nvidia-smi -q -d PCI` (an old driver may not "
                    "know pcie.link.*.max)")]
    gpus = reading.get("gpus") or []
    if not gpus:
        return [row(node, "gpu_link", "warn", expected, "nvidia-smi lists no GPU", "check the driver (nvidia-smi)")]
    parts = [gpu_link_text(g) for g in gpus]
    parts += [f"{pair} {kind}" for pair, kind in (reading.get("topo") or {}).items()]
    found = "; ".join(parts)
    narrow = [g for g in gpus if None not in (g.get("pcie_width_current"), g.get("pcie_width_max"))
              and g["pcie_width_current"] < g["pcie_width_max"]]
    if narrow:
        which = ", ".join(f"GPU{g['index']} x{g['pcie_width_current']} of x{g['pcie_width_max']}" for g in narrow)
        return [row(node, "gpu_link", "warn", expected, found,
                    f"{which}: seat the card in a full-width slot or check the riser and the BIOS lane split; a "
                    "tensor split runs a collective every layer over this link")]
    if all(g.get("pcie_width_current") is None and g.get("pcie_gen_current") is None for g in gpus):
        return [row(node, "gpu_link", "info", expected, found)]
    return [row(node, "gpu_link", "pass", expected, found)]


def gpu_links(hostvars: Mapping[str, Any], node_order: Sequence[str], play_hosts_all: Sequence[str],
              key: str = "preflight_gpu_link") -> dict[str, Any]:
    """Every node's reading in spec order (None for a node this run did not read): what the run record keeps."""
    return {name: (hostvars[name].get(key) if name in play_hosts_all and name in hostvars else None)
            for name in node_order}


def security(cluster: Mapping[str, Any], node: str) -> list[Row]:
    rows: list[Row] = []
    dashboard = cluster["ray"]["dashboard"]
    expected = "off, or bound to 127.0.0.1 (ShadowRay, CVE-2023-48022)"
    if dashboard == "off":
        rows.append(row(node, "ray_dashboard", "info", expected, "off (--include-dashboard=false)"))
    elif dashboard == "localhost":
        rows.append(row(node, "ray_dashboard", "info", expected,
                        "on, bound to 127.0.0.1:8265 (reach it through an SSH tunnel)"))
    else:
        rows.append(row(node, "ray_dashboard", "warn", expected, f"{dashboard}: the Jobs API runs code for anyone "
                        "who reaches port 8265", "set ray.dashboard: off"))
    serving = cluster["serving"]
    key_env = serving.get("api_key_env")
    where = f"{serving['host']}:{serving['port']}"
    expected = "an API key on an endpoint reachable beyond the head"
    if key_env:
        rows.append(row(node, "api_key", "info", expected, f"required: clients send the key from ${key_env}"))
    elif serving["host"].startswith("127."):
        rows.append(row(node, "api_key", "info", expected, f"no key; the endpoint listens on {where} only"))
    else:
        rows.append(row(node, "api_key", "warn", expected, f"open endpoint on {where}: no API key "
                        "(serving.open_endpoint)", "set serving.api_key_env to the name of an env var holding a key"))
    return rows


def spec_sha256(stat: Mapping[str, Any] | None, path: str, expected_sha: str) -> list[Row]:
    expected = f"the spec file hashes to {expected_sha[:12]}, as at render time"
    if not path:
        return [row(CONTROLLER, "spec_sha256", "skip", expected,
                    "no spec path in the inventory (set preflight_spec_path to check)")]
    st = (stat or {}).get("stat", {})
    if not st.get("exists"):
        return [row(CONTROLLER, "spec_sha256", "skip", expected, f"{path} not found on the controller")]
    got = st.get("checksum", "")
    if got == expected_sha:
        return [row(CONTROLLER, "spec_sha256", "pass", expected, f"{path}: {got[:12]}")]
    return [row(CONTROLLER, "spec_sha256", "fail", expected,
                f"{path}: {got[:12]}: the spec changed after the inventory was rendered",
                f"re-render (hy3spark render {path}), then run the play again")]


# ---------------------------------------------------------------------------------------------------------------
# Gathering and reporting
# ---------------------------------------------------------------------------------------------------------------
def collect(hostvars: Mapping[str, Any], node_order: Sequence[str], play_hosts_all: Sequence[str],
            controller_rows: Sequence[Row], key: str = "__preflight_node_results") -> list[Row]:
    """Every node's rows in spec order; a node that gave no rows is a failure, not a silent gap."""
    rows: list[Row] = []
    for name in node_order:
        if name not in play_hosts_all:
            rows.append(row(name, "reachable", "skip", "node in this run", "not in this run (--limit)"))
            continue
        node_rows = hostvars[name].get(key) if name in hostvars else None
        if node_rows is None:
            rows.append(row(name, "reachable", "fail", "Ansible reaches the node",
                            "no results: unreachable, or a probe failed before the report",
                            "check the connection (ansible -m ping) and the earlier error for this node"))
            continue
        rows.extend(node_rows)
    rows.extend(controller_rows)
    return rows


# What the network role sets up: before it has run (site.yml's first preflight), these are expected to be missing.
NETWORK_CHECKS = frozenset({"address", "mtu", "ping", "ping_mtu", "ssh"})


def network_pending(rows: Sequence[Row], pending: bool) -> list[Row]:
    """With `pending`, a failed fabric address/MTU/ping/SSH check is a warning: the network role configures it next,
    and site.yml runs the full preflight again after it. Everything else keeps its verdict."""
    if not pending:
        return list(rows)
    out = []
    for r in rows:
        if r["status"] == "fail" and r["check"] in NETWORK_CHECKS:
            r = {**r, "status": "warn", "found": f"{r['found']} (the network role configures this next)"}
        out.append(r)
    return out


def key(r: Row) -> str:
    """node/check[/target]: how the failure message and `preflight_by_key` name a row."""
    return f"{r['node']}/{r['check']}" + (f"/{r['target']}" if r.get("target") else "")


def failures(rows: Sequence[Row]) -> list[str]:
    return [key(r) for r in rows if r["status"] == "fail"]


def by_key(rows: Sequence[Row]) -> dict[str, Row]:
    return {key(r): r for r in rows}


def _label(r: Row) -> str:
    return f"{r['check']} {r['target']}" if r.get("target") else r["check"]


def table(rows: Sequence[Row], widths: Sequence[int] = (24, 32, 6, 36, 44, 56)) -> str:
    """The report as text: one row per check, long cells wrapped to the column widths, a summary line last."""
    headers = ("NODE", "CHECK", "STATUS", "EXPECTED", "FOUND", "HOW TO FIX")
    cells = [(r["node"], _label(r), r["status"].upper(), r["expected"], r["found"], r.get("fix") or "")
             for r in rows]
    widths = [min(max([len(h)] + [len(str(c[i])) for c in cells]), cap)
              for i, (h, cap) in enumerate(zip(headers, widths, strict=True))]

    def wrap(text: str, n: int) -> list[str]:
        words, lines, cur = str(text).split(" "), [], ""
        for w in words:
            while len(w) > n:
                if cur:
                    lines.append(cur)
                    cur = ""
                lines.append(w[:n])
                w = w[n:]
            if not cur:
                cur = w
            elif len(cur) + 1 + len(w) <= n:
                cur += " " + w
            else:
                lines.append(cur)
                cur = w
        lines.append(cur)
        return lines

    def render(values: Sequence[str]) -> list[str]:
        wrapped = [wrap(v, w) for v, w in zip(values, widths, strict=True)]
        height = max(len(c) for c in wrapped)
        out = []
        for i in range(height):
            parts = [(c[i] if i < len(c) else "").ljust(w) for c, w in zip(wrapped, widths, strict=True)]
            out.append("  ".join(parts).rstrip())
        return out

    lines = render(headers)
    lines.append("  ".join("-" * w for w in widths))
    for values in cells:
        lines.extend(render(values))
    counts = {s: sum(1 for r in rows if r["status"] == s) for s in STATUSES}
    lines.append("")
    lines.append("preflight: " + ", ".join(f"{counts[s]} {s}" for s in ("pass", "fail", "warn", "skip", "info")))
    return "\n".join(lines)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "preflight_fabric": fabric,
            "preflight_no_fabric": no_fabric,
            "preflight_ping": ping,
            "preflight_ssh": ssh,
            "preflight_docker": docker,
            "preflight_docker_usable": docker_usable,
            "preflight_image_arch": image_arch,
            "preflight_disk": disk,
            "preflight_hca": hca,
            "preflight_hca_find_paths": hca_find_paths,
            "preflight_hca_attr_paths": hca_attr_paths,
            "preflight_earlyoom": earlyoom,
            "preflight_main_pid": main_pid,
            "preflight_gpu": gpu,
            "preflight_gpu_link_reading": gpu_link_reading,
            "preflight_gpu_link": gpu_link,
            "preflight_gpu_links": gpu_links,
            "preflight_security": security,
            "preflight_spec_sha256": spec_sha256,
            "preflight_collect": collect,
            "preflight_network_pending": network_pending,
            "preflight_failures": failures,
            "preflight_by_key": by_key,
            "preflight_table": table,
        }
