"""`vllm serve` for the test double: the startup sequence and its log, the engine on Ray, then the HTTP server.

The sequence follows vLLM 0.23: API server (version, non-default args) -> model config (resolve the model, check
flags against config.json, a configuration vLLM refuses) -> engine core (executor: Ray placement group and workers,
weights check on every node, the KV cache lines vLLM 0.23.0 recorded for this configuration and these per-rank
available bytes, see kv.py) -> API server ("Starting vLLM server on http://HOST:PORT", routes, uvicorn's
"Application startup complete."). A failure exits 1 with vLLM's message; the engine failing prints "EngineCore failed
to start." and the API server's "Engine core initialization failed. See root cause above." A worker that dies while
serving takes the engine down (health 503, then exit 1), as a dead Ray worker does to vLLM.

Environment knobs (all optional; VLLM_* names are copied to the Ray workers like vLLM's own):
``VLLM_DOUBLE_PG_TIMEOUT_S`` (placement group wait, default 20), ``VLLM_DOUBLE_LOAD_DELAY_S`` (pretend weight
loading, default 0), ``VLLM_DOUBLE_HEALTH_INTERVAL_S`` (worker liveness check, default 5),
``VLLM_DOUBLE_LOCAL_GPUS`` (GPUs on this node for the mp/uni executors, default 1),
``VLLM_DOUBLE_DISTRIBUTED_TIMEOUT_S`` (torch's distributed timeout: the native launcher's rendezvous wait, a rank's
wait for the store; default 600; native.py), ``VLLM_DOUBLE_KV_UNRECORDED`` (``skip``: a configuration without a
recorded KV vector starts without KV lines; kv.py), plus the fake GPU (kv.py) and the delays (server.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any

from vllm import __version__
from vllm.double import kv, log, network
from vllm.double.executor import RayExecutor
from vllm.double.model import Model, resolve
from vllm.double.native import Layout, NativeExecutor, distributed_timeout, headless_banner
from vllm.double.server import ServerState, make_server
from vllm.double.worker import RayWorkerWrapper, node_ip

E = log.ENGINE
DEFAULT_MAX_NUM_SEQS = 256


class EngineStartupError(Exception):
    pass


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else default


def fail(exc: BaseException, tag: str | None = log.API) -> int:
    """An uncaught exception in the API server process: Python's traceback, tagged, on stderr; exit 1."""
    import traceback

    text = "".join(traceback.format_exception(exc))
    prefix = f"({tag} pid={os.getpid()}) " if tag else ""
    sys.stdout.flush()
    sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
    sys.stderr.flush()
    return 1


def validate_serve_args(args: argparse.Namespace) -> None:
    """The two checks `vllm serve` runs on the parsed namespace, in vLLM 0.23's order, against the parser names vLLM
    registers (from the option table, vllm/double/serve_args.json): validate_parsed_serve_args
    (--enable-auto-tool-choice needs a tool-call parser), then validate_api_server_args (with
    --enable-auto-tool-choice the tool-call parser must be registered; a reasoning parser named in
    --structured-outputs-config must be). As in vLLM, an unknown --tool-call-parser without --enable-auto-tool-choice
    and an unknown --reasoning-parser pass here (the recorded probes show both). Then what the double refuses."""
    from vllm.double.args import reasoning_parsers, tool_call_parsers

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise TypeError("Error: --enable-auto-tool-choice requires --tool-call-parser")
    tools = tool_call_parsers()
    if args.enable_auto_tool_choice and args.tool_call_parser not in tools:
        raise KeyError(f"invalid tool call parser: {args.tool_call_parser} (chose from {{ {','.join(tools)} }})")
    structured = args.structured_outputs_config  # a dict when given (vLLM: a StructuredOutputsConfig)
    reasoning = structured.get("reasoning_parser") if isinstance(structured, dict) else None
    if reasoning and reasoning not in reasoning_parsers():
        raise KeyError(f"invalid reasoning parser: {reasoning} (chose from {{ {','.join(reasoning_parsers())} }})")
    if args.data_parallel_size != 1:
        raise ValueError("hy3spark TEST DOUBLE: --data-parallel-size other than 1 is not doubled")
    # vLLM's parser takes any string here; its ParallelConfig refuses other names when the engine is configured.
    if args.distributed_executor_backend not in (None, "ray", "mp", "uni", "external_launcher"):
        raise ValueError(
            f"hy3spark TEST DOUBLE: --distributed-executor-backend {args.distributed_executor_backend} is none of "
            "vLLM 0.23's executor backends (ray, mp, uni, external_launcher), which vLLM's ParallelConfig refuses"
        )


