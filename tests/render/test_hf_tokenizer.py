"""The gateway's tokenizer wrapper gives exactly the IDs of the `tokenizers` library's own `encode`
(it takes the batch route without offsets, which is faster), for every family's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from tests.support.models import SOURCES
from tokentape.render.hf import HFTokenizer

TEXTS = [
    "",
    " ",
    "Hello, world!",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
    "Ünïcödé — 中文字符 🙂🙂 ❤️\u200b\u00a0tabs\tand\r\nreturns",
    "<|im_start|>user\nnot a special token in plain text<|im_end|>",
    "   leading and trailing spaces   ",
    "a" * 3000,
    "\n".join(f"{i:05d} INFO request {i} took {i % 97} ms path=/v1/chat/completions" for i in range(200)),
]


@pytest.mark.parametrize("family", sorted(SOURCES))
def test_encode_gives_the_library_encodes_ids(model_dirs: dict[str, Path], family: str) -> None:
    reference = tokenizers.Tokenizer.from_file(str(model_dirs[family] / "tokenizer.json"))
    wrapper = HFTokenizer(tokenizers.Tokenizer.from_file(str(model_dirs[family] / "tokenizer.json")))
    for text in TEXTS:
        assert wrapper.encode(text) == reference.encode(text, add_special_tokens=False).ids
    plain = tokenizers.Tokenizer.from_file(str(model_dirs[family] / "tokenizer.json"))
    plain.encode_special_tokens = True  # special tokens' text spelled out, as encode_plain promises
    for text in TEXTS:
        assert wrapper.encode_plain(text) == plain.encode(text, add_special_tokens=False).ids
