"""hy3spark: Ray's two Prometheus servers on loopback (ray.metrics: false, the default).

Ray's dashboard head (ray/dashboard/dashboard.py) and autoscaler monitor (ray/autoscaler/_private/monitor.py, or
ray/autoscaler/v2/monitor.py) each start a Prometheus server with `prometheus_client.start_http_server` on
DASHBOARD_METRIC_PORT / AUTOSCALER_METRIC_PORT, bound to every address unless the head's address is loopback, and
no option of Ray's turns them off or narrows them (Ray 2.52-2.60; --include-dashboard=false still starts the
dashboard head). In those two processes only, this module makes a server asked for on every address bind 127.0.0.1:
the metrics stay readable on the node (curl 127.0.0.1:44227), and nothing else of Ray's connects to them.

It is on the PYTHONPATH of `ray start` and everything Ray starts (the node container's command puts it first), as
Python's `sitecustomize` hook. Every other process is left alone, and the image's own sitecustomize (Debian's,
NVIDIA's), shadowed by this one, is run after it. An error here is Python's to report ("Error in sitecustomize") and
leaves the server as Ray makes it, still fenced by the firewall; molecule/ray reads the binds of a real Ray.

Installed by roles/ray_node at /etc/hy3spark/ray-python/sitecustomize.py; a change restarts the node's Ray.
"""

import os
import sys

# The scripts (as argv[0] ends) whose Prometheus server goes to loopback.
_SERVERS = ("ray/dashboard/dashboard.py", "ray/autoscaler/_private/monitor.py", "ray/autoscaler/v2/monitor.py")
_EVERY_ADDRESS = ("", "0.0.0.0", "::")
_LOOPBACK = "127.0.0.1"


def _is_ray_server(argv0: str) -> bool:
    return argv0.replace(os.sep, "/").endswith(_SERVERS)


def _to_loopback() -> None:
    import inspect

    try:
        import prometheus_client
    except ImportError:  # Ray starts no server without it
        return
    original = prometheus_client.start_http_server
    signature = inspect.signature(original)

    def start_http_server(*args, **kwargs):  # type: ignore[no-untyped-def]
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if bound.arguments.get("addr") in _EVERY_ADDRESS:
            bound.arguments["addr"] = _LOOPBACK
        return original(*bound.args, **bound.kwargs)

    start_http_server.__wrapped__ = original  # type: ignore[attr-defined]
    prometheus_client.start_http_server = start_http_server


def _run_the_next_sitecustomize() -> None:
    """The image's own sitecustomize, which this module shadows on sys.path."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if sys.argv and _is_ray_server(sys.argv[0]):
    _to_loopback()
_run_the_next_sitecustomize()
