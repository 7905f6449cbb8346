"""ASCII text through tiktoken gives exactly the IDs of the `tokenizers` library's own `encode`, for
every family where it is built; where its merge order or reachability would differ, it is not built.
Small byte-level tokenizers written here show each condition is needed."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

import pytest
import tiktoken
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.models import SOURCES
from tokentape.render import hf
from tokentape.render.byte_level import byte_decoder
from tokentape.render.hf import HFTokenizer, load_model_dir
from tokentape.render.rank_bpe import RankBPE, explain_rank_bpe

QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BUILT = {"qwen2.5", "qwen3", "qwen3.5", "qwen3.6"}
DECLINED = {
    "deepseek-r1": "not one split",
    "deepseek-v3": "not one split",
    "deepseek-v3.1": "not one split",
    "glm-4.5": "ignore_merges",
    "glm-4.7": "ignore_merges",
    "glm-5": "ignore_merges",
    "minimax-m2": "not an isolating split",
    "llama3.2": "not listed in the order",
}
ASCII = "".join(map(chr, range(128)))
KELVIN = "\u212a"  # NFKC takes it to K


def _code(rng: random.Random, lines: int) -> str:
    """Tool-output-like ASCII: code, logs, paths, numbers, runs of spaces and blank lines."""
    words = ["def", "return", "self", "x", "_y", "HTTP/1.1", "200", "ms", "it's", "DON'T", "we'll", "0x1f", "a-b"]
    out = []
    for _ in range(lines):
        indent = " " * rng.choice([0, 0, 2, 4, 8, 13])
        body = " ".join(
            rng.choice(words) + rng.choice(["", "(", ")", ":", ",", ".", "==", "  ", "\t"]) for _ in range(6)
        )
        out.append(indent + body + rng.choice(["", " ", "\r", "  "]))
    return "\n".join(out) + rng.choice(["", "\n", "\n\n\n"])


def _texts(added: list[str]) -> list[str]:
    rng = random.Random(7)
    texts = ["", " ", "\n", ASCII, ASCII[::-1], "".join(a + b for a in ASCII for b in ASCII[::7])]
    texts += [_code(rng, rng.randint(1, 60)) for _ in range(40)]
    texts += [f"x{token}y {token}\n{token}{token}" for token in added]
    texts += ["  " * n + "\n" * m + "x" for n in range(4) for m in range(4)]
    texts += ["1234567890 12.5e-3 'S 'sT ''s '''ll", "\x00\x01\x1f\x7f\x0b\x0c", " " * 300 + "end"]
    return texts


@functools.cache
def _load(directory: Path) -> tuple[tokenizers.Tokenizer, bytes]:
    """A family's library tokenizer and file, loaded once a process (about half a second for a large
    vocabulary): the tests and `explain_rank_bpe` only read it."""
    source = (directory / "tokenizer.json").read_bytes()
    return tokenizers.Tokenizer.from_buffer(source), source


@functools.cache
def _explained(directory: Path) -> RankBPE | str:
    """`explain_rank_bpe` on a family's tokenizer, once a process (about half a second where it builds),
    as the served tokenizer builds it once a process: each test checks this one build."""
    return explain_rank_bpe(*_load(directory))


@functools.cache
def _plain(directory: Path) -> tokenizers.Tokenizer:
    """The library tokenizer with special tokens' text spelled out, a copy made once a process."""
    plain = tokenizers.Tokenizer.from_str(_load(directory)[0].to_str())
    plain.encode_special_tokens = True
    return plain


@pytest.mark.parametrize("family", sorted(SOURCES))
def test_built_for_qwen_and_declined_with_its_reason_elsewhere(model_dirs: dict[str, Path], family: str) -> None:
    built = _explained(model_dirs[family])
    if family in BUILT:
        assert isinstance(built, RankBPE)
    else:
        assert isinstance(built, str) and DECLINED[family] in built


@pytest.mark.parametrize("family", sorted(BUILT))
def test_ascii_text_gets_the_ids_of_the_library(model_dirs: dict[str, Path], family: str) -> None:
    tokenizer, _ = _load(model_dirs[family])
    rank_bpe = _explained(model_dirs[family])
    assert isinstance(rank_bpe, RankBPE)
    plain = _plain(model_dirs[family])
    added = [token.content for token in tokenizer.get_added_tokens_decoder().values()]
    assert any(not token.special for token in tokenizer.get_added_tokens_decoder().values())  # <tool_call>
    for text in _texts(added):
        assert rank_bpe.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, text
        assert rank_bpe.encode_plain(text) == plain.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3.5"])