def model_checks(args: argparse.Namespace, model: Model) -> int:
    """Config-time checks vLLM makes against config.json; returns the max model len."""
    config = model.config.get("text_config") or model.config
    if model.config.get("auto_map") and not args.trust_remote_code:
        raise ValueError(
            f"The repository {model.tag} contains custom code which must be executed to correctly load the model. "
            f"You can inspect the repository content at https://hf.co/{model.tag} .\n"
            "Please pass the argument `trust_remote_code=True` to allow custom code to be run."
        )
    derived = model.max_position_embeddings or 2048
    max_len = args.max_model_len if args.max_model_len not in (None, -1) else derived
    if max_len > derived and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0") not in ("1", "true", "True"):
        raise ValueError(
            f"User-specified max_model_len ({max_len}) is greater than the derived max_model_len "
            f"(max_position_embeddings={derived} or model_max_length=None in model's config.json). To allow "
            "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN "
            "must be used with extreme caution. If the model uses relative position encoding (RoPE), positions "
            "exceeding derived_max_model_len lead to nan. If the model uses absolute position encoding, positions "
            "exceeding derived_max_model_len will cause a CUDA array out-of-bounds error."
        )
    heads = int(config.get("num_attention_heads") or 1)
    if heads % args.tensor_parallel_size:
        raise ValueError(
            f"Total number of attention heads ({heads}) must be divisible by tensor parallel size "
            f"({args.tensor_parallel_size})."
        )
    layers = int(config.get("num_hidden_layers") or 1)
    if args.pipeline_parallel_size > layers:
        raise ValueError(
            f"Pipeline parallel size ({args.pipeline_parallel_size}) must not exceed the number of hidden layers "
            f"({layers})."
        )
    return int(max_len)


def check_layout(args: argparse.Namespace, world_size: int) -> None:
    """EngineArgs.create_engine_config's checks of --nnodes/--node-rank (vllm/engine/arg_utils.py)."""
    if args.nnodes > 1:
        assert world_size % args.nnodes == 0, f"world_size={world_size} must be divisible by nnodes={args.nnodes}."
        assert args.node_rank < args.nnodes, f"node_rank={args.node_rank} must be less than nnodes={args.nnodes}."


def executor_backend(args: argparse.Namespace, world_size: int) -> str:
    """ParallelConfig.__post_init__: mp by default when the world fits this node (or --nnodes > 1); an error when it
    does not."""
    backend = args.distributed_executor_backend
    if args.nnodes > 1:
        if backend not in (None, "mp", "uni", "external_launcher"):
            raise ValueError(
                "1 validation error for ParallelConfig\n  Value error, nnodes > 1 can only be set when distributed "
                "executor backend is mp, uni or external_launcher. [type=value_error, input_type=ArgsKwargs]"
            )
        backend = backend or "mp"
    if backend is None:
        backend = "uni" if world_size == 1 else "mp"
    local_gpus = int(_env_float("VLLM_DOUBLE_LOCAL_GPUS", 1))
    if backend in ("mp", "uni") and args.nnodes == 1 and world_size > local_gpus:
        raise ValueError(
            "1 validation error for ParallelConfig\n"
            f"  Value error, World size ({world_size}) is larger than the number of available GPUs ({local_gpus}) "
            "in this node. If this is intentional and you are using:\n"
            "- ray, set '--distributed-executor-backend ray'.\n"
            "- multiprocessing, set '--nnodes' appropriately. [type=value_error, input_type=ArgsKwargs]"
        )
    if backend == "external_launcher":
        raise ValueError("hy3spark TEST DOUBLE: --distributed-executor-backend external_launcher is not doubled")
    return backend


