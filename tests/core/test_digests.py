"""The per-session chain cache gives exactly the chain hashes of hashing every message again, whatever
the requests share, and hashes only the messages a request adds."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokentape.core import digests
from tokentape.core.digests import ChainCache
from tokentape.core.messages import EMPTY_CHAIN, hash_chain

texts = st.sampled_from(["hi", "Hi", "hi ", "é", "é", "", "2", "a b"])
messages = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]), "content": texts}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(texts, st.none())}),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.none(),
            "tool_calls": st.just([{"id": "c", "function": {"name": "f", "arguments": '{"x": 1}'}}]),
        }
    ),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.just([{"type": "text", "text": "hi"}])}),
    st.fixed_dictionaries(
        {"role": st.just("user"), "content": texts, "weight": st.sampled_from([1, True, 1.0, 2**70])}
    ),
)
seeds = st.sampled_from([EMPTY_CHAIN, b"\x01" * 16])


@st.composite
def request_series(draw: st.DrawFn) -> list[tuple[list[dict[str, Any]], bytes]]:
    """Requests as agents send them: each extends, truncates or edits an earlier one, or starts afresh."""
    series: list[tuple[list[dict[str, Any]], bytes]] = []
    for _ in range(draw(st.integers(1, 8))):
        if series and draw(st.booleans()):
            base, seed = draw(st.sampled_from(series))
            cut = draw(st.integers(0, len(base)))
            request = [dict(m) for m in base[:cut]] + draw(st.lists(messages, max_size=4))
            if request and draw(st.booleans()):  # an edit anywhere, the messages around it kept
                request[draw(st.integers(0, len(request) - 1))] = draw(messages)
            seed = draw(st.sampled_from([seed, seed, b"\x02" * 16]))
        else:
            request, seed = draw(st.lists(messages, min_size=1, max_size=6)), draw(seeds)
        series.append((request, seed))
    return series


@given(request_series())
@settings(max_examples=300, deadline=None)
def test_cached_chains_equal_hashing_every_message(series: list[tuple[list[dict[str, Any]], bytes]]) -> None:
    cache = ChainCache()
    for request, seed in series:
        assert cache.chains(request, seed) == list(hash_chain(request, seed))


def _fifty_growing_requests() -> None:
    """An agent's 50 turns: each request is the history so far and a new user message."""
    cache = ChainCache()
    history: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for turn in range(50):
        history.append({"role": "user", "content": f"question {turn}"})
        # the client sends a fresh copy of its history every time, as after JSON parsing
        cache.chains([dict(m) for m in history])
        history.append({"role": "assistant", "content": f"answer {turn}"})


def test_a_request_that_extends_the_last_hashes_only_its_new_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []
    real = digests.hash_chain

    def counting(messages: Any, start: bytes = EMPTY_CHAIN) -> Any:
        hashed.append(len(messages))
        return real(messages, start)

    monkeypatch.setattr(digests, "hash_chain", counting)
    _fifty_growing_requests()
    assert hashed[0] == 2
    assert hashed[1:] == [2] * 49  # the echoed reply and the new user message


def test_a_request_that_extends_the_last_fingerprints_only_its_new_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    fingerprinted: list[int] = []
    real = digests.fingerprints

    def counting(messages: Any) -> Any:
        fingerprinted.append(len(messages))
        return real(messages)

    monkeypatch.setattr(digests, "fingerprints", counting)
    _fifty_growing_requests()
    assert fingerprinted == [2] * 50  # the history before them is compared as one digest


@pytest.mark.parametrize("at", [0, 1, 2, 57, 98, 99])
def test_an_edit_anywhere_in_a_long_history_is_seen(at: int) -> None:
    """Same length, same bytes but one: only the content of the history tells the requests apart."""
    cache = ChainCache()
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i:03}"} for i in range(100)]
    for n in (98, 99, 100):  # the usual extensions first, so the edit meets a remembered history
        assert cache.chains([dict(m) for m in history[:n]]) == list(hash_chain(history[:n]))
    edited = [dict(m) for m in history]
    edited[at]["content"] = edited[at]["content"].replace("message", "massage")
    chains = cache.chains(edited)
    assert chains == list(hash_chain(edited))
    assert chains[:at] == list(hash_chain(history[:at])) and chains[at] != list(hash_chain(history))[at]
    # and the request after it, which extends the edited history, builds on the edit
    extended = [*edited, {"role": "user", "content": "next"}]
    assert cache.chains([dict(m) for m in extended]) == list(hash_chain(extended))
    assert cache.chains([dict(m) for m in history]) == list(hash_chain(history))  # the original again


def test_values_equal_in_python_but_not_in_json_are_different_messages() -> None:
    cache = ChainCache()
    one = [{"role": "user", "content": "x", "weight": 1}]
    true = [{"role": "user", "content": "x", "weight": True}]
    assert cache.chains(one) == list(hash_chain(one))
    assert cache.chains(true) == list(hash_chain(true))
    assert cache.chains(one) != cache.chains(true)
