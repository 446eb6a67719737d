"""Inference engines as data: everything that differs between engines is answered here, once.

An engine turns the spec's serving section (its own union member, spec.VllmServing, ...) into:
- the launch command on the head (`serve_argv`), what each node runs (`node_argv`: nothing on a Ray worker) and which
  launcher joins the nodes (`launcher`: ray, mpi or the engine's own multi-node mode, `native`);
- its per-node environment, laid out around the settings every engine shares (`node_env`);
- the secrets it reads on the head (`secret_env`);
- how its processes are recognised (`process`) and which log lines say what its KV cache holds (`log_lines`);
- which of `serving.extra_args` its own parser would take as an option the spec leaves open (`check_extra_args`);
- optionally, the content of its own options file (`options`: TensorRT-LLM's extra LLM API options), rendered to
  hy3spark.paths.engine_options; an engine without one has no such method.
- optionally, hy3spark's API front before it (`front`: TensorRT-LLM's, which checks no API key itself), started by
  the serve script; an engine that checks its key itself has no such method.
build_context() publishes all of it as `hy3spark.engine` and `hy3spark.serving`, so roles and templates never
assume which engine produced them. docs/engines.md is the checklist for adding one.
"""

from __future__ import annotations

from typing import Any, Protocol

from hy3spark.engines.trtllm import TrtllmEngine
from hy3spark.engines.vllm import VllmEngine
from hy3spark.spec import Node, Spec


class Engine(Protocol):
    name: str
    launchers: tuple[str, ...]  # the launchers it can run under; the spec chooses one (`launcher`)
    launcher: str
    secret_names: tuple[str, ...]  # every variable secret_env() may name

    def serve_argv(self) -> list[str]: ...

    def node_argv(self, index: int) -> list[str]: ...

    def secret_env(self) -> dict[str, str]: ...

    def node_env(self, node: Node, common: dict[str, str]) -> dict[str, str]: ...

    def process(self) -> dict[str, str]: ...

    @staticmethod
    def check_extra_args(args: list[str]) -> list[tuple[int, str]]: ...

    def log_lines(self) -> dict[str, str]: ...


ENGINES: dict[str, type[VllmEngine] | type[TrtllmEngine]] = {"vllm": VllmEngine, "trtllm": TrtllmEngine}


# Every variable an engine may read a secret from (kept off the workers and out of every rendered file).
SECRET_NAMES = frozenset(name for engine in ENGINES.values() for name in engine.secret_names)


def engine_for(spec: Spec) -> Engine:
    return ENGINES[spec.serving.engine](spec)


def engine_options(engine: Engine) -> dict[str, Any] | None:
    """The engine's own options file, or None for an engine that reads none (an optional answer: vLLM has none)."""
    options = getattr(engine, "options", None)
    return options() if options is not None else None


def engine_front(engine: Engine) -> dict[str, Any] | None:
    """hy3spark's API front for the engine (argv, key_env, engine_port), or None: an engine that checks its key
    itself has no `front` (an optional answer: vLLM has none), and TensorRT-LLM's is None without a key."""
    front = getattr(engine, "front", None)
    return front() if front is not None else None
