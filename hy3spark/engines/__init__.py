"""Inference engines as data: each turns the spec's serving section into a launch command.

vLLM is the first; TensorRT-LLM (`trtllm-serve`, MPI-launched) plugs in here as another class with the same
surface, so roles and templates read `hy3spark.serving.argv` and never assume which engine produced it.
"""

from __future__ import annotations

from typing import Protocol

from hy3spark.engines.vllm import VllmEngine
from hy3spark.spec import Spec


class Engine(Protocol):
    name: str

    def serve_argv(self) -> list[str]: ...

    def secret_env(self) -> dict[str, str]: ...


_ENGINES: dict[str, type[VllmEngine]] = {"vllm": VllmEngine}


def engine_for(spec: Spec) -> Engine:
    return _ENGINES[spec.serving.engine](spec)
