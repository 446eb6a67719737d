"""The test double's engine: everything here imitates vLLM 0.23 behaviour without a GPU (see vllm/__init__.py)."""
