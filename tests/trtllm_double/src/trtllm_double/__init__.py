"""hy3spark's TensorRT-LLM TEST DOUBLE: `trtllm-serve` and `trtllm-llmapi-launch` over a real Open MPI.

Not TensorRT-LLM: no GPU, no weights, deterministic answers. See tests/trtllm_double/README.md.
"""

from __future__ import annotations

# The release line the double imitates; "+testdouble" so nothing can mistake it for the engine.
VERSION = "1.2.0rc6+testdouble"
IS_TEST_DOUBLE = True
