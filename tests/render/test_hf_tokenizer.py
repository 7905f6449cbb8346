"""The gateway's tokenizer wrapper gives exactly the IDs of the `tokenizers` library's own `encode`
(it takes the batch route without offsets, which is faster, and skips a Unicode normalizer for ASCII
text, which that leaves as it is), for every family's tokenizer."""

from __future__ import annotations

import functools
from pathlib import Path

import orjson
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import models, normalizers, pre_tokenizers

from tests.support.models import SOURCES
from tokentape.render.hf import HFTokenizer, ascii_twin, plain_copy

TEXTS = [
    "",
    " ",
    "Hello, world!",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
    "Ünïcödé — 中文字符 🙂🙂 ❤️\u200b\u00a0tabs\tand\r\nreturns",
    "<|im_start|>user\nnot a special token in plain text<|im_end|>",
    "   leading and trailing spaces   ",
    "a" * 3000,
    "cafe\u0301 nai\u0308ve re\u0301sume\u0301",  # NFC changes the IDs of this one
    "\n".join(f"{i:05d} INFO request {i} took {i % 97} ms path=/v1/chat/completions" for i in range(200)),
]


@pytest.mark.parametrize("family", sorted(SOURCES))
def test_encode_gives_the_library_encodes_ids(model_dirs: dict[str, Path], family: str) -> None:
    reference = _library(str(model_dirs[family] / "tokenizer.json"))
    wrapper = HFTokenizer(tokenizers.Tokenizer.from_file(str(model_dirs[family] / "tokenizer.json")))
    for text in TEXTS:
        assert wrapper.encode(text) == reference.encode(text, add_special_tokens=False).ids
    loaded = reference.encode_special_tokens
    reference.encode_special_tokens = True  # special tokens' text spelled out, as encode_plain promises
    try:
        for text in TEXTS:
            assert wrapper.encode_plain(text) == reference.encode(text, add_special_tokens=False).ids
    finally:
        reference.encode_special_tokens = loaded  # as loaded, for the other tests that read it


@functools.cache
def _library(path: str) -> tokenizers.Tokenizer:
    """The library's tokenizer as the reference, loaded once a process (about half a second for a large
    vocabulary) and only read: each wrapper under test wraps a tokenizer of its own."""
    return tokenizers.Tokenizer.from_file(path)


# NFC composes these (e and a combining acute accent, i and a diaeresis): the normalizer changes the IDs
DECOMPOSED = "cafe\u0301 nai\u0308ve re\u0301sume\u0301"


@pytest.mark.parametrize("family", sorted(SOURCES))
def test_the_ascii_twin_is_the_tokenizer_without_its_normalizer(model_dirs: dict[str, Path], family: str) -> None:
    original = _library(str(model_dirs[family] / "tokenizer.json"))
    twin = ascii_twin(original)
    spec = orjson.loads(original.to_str())  # a whole vocabulary: orjson parses it in a tenth of the time
    # NFC alone (Qwen's, MiniMax's) always gets one; none, or an empty sequence, has nothing to skip
    assert (twin is not None) == (spec["normalizer"] == {"type": "NFC"})
    if twin is not None:
        spec["normalizer"] = None
        assert orjson.loads(twin.to_str()) == spec


def test_text_that_is_not_ascii_keeps_the_normalizer(model_dirs: dict[str, Path]) -> None:
    path = str(model_dirs["qwen2.5"] / "tokenizer.json")
    reference = _library(path)
    twin = ascii_twin(reference)  # reads it only: the twin shares its model, pre-tokenizer and decoder
    assert twin is not None
    expected = reference.encode(DECOMPOSED, add_special_tokens=False).ids
    assert twin.encode(DECOMPOSED, add_special_tokens=False).ids != expected  # the case tells them apart
    assert _qwen(model_dirs).encode(DECOMPOSED) == expected


