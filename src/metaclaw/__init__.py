"""metaclaw: self-hosted online learning for LLM agents (`metaclaw --help`)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("metaclaw")  # one source: pyproject.toml's version, through the installed metadata
except PackageNotFoundError:  # a source tree on PYTHONPATH that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
