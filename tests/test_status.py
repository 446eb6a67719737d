"""`hy3spark status` output for what playbooks/status.yml reports (the whole path runs in tests/test_operator_cli.py
against a live cluster): here the engine's unit on the host, when it runs from an operator's engine venv."""

from __future__ import annotations

import io

from rich.console import Console

from hy3spark.status import parse_units, print_status


def summary(node: dict) -> dict:
    return {"cluster": "desk", "nodes": {"desktop": {"role": "head", "image_id": "", "mem_available_bytes": 1 << 34,
                                                     "versions": {"vllm": "0.23.0"}, **node}},
            "ray": {"nodes": 0, "gpus_total": 0.0, "gpus_used": 0.0},
            "endpoint": {"url": "http://127.0.0.1:8888", "health": 200, "models": ["m"]},
            "kv_lines": [], "transport": None, "last_run": None}


def printed(node: dict) -> str:
    out = io.StringIO()
    print_status(summary(node), Console(file=out, force_terminal=False))
    return out.getvalue()


def test_the_engine_unit_on_the_host_is_listed_with_its_state_and_venv() -> None:
    unit = {"unit": "hy3spark-engine.service", "ActiveState": "active", "MainPID": "4242", "venv": "/opt/vllm"}
    line = printed({"containers": [], "engine_unit": unit}).splitlines()[1]
    assert line.startswith("desktop  head  containers hy3spark-engine.service (active, venv /opt/vllm)  units none  "
                           "image absent")


def test_a_unit_left_without_the_venv_option_and_a_container_are_both_listed() -> None:
    unit = {"unit": "hy3spark-engine.service", "ActiveState": "failed", "venv": None}
    containers = [{"Names": "qwen32-head", "State": "running"}]
    line = printed({"containers": containers, "engine_unit": unit}).splitlines()[1]
    assert "containers qwen32-head (running), hy3spark-engine.service (failed)  units none  image" in line


def test_no_unit_and_no_container_is_none() -> None:
    assert "containers none  units none  image absent" in printed({"containers": [], "engine_unit": None})


def test_the_units_and_the_supervisor_are_listed() -> None:
    """docs/restarts.md: each node's boot unit and the head's supervisor, from `systemctl show`, and what the
    supervisor did last (here: it gave up, with its cause)."""
    shown = {"hy3spark-node.service": "LoadState=loaded\nActiveState=active\nSubState=running\n"
                                      "UnitFileState=enabled\nNRestarts=2",
             "hy3spark-supervisor.service": "LoadState=loaded\nActiveState=inactive\nSubState=dead\n"
                                            "UnitFileState=enabled\nNRestarts=0",
             "hy3spark-gone.service": "LoadState=not-found\nActiveState=inactive"}
    data = summary({"containers": [], "engine_unit": None, "units": parse_units(shown)})
    data["supervisor"] = {"state": "gave-up", "since": "2026-12-03T06:00:00+00:00", "restarts": 1, "starts": 2,
                          "cause": "gave up after 3 starts in 15 min: vllm: error: unrecognized arguments: --x"}
    out = io.StringIO()
    print_status(data, Console(file=out, force_terminal=False))
    text = out.getvalue()
    assert ("units hy3spark-node.service active, enabled, 2 restarts; hy3spark-supervisor.service inactive, "
            "enabled  image") in text, text
    assert "hy3spark-gone" not in text
    assert ("supervisor: gave up after 3 starts in 15 min: vllm: error: unrecognized arguments: --x (since "
            "2026-12-03T06:00:00+00:00; 1 restart(s), 2 start(s))") in text, text
