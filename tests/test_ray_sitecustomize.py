"""roles/ray_node/files/sitecustomize.py, the shim that binds Ray's two Prometheus servers to 127.0.0.1 (issue 15:
"metrics exporters are off, or on loopback"), with the real prometheus_client of the serving test image.

Ray's dashboard head and autoscaler call `prometheus_client.start_http_server(port=..., registry=...)` with no
address (every address). Here a script at a path that ends as Ray's does (`.../ray/dashboard/dashboard.py`) makes the
same call under the shim, and reads its own listening sockets; a script at any other path must be left alone; and the
image's own sitecustomize, which the shim shadows on sys.path, must still run. molecule/ray checks the real Ray.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from docker_runs import docker, require_docker_as_root

REPO = Path(__file__).resolve().parent.parent
SHIM = REPO / "roles" / "ray_node" / "files" / "sitecustomize.py"
PROBE = """import prometheus_client, sys, time
prometheus_client.start_http_server(port=int(sys.argv[1]))
time.sleep(0.3)
rows = [line.split() for line in open('/proc/net/tcp').read().splitlines()[1:]]
port = '%04X' % int(sys.argv[1])
print(' '.join(sorted(r[1] for r in rows if r[3] == '0A' and r[1].endswith(':' + port))))
"""


def serving_image() -> str:
    if os.environ.get("HY3SPARK_SERVING_IMAGE"):
        return os.environ["HY3SPARK_SERVING_IMAGE"]
    env = REPO / ".cache" / "images.env"
    found = re.search(r"^HY3SPARK_SERVING_IMAGE=(\S+)$", env.read_text(), re.M) if env.is_file() else None
    if not found or docker("image", "inspect", found.group(1), check=False).returncode:
        pytest.skip("no serving image: run scripts/build-images (scripts/test does)")
    return found.group(1)


def test_only_rays_servers_go_to_loopback_and_the_images_sitecustomize_still_runs(tmp_path: Path) -> None:
    require_docker_as_root("the serving image runs in Docker")
    image = serving_image()
    (tmp_path / "shim").mkdir()
    shutil.copy(SHIM, tmp_path / "shim" / "sitecustomize.py")
    for script in ("site-packages/ray/dashboard/dashboard.py", "site-packages/ray/autoscaler/_private/monitor.py",
                   "site-packages/ray/autoscaler/v2/monitor.py", "elsewhere/dashboard.py"):
        (tmp_path / script).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / script).write_text(PROBE)
    (tmp_path / "image").mkdir()
    (tmp_path / "image" / "sitecustomize.py").write_text("print('the image sitecustomize ran')\n")
    # As the Ray container's command runs `ray start`: the shim first on PYTHONPATH, the image's path behind it.
    run = (
        'python=/opt/vllm/bin/python3; export PYTHONPATH=/t/shim:/t/image; '
        '$python /t/site-packages/ray/dashboard/dashboard.py 44227; '
        '$python /t/site-packages/ray/autoscaler/_private/monitor.py 44217; '
        '$python /t/site-packages/ray/autoscaler/v2/monitor.py 44218; '
        '$python /t/elsewhere/dashboard.py 44219'
    )
    out = docker("run", "--rm", "-v", f"{tmp_path}:/t:ro", image, "sh", "-c", run, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "the image sitecustomize ran", "0100007F:ACC3",
        "the image sitecustomize ran", "0100007F:ACB9",
        "the image sitecustomize ran", "0100007F:ACBA",
        "the image sitecustomize ran", "00000000:ACBB",  # not Ray's: left on every address
    ], out.stdout + out.stderr
    assert "Error in sitecustomize" not in out.stderr, out.stderr
