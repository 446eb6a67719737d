#!/usr/bin/env python3
"""Write a tiny synthetic model into a Hugging Face hub cache, in the hub's real layout, for the vLLM test double.

    models--ORG--NAME/blobs/<etag>                      file contents (git blob sha1, or sha256 for *.safetensors)
    models--ORG--NAME/snapshots/<commit>/<file>         -> ../../blobs/<etag>  (relative symlinks)
    models--ORG--NAME/refs/main                         <commit>

huggingface_hub's ``snapshot_download(repo, revision=<commit or "main">, local_files_only=True)`` resolves it, as
vLLM does in offline mode. The shapes are real (preset ``hy3``: Hy3's 80 layers + 1 MTP layer, 8 KV heads,
head_dim 128; ``gpt-oss``: gpt-oss-120b's 36 layers alternating sliding-window and full attention;
``qwen3-32b``: Qwen3-32B-AWQ's 64 layers, 8 KV heads; ``small``: a 4-layer toy), the weights are a few bytes per
shard, and the safetensors index carries the checkpoint size of hy3spark's profile for that model
(``--total-size``; 181 GB for hy3, 65.3 GB for gpt-oss, 19.3 GB for qwen3-32b). The double prints the
KV cache lines vLLM 0.23.0 recorded for a configuration (src/vllm/double/kv.py), and with those sizes and the fake
GPU's defaults the profiles' own configurations land on vLLM's profile vectors (Hy3 TP2 + MTP, fp8 KV:
``hy3-profile-gb10-nvml-unsupported``; gpt-oss-120b TP1: ``gptoss120b-profile-gb10-nvml-unsupported``). vLLM has no
vector for the ``small`` toy, nor for ``qwen3-32b``: the double refuses to
start an engine on them (fine for tests that only need a model on disk) unless ``VLLM_DOUBLE_KV_UNRECORDED=skip``
lets it serve without KV cache lines.
The tokenizer config carries Hy3's suffixed special tokens (``<tool_calls:opensource>`` ...) and ``token_suffix``
unless ``--bare-tokens`` is given.

    python tests/engine_double/make_model.py --cache /var/lib/hy3spark/hub --repo kodelow/Hy3-NVFP4-W4A16

prints the commit sha (pin it as the spec's model.revision).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

PRESETS = {
    "hy3": {
        "architectures": ["HYV3ForCausalLM"],
        "model_type": "hy_v3",
        "auto_map": {
            "AutoConfig": "configuration_hy_v3.HYV3Config",
            "AutoModelForCausalLM": "modeling_hy_v3.HYV3ForCausalLM",
        },
        "hidden_size": 7168,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 262144,
        "torch_dtype": "bfloat16",
        "vocab_size": 120832,
    },
    "gpt-oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
        "vocab_size": 201088,
    },
    # Qwen/Qwen3-32B-AWQ's config.json (the two-card desktop profile qwen3-32b-awq-two-card): 64 layers, 64
    # attention heads, 8 KV heads, head_dim 128, 40960 positions, float16 around the 4-bit AWQ weights.
    "qwen3-32b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "torch_dtype": "float16",
        "vocab_size": 151936,
        "quantization_config": {
            "bits": 4,
            "group_size": 128,
            "quant_method": "awq",
            "version": "gemm",
            "zero_point": True,
        },
    },
    "small": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
        "vocab_size": 32000,
    },
}
# The profiles' model.size_bytes (hy3spark/profiles/): with the fake GPU's defaults they give the vectors' memory.
DEFAULT_TOTAL_SIZE = {
    "hy3": 181_000_000_000,
    "gpt-oss": 65_300_000_000,
    "qwen3-32b": 19_300_000_000,
    "small": 100_000_000,
}
SPECIAL = ("think", "tool_calls", "tool_call", "tool_sep", "arg_key", "arg_value")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def model_files(preset: str, total_size: int, shards: int, suffix: str | None) -> dict[str, bytes]:
    config = dict(PRESETS[preset])
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    weight_map = {f"model.layers.{i}.weight": names[i % shards] for i in range(config["num_hidden_layers"])}
    tokens: dict[str, dict[str, object]] = {}
    next_id = config["vocab_size"] - 2 * len(SPECIAL)
    for name in SPECIAL:
        for text in (f"<{name}{suffix or ''}>", f"</{name}{suffix or ''}>"):
            tokens[str(next_id)] = {
                "content": text,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            next_id += 1
    tokenizer_config: dict[str, object] = {
        "added_tokens_decoder": tokens,
        "model_max_length": 262144,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if suffix:
        tokenizer_config["token_suffix"] = suffix
    files = {
        "config.json": json.dumps(config, indent=2).encode(),
        "generation_config.json": json.dumps({"temperature": 0.7, "top_p": 0.8}, indent=2).encode(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2).encode(),
        "model.safetensors.index.json": json.dumps(
            {"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2
        ).encode(),
    }
    for index, name in enumerate(names):
        # Not a loadable safetensors file: the double only checks that every shard is there and readable.
        files[name] = f"hy3spark synthetic shard {index + 1} of {shards} for the vLLM test double\n".encode()
    return files


def make_model(
    cache_dir: str | os.PathLike[str],
    repo_id: str,
    *,
    preset: str = "hy3",
    total_size: int | None = None,
    shards: int = 2,
    suffix: str | None = ":opensource",
    commit: str | None = None,
) -> str:
    """Write the model into the cache; returns the commit sha its snapshot is filed under."""
    files = model_files(preset, total_size or DEFAULT_TOTAL_SIZE[preset], shards, suffix)
    digest = hashlib.sha1(repo_id.encode())
    for name in sorted(files):
        digest.update(name.encode() + files[name])
    commit = commit or digest.hexdigest()
    repo_dir = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs").mkdir(exist_ok=True)
    for name, data in files.items():
        etag = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else git_blob_sha1(data)
        (repo_dir / "blobs" / etag).write_bytes(data)
        link = snapshot / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f"../../blobs/{etag}")
    (repo_dir / "refs" / "main").write_text(commit)
    return commit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", required=True, help="the hub cache directory (HF_HUB_CACHE)")
    parser.add_argument("--repo", required=True, help="repo id, e.g. kodelow/Hy3-NVFP4-W4A16")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="hy3")
    parser.add_argument("--total-size", type=int, default=None, help="checkpoint bytes written in the index")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--bare-tokens", action="store_true", help="special tokens without the :opensource suffix")
    parser.add_argument("--commit", default=None, help="40-hex commit sha to file the snapshot under")
    args = parser.parse_args()
    print(
        make_model(
            args.cache,
            args.repo,
            preset=args.preset,
            total_size=args.total_size,
            shards=args.shards,
            suffix=None if args.bare_tokens else ":opensource",
            commit=args.commit,
        )
    )


if __name__ == "__main__":
    main()