class LocalExecutor:
    """The uni executor: every rank runs in this process (also what the in-process tests start, with several ranks).
    Like vLLM's (uniproc_executor.py), it hands its rank ``tcp://<get_ip()>:<get_open_port()>``, where rank 0 serves
    the torch.distributed store on every address."""

    def __init__(self, world_size: int, tp: int, distributed_timeout: float) -> None:
        self.workers = [RayWorkerWrapper(rank) for rank in range(world_size)]
        self.reports: list[dict[str, Any]] = []
        init_method = network.tcp_uri(node_ip(), network.get_open_port(E))
        per_rank = [{"local_rank": rank, "world_size": world_size, "tp": tp, "distributed_init_method": init_method,
                     "distributed_timeout": distributed_timeout} for rank in range(world_size)]  # fmt: skip
        self.call("init_worker", per_rank)

    def call(self, method: str, *args: Any) -> list[Any]:
        return [getattr(worker, method)(*args) for worker in self.workers]

    def init_device(self, gpu_memory_utilization: float) -> None:
        self.call("init_device", gpu_memory_utilization)

    def collect_reports(self) -> list[dict[str, Any]]:
        self.reports = [
            {
                "rank": w.rank,
                "node_ip": None,
                "vllm_host_ip": os.environ.get("VLLM_HOST_IP"),
                "hostname": os.uname().nodename,
                "model_path": getattr(w, "model_path", None),
                "listening": w.listening(),
                "env": {},
                "secret_env_names": [],
            }
            for w in self.workers
        ]
        return self.reports

    def alive(self, timeout: float = 10.0) -> tuple[bool, str | None]:
        return False, None

    def shutdown(self) -> None:
        self.call("close_listeners")


def kv_cache_report(vector: kv.Vector) -> None:
    """What vLLM logged while sizing the KV cache (get_kv_cache_configs), then its error if it raised one."""
    if vector.id != kv.UNRECORDED:
        log.info(
            "kv_cache_utils.py:0",
            f"hy3spark TEST DOUBLE: KV cache outcome recorded from vLLM {kv.table()['vllm_version']} for this "
            f"configuration (vector {vector.id} of {kv.FIXTURE})",
            E,
        )
    for level, message in vector.log:
        where = "kv_cache_utils.py:1734" if message.startswith("Maximum concurrency") else "kv_cache_utils.py:1733"
        log.line(where, message, level, E)
    if vector.error is not None:
        log.info(
            "kv_cache_utils.py:0",
            f"hy3spark TEST DOUBLE: rank {vector.error['rank']} is the first worker whose KV cache fails vLLM's check",
            E,
        )
    vector.raise_error()


def start_engine(
    args: argparse.Namespace, model: Model, max_len: int, backend: str, config: dict[str, Any]
) -> tuple[Any, kv.Vector]:
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    world = tp * pp
    started = time.monotonic()
    served = args.served_model_name or [model.tag]
    log.info(
        "core.py:93",
        f"Initializing a V1 LLM engine (v{__version__}) with config: model={model.tag!r}, "
        f"speculative_config={args.speculative_config}, tokenizer={args.tokenizer or model.tag!r}, "
        f"skip_tokenizer_init=False, tokenizer_mode={args.tokenizer_mode}, revision={args.revision}, "
        f"trust_remote_code={args.trust_remote_code}, dtype={args.dtype}, max_seq_len={max_len}, "
        f"download_dir={args.download_dir}, load_format={args.load_format}, tensor_parallel_size={tp}, "
        f"pipeline_parallel_size={pp}, data_parallel_size=1, quantization={args.quantization}, "
        f"enforce_eager={args.enforce_eager}, kv_cache_dtype={args.kv_cache_dtype}, device_config=cuda, "
        f"seed={args.seed}, served_model_name={served[0]}, enable_prefix_caching={args.enable_prefix_caching}",
        E,
    )
    memory = kv.Memory(
        gpu_memory_utilization=args.gpu_memory_utilization,
        weights_per_rank=model.weight_bytes() // world,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enforce_eager=bool(args.enforce_eager),
    )
    if backend == "mp":
        if args.node_rank > 0:  # a follower node without --headless: vLLM's engine core calls its executor anyway
            raise AssertionError("collective_rpc should not be called on follower node")
        executor: Any = NativeExecutor(native_layout(args, world), native_job(args, model, memory))
    else:
        if backend == "ray":
            executor = RayExecutor(world, tp, distributed_timeout(args))
            executor.initialize_cluster()
            executor.init_workers()
        else:
            executor = LocalExecutor(world, tp, distributed_timeout(args))
        executor.init_device(args.gpu_memory_utilization)
        load_started = time.monotonic()
        executor.call("load_model", model.tag, args.revision, _env_float("VLLM_DOUBLE_LOAD_DELAY_S", 0))
        executor.call("log_model_loading", memory.weights_per_rank, time.monotonic() - load_started)
    available = executor.call("determine_available_memory", memory)
    try:
        vector = kv.lookup(config, available)
    except kv.NoVector as missing:
        vector = kv.unrecorded(missing)
    kv_cache_report(vector)
    executor.collect_reports()
    log.info(
        "core.py:210",
        f"init engine (profile, create kv cache, warmup model) took {time.monotonic() - started:.2f} seconds",
        E,
    )
    return executor, vector


