"""Hugging Face model directories: `tokenizer.json` (through `tokenizers`) with the chat template and
special tokens of `tokenizer_config.json` / `chat_template.jinja` / `generation_config.json`."""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
import xxhash

from tokentape.core.bounded import BoundedCache
from tokentape.errors import NotFound
from tokentape.render.byte_level import byte_decoder
from tokentape.render.rank_bpe import RankBPE, explain_rank_bpe, identity_on_ascii, normalized_off_ascii
from tokentape.render.template import ChatTemplate

__all__ = ["HFTokenizer", "ascii_twin", "plain_copy", "load_model_dir", "END_OF_TURN_NAMES"]

log = logging.getLogger("tokentape.render")

# Tokens that end a turn in the families tokentape knows; any that a vocabulary has stop generation.
END_OF_TURN_NAMES = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
    "<|user|>",
    "<|observation|>",
    "<end_of_turn>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
)


def ascii_twin(tokenizer: tokenizers.Tokenizer) -> tokenizers.Tokenizer | None:
    """The tokenizer without its normalizer, for ASCII text, when that changes no ID: the normalizer
    is Unicode normalization only (the identity on ASCII) and no normalized added token could match
    differently. Qwen's NFC is about a tenth of an encode of ASCII text (2.96 against 2.69 ms for
    1,100 tokens of code, warm; 3.70 against 3.40 with the caches cold). Built from the same model
    and pre-tokenizer objects (under a millisecond; a serialised copy takes about a second), so the
    two share the model's cache of words; None when there is nothing to skip."""
    normalizer = tokenizer.normalizer
    if normalizer is None or tokenizer.truncation is not None or tokenizer.padding is not None:
        return None
    if not identity_on_ascii(json.loads(normalizer.__getstate__())):
        return None
    if normalized_off_ascii(tokenizer.get_added_tokens_decoder().values()):
        return None
    return _sharing(tokenizer, normalizer=None, encode_special_tokens=tokenizer.encode_special_tokens)


