"""Every port hy3spark's processes listen on, per node: where each binds and who may reach it.

One table feeds three things: the render preview (`files/<node>/ports.txt`), the firewall (roles/firewall admits a
`fabric` port only from the cluster's fabric addresses on the fabric interface, a `clients` port only from
firewall.api_allow) and the spec's collision rule. What binds where was read from the processes themselves (Ray
2.60's `ray start` with every port pinned, docs/security.md): Ray binds its client server, its dashboard agent's HTTP
port and its runtime-env agent to the node's address (--node-ip-address, the fabric address), and every other port to
all addresses with no option to narrow it, so for those the firewall is the only fence. The two Prometheus servers
(dashboard head, autoscaler) go to 127.0.0.1 with ray.metrics off: roles/ray_node's sitecustomize binds them there.
"""

from __future__ import annotations

from typing import Literal

from typing_extensions import TypedDict

from hy3spark.spec import (
    SSH_PORT,
    Node,
    Spec,
    TrtllmServing,
    engine_port,
    master_port,
    ray_ports,
    vllm_internal_ports,
)

# Who may connect: `fabric` the cluster's own nodes over the cable, `clients` firewall.api_allow, `loopback` only the
# node itself (bound to 127.0.0.1), `ssh` whatever the node's SSH policy is (hy3spark leaves it alone).
Reach = Literal["fabric", "clients", "loopback", "ssh"]
ALL = "0.0.0.0"


class PortEntry(TypedDict):
    name: str  # what listens
    field: str | None  # the spec field that sets it (None: not hy3spark's to set)
    first: int
    last: int  # == first for one port
    bind: str  # the address it binds: the fabric address, 127.0.0.1, or 0.0.0.0 (all)
    reach: Reach


def _entry(name: str, field: str | None, port: int, bind: str, reach: Reach, last: int | None = None) -> PortEntry:
    return {"name": name, "field": field, "first": port, "last": port if last is None else last, "bind": bind,
            "reach": reach}


# Ray binds these to --node-ip-address (the fabric address); every other Ray port to all addresses.
_RAY_BINDS_NODE_IP = {"client_server_port", "dashboard_agent_listen_port", "runtime_env_agent_port"}
# Ray's two Prometheus servers: on 127.0.0.1 with ray.metrics off (roles/ray_node's sitecustomize binds them there).
_RAY_PROMETHEUS = {"dashboard_metrics_port", "autoscaler_metrics_port"}


def port_table(spec: Spec, node: Node, head: bool) -> list[PortEntry]:
    """The node's listening ports, in the order `render` shows them."""
    s = spec.serving
    fabric = str(node.fabric_ip.ip) if node.fabric_ip is not None else "127.0.0.1"
    rows = [_entry("SSH (left as the node has it)", None, SSH_PORT, ALL, "ssh")]
    if head:
        host = str(s.host)
        rows.append(_entry(f"{s.engine} API" if engine_port(spec) is None else "hy3spark API front", "serving.port",
                           s.port, host, "loopback" if s.host.is_loopback else "clients"))
        behind = engine_port(spec)
        if behind is not None:
            rows.append(_entry(f"{s.engine} behind the API front", "serving.engine_port", behind, "127.0.0.1",
                               "loopback"))
    if s.launcher == "ray":
        for name, field, port in ray_ports(spec, head):
            if field == "dashboard_port" or (field in _RAY_PROMETHEUS and not spec.ray.metrics):
                rows.append(_entry(name, f"ray.{field}", port, "127.0.0.1", "loopback"))
            elif field in _RAY_BINDS_NODE_IP:
                rows.append(_entry(name, f"ray.{field}", port, fabric, "fabric"))
            else:
                rows.append(_entry(name, f"ray.{field}", port, ALL, "fabric"))
        rows.append(_entry("Ray worker processes", "ray.min_worker_port..max_worker_port", spec.ray.min_worker_port,
                           ALL, "fabric", last=spec.ray.max_worker_port))
    elif isinstance(s, TrtllmServing) and spec.multi_node:
        rows.append(_entry("mpirun's sshd (in the node container)", "serving.mpi_port", s.mpi_port, fabric, "fabric"))
    elif isinstance(s, TrtllmServing):  # one node: mpirun starts the rank itself; the sshd waits on loopback
        rows.append(_entry("mpirun's sshd (in the node container)", "serving.mpi_port", s.mpi_port, "127.0.0.1",
                           "loopback"))
    elif head and master_port(spec) is not None:
        port = master_port(spec)
        assert port is not None
        rows.append(_entry("torch.distributed rendezvous (native launcher)", "serving.master_port", port, ALL,
                           "fabric"))
    span = vllm_internal_ports(spec)
    if span is not None:
        # VLLM_PORT upward: the store (all addresses) on the node of rank 0, the broadcast queue (the fabric address)
        # across nodes. Every node gets the range: which node holds rank 0 is Ray's choice.
        rows.append(_entry("vLLM internal (torch.distributed store, broadcast queue; VLLM_PORT upward)",
                           "serving.internal_port", span[0], ALL, "fabric", last=span[1]))
    return rows
