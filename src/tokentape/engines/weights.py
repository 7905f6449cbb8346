"""The weight-update seam: what a trainer asks an engine to load, and the four steps every engine that
can change weights under a live gateway offers. The gateway (not the engine) orders the steps over all
of its engines, holds new generations meanwhile and bumps the policy version only when every engine
succeeded; an engine only does its own part, the engine's own way.

    check_weights      before anything is paused: can this engine do it? (path, format, architecture,
                       vocabulary, the engine's version and flags). Raises WeightUpdateRefused; changes nothing.
    pause_generation   stop sampling. By then the gateway has stopped every generation it runs on this
                       engine at a token boundary, in every mode (it goes on afterwards from prompt +
                       sampled tokens as a new request); the engine drops whatever is left of them.
                       `keep`: keep the KV cache (the continuation may reuse the prefix the old weights
                       computed: vLLM's prefix cache, SGLang's radix cache, the embedded engine's slot).
    load_weights       load them; raises WeightUpdateFailed with the engine's words. Also called to put
                       the current weights back after another engine failed (the same source again, or
                       `start_source`, an engine's optional attribute, for version 0).
    resume_generation  sample again; `fresh_kv`: drop every cached prefix first (computed under the old
                       weights), which every mode but `keep` asks for.

Between load_weights and resume_generation the gateway probes each engine: its optional
`probe_weights()` if it has one (the embedded engine: one forward pass on a scratch context, so that
its cached prefix survives for keep), else its ordinary `generate` (one greedy token of a fixed
one-token prompt); nothing else is generated meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "IN_FLIGHT_MODES",
    "InFlight",
    "UpdatableEngine",
    "WeightKind",
    "WeightSource",
    "WeightUpdateFailed",
    "WeightUpdateRefused",
]

# What happens to generations running when an update lands:
#   continue  stop each at a token boundary, then generate on from prompt + sampled tokens on fresh KV
#             under the new weights, as one turn
#   keep      the same, but the engine keeps the KV the old weights computed, for the continuation to reuse
#   abort     end them with finish reason `abort`
InFlight = Literal["continue", "keep", "abort"]
IN_FLIGHT_MODES: tuple[InFlight, ...] = ("continue", "keep", "abort")

# lora: an adapter on the loaded base model (GGUF for the embedded engine, a PEFT directory for vLLM and
# SGLang); model: whole weights (a GGUF for the embedded engine, a directory the engine can read for the
# others); engine_managed: the trainer pushed the weights itself (e.g. over NCCL), nothing to load.
WeightKind = Literal["lora", "model", "engine_managed"]


@dataclass(frozen=True, slots=True)
class WeightSource:
    kind: WeightKind
    path: str | None = None  # None only for engine_managed


class WeightUpdateRefused(Exception):
    """The engine cannot do this update; raised before anything changed. The message names the problem."""


class WeightUpdateFailed(Exception):
    """The engine tried and failed (it may now be paused, or hold partly loaded weights)."""


@runtime_checkable
class UpdatableEngine(Protocol):
    """An engine whose weights can change while the gateway runs."""

    async def check_weights(self, source: WeightSource, in_flight: InFlight) -> None: ...

    async def pause_generation(self, in_flight: InFlight) -> None: ...

    async def load_weights(self, source: WeightSource, version: int) -> None: ...

    async def resume_generation(self, *, fresh_kv: bool) -> None: ...