_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.one_of(st.text(alphabet=st.characters(max_codepoint=127), max_size=40), st.sampled_from(_SPECIALS)),
        max_size=12,
    )
)
def test_any_ascii_text_gets_the_librarys_ids(model_dirs: dict[str, Path], pieces: list[str]) -> None:
    text = "".join(pieces)
    tokenizer = _qwen(model_dirs)
    assert tokenizer._ascii is not None
    assert tokenizer.encode(text) == _qwen_reference(model_dirs).encode(text, add_special_tokens=False).ids


@functools.cache
def _qwen_pair(path: str) -> tuple[HFTokenizer, tokenizers.Tokenizer]:
    return HFTokenizer(tokenizers.Tokenizer.from_file(path)), _library(path)


def _qwen(model_dirs: dict[str, Path]) -> HFTokenizer:
    return _qwen_pair(str(model_dirs["qwen2.5"] / "tokenizer.json"))[0]


def _qwen_reference(model_dirs: dict[str, Path]) -> tokenizers.Tokenizer:
    return _qwen_pair(str(model_dirs["qwen2.5"] / "tokenizer.json"))[1]


def _word_level(normalizer: normalizers.Normalizer | None, added: list[tokenizers.AddedToken]) -> tokenizers.Tokenizer:
    vocab = {"[UNK]": 0, "k": 1, "K": 2, "abc": 3}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.normalizer = normalizer
    tokenizer.add_special_tokens(added)
    return tokenizer


@pytest.mark.parametrize(
    ("normalizer", "added", "twinned"),
    [
        (normalizers.NFC(), [], True),
        (normalizers.NFKC(), [tokenizers.AddedToken("<end>", normalized=True)], True),
        (normalizers.Sequence([normalizers.NFD(), normalizers.NFKC()]), [], True),
        (normalizers.Lowercase(), [], False),  # not the identity on ASCII
        (normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()]), [], False),
        (normalizers.Replace("a", "b"), [], False),
        (None, [], False),  # nothing to skip
        # NFKC takes the Kelvin sign to K: in ASCII text, the original matches this token and a twin would not
        (normalizers.NFKC(), [tokenizers.AddedToken("\u212a", normalized=True)], False),
    ],
)
def test_a_twin_only_where_skipping_the_normalizer_changes_no_id(
    normalizer: normalizers.Normalizer | None, added: list[tokenizers.AddedToken], twinned: bool
) -> None:
    tokenizer = _word_level(normalizer, added)
    twin = ascii_twin(tokenizer)
    assert (twin is not None) == twinned
    plain = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    plain.encode_special_tokens = True
    for text in ("abc K k", "ABC", "x K abc <end>", "\u212a <end> K\u212a"):
        assert HFTokenizer(tokenizer).encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
        # encode_plain's copy shares the objects too, with the normalizer
        assert HFTokenizer(tokenizer).encode_plain(text) == plain.encode(text, add_special_tokens=False).ids


def test_a_kelvin_sign_token_matches_in_ascii_text_under_nfkc() -> None:
    """Why such a tokenizer gets no twin: its normalized added token matches plain ASCII text."""
    tokenizer = _word_level(normalizers.NFKC(), [tokenizers.AddedToken("\u212a", normalized=True)])
    kelvin = tokenizer.token_to_id("\u212a")
    assert tokenizer.encode("abc K", add_special_tokens=False).ids == [3, kelvin]
    twin = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    twin.normalizer = None
    assert twin.encode("abc K", add_special_tokens=False).ids == [3, 2]


def test_a_tokenizer_that_truncates_gets_no_twin() -> None:
    tokenizer = _word_level(normalizers.NFC(), [])
    tokenizer.enable_truncation(2)
    assert ascii_twin(tokenizer) is None
    plain = plain_copy(tokenizer)  # a serialised copy: the shared objects would not carry the truncation
    assert plain.encode_special_tokens and plain.truncation == tokenizer.truncation
    assert plain.encode("abc k K abc", add_special_tokens=False).ids == [3, 1]
