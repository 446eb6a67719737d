"""The extra LLM API options file (`--extra_llm_api_options` / `--config`), validated as TorchLlmArgs would.

trtllm-serve merges the YAML's top-level keys over its own arguments (`update_llm_args_with_extra_dict`) and builds
the LLM from the result; TensorRT-LLM's argument models are pydantic models that forbid unknown keys, so a
misspelt key fails the start with pydantic's "Extra inputs are not permitted". The double knows the top-level keys
and the two nested sections hy3spark writes (`kv_cache_config`, `cuda_graph_config`) by name and type; the key
lists are hand-written from TensorRT-LLM's LLM API reference (llm_args.py), not extracted, and cover the common
fields rather than every one (README: what the double does not imitate).
"""

from __future__ import annotations

from typing import Any

import yaml

# Top-level fields of TorchLlmArgs (with BaseLlmArgs): the common ones.
TOP_LEVEL = frozenset({
    "model", "tokenizer", "tokenizer_mode", "custom_tokenizer", "skip_tokenizer_init", "trust_remote_code",
    "tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size", "gpus_per_node",
    "moe_cluster_parallel_size", "moe_tensor_parallel_size", "moe_expert_parallel_size", "enable_attention_dp",
    "cp_config", "load_format", "enable_lora", "lora_config", "kv_cache_config", "enable_chunked_prefill",
    "guided_decoding_backend", "batched_logits_processor", "iter_stats_max_iterations",
    "request_stats_max_iterations", "peft_cache_config", "scheduler_config", "cache_transceiver_config",
    "speculative_config", "max_batch_size", "max_input_len", "max_seq_len", "max_beam_width", "max_num_tokens",
    "gather_generation_logits", "num_postprocess_workers", "postprocess_tokenizer_dir", "reasoning_parser",
    "garbage_collection_gen0_threshold", "backend", "build_config", "revision", "dtype", "return_perf_metrics",
    "perf_metrics_max_requests", "otlp_traces_endpoint", "fail_fast_on_attention_window_too_large",
    "cuda_graph_config", "attn_backend", "moe_config", "sampler_type", "disable_overlap_scheduler",
    "enable_iter_perf_stats", "enable_iter_req_stats", "print_iter_log", "torch_compile_config",
    "enable_autotuner", "enable_layerwise_nvtx_marker", "checkpoint_loader", "checkpoint_format",
    "kv_connector_config", "stream_interval", "force_dynamic_quantization", "allreduce_strategy",
    "mm_encoder_only", "batch_wait_timeout_ms", "batch_wait_timeout_iters", "batch_wait_max_tokens_ratio",
    "enable_min_latency", "use_cuda_graph", "mpi_session", "disagg_cluster", "ray_worker_extension_cls",
    "orchestrator_type", "sparse_attention_config", "decoding_config", "quant_config", "calib_config",
})
FLOAT, BOOL, INT, STR, LIST = "float", "bool", "int", "str", "list"
KV_CACHE_CONFIG = {
    "enable_block_reuse": BOOL, "max_tokens": INT, "max_attention_window": LIST, "sink_token_length": INT,
    "free_gpu_memory_fraction": FLOAT, "host_cache_size": INT, "onboard_blocks": BOOL,
    "cross_kv_cache_fraction": FLOAT, "secondary_offload_min_priority": INT, "event_buffer_max_size": INT,
    "attention_dp_events_gather_period_ms": INT, "enable_partial_reuse": BOOL, "copy_on_partial_reuse": BOOL,
    "use_uvm": BOOL, "max_gpu_total_bytes": INT, "dtype": STR, "mamba_ssm_cache_dtype": STR,
    "tokens_per_block": INT,
}
CUDA_GRAPH_CONFIG = {"batch_sizes": LIST, "max_batch_size": INT, "enable_padding": BOOL}
SCALARS = {
    "print_iter_log": BOOL, "enable_attention_dp": BOOL, "disable_overlap_scheduler": BOOL,
    "enable_chunked_prefill": BOOL, "trust_remote_code": BOOL, "enable_iter_perf_stats": BOOL,
    "max_batch_size": INT, "max_num_tokens": INT, "max_seq_len": INT, "max_beam_width": INT,
    "tensor_parallel_size": INT, "pipeline_parallel_size": INT, "moe_expert_parallel_size": INT,
    "stream_interval": INT,
}
KV_DTYPES = ("auto", "fp8", "nvfp4")


