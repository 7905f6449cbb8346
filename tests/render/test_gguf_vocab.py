"""The `tokenizers` copy of a GGUF vocabulary (render/gguf_vocab.py): its header reader against what
llama.cpp loaded from the same file, and its tokenization against llama.cpp's on random text."""

from __future__ import annotations

import random
from pathlib import Path

import llama_cpp
import pytest

from tokentape.render import gguf_vocab
from tokentape.render.gguf_vocab import fast_tokenizer, read_metadata
from tokentape.render.tokenizer import GGUFTokenizer

TOKENS, TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"


def test_the_header_reader_agrees_with_llama_cpp(model_path: Path, tokenizer: GGUFTokenizer) -> None:
    keys = frozenset({TOKENS, TYPES, "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id"})
    ours = read_metadata(model_path, keys)
    assert set(ours) == keys
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id"):
        assert str(ours[key]) == tokenizer.metadata[key], key
    vocab = tokenizer._vocab
    assert len(ours[TOKENS]) == len(ours[TYPES]) == llama_cpp.llama_vocab_n_tokens(vocab)
    control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    for token_id, (text, kind) in enumerate(zip(ours[TOKENS], ours[TYPES], strict=True)):
        assert text.encode() == llama_cpp.llama_vocab_get_text(vocab, token_id), token_id
        assert (kind == 3) == bool(llama_cpp.llama_vocab_get_attr(vocab, token_id) & control), token_id


def _random_texts(tokenizer: GGUFTokenizer, count: int, seed: int) -> list[str]:
    """Text that stresses pre-tokenization: vocabulary pieces, digits, whitespace runs, scripts,
    emoji, contractions and special tokens, in random order."""
    rng = random.Random(seed)
    specials = [tokenizer.special_text(t) for t in range(tokenizer.vocab_size) if not tokenizer.token_bytes(t)]
    words = [tokenizer.decode([t]) for t in rng.sample(range(300, tokenizer.vocab_size), 3000)]
    pieces = [*"abcXYZ 0123456789\n\t.,;:!?'\"-_()[]{}<>/\\|@#$%^&*+=~`", "é", "ü", "ß", "中", "日本", "😀"]
    pieces += ["👍🏽", "\u200b", "\u00a0", "א", "ж", " 's", "'re", " 've", "n't", "  ", "   ", "\r\n", "\n\n\n", "<|"]
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randrange(0, 40)):
            roll = rng.random()
            parts.append(rng.choice(specials if roll < 0.05 else words if roll < 0.3 else pieces))
        texts.append("".join(parts))
    return texts


def test_the_fast_tokenizer_splits_text_as_llama_cpp_does(tokenizer: GGUFTokenizer) -> None:
    assert tokenizer.fast  # the embedded SmolLM2 vocabulary has a known recipe
    for text in _random_texts(tokenizer, 20_000, seed=5):
        assert tokenizer.encode(text) == tokenizer.llama_encode(text), repr(text)
    long = " ".join(_random_texts(tokenizer, 200, seed=6))
    assert tokenizer.encode(long) == tokenizer.llama_encode(long)


def test_text_the_copy_cannot_take_is_encoded_by_llama_cpp(tokenizer: GGUFTokenizer) -> None:
    text = "a\ud800b"  # a lone surrogate: not Unicode text, yet llama.cpp takes its bytes
    assert tokenizer.encode(text) == tokenizer.llama_encode(text) != []


def test_a_copy_that_disagrees_on_a_probe_is_not_used(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def with_a_space_prefix(path: Path) -> object:
        fast = fast_tokenizer(path)
        assert fast is not None
        fast.pre_tokenizer = gguf_vocab.pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
        return fast

    monkeypatch.setattr("tokentape.render.tokenizer.fast_tokenizer", with_a_space_prefix)
    tokenizer = GGUFTokenizer(model_path)
    assert not tokenizer.fast  # "hello world" would start with " hello": llama.cpp encodes
    assert tokenizer.encode("hello world") == tokenizer.llama_encode("hello world")


def test_an_unknown_recipe_is_not_copied(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = read_metadata

    def renamed(path: Path, keys: frozenset[str]) -> dict[str, object]:
        return {**real(path, keys), "tokenizer.ggml.pre": "llama-bpe"}

    monkeypatch.setattr(gguf_vocab, "read_metadata", renamed)
    assert fast_tokenizer(model_path) is None
