"""Incremental text: UTF-8 split anywhere across tokens, stop strings split anywhere across deltas."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.support.splitting import split_at
from tokentape.core.text import StopStringFilter, TextAssembler

texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)


@given(texts, st.lists(st.integers(0, 200), max_size=10))
def test_utf8_split_across_tokens_is_reassembled(text: str, cuts: list[int]) -> None:
    assembler = TextAssembler()
    out = "".join(assembler.feed(piece) for piece in split_at(text.encode(), cuts)) + assembler.finish()
    assert out == text


@given(st.lists(st.sampled_from([b"a", b" x", b"\n", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"\xff"]), max_size=12))
def test_any_bytes_in_any_pieces_decode_as_the_whole_does(pieces: list[bytes]) -> None:
    # ASCII pieces beside held-back lead bytes and invalid ones: the incremental text is the one-shot decode
    assembler = TextAssembler()
    out = "".join(assembler.feed(piece) for piece in pieces) + assembler.finish()
    assert out == b"".join(pieces).decode("utf-8", errors="replace")


def test_a_character_cut_by_truncation_becomes_one_replacement_character() -> None:
    assembler = TextAssembler()
    emitted = assembler.feed("ok é".encode()[:-1])
    assert emitted == "ok "
    assert assembler.finish() == "\ufffd"


@given(
    texts, st.lists(st.integers(0, 60), max_size=8), st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3)
)
def test_stop_strings_cut_the_text_wherever_the_deltas_split(text: str, cuts: list[int], stops: list[str]) -> None:
    deltas = split_at(text, cuts)
    filt = StopStringFilter(stops)
    out = "".join(filt.feed(d) for d in deltas) + filt.finish()
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        assert filt.stopped
        assert out == text[: min(hits)]
    else:
        assert not filt.stopped
        assert out == text


def test_text_that_may_start_a_stop_string_is_held_back() -> None:
    filt = StopStringFilter(["</answer>"])
    assert filt.feed("42</ans") == "42"
    assert filt.feed("wer> more") == ""
    assert filt.stopped


@st.composite
def _text_with_overlapping_stops(draw: st.DrawFn) -> tuple[str, list[str]]:
    """Text over a small alphabet, a stop cut from it and a shorter stop inside that one (starting
    later), plus a few more: the stops overlap and nest, which is where cutting goes wrong."""
    text = draw(st.text(alphabet="abcd", min_size=2, max_size=16))
    start = draw(st.integers(0, len(text) - 2))
    longer = text[start : draw(st.integers(start + 2, min(len(text), start + 5)))]
    inner = draw(st.integers(1, len(longer) - 1))
    stops = [longer, longer[inner : draw(st.integers(inner + 1, len(longer)))]]
    stops += draw(st.lists(st.text(alphabet="abcd", min_size=1, max_size=4), max_size=2))
    return text, draw(st.permutations(stops))


@given(_text_with_overlapping_stops(), st.lists(st.integers(0, 16), max_size=8))
def test_overlapping_stop_strings_cut_at_the_earliest_match_however_the_deltas_split(
    case: tuple[str, list[str]], cuts: list[int]
) -> None:
    text, stops = case
    filt = StopStringFilter(stops)
    out = "".join(filt.feed(d) for d in split_at(text, cuts)) + filt.finish()
    earliest = min(i for i in (text.find(s) for s in stops) if i >= 0)  # at least one stop is in the text
    assert filt.stopped and out == text[:earliest]


def test_a_longer_stop_that_starts_earlier_wins_over_a_shorter_one_inside_it() -> None:
    for deltas in (["abcd"], list("abcd"), ["ab", "cd"], ["abc", "d"]):
        filt = StopStringFilter(["bcd", "c"])
        assert "".join(filt.feed(d) for d in deltas) + filt.finish() == "a", deltas
        assert filt.stopped
    filt = StopStringFilter(["bcd", "c"])  # "bcx": the longer stop never completes; "c" cuts
    assert "".join(filt.feed(d) for d in "abcx") + filt.finish() == "ab"
