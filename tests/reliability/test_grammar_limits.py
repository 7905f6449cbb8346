"""No output constraint stops, wedges or starves the embedded engine for the others.

Three ways a request's schema once did, each driven directly:

- A `maxLength` (or `maxItems`, or a pattern's `{m,n}`) far above its minimum: the schema converter
  writes one nested group per count, and llama.cpp's grammar parser, recursing once per group on the
  engine's worker thread, overflowed its stack at about 20,000: the whole process died (SIGSEGV).
- A count of a billion: the converter wrote it out in full, gigabytes, on the event loop.
- A grammar whose masks cost seconds a token (tens of thousands of enum values; an ambiguous pattern
  such as `^(a?){160}$` took half a minute a token): every generation in the batch waited on it.

Schemas the converter cannot take (`not`, an `items` that is no schema) were 500s; they are 400s
naming the field. The cost of a grammar is driven here by a mask that blocks until released, so the
test rests on no CPU's speed and on nothing the model samples.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import MODEL_NAME
from tokentape.core.sampling import SamplingParams
from tokentape.engines import batch_sampling
from tokentape.engines.base import Constraint
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.formats.gbnf import (
    MAX_AMBIGUOUS_REPEATS,
    MAX_GRAMMAR_ALTERNATIVES,
    MAX_GRAMMAR_DEPTH,
    MAX_REPETITIONS,
    check_grammar,
    schema_grammar,
)

DEADLINE = 60.0  # seconds: far beyond a few tokens of the embedded model on one core


def _chat(content: str = "Say hi.", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 6, **fields}


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _forced_tool(parameters: Any) -> dict[str, Any]:
    return {
        "tools": [{"type": "function", "function": {"name": "answer", "parameters": parameters}}],
        "tool_choice": "required",
    }


async def _post(http: httpx.AsyncClient, session: str, body: dict[str, Any]) -> httpx.Response:
    return await asyncio.wait_for(http.post(f"/sessions/{session}/v1/chat/completions", json=body), DEADLINE)


async def _served(http: httpx.AsyncClient, session: str) -> None:
    response = await _post(http, session, _chat())
    assert response.status_code == 200, response.text


# -- the converter's limits, without a model ----------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "string", "maxLength": 20_000}, "repetitions"),  # the parser's stack overflow, once
        ({"type": "string", "minLength": 10**9}, "repetitions"),  # gigabytes of grammar, once
        ({"type": "array", "items": {"type": "integer"}, "minItems": 10**12}, "repetitions"),
        ({"type": "string", "pattern": "^a{1000000000}$"}, "repetitions"),
        ({"type": "string", "maxLength": float("inf")}, "repetitions"),
        # within the repetitions, but nested past what the worker's parser may recurse into
        ({"type": "string", "maxLength": MAX_GRAMMAR_DEPTH + 500}, "nests"),
        ({"type": "array", "items": {"type": "string"}, "maxItems": MAX_GRAMMAR_DEPTH + 500}, "nests"),
        ({"enum": list(range(MAX_GRAMMAR_ALTERNATIVES + 10))}, "alternatives"),
        ({"anyOf": [{"const": i} for i in range(MAX_GRAMMAR_ALTERNATIVES + 10)]}, "alternatives"),
        # groups that match in several ways, repeated: half a minute a token, and five seconds
        ({"type": "string", "pattern": "^(a?){160}$"}, "several ways"),
        ({"type": "string", "pattern": "^((a?){10}){10}$"}, "several ways"),
        ({"type": "string", "pattern": "^([a-z]+,?){100}$"}, "several ways"),
        ({"type": "string", "pattern": "^" + "a?" * 160 + "$"}, "several ways"),  # 17 s a token
        # shapes the converter asserts on or indexes into: refused as unsupported, not a crash
        ({"not": {"type": "string"}}, "unsupported"),
        ({"type": "array", "items": 5}, "unsupported"),
        ({"type": "object", "properties": {"a": 5}}, "unsupported"),
        ({"type": "string", "pattern": "^a)$"}, "unsupported"),
        ({"$ref": "#/definitions/missing"}, "unsupported"),
    ],
)
def test_a_schema_past_the_limits_is_refused_by_name(schema: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        schema_grammar({"": schema})


def test_schemas_within_the_limits_convert() -> None:
    for schema in (
        {"type": "string", "maxLength": MAX_GRAMMAR_DEPTH - 10},
        {"type": "string", "minLength": MAX_REPETITIONS},  # flat: no nesting
        {"enum": list(range(MAX_GRAMMAR_ALTERNATIVES // 2))},
        {"type": "string", "pattern": "^[a-z0-9._%+-]{1,64}@[a-z0-9.-]{1,255}\\.[a-z]{2,24}$"},
        {"type": "string", "pattern": "^(\\d{3}-){3}\\(?[0-9]{4}\\)?$"},
        {"type": "string", "pattern": f"^(a?){{{MAX_AMBIGUOUS_REPEATS}}}$"},
        {"type": "string", "pattern": "^" + "a?" * MAX_AMBIGUOUS_REPEATS + "$"},
        {"type": "string", "pattern": "^\\d+(\\.\\d+)?$"},
        {"type": "object", "properties": {"maxLength": {"type": "string"}}, "default": {"maxLength": 10**9}},
    ):
        assert schema_grammar({"": schema}).count("::=") > 0


def test_literals_and_classes_are_no_groups_or_alternatives() -> None:
    depth = MAX_GRAMMAR_DEPTH + 10
    check_grammar('root ::= "' + "(" * depth + '|\\"" [(|\\]] ')
    check_grammar("# " + "(" * depth + "\nroot ::= [a]")
    with pytest.raises(ValueError, match="nests"):
        check_grammar("root ::= " + "(" * depth + '"a"' + ")?" * depth)


# -- over HTTP, on the embedded engine ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": _schema_format({"type": "string", "maxLength": 20_000})}, "response_format"),
        ({"response_format": _schema_format({"type": "string", "minLength": 10**9})}, "response_format"),
        ({"response_format": _schema_format({"type": "string", "maxLength": 5_000})}, "response_format"),
        ({"response_format": _schema_format({"enum": list(range(5_000))})}, "response_format"),
        ({"response_format": _schema_format({"not": {"type": "string"}})}, "response_format"),
        ({"response_format": _schema_format({"type": "string", "pattern": "^(a?){160}$"})}, "response_format"),
        (_forced_tool({"type": "object", "properties": {"a": {"type": "string", "maxLength": 20_000}}}), "tools"),
        (_forced_tool({"type": "array", "items": 5}), "tools"),
    ],
)
async def test_a_schema_past_the_limits_is_a_400_and_the_engine_serves_on(
    http: httpx.AsyncClient, engine: LlamaCppEngine, fields: dict[str, Any], param: str
) -> None:
    faults = engine.describe()["worker_faults"]
    response = await _post(http, "hostile", _chat(**fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "enforce" in error["message"], error
    await _served(http, "honest")
    assert engine.describe()["worker_faults"] == faults


class _HeldMask:
    """A real grammar mask whose `apply` first waits to be released: a grammar as costly as the test
    wants, on any CPU."""

    def __init__(self, mask: Any, release: threading.Event) -> None:
        self._mask, self._release = mask, release
        self.applying = threading.Event()
        self.closed = threading.Event()

    def apply(self, logits: np.ndarray) -> np.ndarray:
        self.applying.set()
        self._release.wait()
        result: np.ndarray = self._mask.apply(logits)
        return result

    def accept(self, token: int) -> None:
        self._mask.accept(token)

    def close(self) -> None:
        self._mask.close()
        self.closed.set()


async def test_a_grammar_that_takes_too_long_fails_its_own_generation_and_holds_up_nobody(
    http: httpx.AsyncClient, engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch_sampling, "GRAMMAR_SECONDS", 3.0)
    batcher = engine._batcher
    real_make_mask = batcher._make_mask
    release = threading.Event()
    held: list[_HeldMask] = []

    def make_mask(native: Any, grammar: str) -> Any:
        mask = _HeldMask(real_make_mask(native, grammar), release)
        held.append(mask)
        return mask

    monkeypatch.setattr(batcher, "_make_mask", make_mask)
    try:
        costly = asyncio.create_task(
            _post(http, "costly", _chat(max_tokens=12, response_format=_schema_format({"type": "string"})))
        )
        while not (held and held[0].applying.is_set()):  # its grammar holds the first token now
            await asyncio.sleep(0.01)
        # sessions without a grammar are served meanwhile, each in a step its grammar is not part of
        await asyncio.wait_for(asyncio.gather(*(_served(http, f"honest-{i}") for i in range(3))), DEADLINE)
        response = await asyncio.wait_for(costly, DEADLINE)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "grammar_too_costly" and "took more than" in error["message"], error
        assert not held[0].closed.is_set()  # its thread still holds it: it is freed after, not under it
        # and what it reads (the model) is freed only after it too, should the model be swapped or closed
        freed = threading.Event()
        batcher.when_grammars_done(freed.set)
        assert not freed.is_set()
    finally:
        release.set()
    assert await asyncio.to_thread(held[0].closed.wait, DEADLINE)
    assert await asyncio.to_thread(freed.wait, DEADLINE)
    # (the gateway tries a generation that failed before its first token once more: it fails as well)
    await _served(http, "after")
    assert not batcher._grammar_jobs


async def test_a_grammar_that_is_merely_slow_still_completes(
    http: httpx.AsyncClient, engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mask later than a decode step costs its own generation steps, never its output: the reply
    comes when the grammar is done, and it is the constrained JSON."""
    batcher = engine._batcher
    real_make_mask = batcher._make_mask
    release = threading.Event()
    held: list[_HeldMask] = []

    def make_mask(native: Any, grammar: str) -> Any:
        mask = _HeldMask(real_make_mask(native, grammar), release)
        held.append(mask)
        return mask

    monkeypatch.setattr(batcher, "_make_mask", make_mask)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    slow = asyncio.create_task(_post(http, "slow", _chat(max_tokens=24, response_format=_schema_format(schema))))
    try:
        while not (held and held[0].applying.is_set()):
            await asyncio.sleep(0.01)
        await _served(http, "meanwhile")
        assert not slow.done()
    finally:
        release.set()
    response = await slow
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"])["ok"], bool)


