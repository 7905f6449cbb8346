"""The lower bound on token counts from text length (`render.bounds`): each vocabulary's longest token
in bytes, checked against llama.cpp's own pieces; the bound never above the real count, on texts
made to pack the most text into the fewest tokens; and the embedded tokenizer letting other threads
run while it encodes a long text."""

from __future__ import annotations

import asyncio
import ctypes
import time
from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken, models, pre_tokenizers

from tests.support.models import materialise
from tokentape.render.gguf_vocab import PROBES
from tokentape.render.hf import HFTokenizer, load_model_dir
from tokentape.render.renderer import Renderer
from tokentape.render.tokenizer import GGUFTokenizer, Tokenizer


def _dense_texts(tokenizer: Tokenizer) -> list[str]:
    """Texts that pack much text into few tokens: whitespace runs (the longest pieces of most
    vocabularies), special-token strings back to back, and ordinary text, digits and scripts."""
    specials = [tokenizer.special_text(t) for t in range(tokenizer.vocab_size) if not tokenizer.token_bytes(t)]
    return [
        ("\n" + " " * 80) * 200,
        " " * 20_000,
        "\t" * 5_000 + "\n" * 5_000,
        "".join(specials) * 20,
        "-" * 10_000 + "=" * 10_000,
        *(probe * 50 for probe in PROBES if probe),
    ]


def _piece(tokenizer: GGUFTokenizer, token: int) -> bytes:
    """llama.cpp's own text of a token, control tokens written out, into a buffer that holds any piece
    (llama-cpp-python's `detokenize` gives each token 32 bytes)."""
    from tokentape.native import llama_cpp as load

    llama_cpp = load()
    buffer = (ctypes.c_char * 1024)()
    count = llama_cpp.llama_token_to_piece(tokenizer._vocab, token, buffer, 1024, 0, True)
    assert 0 <= count <= 1024
    return bytes(buffer[:count])


def test_the_embedded_vocabularys_longest_token_is_what_llama_cpp_writes(tokenizer: GGUFTokenizer) -> None:
    # independent: every token's text as llama.cpp writes it, against the figure read from the file's
    # token strings
    longest = max(len(_piece(tokenizer, t)) for t in range(tokenizer.vocab_size))
    assert tokenizer.longest_token_bytes == longest == 81  # a newline and 80 spaces


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.2"])
def test_hugging_face_vocabularies_bound_their_tokens(name: str, tmp_path: Path) -> None:
    _, tokenizer = load_model_dir(materialise(name, tmp_path))
    span = tokenizer.longest_token_bytes
    assert span is not None
    widest = max(len(tokenizer.token_bytes(t)) for t in range(tokenizer.vocab_size))
    assert span >= widest
    for text in _dense_texts(tokenizer):
        assert len(tokenizer.encode(text)) >= len(text) // span, text[:40]


def test_the_embedded_bound_holds_on_dense_texts(tokenizer: GGUFTokenizer) -> None:
    span = tokenizer.longest_token_bytes
    assert span is not None
    for text in _dense_texts(tokenizer):
        tokens = len(tokenizer.llama_encode(text))  # llama.cpp's own count, the reference
        assert tokens >= len(text) // span, (text[:40], tokens, len(text) // span)


def test_added_tokens_that_strip_whitespace_leave_no_bound() -> None:
    """`rstrip` swallows the whitespace after the token: one token for any run, so no bound holds."""
    backend = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, " ": 1}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.add_special_tokens([AddedToken("<x>", rstrip=True, special=True)])
    tokenizer = HFTokenizer(backend)
    assert len(tokenizer.encode("<x>" + " " * 1000)) < 1003 // 4  # what a bound of 4 bytes a token would claim
    assert tokenizer.longest_token_bytes is None


def test_the_renderer_sees_what_its_template_writes_as_sent(renderer: Renderer) -> None:
    floor = renderer.floor
    assert floor is not None and floor.span == 81
    # SmolLM2's template writes user content as sent; its tools are listed by the renderer as JSON
    assert floor.verbatim.user == "whole" and floor.verbatim.tools


async def test_encoding_a_long_text_on_a_thread_leaves_the_event_loop_free(tokenizer: GGUFTokenizer) -> None:
    """`tokenizers`' `encode` held the GIL for the whole of a long text: on a worker thread it still
    stopped the event loop (12.7 s for a 6 MB message). Its batch route lets it go while it runs."""
    assert tokenizer.fast
    text = "<|im_start|>user\n" + "the quick brown fox jumps over the lazy dog and runs " * 40_000 + "<|im_end|>\n"
    lags: list[float] = []

    async def tick() -> None:
        while True:
            asked = time.monotonic() + 0.01
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - asked)

    ticker = asyncio.create_task(tick())
    try:
        ids = await asyncio.to_thread(tokenizer.encode, text)
    finally:
        ticker.cancel()
    assert ids == tokenizer.llama_encode(text)  # the same IDs as llama.cpp's
    assert len(lags) > 1 and max(lags) < 0.5, max(lags, default=None)
