"""hy3spark's API front before TensorRT-LLM (issue 12: "401 without the key"; trtllm-serve checks none,
NVIDIA/TensorRT-LLM#9950), run as a deployment runs it: the serve script `hy3spark render` makes for a one-node
TensorRT-LLM spec with serving.api_key_env, started with `docker exec -i` (the secrets on stdin) in a container of
the TensorRT-LLM test double's image (tests/trtllm_double), where it starts the front
(roles/vllm_serve/files/engines/trtllm/api_front.py, at the path the role copies it to) and execs the real mpirun,
whose one rank serves the double's trtllm-serve behind the front on loopback.

Only the engine is a double: the front, the serve script, bash, mpirun and the HTTP on both sides are real. Needs
root and a Docker engine; builds the image when this checkout's tag is missing.
"""

from __future__ import annotations

import copy
import http.client
import itertools
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from hy3spark.render import render_all
from hy3spark.spec import parse_spec

REPO = Path(__file__).resolve().parent.parent
DOUBLE = REPO / "tests" / "trtllm_double"
FRONT = REPO / "roles" / "vllm_serve" / "files" / "engines" / "trtllm" / "api_front.py"
sys.path.insert(0, str(REPO / "tests" / "engine_double"))
import docker_runs  # noqa: E402
from docker_runs import docker, require_docker_as_root  # noqa: E402
from make_model import make_model  # noqa: E402

RUN = f"trtllm-front-{os.getpid()}"
LABEL = "org.hy3spark.test=trtllm-front"
SUBNETS = [f"10.250.{third}.0/24" for third in range(180, 200)]
MODEL = "nvidia/Qwen3-235B-A22B-FP4"
PORT = 8355
CHAT = "/v1/chat/completions"
ROUTES = (("GET", "/v1/models", None), ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}),
          ("POST", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))


def one_node_spec(ip: str) -> str:
    """The TensorRT-LLM example on one node, its API on every address with the key from HY3SPARK_API_KEY, as the
    example sets it. The node's fabric address is the container's own, so the hostfile names this node and mpirun
    starts the rank itself, over no SSH."""
    data = yaml.safe_load((REPO / "examples" / "pair-trtllm-235b.yml").read_text())
    data = {k: v for k, v in data.items() if k != "workers"}
    data["head"] = {"name": "solo", "fabric_ip": f"{ip}/24", "mgmt_ip": "192.168.1.10"}
    data["fabric"] = {"interfaces": ["eth0"], "hcas": [], "mtu": 9000}
    data["serving"] = {**copy.deepcopy(data["serving"]), "tensor_parallel": 1}
    assert data["serving"]["api_key_env"] == "HY3SPARK_API_KEY" and data["serving"]["host"] == "0.0.0.0"
    return yaml.safe_dump(data, sort_keys=False)


