"""Prometheus metrics of one gateway, served at `GET /metrics`.

The gateway reports events as they happen, through the few methods below (a session finished, a turn
recorded, a rewrite, a generation timed, a request turned away, a store write timed); gauges are read
when scraped. Each gateway has its own registry, so several in one process never mix their counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "GatewayMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Engine calls run from milliseconds (a cached short reply) to minutes (long generations on a CPU).
ENGINE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# A store write is one SQLite transaction: well under a millisecond to tens of milliseconds.
STORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# How late the event loop's ticker woke (`server.loop_lag`): well under a millisecond when nothing holds it.
LOOP_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._sessions_live = Gauge("tokentape_sessions_live", "Sessions in memory and not finished", registry=r)
        self._sessions_finished = Counter("tokentape_sessions_finished", "Sessions marked finished", registry=r)
        self._turns = Counter("tokentape_turns", "Turns recorded (one per choice)", ["finish_reason"], registry=r)
        self._turns_by_reason: dict[str, Counter] = {}  # each label's child, looked up once per reason
        self._tokens_in = Counter(
            "tokentape_prompt_tokens", "Prompt tokens sent to the engine, one count per turn", registry=r
        )
        self._tokens_out = Counter(
            "tokentape_sampled_tokens", "Tokens the engine sampled (all on the tape)", registry=r
        )
        self._rewrites = Counter(
            "tokentape_rewrites", "Requests that rewrote recorded history, by kind", ["kind"], registry=r
        )
        self._engine = Histogram(
            "tokentape_engine_seconds",
            "One generation: engine call to its last token",
            buckets=ENGINE_BUCKETS,
            registry=r,
        )
        self._first_token = Histogram(
            "tokentape_time_to_first_token_seconds",
            "Engine call to the first sampled token, for requests that stream",
            buckets=ENGINE_BUCKETS,
            registry=r,
        )
        self._queue = Gauge(
            "tokentape_requests_active", "Requests admitted and not done (waiting for or using the engine)", registry=r
        )
        self._overloaded = Counter(
            "tokentape_overloaded_rejections", "Requests answered 429 because too many were waiting", registry=r
        )
        self._worker_faults = Gauge(
            "tokentape_engine_worker_faults",
            "Errors the embedded engine's worker caught and survived (each failed only its own generations)",
            registry=r,
        )
        self._worker_restarts = Gauge(
            "tokentape_engine_worker_restarts",
            "Times the embedded engine's worker thread died and was started again",
            registry=r,
        )
        self._store = Histogram(
            "tokentape_store_write_seconds", "Writing one turn to the store", buckets=STORE_BUCKETS, registry=r
        )
        self._held = _HeldByKind()
        r.register(self._held)
        self._budget = Gauge("tokentape_memory_budget_bytes", "--max-memory-bytes", registry=r)
        self._image_cache = Gauge(
            "tokentape_image_cache_bytes", "Image bytes read back from the store or waiting for their write", registry=r
        )
        self._image_resends = Gauge(
            "tokentape_engine_image_resends",
            "Generations sent again with every image's tensors after the engine no longer held an image named by hash",
            registry=r,
        )
        self._loop_lag = Histogram(
            "tokentape_event_loop_lag_seconds",
            "How late the event loop's ticker woke: how long one piece of work held every request",
            buckets=LOOP_LAG_BUCKETS,
            registry=r,
        )
        self._loop_lag_max = Gauge(
            "tokentape_event_loop_lag_max_seconds", "The longest the event loop was held since start", registry=r
        )
        self._longest_lag = 0.0
        ProcessCollector(registry=r)  # process_resident_memory_bytes and the rest, for this process

    # -- gauges, read when scraped ---------------------------------------------------------------------
    def watch(
        self,
        *,
        live_sessions: Callable[[], int],
        active_requests: Callable[[], int],
        engine: Callable[[], Mapping[str, Any]] = dict,
        memory: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0),
        held: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        """`engine`: the engine's own account of itself (`describe()`), for its worker's counters and
        image resends (summed over a pool's engines). `memory`: bytes held, the budget, image bytes.
        `held`: the bytes held against the budget by kind (`core.held.HeldBytes.by_kind`)."""
        self._sessions_live.set_function(lambda: float(live_sessions()))
        self._queue.set_function(lambda: float(active_requests()))
        self._worker_faults.set_function(lambda: float(engine().get("worker_faults", 0)))
        self._worker_restarts.set_function(lambda: float(engine().get("worker_restarts", 0)))
        self._held.read = held
        self._budget.set_function(lambda: float(memory()[1]))
        self._image_cache.set_function(lambda: float(memory()[2]))
        self._image_resends.set_function(lambda: float(_image_resends(engine())))

    # -- events ----------------------------------------------------------------------------------------
    def session_finished(self) -> None:
        self._sessions_finished.inc()

    def turn_recorded(self, *, prompt_tokens: int, sampled_tokens: int, finish_reason: str) -> None:
        turns = self._turns_by_reason.get(finish_reason)
        if turns is None:
            turns = self._turns_by_reason[finish_reason] = self._turns.labels(finish_reason=finish_reason)
        turns.inc()
        self._tokens_in.inc(prompt_tokens)
        self._tokens_out.inc(sampled_tokens)

    def rewrite(self, kind: str) -> None:
        self._rewrites.labels(kind=kind).inc()

    def generation(self, *, seconds: float, first_token_seconds: float | None) -> None:
        self._engine.observe(seconds)
        if first_token_seconds is not None:
            self._first_token.observe(first_token_seconds)

    def overloaded(self) -> None:
        self._overloaded.inc()

    def store_write(self, seconds: float) -> None:
        self._store.observe(seconds)

    def loop_lag(self, seconds: float) -> None:
        self._loop_lag.observe(seconds)
        if seconds > self._longest_lag:
            self._longest_lag = seconds
            self._loop_lag_max.set(seconds)

    # -- exposition ------------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)


class _HeldByKind:
    """`tokentape_memory_held_bytes{kind}`: what the gateway holds against --max-memory-bytes, one
    sample per kind (their sum is what the budget is checked against), read when scraped."""

    def __init__(self) -> None:
        self.read: Callable[[], Mapping[str, int]] = dict

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "tokentape_memory_held_bytes",
            "Bytes held against --max-memory-bytes, by kind (tapes, template_inputs, images, retry_records, "
            "parses, responses); their sum is what the budget is checked against",
            labels=["kind"],
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for kind, held in self.read().items():
            family.add_metric([kind], float(held))
        yield family


def _image_resends(described: Mapping[str, Any]) -> int:
    members = described.get("engines")
    if isinstance(members, list):
        return sum(int(member.get("image_resends", 0)) for member in members if isinstance(member, Mapping))
    return int(described.get("image_resends", 0))
