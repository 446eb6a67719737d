"""A stand-in `tensorrt_llm` package so `python3 -c 'import tensorrt_llm; print(tensorrt_llm.__version__)'` answers
as in the release image (and prints the version line TensorRT-LLM prints on import). hy3spark's TEST DOUBLE."""

from trtllm_double import IS_TEST_DOUBLE, VERSION

__version__ = VERSION
__all__ = ["IS_TEST_DOUBLE", "__version__"]

print(f"[TensorRT-LLM] TensorRT-LLM version: {__version__}", flush=True)
