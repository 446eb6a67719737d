"""hy3spark: turn two or more NVIDIA DGX Sparks into one LLM endpoint, from one cluster spec."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hy3spark")  # pyproject.toml's, the one place the version is written
except PackageNotFoundError:  # the source tree on sys.path with no install: there is no metadata to read
    __version__ = "0+unknown"
