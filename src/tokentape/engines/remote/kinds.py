"""The remote engines by the kind an operator names (`--engine KIND=URL`)."""

from __future__ import annotations

from tokentape.engines.remote.client import RemoteEngine
from tokentape.engines.remote.sglang import SGLangEngine
from tokentape.engines.remote.vllm import VLLMEngine, VLLMGenerateEngine
from tokentape.errors import InvalidRequest

__all__ = ["ENGINE_KINDS", "make_engine"]

ENGINE_KINDS: dict[str, type[RemoteEngine]] = {
    "vllm": VLLMEngine,
    "vllm-generate": VLLMGenerateEngine,
    "sglang": SGLangEngine,
}


def make_engine(spec: str) -> RemoteEngine:
    """`KIND=URL[,logprobs-mode=MODE]`, e.g. `vllm=http://10.0.0.5:8000,logprobs-mode=processed_logprobs`."""
    kind, sep, rest = spec.partition("=")
    url, _, option = rest.partition(",")
    name, _, mode = option.partition("=")
    if (
        not sep
        or kind not in ENGINE_KINDS
        or not url.startswith(("http://", "https://"))
        or (option and (name != "logprobs-mode" or not mode))
    ):
        raise InvalidRequest(
            f"engines are given as KIND=URL[,logprobs-mode=MODE] with KIND one of {', '.join(ENGINE_KINDS)}",
            param="engine",
        )
    return ENGINE_KINDS[kind](url, logprobs_mode=mode or None)
