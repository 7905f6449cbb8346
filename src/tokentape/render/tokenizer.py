"""Tokenizers behind one small protocol. Text is encoded the way chat templates expect: special
tokens written in the text are parsed as special tokens, and no BOS is added (templates write it)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import tokenizers

from tokentape.render.gguf_vocab import PROBES, fast_tokenizer, read_metadata

__all__ = ["Tokenizer", "GGUFTokenizer"]

_NORMAL_TOKEN = 1  # llama.cpp's token type for a vocabulary piece (others: control, user-defined, byte, ...)


class Tokenizer(Protocol):
    vocab_size: int
    end_of_turn_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        """Token IDs of `text`, special tokens parsed, nothing added."""
        ...

    def encode_plain(self, text: str) -> list[int]:
        """Token IDs of `text` with special-token strings in it taken as plain text."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes a token contributes to visible text (empty for control tokens)."""
        ...

    def special_text(self, token_id: int) -> str:
        """A token's own text, control tokens included (e.g. `<|im_end|>`)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Visible text of a token sequence."""
        ...

    def decode_all(self, token_ids: Sequence[int]) -> str:
        """Text of a token sequence with control tokens written out (what a template renders)."""
        ...


class GGUFTokenizer:
    """The vocabulary stored in a GGUF file, loaded alone (no weights) through llama.cpp.

    Text is encoded by a `tokenizers` copy of the same BPE where the file's pre-tokenizer recipe is
    known (gguf_vocab.py) and the copy splits every probe text exactly as llama.cpp does; by llama.cpp
    otherwise, and for text `tokenizers` cannot take (lone surrogates)."""

    def __init__(self, model_path: Path) -> None:
        from tokentape.native import llama_cpp as load

        llama_cpp = load()
        self._path = model_path
        self._llama = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(self._llama.model)
        self._vocab = vocab
        self._tokenize = llama_cpp.llama_tokenize
        self._to_piece = llama_cpp.llama_token_to_piece
        self._bos = self._llama.token_bos()
        self._token_array = llama_cpp.llama_token
        self.vocab_size: int = self._llama.n_vocab()
        self.end_of_turn_ids = frozenset(t for t in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, t))
        self.metadata: dict[str, str] = dict(self._llama.metadata)
        copy = fast_tokenizer(model_path)
        self._fast = copy if copy is not None and self._agrees(copy) else None

    @property
    def fast(self) -> bool:
        """Whether text is encoded by the `tokenizers` copy."""
        return self._fast is not None

    def _agrees(self, copy: tokenizers.Tokenizer) -> bool:
        # the tokens with no visible bytes are control tokens, all of which the copy holds as added
        # tokens: only those are asked of llama.cpp, not the 49k pieces of the whole vocabulary
        added = sorted(copy.get_added_tokens_decoder())
        specials = [self.special_text(t) for t in added if not self.token_bytes(t)]
        probes = [*PROBES, "".join(specials), " ".join(specials)]
        return all(copy.encode(text, add_special_tokens=False).ids == self.llama_encode(text) for text in probes)

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            try:
                # the batch route: the same IDs, without offsets, and with the GIL let go while it
                # runs (`encode` holds it throughout: 7.5 s of a 6 MB text, every other thread stopped)
                ids: list[int] = self._fast.encode_batch_fast([text], add_special_tokens=False)[0].ids
                return ids
            except TypeError:  # text that is not valid Unicode (a lone surrogate): llama.cpp takes its bytes
                pass
        return self.llama_encode(text)

    def encode_plain(self, text: str) -> list[int]:
        return self.llama_encode(text, special=False)

    def llama_encode(self, text: str, *, special: bool = True) -> list[int]:
        """llama.cpp's encoding (the reference); `special`: special-token strings parsed."""
        # llama.cpp's own call, with a buffer as long as the text can need (a token covers at least one
        # byte): llama-cpp-python's wrapper tries a buffer of the training context first, which a
        # vocabulary-only model reports as 0, so it tokenized every text twice
        data = text.encode("utf-8", "surrogatepass")
        room = len(data) + 2
        tokens = (self._token_array * room)()
        count = self._tokenize(self._vocab, data, len(data), tokens, room, False, special)
        if count < 0:
            raise RuntimeError(f"llama.cpp could not tokenize {len(data)} bytes (it needed {-count} tokens)")
        ids: list[int] = tokens[:count]
        return ids

    @functools.cached_property
    def longest_token_bytes(self) -> int | None:
        """The most bytes of text one token stands for (`render.bounds`), from the file's own token
        strings; None for vocabularies whose tokenizer may drop or fold text (WordPiece, Unigram)."""
        keys = frozenset({"tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"})
        meta = read_metadata(self._path, keys)
        model, tokens = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.tokens")
        kinds = meta.get("tokenizer.ggml.token_type") or [_NORMAL_TOKEN] * len(tokens or ())
        if model not in ("gpt2", "llama") or not tokens:
            return None
        # a byte-level character is one byte, an SPM piece writes a space as "\u2581", and any other
        # token (special, user-defined, byte) as UTF-8: each length is at least what the token covers
        longest = 0
        for token, kind in zip(tokens, kinds, strict=False):
            if kind == _NORMAL_TOKEN:
                length = len(token) if model == "gpt2" else len(token.replace("\u2581", " ").encode())
            else:
                length = len(token.encode())
            longest = max(longest, length)
        return max(longest, 4)  # an unknown character is one token of up to 4 bytes

    def _piece(self, token_id: int, special: bool) -> bytes:
        """One token's bytes, from llama.cpp's own `llama_token_to_piece`, in a buffer as long as the
        piece needs: llama-cpp-python's `detokenize` gives every token 32 bytes and keeps whatever a
        longer one (SmolLM2's newline and 80 spaces) left in it."""
        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            written = self._to_piece(self._vocab, token_id, buffer, size, 0, special)
            if written >= 0:
                return buffer.raw[:written]
            size = -written  # too short: llama.cpp says how long a buffer the piece needs

    def _text(self, token_ids: Sequence[int], special: bool) -> bytes:
        text = b"".join(self.token_bytes(t) if not special else self._piece(t, True) for t in token_ids)
        # as llama.cpp's detokenizing: the space a beginning-of-sequence token leaves before the text goes
        if token_ids and token_ids[0] == self._bos and text[:1] == b" ":
            return text[1:]
        return text

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one tokenizer per process, bounded cache
    def token_bytes(self, token_id: int) -> bytes:
        return self._piece(token_id, False)

    @functools.lru_cache(maxsize=4096)  # noqa: B019
    def special_text(self, token_id: int) -> str:
        return self._piece(token_id, True).decode("utf-8", "replace")

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._text(token_ids, False).decode("utf-8", "replace")

    def decode_all(self, token_ids: Sequence[int]) -> str:
        return self._text(token_ids, True).decode("utf-8", "replace")

    def token_name(self, key: str) -> str:
        """The text of a special token named in the GGUF metadata (e.g. `tokenizer.ggml.eos_token_id`)."""
        value = self.metadata.get(key)
        return self.special_text(int(value)) if value is not None else ""
