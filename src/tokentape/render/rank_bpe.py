"""Byte-level BPE on ASCII text through tiktoken, built only where it gives `tokenizers`' own IDs.

`tokenizers` merges, in a word, the adjacent pair listed first in `merges`; tiktoken merges the pair
whose concatenation has the lowest rank (its ID), and takes a word that is itself a token whole. On
1,100 tokens of code tiktoken takes a quarter of the time. The two agree when (checked on the ASCII
part of the vocabulary, the only part ASCII text reaches):

1. every merge makes a token, and the merges are listed in the order of the IDs they make, so both
   follow one order and each token has one merge;
2. every multi-byte token comes out whole when the model encodes it as a word ("reachable").

Then, by induction on the length of a word: say tiktoken merges a pair into `t`. The merges inside
`t`'s bytes ran as they run on `t` alone (a merge across its edge would have taken a byte away), so
the pair is the last step of `t` alone, which by (2) and the induction `tokenizers` takes through a
listed merge; as the lowest rank among pairs that make tokens, it is listed first among those in
`merges`. A token that is not reachable is never made by either, so it only differs where tiktoken
takes a whole word: it is left out of tiktoken's table. (A model with `ignore_merges` takes whole
words too, and would hide from the check which tokens merges reach: it declines.)

Words must come from the same split: one regex split and a byte-level mapping (tiktoken keeps only
the regex's matches, so the regex must match everywhere), a normalizer that is the identity on ASCII,
and plain added tokens (no stripping; none begins another, since tiktoken takes the first of its
alternation and `tokenizers` the longest).
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import tiktoken
import tokenizers
from tokenizers import pre_tokenizers

from tokentape.render.byte_level import byte_decoder

__all__ = ["RankBPE", "explain_rank_bpe", "identity_on_ascii", "normalized_off_ascii", "BYTE_LEVEL_PATTERN"]

# ByteLevel(use_regex=True)'s own split: GPT-2's pattern
BYTE_LEVEL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Unicode normal forms leave ASCII text as it is; case folding, replacements and prefixes do not.
_NORMAL_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
_ASCII = "".join(map(chr, range(128)))
_ALL_PAIRS = "".join(a + b for a in _ASCII for b in _ASCII)
_SEPARATOR = "\uffff"  # not a byte-level character
_CHUNKS = 16  # the reachability check runs in parallel over this many texts


def identity_on_ascii(normalizer: Mapping[str, Any] | None) -> bool:
    """Whether a serialised normalizer leaves every ASCII text as it is."""
    if normalizer is None:
        return True
    if normalizer.get("type") == "Sequence":
        return all(identity_on_ascii(step) for step in normalizer.get("normalizers", []))
    return normalizer.get("type") in _NORMAL_FORMS


@dataclass(frozen=True, slots=True)
class RankBPE:
    """tiktoken over the ASCII part of a vocabulary; `encode*` take ASCII text only, and raise
    ValueError where tiktoken's regex engine gives up (its backtracking stack: a run of about a
    million spaces), which `tokenizers` splits."""

    encoding: tiktoken.Encoding
    parsed: frozenset[str]  # added tokens `encode` takes as tokens
    parsed_plain: frozenset[str]  # those `encode_plain` does (the non-special ones)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special=self.parsed, disallowed_special=())

    def encode_plain(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special=self.parsed_plain, disallowed_special=())


class _Declined(Exception):
    pass


def explain_rank_bpe(tokenizer: tokenizers.Tokenizer, source: bytes) -> RankBPE | str:
    """The tiktoken twin of `tokenizer` (loaded from `source`, a `tokenizer.json`; added tokens as
    the tokenizer holds them), or why there is none."""
    try:
        return _build(tokenizer, source)
    except _Declined as reason:
        return str(reason)


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise _Declined(reason)


def _build(tokenizer: tokenizers.Tokenizer, source: bytes) -> RankBPE:
    # what the tokenizer's objects tell cheaply first; the vocabulary is parsed only if they pass
    model = tokenizer.model
    _require(isinstance(model, tokenizers.models.BPE), "not a BPE model")
    assert isinstance(model, tokenizers.models.BPE)
    for option in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
        _require(not getattr(model, option), f"the model sets {option}")
    # the reachability check encodes each token as a word, which ignore_merges takes whole unmerged
    _require(not model.ignore_merges, "the model takes words that are tokens whole (ignore_merges)")
    _require(tokenizer.truncation is None and tokenizer.padding is None, "truncation or padding is set")
    _require(not tokenizer.encode_special_tokens, "special tokens are encoded as text")
    normalizer = _state(tokenizer.normalizer)
    _require(identity_on_ascii(normalizer), "the normalizer changes ASCII text")
    pattern = _split_pattern(_state(tokenizer.pre_tokenizer))
    parsed, parsed_plain = _added_tokens(tokenizer, normalized_matter=normalizer is not None)
    spelled = _ascii_tokens(source)
    unreached = _unreached(tokenizer, spelled)  # tiktoken would take a word equal to one whole
    table = _latin1_table()
    # the table (about 10 MB for Qwen's vocabulary) is made last, into the room the parsed file left
    ranks = {
        piece.translate(table).encode("latin-1"): rank for piece, rank in spelled.items() if piece not in unreached
    }
    encoding = tiktoken.Encoding("tokentape-ascii", pat_str=pattern, mergeable_ranks=ranks, special_tokens=parsed)
    # tiktoken keeps only the regex's matches; `tokenizers`' isolated split keeps the text between too
    _require(encoding.decode_bytes(encoding.encode_ordinary(_ALL_PAIRS)) == _ALL_PAIRS.encode(), "the split skips text")
    return RankBPE(encoding, frozenset(parsed), frozenset(parsed_plain))


def _state(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's serialised form."""
    return None if component is None else json.loads(component.__getstate__())