def native_layout(args: argparse.Namespace, world: int) -> Layout:
    return Layout(
        world_size=world,
        tp=args.tensor_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        timeout=distributed_timeout(args),
    )


def native_job(args: argparse.Namespace, model: Model, memory: kv.Memory) -> dict[str, Any]:
    return {
        "model_tag": model.tag,
        "revision": args.revision,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "weights_per_rank": memory.weights_per_rank,
        "load_delay_s": _env_float("VLLM_DOUBLE_LOAD_DELAY_S", 0),
    }


def check_reasoning_parser(args: argparse.Namespace, model: Model) -> None:
    """VllmConfig.__post_init__ -> ReasoningConfig.initialize_token_ids builds the --reasoning-parser once with the
    model's tokenizer: a parser that cannot find its tokens fails the startup (vllm/config/reasoning.py)."""
    if not args.reasoning_parser:
        return
    from vllm.reasoning import get_reasoning_parser

    parser = get_reasoning_parser(args.reasoning_parser)
    if parser is not None:  # a name vLLM registers that the double has no parser for
        parser(model.tokenizer)


def engine_config(args: argparse.Namespace, tag: str | None) -> tuple[Model, int, str, dict[str, Any]]:
    """What EngineArgs.create_engine_config does before an engine starts: model config, parallel config (layout
    and executor), the scheduler's batch size, the reasoning parser."""
    validate_serve_args(args)
    model = resolve(args.model_tag, args.revision)
    log.info("model.py:547", f"Resolved architecture: {model.architecture}", tag)
    max_len = model_checks(args, model)
    log.info("model.py:1510", f"Using max model len {max_len}", tag)
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    check_layout(args, world)
    backend = executor_backend(args, world)
    kv_config = kv.engine_config(model.config, args, max_len)
    kv.check_config(kv_config)
    log.info("scheduler.py:231", f"Chunked prefill is enabled with max_num_batched_tokens="
             f"{kv_config['max_num_batched_tokens']}.", tag)  # fmt: skip
    if args.enforce_eager:
        log.info("vllm.py:590", "Cudagraph is disabled under eager mode", tag)
    check_reasoning_parser(args, model)
    return model, max_len, backend, kv_config