def plain_copy(tokenizer: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """The tokenizer with its special tokens' text read as text (`encode_special_tokens`), the rest as
    it is: built from the same model, normalizer and pre-tokenizer objects (under a millisecond, where
    a serialised copy takes about a second for a large vocabulary); a serialised copy where truncation
    or padding is set, or where the added tokens would not land as they are."""
    if tokenizer.truncation is None and tokenizer.padding is None:
        copy = _sharing(tokenizer, normalizer=tokenizer.normalizer, encode_special_tokens=True)
        if copy is not None:
            return copy
    copy = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = True
    return copy


def _sharing(
    tokenizer: tokenizers.Tokenizer,
    *,
    normalizer: tokenizers.normalizers.Normalizer | None,
    encode_special_tokens: bool,
) -> tokenizers.Tokenizer | None:
    """A tokenizer over the same model and pre-tokenizer objects (so the two share the model's cache of
    words), with this normalizer; None where an added token would not land on its ID with its flags."""
    added = tokenizer.get_added_tokens_decoder()
    twin = tokenizers.Tokenizer(tokenizer.model)
    if normalizer is not None:
        twin.normalizer = normalizer
    twin.pre_tokenizer = tokenizer.pre_tokenizer
    twin.post_processor = tokenizer.post_processor
    twin.decoder = tokenizer.decoder
    twin.encode_special_tokens = encode_special_tokens
    for token_id in sorted(added):  # in ID order, so each lands on its own ID
        token = added[token_id]
        (twin.add_special_tokens if token.special else twin.add_tokens)([token])
    return twin if _flags(twin.get_added_tokens_decoder()) == _flags(added) else None


def _flags(added: Mapping[int, tokenizers.AddedToken]) -> dict[int, tuple[Any, ...]]:
    """Each added token as everything that decides where it matches."""
    return {
        token_id: (token.content, token.special, token.normalized, token.lstrip, token.rstrip, token.single_word)
        for token_id, token in added.items()
    }


class HFTokenizer:
    """A `tokenizers` tokenizer behind the `Tokenizer` protocol."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, *, end_of_turn: Iterable[int] = (), rank_bpe: RankBPE | None = None
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()
        self._added = {token_id: token.content for token_id, token in added.items()}
        self._control = frozenset(token_id for token_id, token in added.items() if token.special)
        named = {tokenizer.token_to_id(name) for name in END_OF_TURN_NAMES}
        self.end_of_turn_ids = frozenset(t for t in {*named, *end_of_turn} if t is not None)
        # the decoder's repr names nested decoders too; serialising the whole tokenizer costs a second
        self._byte_level = "ByteLevel" in repr(tokenizer.decoder)
        self._plain: tokenizers.Tokenizer | None = None  # `encode_plain`'s copy
        self._ascii = ascii_twin(tokenizer)
        self._rank_bpe = rank_bpe  # ASCII text through tiktoken, where it gives these IDs (`render.rank_bpe`)

    def encode(self, text: str) -> list[int]:
        ascii_text = text.isascii()
        if ascii_text and self._rank_bpe is not None:
            try:
                return self._rank_bpe.encode(text)
            except ValueError:  # tiktoken's regex gives up on a run of about a million spaces
                pass
        # the batch route without offsets: the same IDs, a third less time (0.9 against 1.35 ms for a
        # 1k-token tool output; 27 against 31-33 ms for a 19k-token transcript's opening call)
        backend = self._ascii if self._ascii is not None and ascii_text else self._tokenizer
        ids: list[int] = backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return ids

    def encode_plain(self, text: str) -> list[int]:
        if self._rank_bpe is not None and text.isascii():
            try:
                return self._rank_bpe.encode_plain(text)
            except ValueError:  # as in `encode`
                pass
        plain = self._plain
        if plain is None:  # a copy, made once: the flag is the tokenizer's own
            plain = self._plain = plain_copy(self._tokenizer)
        ids: list[int] = plain.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return ids

    @functools.cached_property
    def longest_token_bytes(self) -> int | None:
        """The most bytes of text one token stands for (`render.bounds`); None where the tokenizer may
        drop text or fold a run of it into one token (`_covers_its_text`)."""
        growth = _covers_its_text(self._tokenizer)
        if growth is None:
            return None
        added = self._tokenizer.get_added_tokens_decoder()
        longest = max((len(token.content.encode()) for token in added.values()), default=0)
        pieces = self._tokenizer.get_vocab(with_added_tokens=False)
        if self._byte_level:  # a byte-level character is one byte
            longest = max(longest, max(map(len, pieces), default=0))
        else:  # "\u2581" is a space, the rest UTF-8
            longest = max(longest, max((len(p.replace("\u2581", " ").encode()) for p in pieces), default=0))
        return max(longest, 4) * growth  # 4: one character an unknown token stands for

    @functools.lru_cache(maxsize=262144)  # noqa: B019 - bounded; tokenizers live as long as the server
    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return b"" if token_id in self._control else self._added[token_id].encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = byte_decoder()
            return bytes(table[c] for c in piece if c in table)
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode()

    def special_text(self, token_id: int) -> str:
        return self._added.get(token_id) or self._tokenizer.id_to_token(token_id) or ""

    def decode(self, token_ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", "replace")

    def decode_all(self, token_ids: Sequence[int]) -> str:
        pieces = (self._added[t].encode() if t in self._control else self.token_bytes(t) for t in token_ids)
        return b"".join(pieces).decode("utf-8", "replace")


# how much each Unicode normal form may shrink text, in bytes: NFC joins three Hangul jamo (9 bytes)
# into one syllable (3); NFKC also takes a 4-byte mathematical letter to one ASCII letter
_NORMAL_FORMS = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4}
_KEEPING_SPLITS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"})


def _covers_its_text(tokenizer: tokenizers.Tokenizer) -> int | None:
    """By how much the normalizer may shrink text (1, or `_NORMAL_FORMS`' factor), where every byte of
    text reaches a token that covers at most its own length: a BPE model that fuses no unknowns, a
    normalizer that only composes or adds, a pre-tokenizer that drops nothing, added tokens that strip
    no whitespace. Else None."""
    model = tokenizer.model
    if not isinstance(model, tokenizers.models.BPE) or getattr(model, "fuse_unk", False):
        return None
    if any(token.lstrip or token.rstrip for token in tokenizer.get_added_tokens_decoder().values()):
        return None
    growth = 1
    normalizer = tokenizer.normalizer
    steps = _steps(None if normalizer is None else json.loads(normalizer.__getstate__()), "normalizers")
    for step in steps:
        kind = step.get("type")
        if kind in _NORMAL_FORMS:
            growth = max(growth, _NORMAL_FORMS[kind])
        elif kind == "Prepend" or (
            kind == "Replace" and step.get("pattern") == {"String": " "} and step.get("content") == "\u2581"
        ):
            continue
        else:
            return None
    split = tokenizer.pre_tokenizer
    for step in _steps(None if split is None else json.loads(split.__getstate__()), "pretokenizers"):
        kind = step.get("type")
        if kind not in _KEEPING_SPLITS and not (kind == "Split" and step.get("behavior") != "Removed"):
            return None
    return growth


def _steps(state: Mapping[str, Any] | None, key: str) -> list[Mapping[str, Any]]:
    """A serialised normalizer's or pre-tokenizer's steps (a Sequence's, or itself alone)."""
    if state is None:
        return []
    if state.get("type") == "Sequence":
        return [step for inner in state.get(key) or [] for step in _steps(inner, key)]
    return [state]


def _token_content(value: Any) -> str:
    if isinstance(value, Mapping):
        return str(value.get("content", ""))
    return str(value) if value else ""


def _template_source(directory: Path, config: Mapping[str, Any]) -> str:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    if not isinstance(template, str) or not template:
        raise NotFound(f"{directory} has no chat template (chat_template.jinja or tokenizer_config.json)")
    return template


def _add_declared_tokens(backend: tokenizers.Tokenizer, config: Mapping[str, Any]) -> None:
    """Added tokens that `tokenizer_config.json` declares and `tokenizer.json` lacks, at their declared
    IDs, as transformers adds them (Qwen2-VL's files declare `<|image_pad|>` only there)."""
    declared = config.get("added_tokens_decoder")
    if not isinstance(declared, Mapping):
        return
    for key in sorted(declared, key=lambda k: int(k) if str(k).isdigit() else -1):
        entry = declared[key]
        if not str(key).isdigit() or not isinstance(entry, Mapping) or not isinstance(entry.get("content"), str):
            continue
        if backend.token_to_id(entry["content"]) is not None:
            continue
        if backend.get_vocab_size(with_added_tokens=True) != int(key):
            return  # a gap before it: the IDs would not be the declared ones
        token = tokenizers.AddedToken(
            entry["content"],
            special=bool(entry.get("special", True)),
            normalized=bool(entry.get("normalized", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            single_word=bool(entry.get("single_word", False)),
        )
        backend.add_special_tokens([token]) if token.special else backend.add_tokens([token])


def load_model_dir(directory: Path) -> tuple[ChatTemplate, HFTokenizer]:
    """The chat template and tokenizer of a local model directory (no network)."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise NotFound(f"{directory} has no tokenizer.json")
    config_file = directory / "tokenizer_config.json"
    config_text = config_file.read_bytes() if config_file.is_file() else b"{}"
    config: dict[str, Any] = json.loads(config_text)
    generation_file = directory / "generation_config.json"
    generation = generation_file.read_bytes() if generation_file.is_file() else b""
    tokenizer = _tokenizer(tokenizer_file.read_bytes(), config, config_text, generation)
    template = ChatTemplate(
        _template_source(directory, config),
        bos_token=_token_content(config.get("bos_token")),
        eos_token=_token_content(config.get("eos_token")),
    )
    return template, tokenizer


# tokenizers loaded, by a digest of the three files they are built from: a process that loads the same
# files again (a gateway built in-process for each rollout worker, or each test) shares one, read only;
# a Qwen vocabulary takes about a second to load and holds tens of MB
_TOKENIZERS: BoundedCache[bytes, HFTokenizer] = BoundedCache(8, lambda _: 1)


def _tokenizer(source: bytes, config: Mapping[str, Any], config_text: bytes, generation: bytes) -> HFTokenizer:
    """The tokenizer built from these files' bytes (`config` is `config_text` parsed), loaded once."""
    digest = xxhash.xxh3_128()
    for part in (source, config_text, generation):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    key = digest.digest()
    loaded = _TOKENIZERS.get(key)
    if loaded is None:
        loaded = _load_tokenizer(source, config, generation)
        _TOKENIZERS.put(key, loaded)
    return loaded


def _load_tokenizer(source: bytes, config: Mapping[str, Any], generation: bytes) -> HFTokenizer:
    backend = tokenizers.Tokenizer.from_buffer(source)
    _add_declared_tokens(backend, config)
    end_of_turn: set[int] = set()
    eos = _token_content(config.get("eos_token"))
    if eos and (eos_id := backend.token_to_id(eos)) is not None:
        end_of_turn.add(eos_id)
    if generation:
        ids = json.loads(generation).get("eos_token_id")
        end_of_turn.update([ids] if isinstance(ids, int) else ids or [])
    return HFTokenizer(backend, end_of_turn=end_of_turn, rank_bpe=_rank_bpe(source, backend))


# built tables, and reasons for none, by the file's digest and the added tokens' flags: at most 8
# tables (about 10 MB each for Qwen's vocabulary); a reason weighs nothing, so loading the tokenizers
# that decline does not push a built table out to be built again (a second each)
_RANK_BPES: BoundedCache[tuple[bytes, tuple[Any, ...]], RankBPE | str] = BoundedCache(
    8, lambda built: 0 if isinstance(built, str) else 1, max_items=64
)
_rank_bpes_built = threading.Lock()  # one build at a time, each once


def _rank_bpe(source: bytes, backend: tokenizers.Tokenizer) -> RankBPE | None:
    """The tiktoken twin of a tokenizer loaded from `source`, built once a process for each file and
    set of added tokens (about a second for Qwen's vocabulary on a 2-core machine)."""
    key = (xxhash.xxh3_128_digest(source), tuple(sorted(_flags(backend.get_added_tokens_decoder()).items())))
    with _rank_bpes_built:
        built = _RANK_BPES.get(key)
        if built is None:
            built = explain_rank_bpe(backend, source)
            if isinstance(built, str):
                log.info("ASCII text is tokenized by tokenizers alone: %s", built)
            _RANK_BPES.put(key, built)
    return built if isinstance(built, RankBPE) else None