async def test_a_generation_cancelled_while_its_grammar_masks_ends_and_its_grammar_is_freed_after(
    http: httpx.AsyncClient, engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client gone while its grammar is still masking: the worker drops the generation at once (its
    slot free for others), and frees the grammar only when the thread using it is done with it."""
    batcher = engine._batcher
    real_make_mask = batcher._make_mask
    release = threading.Event()
    held: list[_HeldMask] = []

    def make_mask(native: Any, grammar: str) -> Any:
        mask = _HeldMask(real_make_mask(native, grammar), release)
        held.append(mask)
        return mask

    monkeypatch.setattr(batcher, "_make_mask", make_mask)
    constraint = Constraint("json_schema", json.dumps({"type": "string"}))
    tokens = engine.generate([1, 2, 3], SamplingParams(max_tokens=8), seed=1, constraint=constraint)
    try:
        first = asyncio.ensure_future(anext(tokens))
        while not (held and held[0].applying.is_set()):
            await asyncio.sleep(0.01)
        first.cancel()  # the listener goes away mid-token
        with pytest.raises(asyncio.CancelledError):
            await first
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE
        while batcher.active and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert not batcher.active  # dropped while its mask was still being applied
        assert not held[0].closed.is_set()
        await _served(http, "meanwhile")
    finally:
        release.set()
        await tokens.aclose()
    assert await asyncio.to_thread(held[0].closed.wait, DEADLINE)
    await _served(http, "after")
