"""A prompt's IDs and their JSON text, written once: the text against the standard library's writing
of the same IDs, after each way the IDs can grow."""

from __future__ import annotations

import json
import pickle
from array import array

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokentape.core.token_ids import PromptIds
from tokentape.engines.remote.wire import wire_ids

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)


def _written(value: object) -> list[int]:
    return json.loads(orjson.dumps({"ids": value}))["ids"]


@given(st.lists(INT32, max_size=300), st.lists(INT32, max_size=50))
def test_the_text_is_the_ids_after_each_change(first: list[int], more: list[int]) -> None:
    ids = PromptIds(array("i", first))
    assert _written(ids.json()) == first
    ids.extend(more)  # grown after its text was made: written again
    assert _written(ids.json()) == first + more
    ids.append(7)
    assert _written(ids.json()) == [*first, *more, 7]


def test_the_text_is_made_once() -> None:
    ids = PromptIds(range(19_000))
    assert ids.json() is ids.json()
    assert wire_ids(ids) is ids.json()  # what the engine's body and the response embed


def test_an_empty_prompt_is_an_empty_array() -> None:
    assert orjson.dumps(PromptIds().json()) == b"[]"


def test_the_ids_are_int32_copied_from_the_tape() -> None:
    tape = array("i", [5, 6, 7])
    ids = PromptIds(tape)
    tape[0] = 9  # the tape's array is not shared
    assert list(ids) == [5, 6, 7] and ids.itemsize == 4
    with pytest.raises(OverflowError):
        PromptIds([2**31])


def test_they_travel_as_ids() -> None:
    ids = PromptIds([1, 2, 3])
    ids.json()
    back = pickle.loads(pickle.dumps(ids))
    assert type(back) is PromptIds and list(back) == [1, 2, 3]
    assert _written(back.json()) == [1, 2, 3]