def _split_pattern(pre_tokenizer: Mapping[str, Any] | None) -> str:
    _require(pre_tokenizer is not None, "no pre-tokenizer")
    assert pre_tokenizer is not None
    if pre_tokenizer.get("type") == "ByteLevel":
        _require(bool(pre_tokenizer.get("use_regex", True)), "ByteLevel without its split")
        _require(not pre_tokenizer.get("add_prefix_space", True), "ByteLevel adds a prefix space")
        return BYTE_LEVEL_PATTERN
    steps = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" else None
    _require(isinstance(steps, list) and len(steps) == 2, "the pre-tokenizer is not one split and byte-level")
    assert isinstance(steps, list)
    split, level = steps
    plain_level = not level.get("use_regex", True) and not level.get("add_prefix_space", True)
    _require(level.get("type") == "ByteLevel" and plain_level, "the second pre-tokenizer is not plain byte-level")
    _require(
        split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert"),
        "the first pre-tokenizer is not an isolating split",
    )
    pattern = (split.get("pattern") or {}).get("Regex")
    _require(isinstance(pattern, str), "the split is not a regex")
    assert isinstance(pattern, str)
    return pattern


def normalized_off_ascii(tokens: Iterable[tokenizers.AddedToken]) -> bool:
    """Whether an added token that is matched on normalized text is not ASCII: NFKC takes some such
    tokens (a fullwidth bar, the Kelvin sign) to ASCII, so they match ASCII text."""
    return any(token.normalized and not token.content.isascii() for token in tokens)