def run_headless(args: argparse.Namespace) -> int:
    """`vllm serve ... --headless`: no API server, no port; this node's share of the ranks
    (vllm/entrypoints/cli/serve.py run_headless, the node_rank_within_dp > 0 branch). Returns when a local rank
    dies (exit 0, as vLLM) or on SIGTERM/SIGINT."""
    if args.api_server_count is not None and args.api_server_count > 0:
        return fail(ValueError(
            f"--api-server-count={args.api_server_count} cannot be used with --headless (no API servers are started "
            "in headless mode)."
        ), None)  # fmt: skip
    log.warning("double.py:1", "hy3spark TEST DOUBLE of vLLM: no GPU is used and no weights are loaded. Not for "
                "production.", None)  # fmt: skip
    args.model_tag = args.model_tag or "Qwen/Qwen3-0.6B"
    try:
        model, _max_len, backend, _kv_config = engine_config(args, None)
        world = args.tensor_parallel_size * args.pipeline_parallel_size
        if backend != "mp" or args.node_rank == 0:
            raise ValueError(
                "hy3spark TEST DOUBLE: --headless is doubled only for the multi-node mp executor's other nodes "
                "(--nnodes N --node-rank K with K > 0), not vLLM's headless data-parallel engines"
            )
        layout = native_layout(args, world)
        headless_banner(layout)
        memory = kv.Memory(
            gpu_memory_utilization=args.gpu_memory_utilization,
            weights_per_rank=model.weight_bytes() // world,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            enforce_eager=bool(args.enforce_eager),
        )
        executor = NativeExecutor(layout, native_job(args, model, memory))
    except Exception as exc:
        return fail(exc, None)

    def stop(_signum: int, _frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        executor.start_monitor(inline=True)
    except SystemExit:
        pass
    finally:
        executor.shutdown()
    return 0


def engine_failed(exc: BaseException) -> int:
    log.exception("core.py:1023", "EngineCore failed to start.", exc, E)
    return fail(RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}"))


def monitor(executor: Any, state: ServerState, server: Any, outcome: dict[str, int]) -> None:
    interval = _env_float("VLLM_DOUBLE_HEALTH_INTERVAL_S", 5)
    timeouts = 0
    while state.dead is None:
        time.sleep(interval)
        fatal, problem = executor.alive(timeout=10)
        if problem is None:
            timeouts = 0
            continue
        timeouts += 1
        if not fatal and timeouts < 3:
            continue
        state.dead = problem
        log.error("core.py:1101", "EngineCore encountered a fatal error.", E)
        log.error("core.py:1101", problem, E)
        log.error("async_llm.py:525", "AsyncLLM output_handler failed.")
        log.error(
            "async_llm.py:525",
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for "
            "the root cause.",
        )
        # Let /health answer 503 for a moment, as vLLM does while it shuts down, then stop.
        time.sleep(_env_float("VLLM_DOUBLE_DEAD_GRACE_S", 2))
        log.info("launcher.py:110", "Shutting down FastAPI HTTP server.")
        outcome["code"] = 1
        server.shutdown()
        return


def run_serve(args: argparse.Namespace, non_default: dict[str, Any]) -> int:
    log.info("api_server.py:1884", f"vLLM API server version {__version__}")
    log.warning(
        "double.py:1",
        "hy3spark TEST DOUBLE of vLLM: no GPU is used and no weights are loaded; answers are deterministic text. "
        "Not for production.",
    )
    log.info("utils.py:253", f"non-default args: {non_default}")
    args.model_tag = args.model_tag or "Qwen/Qwen3-0.6B"
    try:
        model, max_len, backend, kv_config = engine_config(args, log.API)
        max_num_seqs = args.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        api_keys = list(args.api_key or ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else []))
        host = args.host or "0.0.0.0"
        server = make_server(
            host,
            args.port,
            ServerState(
                served_names=args.served_model_name or [args.model_tag],
                model_root=args.model_tag,
                max_model_len=max_len,
                max_num_seqs=max_num_seqs,
                api_keys=api_keys,
                tokenizer=model.tokenizer,
                enable_auto_tool_choice=bool(args.enable_auto_tool_choice),
                access_log=not args.disable_uvicorn_access_log and args.uvicorn_log_level in ("info", "debug", "trace"),
            ),
        )
    except Exception as exc:  # config errors: raised in the API server before the engine starts
        return fail(exc)

    state: ServerState = server.RequestHandlerClass.state  # type: ignore[attr-defined]
    from vllm.reasoning import get_reasoning_parser
    from vllm.tool_parsers import get_tool_parser

    try:
        state.tool_parser = get_tool_parser(args.tool_call_parser) if args.tool_call_parser else None
        state.reasoning_parser = get_reasoning_parser(args.reasoning_parser) if args.reasoning_parser else None
    except Exception as exc:  # a broken (badly patched) parser module fails the import
        server.server_close()
        return fail(exc)

    try:
        executor, vector = start_engine(args, model, max_len, backend, kv_config)
    except Exception as exc:
        server.server_close()
        return engine_failed(exc)
    if isinstance(executor, NativeExecutor):
        executor.start_monitor()
    state.workers = executor.reports
    state.max_model_len = vector.max_model_len or max_len  # --max-model-len -1: what vLLM's auto-fit chose

    outcome = {"code": 0}

    def stop(signum: int, _frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    log.info(
        "loggers.py:147",
        f"Engine 000: vllm cache_config_info with initialization after num_gpu_blocks is: {vector.num_blocks}",
    )
    log.info("api_server.py:1632", "Supported tasks: ['generate']")
    if args.enable_auto_tool_choice:
        log.info("serving_chat.py:137", '"auto" tool choice has been enabled.')
    log.info("api_server.py:1949", f"Starting vLLM server on http://{host}:{args.port}")
    log.info("launcher.py:37", "Available routes are:")
    for route, methods in (
        ("/health", "GET"),
        ("/version", "GET"),
        ("/v1/models", "GET"),
        ("/v1/chat/completions", "POST"),
        ("/v1/completions", "POST"),
    ):
        log.info("launcher.py:46", f"Route: {route}, Methods: {methods}")
    server.server_activate()
    log.uvicorn(f"Started server process [{os.getpid()}]")
    log.uvicorn("Waiting for application startup.")
    log.uvicorn("Application startup complete.")
    threading.Thread(target=monitor, args=(executor, state, server, outcome), daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        log.uvicorn("Shutting down")
        log.uvicorn("Waiting for application shutdown.")
        log.uvicorn("Application shutdown complete.")
        log.uvicorn(f"Finished server process [{os.getpid()}]")
        server.server_close()
        if outcome["code"] == 0:
            executor.shutdown()
    if outcome["code"]:
        # The engine is dead: Ray's client threads may still wait on the lost node, so do not let them hold the exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(outcome["code"])
    return outcome["code"]