def test_every_ascii_token_written_alone_gets_the_ids_of_the_library(model_dirs: dict[str, Path], family: str) -> None:
    """A word that is a token whole: tiktoken takes it whole, `tokenizers` merges it. Qwen3.5's
    vocabulary has ASCII tokens no merge reaches, which tiktoken must not take whole."""
    tokenizer, _ = _load(model_dirs[family])
    rank_bpe = _explained(model_dirs[family])
    assert isinstance(rank_bpe, RankBPE)
    table = byte_decoder()
    pieces = [piece for piece in tokenizer.get_vocab(with_added_tokens=False) if all(table[c] < 128 for c in piece)]
    texts = [bytes(table[char] for char in piece).decode() for piece in pieces]
    expected = [encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    # the case this test is about: a word that is a token, which the model alone does not make whole
    split = [piece for piece, ids in zip(pieces, expected, strict=True) if len(ids) > 1]
    unreached = [piece for piece in split if len(tokenizer.model.tokenize(piece)) > 1]
    assert bool(unreached) == (family == "qwen3.5")
    assert [rank_bpe.encode(text) for text in texts] == expected


_FRAGMENTS = st.sampled_from(
    [
        "'s",
        "'LL",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\r\n",
        "\t",
        "x",
        "Ab",
        "42",
        "3.14",
        "```",
        "->",
        "<|im_end|>",
        "<tool_call>",
    ]
)


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3.5"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.one_of(
        st.text(alphabet=ASCII, max_size=200),
        st.lists(st.one_of(_FRAGMENTS, st.text(alphabet=ASCII, max_size=4)), max_size=40).map("".join),
    )
)
def test_any_ascii_text_gets_the_ids_of_the_library(model_dirs: dict[str, Path], family: str, text: str) -> None:
    tokenizer, _ = _load(model_dirs[family])
    rank_bpe = _explained(model_dirs[family])
    assert isinstance(rank_bpe, RankBPE)
    assert rank_bpe.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids


def test_the_served_tokenizer_takes_ascii_text_through_it_and_is_built_once_a_process(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    _, served = load_model_dir(model_dirs["qwen2.5"])
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in model_dirs["qwen2.5"].iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    _, again = load_model_dir(copy)
    assert served._rank_bpe is not None and again._rank_bpe is served._rank_bpe
    reference, _ = _load(model_dirs["qwen2.5"])
    for text in ("plain ascii <|im_end|> text\n", "not ascii: caf\u00e9 \u4e2d", "cafe\u0301"):
        assert served.encode(text) == reference.encode(text, add_special_tokens=False).ids


# -- small byte-level tokenizers: each condition, and what breaks without it ----------------------------


def _byte_level_json(
    extra: list[str],
    merges: list[list[str]],
    *,
    split: str = QWEN_SPLIT,
    added: list[dict[str, Any]] | None = None,
    model: dict[str, Any] | None = None,
    normalizer: dict[str, Any] | None = None,
) -> str:
    """A tokenizer.json: the 256 byte-level characters (IDs in byte order), then `extra` tokens."""
    by_byte = sorted(byte_decoder().items(), key=lambda item: item[1])
    vocab = {char: byte for char, byte in by_byte}
    for piece in extra:
        vocab[piece] = len(vocab)
    return json.dumps(
        {
            "version": "1.0",
            "added_tokens": [
                {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True} | token
                for token in added or []
            ],
            "normalizer": normalizer,
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
                    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
                ],
            },
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": vocab,
                "merges": merges,
            }
            | (model or {}),
        }
    )


def _explain(source: str) -> RankBPE | str:
    return explain_rank_bpe(tokenizers.Tokenizer.from_str(source), source.encode())


def test_merges_out_of_id_order_decline_because_tiktoken_would_merge_otherwise() -> None:
    source = _byte_level_json(["ab", "bc"], [["b", "c"], ["a", "b"]])  # bc is listed first, ab has the lower ID
    library = tokenizers.Tokenizer.from_str(source)
    assert library.encode("abc", add_special_tokens=False).ids == [97, 257]  # a + bc
    ranks = {bytes([byte]): byte for byte in range(256)} | {b"ab": 256, b"bc": 257}
    naive = tiktoken.Encoding("naive", pat_str=QWEN_SPLIT, mergeable_ranks=ranks, special_tokens={})
    assert naive.encode("abc") == [256, 99]  # ab + c: a twin built anyway would be wrong
    explained = _explain(source)
    assert isinstance(explained, str) and "order" in explained