class OptionsError(Exception):
    """pydantic's ValidationError as TensorRT-LLM lets it through: the start fails, exit 1."""


def _type_ok(kind: str, value: Any) -> bool:
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == FLOAT:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == LIST:
        return isinstance(value, list)
    return isinstance(value, str)


_WORDS = {BOOL: "a valid boolean", INT: "a valid integer", FLOAT: "a valid number", LIST: "a valid list",
          STR: "a valid string"}
_PYDANTIC = {BOOL: "bool_type", INT: "int_type", FLOAT: "float_type", LIST: "list_type", STR: "string_type"}


def _problem(where: str, message: str, kind: str, value: Any) -> str:
    return f"{where}\n  {message} [type={kind}, input_value={value!r}, input_type={type(value).__name__}]"


def validate(extra: Any) -> list[str]:
    """pydantic-style problems of an options mapping, each "field.path\\n  message [type=...]"; [] when valid."""
    if extra is None:
        return []
    if not isinstance(extra, dict):
        return [_problem("(root)", "Input should be a valid dictionary", "dict_type", extra)]
    problems = []
    for key, value in extra.items():
        if key not in TOP_LEVEL:
            problems.append(_problem(str(key), "Extra inputs are not permitted", "extra_forbidden", value))
        elif key in SCALARS and not _type_ok(SCALARS[key], value):
            kind = SCALARS[key]
            problems.append(_problem(key, f"Input should be {_WORDS[kind]}", _PYDANTIC[kind], value))
    for section, fields in (("kv_cache_config", KV_CACHE_CONFIG), ("cuda_graph_config", CUDA_GRAPH_CONFIG)):
        value = extra.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            problems.append(_problem(section, "Input should be a valid dictionary", "dict_type", value))
            continue
        for key, item in value.items():
            where = f"{section}.{key}"
            if key not in fields:
                problems.append(_problem(where, "Extra inputs are not permitted", "extra_forbidden", item))
            elif item is not None and not _type_ok(fields[key], item):
                kind = fields[key]
                problems.append(_problem(where, f"Input should be {_WORDS[kind]}", _PYDANTIC[kind], item))
    fraction = (extra.get("kv_cache_config") or {}).get("free_gpu_memory_fraction") \
        if isinstance(extra.get("kv_cache_config"), dict) else None
    if isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and not 0 <= fraction <= 1:
        problems.append(_problem("kv_cache_config.free_gpu_memory_fraction",
                                 "Value error, kv_cache_config.free_gpu_memory_fraction must be a float between 0 "
                                 "and 1", "value_error", fraction))
    dtype = (extra.get("kv_cache_config") or {}).get("dtype") if isinstance(extra.get("kv_cache_config"), dict) \
        else None
    if isinstance(dtype, str) and dtype not in KV_DTYPES:
        problems.append(_problem("kv_cache_config.dtype", f"Input should be {', '.join(map(repr, KV_DTYPES))}",
                                 "literal_error", dtype))
    return problems


def load(path: str) -> dict[str, Any]:
    """Read the file as trtllm-serve does (yaml.safe_load) and validate it; OptionsError names every problem."""
    with open(path) as handle:
        extra = yaml.safe_load(handle)
    problems = validate(extra)
    if problems:
        count = len(problems)
        raise OptionsError(
            f"{count} validation error{'s' if count > 1 else ''} for TorchLlmArgs\n" + "\n".join(problems))
    return extra or {}


def merged(args: dict[str, Any], extra: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The LLM arguments trtllm-serve ends with, and the sections the file replaced: the flags first, then every
    top-level key of the file over them (`update_llm_args_with_extra_dict`: a config section of the file replaces
    the flags' whole section, so `kv_cache_config` without `free_gpu_memory_fraction` means the default 0.9)."""
    out = {
        "tensor_parallel_size": args["tensor_parallel_size"],
        "pipeline_parallel_size": args["pipeline_parallel_size"],
        "max_batch_size": args["max_batch_size"],
        "max_num_tokens": args["max_num_tokens"],
        "max_seq_len": args["max_seq_len"],
        "backend": args["backend"],
        "trust_remote_code": args["trust_remote_code"],
        "kv_cache_config": {"free_gpu_memory_fraction": args["free_gpu_memory_fraction"]},
        "print_iter_log": False,
    }
    replaced = [key for key, value in extra.items() if isinstance(value, dict) and key.endswith("_config")]
    return out | extra, replaced
