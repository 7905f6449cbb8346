"""The installed distribution's version: one source (pyproject.toml), read from the package metadata."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["VERSION"]

try:
    VERSION = version("tokentape")
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0+unknown"
