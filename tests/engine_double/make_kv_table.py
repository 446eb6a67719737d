#!/usr/bin/env python3
"""Derive the engine double's KV table (src/vllm/double/kv_vectors.json) from vLLM 0.23.0's own test vectors.

    python tests/engine_double/make_kv_table.py            # rewrite the table from the fixture
    python tests/engine_double/make_kv_table.py --check    # exit 1 when the shipped table differs

Input: tests/fixtures/vllm-0.23.0/kv-cases.json (what vLLM 0.23.0's code computed; see the README beside it). Every
value in the table is copied from it, never computed: per case, the configuration vLLM was given as the double can
describe its own (``config``: model shape from config.json, parallelism, KV dtype, block size, max_model_len,
max_num_batched_tokens, hybrid manager, speculative method, and the hidden + extra layers of each PP stage by
attention type), the per-rank available KV bytes, and vLLM's outcome: the KV lines it logged (``log``), the error
it raised at the first failing rank (``error``), or the configuration it refused (``config_error``). A field vLLM
never resolved (it refused the flags first) is left out of ``config``, so it matches any value. Also the
``vllm serve`` batch defaults vLLM resolved on the faked GB10 (``batch_defaults``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import derived_table

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parent / "fixtures" / "vllm-0.23.0" / "kv-cases.json"
TABLE = HERE / "src" / "vllm" / "double" / "kv_vectors.json"
SPEC_KINDS = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding"}


def _stages(inputs: dict[str, Any]) -> list[dict[str, int]]:
    """Layers per PP stage by attention type, from the first rank of each stage (TP ranks share their stage)."""
    stages: dict[int, dict[str, int]] = {}
    for rank in inputs["ranks"]:
        counts = {kind: 0 for kind in SPEC_KINDS.values()}
        for spec, layers in rank["layers_by_spec"].items():
            counts[SPEC_KINDS[spec]] += layers
        stages.setdefault(rank["pp_rank"], counts)
    return [stages[pp_rank] for pp_rank in sorted(stages)]


def _config(case: dict[str, Any]) -> dict[str, Any]:
    inputs = case["inputs"]
    model = inputs["model"]
    flags = inputs["serve_flags"]
    speculative = json.loads(flags[flags.index("--speculative-config") + 1]) if "--speculative-config" in flags else {}
    specs = inputs.get("layer_specs")
    sliding = sum(s["layers"] for s in specs if s["spec"] == "SlidingWindowSpec") if specs else 0
    config: dict[str, Any] = {
        "architecture": model["architecture"],
        "num_hidden_layers": model["num_hidden_layers"],
        "num_key_value_heads": model["num_key_value_heads_total"],
        "head_dim": model["head_dim"],
        "model_dtype": model["model_dtype"],
        "sliding_window": model["sliding_window"] if sliding else None,
        "sliding_layers": sliding,
        "extra_full_layers": model["extra_full_layers_on_last_pp_rank"],
        "speculative_method": speculative.get("method"),
        "tensor_parallel": inputs["tensor_parallel"],
        "pipeline_parallel": inputs["pipeline_parallel"],
        "kv_cache_dtype": inputs["kv_cache_dtype"],
        "max_model_len": inputs["max_model_len"],
    }
    resolved = inputs.get("resolved_vllm_config")
    if resolved is None:  # refused before vLLM resolved the rest
        return config
    config.update(
        {
            "stages": _stages(inputs),
            "block_size": resolved["block_size"],
            "max_num_batched_tokens": resolved["max_num_batched_tokens"],
            "hybrid_kv_cache_manager": not resolved["disable_hybrid_kv_cache_manager"],
            # --max-model-len -1 starts from the model's own length (what vLLM resolved before auto-fitting).
            "auto_fit_from": resolved["max_model_len"] if inputs["max_model_len"] == -1 else None,
        }
    )
    return config


def _log(lines: list[str]) -> list[list[str]]:
    """ "INFO: text" -> ["INFO", "text"]."""
    return [line.split(": ", 1) for line in lines]


def _vector(case: dict[str, Any]) -> dict[str, Any]:
    inputs, vllm = case["inputs"], case["vllm"]
    vector: dict[str, Any] = {"id": case["id"], "title": case["title"], "config": _config(case)}
    if "config_error" in vllm:
        kind, message = vllm["config_error"].split(": ", 1)
        vector["config_error"] = {"type": kind, "message": message}
        return vector
    vector["available_kv_bytes_per_rank"] = inputs["available_kv_bytes_per_rank"]
    vector["log"] = _log(vllm["log"])
    if "error" in vllm:
        vector["error"] = {
            "type": vllm["error"]["type"],
            "message": vllm["error"]["message"],
            # vLLM checks the ranks in order and raises at the first that fails: the last one it checked.
            "rank": vllm["per_rank_checks"][-1]["rank"],
        }
        return vector
    auto_fit = vllm.get("max_model_len_auto_fit")
    vector["num_blocks"] = vllm["num_blocks"]
    vector["max_model_len"] = auto_fit["to"] if auto_fit else inputs["max_model_len"]
    return vector


def build_table(fixture: Path = FIXTURE) -> dict[str, Any]:
    raw = fixture.read_bytes()
    data = json.loads(raw)
    defaults = data["gb10_batch_defaults"]
    reported = defaults["total_memory_121.69GiB"]
    return {
        "about": (
            "vLLM 0.23.0's KV-cache outcomes for the engine double, generated by tests/engine_double/make_kv_table.py "
            "from tests/fixtures/vllm-0.23.0/kv-cases.json: do not edit, add a case to the fixture and regenerate"
        ),
        "vllm_version": data["vllm_version"],
        "source": {"path": "tests/fixtures/vllm-0.23.0/kv-cases.json", "sha256": hashlib.sha256(raw).hexdigest()},
        "batch_defaults": {
            "nvml_total_memory_bytes": reported["get_device_total_memory"],
            "nvml_reported": reported["max_num_batched_tokens"]["OPENAI_API_SERVER"],
            "nvml_not_supported": defaults["nvml_not_supported"]["max_num_batched_tokens"]["OPENAI_API_SERVER"],
        },
        "vectors": [_vector(case) for case in data["cases"]],
    }


def render(table: dict[str, Any]) -> str:
    return json.dumps(table, indent=1) + "\n"


if __name__ == "__main__":
    sys.exit(derived_table.main(__doc__, TABLE, lambda: render(build_table()), Path(__file__).name))
