"""Remote engines over HTTP, token IDs in and out: vLLM (`vllm`: `/v1/completions`; `vllm-generate`:
its `/inference/v1/generate` token endpoint) and SGLang (`sglang`: `/generate`), one module per wire
dialect (`vllm.py`, `sglang.py`) over one shared exchange (`client.py`: connection pools, the event
stream, and the one place where what goes wrong becomes an error of tokentape's tree); `wire.py` holds
the fields and checks both wire formats share, `updates.py` what both need to take new weights,
`kinds.py` the engines by the kind `--engine KIND=URL` names."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokentape.engines.remote.client import RemoteEngine
    from tokentape.engines.remote.kinds import ENGINE_KINDS, make_engine
    from tokentape.engines.remote.sglang import SGLangEngine
    from tokentape.engines.remote.vllm import VLLMEngine, VLLMGenerateEngine

__all__ = [
    "ENGINE_KINDS",
    "RemoteEngine",
    "SGLangEngine",
    "VLLMEngine",
    "VLLMGenerateEngine",
    "make_engine",
]

# Each name is imported from its module on first use: the dialects import `wire` alone, and a gateway
# on the embedded engine never loads aiohttp and the engines' modules (about 0.3 s of every start).
_HOMES = {
    "ENGINE_KINDS": "kinds",
    "RemoteEngine": "client",
    "SGLangEngine": "sglang",
    "VLLMEngine": "vllm",
    "VLLMGenerateEngine": "vllm",
    "make_engine": "kinds",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