@dataclass
class Head:
    name: str
    ip: str
    key: str
    log: Path
    port: int = PORT

    def request(self, method: str, path: str, body: dict | None = None, key: str | None = None,
                timeout: float = 10) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.ip, self.port, timeout=timeout)
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def ps(self) -> str:
        return docker("exec", self.name, "ps", "-ww", "-eo", "pid,ppid,args").stdout


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Head]:
    require_docker_as_root("the image build runs debootstrap")
    built = subprocess.run([str(DOUBLE / "build-image")], capture_output=True, text=True, timeout=900, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    image = built.stdout.strip().splitlines()[-1]
    tmp = tmp_path_factory.mktemp("trtllm-front")
    # What the serving role puts on the head: the rendered files under /etc/hy3spark, the front where the role
    # copies it, and the 0600 secrets file it writes from the controller's variable.
    etc, logs, hub = tmp / "etc", tmp / "log", tmp / "hub"
    for d in (etc, logs, hub):
        d.mkdir()
    docker_runs.remove_leftovers("trtllm-front", LABEL)
    ip, _ = docker_runs.create_network(RUN, LABEL, SUBNETS)
    node_env = None
    for out in render_all(parse_spec(one_node_spec(ip), "solo.yml")):
        if out.path.startswith("files/solo/etc/hy3spark/"):
            path = etc / out.path.removeprefix("files/solo/etc/hy3spark/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(out.content)
            path.chmod(0o755 if path.suffix == ".sh" else 0o644)
            if path.name == "node.env":
                node_env = path
    assert node_env is not None and (etc / "serve.sh").exists()
    shutil.copy(FRONT, etc / "api-front.py")
    (etc / "api-front.py").chmod(0o755)
    key = "sk-front-" + secrets.token_hex(16)
    # As the serving role keeps it: outside /etc/hy3spark (which the container mounts), handed to the serve script
    # on its stdin.
    env_file = f"HY3SPARK_API_KEY='{key}'\n"
    make_model(hub, MODEL, preset="small", total_size=10**9)
    name = f"{RUN}-head"
    try:
        # Under Docker's init, as every node container runs (the detached engine's parent is PID 1).
        docker("run", "-d", "--init", "--name", name, "--label", LABEL, "--network", RUN, "--ip", ip,
               "--env-file", str(node_env), "-v", f"{etc}:/etc/hy3spark:ro", "-v", f"{logs}:/var/log/hy3spark",
               "-v", f"{hub}:/var/lib/hy3spark/hub:ro", "-v", f"{etc / 'openmpi-hostfile'}:/etc/openmpi-hostfile:ro",
               image, "sleep", "infinity")
        # As the serving role starts the engine: `docker exec -i` with the secrets on stdin; the script detaches.
        docker("exec", "-i", name, "/etc/hy3spark/serve.sh", input=env_file, timeout=30)
        # A second copy inside the container, for start_front's extra fronts only (the test's own launcher).
        docker("exec", "-i", name, "sh", "-c", "umask 077; cat > /tmp/front.env", input=env_file)
        found = Head(name, ip, key, logs / "serve.log")
        deadline = time.monotonic() + 60
        while True:
            try:
                if found.request("GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            log = found.log.read_text() if found.log.exists() else "(no serve log)"
            assert time.monotonic() < deadline, f"/health never answered 200 through the front:\n{log}"
            time.sleep(0.5)
        yield found
    finally:
        docker_runs.remove_leftovers("trtllm-front", LABEL)


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_v1_needs_the_key(head: Head, method: str, path: str, body: dict | None) -> None:
    for offered in (None, "wrong-" + head.key, head.key[:-1], "Bearer"):
        status, answer = head.request(method, path, body, key=offered)
        assert status == 401, (offered, answer)
        assert json.loads(answer)["error"]["code"] == "invalid_api_key" and head.key not in answer.decode()
    status, answer = head.request(method, path, body, key=head.key)
    assert status == 200, answer
    reply = json.loads(answer)
    if path == "/v1/models":
        assert [m["id"] for m in reply["data"]] == [MODEL]
    else:
        assert reply["usage"]["completion_tokens"] == 3


def test_the_scheme_and_spellings_of_v1_are_checked_as_vllm_does(head: Head) -> None:
    conn = http.client.HTTPConnection(head.ip, PORT, timeout=10)
    try:
        conn.request("GET", "/v1/models", headers={"Authorization": f"bearer {head.key}"})  # the scheme: any case
        response = conn.getresponse()
        assert (response.status, json.loads(response.read())["data"][0]["id"]) == (200, MODEL)
    finally:
        conn.close()
    assert head.request("GET", "/v1/models", key=None)[0] == 401
    # Every spelling trtllm-serve's router could take for /v1 needs the key too.
    for spelling in ("/%76%31/models", "//v1/models", "/./v1/models", "/v1"):
        assert head.request("GET", spelling)[0] == 401, spelling


def test_health_and_the_other_routes_outside_v1_are_open(head: Head) -> None:
    assert head.request("GET", "/health") == (200, b"")
    status, answer = head.request("GET", "/version")
    assert status == 200 and json.loads(answer)["version"].endswith("+testdouble")
    assert head.request("GET", "/nothing")[0] == 404  # the engine's own answer, forwarded


def test_a_streamed_chat_arrives_as_the_engines_events(head: Head) -> None:
    words = 50
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stream"}], "max_tokens": words, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection(head.ip, PORT, timeout=60)
    try:
        conn.request("POST", CHAT, body=json.dumps(body),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {head.key}"})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("Transfer-Encoding") == "chunked"
        assert response.getheader("Content-Type").startswith("text/event-stream")
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    finally:
        conn.close()
    assert events[-1] == "[DONE]" and len(events) == 1 + words + 1 + 1  # the role, the words, the usage, [DONE]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["usage"]["completion_tokens"] == words
    assert len("".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]).split()) == words


# The double writes its whole stream at once (it makes the words before the first event), so it cannot show that the
# front passes each event on as it comes. This stand-in engine can: it sends one event every half second.
PACED = """
import sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
class Paced(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in [*(f'{{"n": {i}}}' for i in range(4)), "[DONE]"]:
            data = f"data: {event}\\n\\n".encode()
            self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(0.5)
        self.wfile.write(b"0\\r\\n\\r\\n")
HTTPServer(("127.0.0.1", int(sys.argv[1])), Paced).serve_forever()
"""


def start_front(head: Head, port: int, upstream: int, parent_s: int) -> None:
    """A second front in the head's container, as the serve script starts it (the key in its environment, its
    NAME on the command line), under a parent that lives `parent_s` seconds."""
    docker("exec", "-d", head.name, "bash", "-c",
           "set -a; . /tmp/front.env; set +a; python3 /etc/hy3spark/api-front.py --listen "
           f"0.0.0.0:{port} --upstream 127.0.0.1:{upstream} --key-env HY3SPARK_API_KEY "
           f">>/tmp/front-{port}.log 2>&1 & exec sleep {parent_s}")


def test_each_event_passes_as_the_engine_sends_it(head: Head) -> None:
    docker("exec", "-d", head.name, "python3", "-c", PACED, "18401")
    start_front(head, 18400, 18401, 60)
    deadline = time.monotonic() + 10
    while True:
        try:
            if head_port(head, 18400).request("GET", "/health")[0] == 501:  # the stand-in answers POST only
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, docker("exec", head.name, "cat", "/tmp/front-18400.log").stdout
        time.sleep(0.2)
    conn = http.client.HTTPConnection(head.ip, 18400, timeout=30)
    try:
        start = time.monotonic()
        conn.request("POST", CHAT, body=b"{}", headers={"Authorization": f"Bearer {head.key}"})
        response = conn.getresponse()
        arrived = []
        while line := response.readline():
            if line.startswith(b"data: "):
                arrived.append((round(time.monotonic() - start, 2), line[6:].strip().decode()))
    finally:
        conn.close()
    assert [event for _, event in arrived] == ['{"n": 0}', '{"n": 1}', '{"n": 2}', '{"n": 3}', "[DONE]"]
    # Sent 0.5 s apart: received as sent, the first long before the last (a buffering front sends all at 2 s).
    assert arrived[0][0] < 1.0 and arrived[-1][0] >= 1.9, arrived
    assert all(b[0] - a[0] > 0.3 for a, b in itertools.pairwise(arrived)), arrived


def head_port(head: Head, port: int) -> Head:
    return Head(head.name, head.ip, head.key, head.log, port)


def test_the_front_exits_when_its_parent_does(head: Head) -> None:
    start_front(head, 18402, 18403, 3)
    front = head_port(head, 18402)
    deadline = time.monotonic() + 10
    while True:
        try:
            if front.request("GET", "/health")[0] == 502:  # listening, nothing behind it
                break
        except OSError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while "api-front.py --listen 0.0.0.0:18402" in head.ps():
        assert time.monotonic() < deadline, "the front outlived its parent"
        time.sleep(0.2)
    assert "exited; the API front exits too" in docker("exec", head.name, "cat", "/tmp/front-18402.log").stdout
    with pytest.raises(OSError):
        front.request("GET", "/health", timeout=3)


def test_the_key_is_in_no_command_line_no_inspect_and_no_rank(head: Head) -> None:
    ps = head.ps()
    assert "python3 /etc/hy3spark/api-front.py --listen 0.0.0.0:8355 --upstream 127.0.0.1:8356 --key-env " \
           "HY3SPARK_API_KEY" in ps
    assert "--port 8356 --host 127.0.0.1" in ps, "trtllm-serve behind the front, on loopback"
    assert head.key not in ps
    cmdlines = docker("exec", head.name, "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
    assert "api-front.py" in cmdlines and head.key not in cmdlines
    assert head.key not in docker("inspect", head.name).stdout
    # The serve script unsets the key before it execs mpirun: neither mpirun nor any rank has it.
    pids = docker("exec", head.name, "pgrep", "-f", "mpirun|trtllm").stdout.split()
    assert pids
    for pid in pids:
        environ = docker("exec", head.name, "cat", f"/proc/{pid}/environ", check=False).stdout
        assert "HY3SPARK_API_KEY" not in environ and head.key not in environ, pid
    # trtllm-serve answers on loopback only: from outside the container its port is closed.
    with pytest.raises(OSError):
        http.client.HTTPConnection(head.ip, 8356, timeout=3).request("GET", "/health")


def test_upstream_gone_is_a_502_and_the_front_exits_with_its_launcher(head: Head) -> None:
    """A stop (engine.py's: SIGTERM to the launcher) ends the front too; while the engine is going away the front
    answers 502 in JSON. Last: it stops the engine."""
    front = docker("exec", head.name, "pgrep", "-f", "api-front.py --listen 0.0.0.0:8355").stdout.split()
    mpirun = docker("exec", head.name, "pgrep", "-x", "mpirun").stdout.split()
    assert len(front) == 1 and len(mpirun) == 1
    ppid = docker("exec", head.name, "ps", "-o", "ppid=", "-p", front[0]).stdout.strip()
    assert ppid == mpirun[0], "the serve script execs mpirun: the front's parent is the launcher"
    # The engine gone, the launcher still there: the front says 502, in JSON.
    serve = docker("exec", head.name, "pgrep", "-f", "trtllm_double.serve").stdout.split()
    docker("exec", head.name, "kill", "-STOP", mpirun[0])
    try:
        docker("exec", head.name, "kill", "-KILL", *serve)
        deadline = time.monotonic() + 10
        while (status := head.request("GET", "/health")[0]) != 502:
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        status, answer = head.request("GET", "/v1/models", key=head.key)
        assert status == 502 and json.loads(answer)["error"]["type"] == "upstream_error"
    finally:
        docker("exec", head.name, "kill", "-CONT", mpirun[0])
    docker("exec", head.name, "kill", "-TERM", mpirun[0], check=False)
    deadline = time.monotonic() + 20
    while "api-front.py --listen 0.0.0.0:8355" in head.ps():
        assert time.monotonic() < deadline, head.ps()
        time.sleep(0.2)
    assert "mpirun" not in head.ps()
    assert "the API front exits too" in head.log.read_text()
    with pytest.raises(OSError):
        head.request("GET", "/health", timeout=3)