def test_a_token_no_merge_reaches_is_left_out_so_a_word_equal_to_it_is_merged_as_the_library_does() -> None:
    source = _byte_level_json(["ab", "abc", "cd"], [["a", "b"], ["c", "d"]])  # no merge makes abc
    built = _explain(source)
    assert isinstance(built, RankBPE)
    library = tokenizers.Tokenizer.from_str(source)
    for text in ("abc", "abcd", "xabc abc", "abcabc"):
        assert built.encode(text) == library.encode(text, add_special_tokens=False).ids, text
    assert built.encode("abc") == [256, 99]  # tiktoken alone takes a word that is a token whole: [257]


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"split": r"\p{L}+"}, "skips text"),
        ({"model": {"ignore_merges": True}}, "ignore_merges"),
        ({"model": {"byte_fallback": True}}, "byte_fallback"),
        ({"model": {"dropout": 0.5}}, "dropout"),
        ({"normalizer": {"type": "Lowercase"}}, "normalizer"),
        ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}}, "normalizer"),
        ({"added": [{"id": 257, "content": "<a>", "lstrip": True}]}, "strips"),
        ({"added": [{"id": 257, "content": "<a>"}, {"id": 258, "content": "<a>b"}]}, "begins"),
        (
            {"added": [{"id": 257, "content": "\u212a", "normalized": True}], "normalizer": {"type": "NFKC"}},
            "normalized",
        ),
    ],
)
def test_what_could_split_or_merge_otherwise_declines(changes: dict[str, Any], reason: str) -> None:
    assert isinstance(_explain(_byte_level_json(["ab"], [["a", "b"]])), RankBPE)  # the same without the change
    explained = _explain(_byte_level_json(["ab"], [["a", "b"]], **changes))
    assert isinstance(explained, str) and reason in explained


def test_special_tokens_read_as_text_and_other_pre_tokenizers_decline() -> None:
    source = _byte_level_json(["ab"], [["a", "b"]])
    spelled_out = tokenizers.Tokenizer.from_str(source)
    spelled_out.encode_special_tokens = True
    assert "as text" in str(explain_rank_bpe(spelled_out, source.encode()))
    digits_apart = json.loads(source)
    digits_apart["pre_tokenizer"]["pretokenizers"].insert(0, {"type": "Digits", "individual_digits": True})
    assert "one split" in str(_explain(json.dumps(digits_apart)))


def test_a_lone_byte_level_pre_tokenizer_uses_gpt2s_split() -> None:
    gpt2 = json.loads(_byte_level_json(["ab", "Ġab"], [["a", "b"], ["Ġ", "ab"]]))
    gpt2["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    source = json.dumps(gpt2)
    built = _explain(source)
    assert isinstance(built, RankBPE)
    library = tokenizers.Tokenizer.from_str(source)
    for text in ("ab ab  ab\n\nab's", "x" + ASCII, "  ab1234 ab"):
        assert built.encode(text) == library.encode(text, add_special_tokens=False).ids


def test_hf_tokenizer_without_a_twin_or_with_one_gives_the_same_ids(model_dirs: dict[str, Path]) -> None:
    tokenizer, source = _load(model_dirs["qwen3"])
    built = _explained(model_dirs["qwen3"])
    assert isinstance(built, RankBPE)
    with_twin = HFTokenizer(tokenizers.Tokenizer.from_buffer(source), rank_bpe=built)
    without = HFTokenizer(tokenizer)
    for text in _texts(["<|im_end|>", "<tool_call>"])[:20]:
        assert with_twin.encode(text) == without.encode(text)
        assert with_twin.encode_plain(text) == without.encode_plain(text)


def test_tokenizers_that_decline_do_not_push_a_built_table_out(model_dirs: dict[str, Path]) -> None:
    """A process that loads every family (a test run, a benchmark) keeps the tables it built."""
    _, served = load_model_dir(model_dirs["qwen3"])
    assert served._rank_bpe is not None
    reasons = [(n.to_bytes(16, "big"), ()) for n in range(12)]  # more than the cache holds tables
    try:
        for key in reasons:
            hf._RANK_BPES.put(key, "not one split")
        _, again = load_model_dir(model_dirs["qwen3"])
        assert again._rank_bpe is served._rank_bpe
    finally:
        for key in reasons:
            hf._RANK_BPES.discard(key)


def test_a_run_of_spaces_tiktoken_gives_up_on_is_tokenized_by_the_library(model_dirs: dict[str, Path]) -> None:
    """An agent may send a megabyte of spaces: tiktoken's regex runs out of backtracking stack there
    (ValueError), and the served tokenizer takes the text through `tokenizers` instead."""
    _, served = load_model_dir(model_dirs["qwen2.5"])
    assert served._rank_bpe is not None
    text = " " * 1_100_000 + "x"
    with pytest.raises(ValueError, match="backtracking"):
        served._rank_bpe.encode(text)
    reference, _ = _load(model_dirs["qwen2.5"])
    assert served.encode(text) == reference.encode(text, add_special_tokens=False).ids
    plain = _plain(model_dirs["qwen2.5"])
    assert served.encode_plain(text) == plain.encode(text, add_special_tokens=False).ids


def test_a_vocabulary_without_a_token_for_an_ascii_byte_declines() -> None:
    """tiktoken needs a token for every byte it meets (it fails without one); `tokenizers` drops it."""
    without_z = json.loads(_byte_level_json(["ab"], [["a", "b"]]))
    del without_z["model"]["vocab"]["z"]
    explained = _explain(json.dumps(without_z))
    assert isinstance(explained, str) and "ASCII byte" in explained
