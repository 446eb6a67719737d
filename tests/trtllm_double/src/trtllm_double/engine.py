"""What each rank does when the LLM is built: find the model on its node, "load" its shard, size the KV cache, join
the NCCL communicator, and its share of every generation step.

The arithmetic is the double's own (TensorRT-LLM's memory profiling needs a GPU): a rank's GPU memory
(TRTLLM_DOUBLE_GPU_MEMORY_GIB, default 119.7, what a GB10 reports) less its share of the weights (the safetensors
index's total_size / (tp * pp)) and 2 GiB of activations, times kv_cache_config.free_gpu_memory_fraction, in
tokens of 2 bytes (1 with kv_cache_config.dtype fp8/nvfp4) x K and V x layers/pp x KV heads/tp x head_dim, rounded
down to whole blocks of tokens_per_block (32). The lines are TensorRT-LLM's C++ runtime lines.
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import Any

from . import log, nccl
from .model import Model, ModelError, resolve

GIB = 2**30
# A fault a test can plant on one node (the container's own file: a rank started over SSH does not see the
# container's environment) or pass to every rank (mpirun -x TRTLLM_DOUBLE_DIE_AT_START=RANK[,RANK]).
DIE_FILE = "/run/trtllm-double/die-at-start"
WORDS = ("spark", "fabric", "tensor", "rank", "token", "cache", "kernel", "node", "stream", "batch", "layer",
         "expert", "shard", "ring", "block", "prefill", "decode", "mesh", "lane", "queue")


def _bytes_per_token(model: Model, args: dict[str, Any]) -> int:
    cfg = model.config.get("text_config", model.config)
    tp, pp = args["tensor_parallel_size"], args["pipeline_parallel_size"]
    heads = int(cfg.get("num_attention_heads", 32))
    layers = int(cfg.get("num_hidden_layers", 32))
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 4096)) // heads)
    width = 1 if (args.get("kv_cache_config") or {}).get("dtype") in ("fp8", "nvfp4") else 2
    return 2 * max(1, layers // pp) * max(1, kv_heads // tp) * head_dim * width


def kv_tokens(model: Model, args: dict[str, Any]) -> int:
    tp, pp = args["tensor_parallel_size"], args["pipeline_parallel_size"]
    kv = args.get("kv_cache_config") or {}
    fraction = kv.get("free_gpu_memory_fraction")
    fraction = 0.9 if fraction is None else float(fraction)
    gpu = float(os.environ.get("TRTLLM_DOUBLE_GPU_MEMORY_GIB", "119.7")) * GIB
    weights = model.total_size / (tp * pp)
    free = gpu - weights - 2 * GIB
    if free <= 0:
        raise RuntimeError(f"[TensorRT-LLM][ERROR] CUDA runtime error in cudaMalloc: out of memory (the weights' "
                           f"share, {weights / GIB:.2f} GiB, does not fit in {gpu / GIB:.2f} GiB)")
    block = int(kv.get("tokens_per_block") or 32)
    tokens = int(free * fraction // _bytes_per_token(model, args)) // block * block
    if kv.get("max_tokens"):
        tokens = min(tokens, int(kv["max_tokens"]))
    return tokens


def load(rank: int, world: int, nodes: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank's part of building the LLM; the reply gathered on rank 0 (an "error" key when it failed)."""
    host = socket.gethostname()
    args = spec["llm_args"]
    log.cpp("INFO", f"MPI size: {world}, MPI local size: 1, rank: {rank}")
    log.cpp("INFO", f"Rank {rank} is using GPU 0")
    die_at_start(rank, host)
    try:
        model = resolve(spec["model"], spec.get("revision"))
        log.log("I", f"Loading {model.name} from {model.path} on {host}", rank=rank)
        nccl.emit(rank, world, nodes)
        tokens = kv_tokens(model, args)
    except (ModelError, RuntimeError, ValueError, OSError) as err:
        log.log("E", f"{type(err).__name__}: {err}", rank=rank)
        return {"rank": rank, "host": host, "error": f"rank {rank} on {host}: {err}"}
    block = int((args.get("kv_cache_config") or {}).get("tokens_per_block") or 32)
    gib = tokens * _bytes_per_token(model, args) / GIB
    log.cpp("INFO", f"Number of tokens per block: {block}.")
    log.cpp("INFO", f"[MemUsageChange] Allocated {gib:.2f} GiB for max tokens in paged KV cache ({tokens}).")
    cfg = model.config.get("text_config", model.config)
    return {"rank": rank, "host": host, "kv_tokens": tokens, "model": model.name,
            "max_position_embeddings": cfg.get("max_position_embeddings")}


def die_at_start(rank: int, host: str) -> None:
    """The planted fault: this rank dies while loading, abruptly (no MPI_Abort, no cleanup), as a crashed GPU worker
    does; mpirun then ends the whole job."""
    ranks = os.environ.get("TRTLLM_DOUBLE_DIE_AT_START", "")
    if os.path.exists(DIE_FILE) or str(rank) in (r.strip() for r in ranks.split(",")):
        why = DIE_FILE if os.path.exists(DIE_FILE) else f"TRTLLM_DOUBLE_DIE_AT_START={ranks}"
        log.log("E", f"hy3spark TEST DOUBLE: rank {rank} on {host} dies at start ({why})", rank=rank)
        os._exit(134)


def shard(seed: str, count: int, rank: int, world: int) -> dict[int, str]:
    """This rank's words of a generation: positions i with i % world == rank (the text does not depend on world)."""
    return {i: word(seed, i) for i in range(rank, count, world)}


def word(seed: str, index: int) -> str:
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return WORDS[digest[0] % len(WORDS)]
