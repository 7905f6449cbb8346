"""A GGUF file's BPE vocabulary as a `tokenizers` tokenizer, for the pre-tokenizers whose recipe is
known exactly; llama.cpp's own tokenizer stays the reference.

llama.cpp tokenizes a short chat turn (a bridge: the new user message and the generation prompt) in
about 70 us (16 for two letters); `tokenizers` takes about 22 (2). The gateway tokenizes the new messages
of every request, so that is a good part of its CPU per request. Where a GGUF's `tokenizer.ggml.pre`
names a recipe listed here, the same BPE is built from the file's own tokens and merges;
`GGUFTokenizer` then checks it against llama.cpp on a set of probe texts before using it, and keeps
llama.cpp when anything differs.

The file's key-value header is read directly (the `gguf` package's reader maps every field of the
file as numpy arrays, which takes seconds for a 49k-token vocabulary).
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from tokentape.formats.gguf import GGUF_MAGIC, read_metadata_values

__all__ = ["read_metadata", "fast_tokenizer", "PROBES"]

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp token types; the last two are parsed in text


def read_metadata(path: Path, keys: frozenset[str]) -> dict[str, Any]:
    """The values of `keys` in a GGUF file's header (versions 2 and 3), skipping every other value."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        try:
            found, _offset, _tensors = read_metadata_values(data, keys, whole=False)
        except ValueError as exc:  # an unsupported version
            raise ValueError(f"{path}: {exc}") from None
        return found


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer | None:
    """The Hugging Face pre-tokenizer that splits text as llama.cpp does for `pre`, where known."""
    if pre == "smollm":  # digits one by one, then GPT-2's split (llama.cpp: LLAMA_VOCAB_PRE_TYPE_SMOLLM)
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    return None


def fast_tokenizer(path: Path) -> tokenizers.Tokenizer | None:
    """The GGUF's BPE vocabulary as a `tokenizers` tokenizer, or None when its recipe is not known."""
    wanted = frozenset(
        {
            "tokenizer.ggml.model",
            "tokenizer.ggml.pre",
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges",
        }
    )
    meta = read_metadata(path, wanted)
    if meta.get("tokenizer.ggml.model") != "gpt2" or set(meta) != wanted:
        return None
    split = _pre_tokenizer(str(meta["tokenizer.ggml.pre"]))
    if split is None:
        return None
    kinds: list[int] = meta["tokenizer.ggml.token_type"]
    if not set(kinds) <= {_NORMAL, _CONTROL, _USER_DEFINED}:  # unknown, unused or byte tokens: not copied
        return None
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    # byte-level tokens hold no literal space (GPT-2 writes it as "Ġ"): a merge is two tokens and one space
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = split
    tokenizer.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, kinds, strict=True) if kind in (_CONTROL, _USER_DEFINED)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tokenizer


# Texts a fast tokenizer must split exactly as llama.cpp before it is used: chat turns, digits, code,
# whitespace runs, contractions, accents, CJK, emoji with modifiers, and special tokens in between.
PROBES = (
    "",
    " ",
    "\n\n\n",
    "hello world",
    "Hello, World! It's 2024-11-23 and I'm   here.\n\tThey've said we'll see; don't.",
    "<|im_start|>user\nStep 3 of agent 0: what should we do next?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>",
    "x = [1, 22, 333, 4444]; print(f'{x!r}')  # 3.14159e-10\r\n",
    "    def f(self):\n        return {'a': 1}\n\n\n",
    "café naïve Straße ÆØÅ ñ über",
    "中文文本\uff0c日本語のテキスト。한국어",
    "😀👍🏽 👩‍👩‍👧 ✨🚀",
    "a\u200bb\u00a0c\u2028d",
    "<|endoftext|><|endoftext|>text<|im_end|>more",
    "<|im_start|> spaced <|im_end|> \n",
    "'s 't 're 've 'm 'll 'd 'S 'RE",
    "!!!??? ... --- ___ *** ``` ~~~",
    "1234567890 00 007 3.5 -42 +7 1e9 0x1F",
    "tab\tand\ttabs\t\t\tend",
    "trailing spaces   ",
)