def _added_tokens(tokenizer: tokenizers.Tokenizer, *, normalized_matter: bool) -> tuple[dict[str, int], set[str]]:
    """(the ASCII added tokens `encode` parses, with their IDs; those `encode_plain` parses)."""
    added = tokenizer.get_added_tokens_decoder()
    for token in added.values():
        _require(not (token.lstrip or token.rstrip or token.single_word), f"{token.content!r} strips or is a word")
        _require(bool(token.content), "an empty added token")
    _require(not (normalized_matter and normalized_off_ascii(added.values())), "a normalized token")
    parsed = {token.content: token_id for token_id, token in added.items() if token.content.isascii()}
    contents = sorted(parsed)
    for shorter, longer in itertools.pairwise(contents):  # sorted, whatever a token begins sorts right after it
        _require(not longer.startswith(shorter), f"{shorter!r} begins {longer!r}")
    parsed_plain = {token.content for token in added.values() if token.content.isascii() and not token.special}
    return parsed, parsed_plain


def _ascii_tokens(source: bytes) -> dict[str, int]:
    """The vocabulary's ASCII tokens by their byte-level spelling, after checking the vocabulary is
    byte-level and its merges are in order (the parsed file is let go on return)."""
    model = orjson.loads(source).get("model") or {}
    vocab: dict[str, int] = model.get("vocab") or {}
    joined = _SEPARATOR.join(vocab)
    _require(set(joined) <= {*byte_decoder(), _SEPARATOR}, "the vocabulary is not byte-level")
    _require(len(set(vocab.values())) == len(vocab), "two tokens share an ID")
    as_latin1 = joined.translate(_latin1_table()).split(_SEPARATOR)  # one pass in C, not one a token
    spelled = {
        piece: rank for piece, latin1, rank in zip(vocab, as_latin1, vocab.values(), strict=True) if latin1.isascii()
    }
    ascii_bytes = [char for char, byte in byte_decoder().items() if byte < 128]
    _require(all(char in spelled for char in ascii_bytes), "an ASCII byte has no token")
    _check_merge_order(model.get("merges") or [], spelled)
    return spelled


def _check_merge_order(merges: list[Any], spelled: Mapping[str, int]) -> None:
    """Merges that make ASCII tokens are listed in the order of those tokens' IDs, one per token."""
    get = spelled.get
    if merges and isinstance(merges[0], str):
        made = [get(merge.replace(" ", "", 1), -1) for merge in merges]
    else:
        made = [get(left + right, -1) for left, right in merges]
    ids = np.asarray(made, dtype=np.int64)
    ids = ids[ids >= 0]
    _require(bool(np.all(ids[1:] > ids[:-1])), "the merges are not listed in the order of the tokens they make")


def _unreached(tokenizer: tokenizers.Tokenizer, spelled: Mapping[str, int]) -> set[str]:
    """The multi-byte tokens that do not come out whole when the model alone encodes each as a word."""
    pieces = [piece for piece in spelled if len(piece) > 1]
    bare = tokenizers.Tokenizer(tokenizer.model)  # the same model: no normalizer, no added tokens
    bare.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # byte-level spellings hold no whitespace
    chunks = [pieces[start::_CHUNKS] for start in range(_CHUNKS)]
    encodings = bare.encode_batch_fast([" ".join(chunk) for chunk in chunks], add_special_tokens=False)
    length = np.zeros(max(spelled.values()) + 1, dtype=np.int64)
    length[list(spelled.values())] = [len(piece) for piece in spelled]
    unreached: list[str] = []
    for chunk, encoding in zip(chunks, encodings, strict=True):
        if len(encoding.ids) == len(chunk):
            continue  # each word gives at least one token: as many tokens as words, each whole
        # where each word ends among the tokens' ends: a word whole is one token past the last
        token_ends = np.cumsum(length[np.asarray(encoding.ids, dtype=np.int64)])
        word_ends = np.cumsum([len(piece) for piece in chunk])
        tokens_per_word = np.diff(np.searchsorted(token_ends, word_ends), prepend=-1)
        unreached += [chunk[index] for index in np.flatnonzero(tokens_per_word != 1)]
    return set(unreached)


@functools.cache
def _latin1_table() -> dict[int, str]:
    """Byte-level characters to the Latin-1 characters of their bytes (then `encode("latin-1")`)."""
    return {ord(char): chr(byte) for char, byte in byte_decoder().items()}
