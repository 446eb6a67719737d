"""hy3spark: turn two or more NVIDIA DGX Sparks into one LLM endpoint, from one cluster spec."""

__version__ = "0.1.0"
