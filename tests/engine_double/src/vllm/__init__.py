"""hy3spark's TEST DOUBLE of vLLM 0.23 (the `vllm` CLI and its OpenAI-compatible server).

This package is NOT vLLM. It exists only inside hy3spark's test serving image, where no GPU and no inference engine
can exist. It reproduces what hy3spark's roles depend on: `vllm serve` flag parsing and its errors, model resolution
from the offline Hugging Face cache, the Ray placement group over TP x PP GPU bundles and its failure messages, the
per-node worker checks, the startup log lines (KV cache size, maximum concurrency), and the HTTP endpoints with
deterministic text. See tests/engine_double/README.md in the hy3spark repository.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("vllm")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.23.0+testdouble"

IS_TEST_DOUBLE = True
