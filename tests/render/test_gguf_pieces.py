"""Every token of the embedded GGUF vocabulary decodes to its own bytes, the long ones included:
llama-cpp-python's `detokenize` gives each token a 32-byte buffer, and SmolLM2 has tokens up to 81
bytes (a newline and 80 spaces), whose text came back empty or wrong, so a sampled run of
whitespace vanished from the response. Checked against the vocabulary's token strings read from the
file and undone with GPT-2's byte-to-character table, computed here."""

from __future__ import annotations

from pathlib import Path

from tests.support.models import read_gguf_metadata
from tokentape.render.tokenizer import GGUFTokenizer


def _byte_of_char() -> dict[str, int]:
    """GPT-2's table: printable bytes stand for themselves, the rest for code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def test_every_normal_token_decodes_to_its_bytes(model_path: Path, tokenizer: GGUFTokenizer) -> None:
    meta = read_gguf_metadata(model_path)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    tokens, kinds = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert isinstance(tokens, list) and isinstance(kinds, list) and len(tokens) == len(kinds)
    table = _byte_of_char()
    pairs = enumerate(zip(tokens, kinds, strict=True))
    expected = {i: bytes(table[c] for c in text) for i, (text, kind) in pairs if kind == 1}
    long_ones = [i for i, piece in expected.items() if len(piece) > 32]
    assert long_ones, "the vocabulary has tokens longer than llama-cpp-python's 32-byte buffer"
    assert {i: tokenizer.token_bytes(i) for i in expected} == expected
    run = long_ones[:3]
    assert tokenizer.decode(run) == b"".join(expected[i] for i in run).decode("utf-8", "replace")
