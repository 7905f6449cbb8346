"""A prompt's IDs and their JSON text, written once: the text against the standard library's writing
of the same IDs, after each way the IDs can grow."""

from __future__ import annotations

import json
import pickle
from array import array
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokentape.core.session import SessionTree
from tokentape.core.token_ids import FirstPromptIds, PathTextSlot, PromptIds
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


# -- a session's prompts on one path: each written from the previous one's text ----------------------
def _grown(buffer: array[int], more: list[int]) -> array[int]:
    buffer.extend(more)
    return buffer


@given(st.lists(st.tuples(st.lists(INT32, max_size=40), st.lists(INT32, max_size=20), st.integers(0, 3)), max_size=8))
def test_prompts_on_a_growing_buffer_are_written_true(steps: list[tuple[list[int], list[int], int]]) -> None:
    """Each step: the tape grows by `turn` (a reply and what bridged to it), then a prompt is that path
    up to some point, plus new tokens; now and then the path is held by another buffer (a branch)."""
    slot = PathTextSlot()
    buffers = [array("i"), array("i")]
    for turn, new, which in steps:
        buffer = _grown(buffers[which % 2], turn)
        count = len(buffer) - (which // 2) * min(len(buffer), 3)  # sometimes an earlier point of the path
        prompt = PromptIds(buffer[:count])
        prompt.extend(new)
        prompt.on_path(slot, buffer, count)
        assert _written(prompt.json(keep=True)) == [*buffer[:count], *new]
        assert slot.entry is not None and slot.entry.count == count
        assert json.loads(slot.entry.text[: slot.entry.cut] + b"]") == list(buffer[:count])


def test_a_later_prompt_writes_only_the_ids_after_the_previous_one(monkeypatch: pytest.MonkeyPatch) -> None:
    slot = PathTextSlot()
    buffer = array("i", range(10_000))
    first = PromptIds(buffer).on_path(slot, buffer, len(buffer))
    first.extend([1, 2, 3])  # the bridge, not yet on the tape
    first.json(keep=True)
    buffer.extend([1, 2, 3, 40, 41])  # recorded: the bridge and the reply
    sizes, text = _next_prompt_written(monkeypatch, slot, buffer, [7, 8])
    assert sizes == [5, 2]  # what the tape gained since, then the new bridge
    assert _written(text) == [*range(10_000), 1, 2, 3, 40, 41, 7, 8]


def _next_prompt_written(
    monkeypatch: pytest.MonkeyPatch, slot: PathTextSlot, buffer: array[int], new: list[int]
) -> tuple[list[int], object]:
    """The next prompt on `buffer` (all of it, then `new`) written for an engine, and the lengths of
    what orjson was asked to write meanwhile."""
    sizes: list[int] = []
    dumps = orjson.dumps

    def counted(value: Any, **options: Any) -> bytes:
        sizes.append(len(value))
        return dumps(value, **options)

    monkeypatch.setattr(orjson, "dumps", counted)
    prompt = PromptIds(buffer).on_path(slot, buffer, len(buffer))
    prompt.extend(new)
    text = prompt.json(keep=True)
    monkeypatch.undo()
    return sizes, text


def test_a_prompt_on_another_buffer_or_before_the_known_text_is_written_whole() -> None:
    slot = PathTextSlot()
    path = array("i", [1, 2, 3, 4])
    PromptIds(path).on_path(slot, path, 4).json(keep=True)
    other = array("i", [1, 2, 9])
    assert _written(PromptIds(other).on_path(slot, other, 3).json(keep=True)) == [1, 2, 9]
    PromptIds(path).on_path(slot, path, 4).json(keep=True)
    earlier = PromptIds(path[:2]).on_path(slot, path, 2)  # a branch off an earlier point of the same array
    earlier.append(5)
    assert _written(earlier.json(keep=True)) == [1, 2, 5]


def test_the_kept_text_counts_against_the_sessions_memory() -> None:
    tree = SessionTree("s")
    before = tree.held_bytes
    path = array("i", range(1000))
    PromptIds(path).on_path(tree.prompt_text, path, 1000).json(keep=True)
    assert tree.held_bytes - before == len(orjson.dumps(list(range(1000))))


def test_a_prompt_on_a_path_travels_as_its_ids_alone() -> None:
    slot = PathTextSlot()
    path = array("i", [1, 2, 3])
    ids = PromptIds(path).on_path(slot, path, 3)
    ids.json(keep=True)
    back = pickle.loads(pickle.dumps(ids))
    assert list(back) == [1, 2, 3] and getattr(back, "_path", None) is None


def test_a_response_writes_the_text_without_keeping_it() -> None:
    """Only an engine's body keeps the text: a response is written after the turn is counted against the
    session's memory, so a text it kept would go uncounted until the next turn."""
    slot = PathTextSlot()
    path = array("i", [1, 2, 3])
    ids = PromptIds(path).on_path(slot, path, 3)
    assert _written(ids.json()) == [1, 2, 3] and slot.entry is None
    assert wire_ids(ids) is ids.json() and slot.entry is None
    fresh = PromptIds(path).on_path(slot, path, 3)
    assert _written(wire_ids(fresh, to_engine=True)) == [1, 2, 3] and slot.entry is not None


@given(st.lists(INT32, max_size=300), st.lists(INT32, min_size=1, max_size=50), st.lists(INT32, max_size=20))
def test_a_first_prompt_sent_to_an_engine_hands_its_text_on(first: list[int], reply: list[int], new: list[int]) -> None:
    """A session's first prompt, recorded at the start of a tape buffer: the next prompt on that buffer
    is written from its text, and says its own IDs."""
    prompt = FirstPromptIds(first)
    assert _written(wire_ids(prompt, to_engine=True)) == first
    buffer = array("i", [*first, *reply])  # recorded: the prompt, then the reply
    slot = PathTextSlot()
    prompt.hand_on(slot, buffer)
    assert slot.entry is not None and slot.entry.buffer is buffer and slot.entry.count == len(first)
    second = PromptIds(buffer).on_path(slot, buffer, len(buffer))
    second.extend(new)
    assert _written(second.json(keep=True)) == [*first, *reply, *new]


def test_the_second_prompt_writes_only_the_ids_after_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    first = FirstPromptIds(range(10_000))
    first.json(keep=True)
    buffer = array("i", [*range(10_000), 40, 41])
    slot = PathTextSlot()
    first.hand_on(slot, buffer)
    sizes, text = _next_prompt_written(monkeypatch, slot, buffer, [7, 8])
    assert sizes == [2, 2]  # the reply, then the new bridge
    assert _written(text) == [*range(10_000), 40, 41, 7, 8]


def test_a_first_prompt_hands_on_only_what_an_engine_was_sent() -> None:
    """Written for a response only (an engine that takes IDs, not JSON), or not at all, nothing is kept;
    nor on a buffer that does not hold the prompt."""
    buffer = array("i", [1, 2, 3, 4])
    slot = PathTextSlot()
    for prompt in (FirstPromptIds([1, 2, 3]), FirstPromptIds([1, 2, 3])):
        prompt.hand_on(slot, buffer)
        assert wire_ids(prompt) is prompt.json()  # a response's writing: made once, kept by the prompt alone
        prompt.hand_on(slot, buffer)
        assert slot.entry is None
    sent = FirstPromptIds([1, 2, 3, 4, 5])
    sent.json(keep=True)
    sent.hand_on(slot, buffer)  # the buffer is shorter than the prompt: it cannot be the prompt's
    assert slot.entry is None
    grown = FirstPromptIds([1, 2])
    grown.json(keep=True)
    grown.append(3)  # the text no longer says the IDs
    grown.hand_on(slot, buffer)
    assert slot.entry is None


def test_a_first_prompt_travels_as_its_ids_alone() -> None:
    prompt = FirstPromptIds([1, 2, 3])
    prompt.json(keep=True)
    back = pickle.loads(pickle.dumps(prompt))
    assert type(back) is FirstPromptIds and back == [1, 2, 3] and getattr(back, "_json", None) is None
