"""The renderer on the embedded model's real tokenizer and chat template (SmolLM2, ChatML).

Ground truth for a bridge is the template's own rendering of the whole conversation: after the
prompt and the reply's text, it continues with the turn close, the new messages and the generation
prompt. The bridge must be exactly that continuation, minus what the engine already sampled.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tokentape.render.renderer import Renderer, RenderOptions
from tokentape.render.tokenizer import GGUFTokenizer

OPTIONS = RenderOptions()
IM_END = "<|im_end|>"

user_texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30)


def _conversation(system: bool, user: str, reply: str, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    head = [{"role": "system", "content": "You are terse."}] if system else []
    return [*head, {"role": "user", "content": user}, {"role": "assistant", "content": reply}, *new]


def test_the_turn_close_is_derived_from_the_template(renderer: Renderer) -> None:
    assert renderer.turn_close == "<|im_end|>\n"


@given(
    system=st.booleans(),
    user=user_texts,
    sampled=st.lists(st.integers(0, 49151), min_size=1, max_size=12),
    stopped=st.booleans(),
    follow=st.lists(st.tuples(st.sampled_from(["user", "tool", "system"]), user_texts), min_size=1, max_size=3),
)
@settings(max_examples=150, deadline=None)
def test_bridge_is_the_templates_own_continuation(
    renderer: Renderer,
    tokenizer: GGUFTokenizer,
    system: bool,
    user: str,
    sampled: list[int],
    stopped: bool,
    follow: list[tuple[str, str]],
) -> None:
    end = tokenizer.encode(IM_END)[0]
    sampled = [t for t in sampled if t not in tokenizer.end_of_turn_ids] + ([end] if stopped else [])
    reply = tokenizer.decode(sampled)
    new = [{"role": role, "content": text} for role, text in follow]
    messages = _conversation(system, user, reply, new)
    reply_index = len(messages) - len(new) - 1

    prompt = renderer.prompt(messages[:reply_index], OPTIONS).tokens
    bridge = renderer.bridge(messages, reply_index, messages[reply_index], end if stopped else None, OPTIONS)

    full = renderer.render_text(messages, True, OPTIONS)
    before = renderer.render_text(messages[:reply_index], True, OPTIONS)
    expected = full[len(before) + len(reply) + (len(IM_END) if stopped else 0) :]
    assert bridge.text == expected
    assert bridge.tokens == tokenizer.encode(expected)
    assert not bridge.template_rewrite
    tape = prompt + sampled + bridge.tokens
    # sampled tokens are kept verbatim and the close is neither doubled nor dropped
    assert tape[len(prompt) : len(prompt) + len(sampled)] == sampled
    assert tape.count(end) == tokenizer.encode(full).count(end)


def test_naive_retokenisation_differs_from_the_tape_where_bpe_merges(
    renderer: Renderer, tokenizer: GGUFTokenizer
) -> None:
    """Hard case 3: sampled tokens whose text re-tokenises differently stay as sampled."""
    pieces = tokenizer.encode("unbelievable")
    split = [t for piece in ("un", "bel", "iev", "able") for t in tokenizer.encode(piece)]
    assert split != pieces and tokenizer.decode(split) == tokenizer.decode(pieces)
    messages = _conversation(False, "Say it.", tokenizer.decode(split), [{"role": "user", "content": "Again."}])
    end = tokenizer.encode(IM_END)[0]
    prompt = renderer.prompt(messages[:1], OPTIONS).tokens
    tape = prompt + split + [end] + renderer.bridge(messages, 1, messages[1], end, OPTIONS).tokens
    naive = tokenizer.encode(renderer.template.render(messages, add_generation_prompt=True))
    assert tape != naive
    assert len(tape) == len(naive) - len(pieces) + len(split)


def test_a_truncated_reply_gets_its_whole_close_bridged(renderer: Renderer, tokenizer: GGUFTokenizer) -> None:
    messages = _conversation(False, "Count.", "one two thr", [{"role": "user", "content": "Go on."}])
    bridge = renderer.bridge(messages, 1, messages[1], None, OPTIONS)
    assert bridge.text == "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    assert bridge.tokens[0] == tokenizer.encode(IM_END)[0]


def test_bridge_cost_does_not_depend_on_the_history(renderer: Renderer) -> None:
    """The bridge is rendered from an anchor; a long history must not change it."""
    short = _conversation(True, "Hi.", "Hello.", [{"role": "user", "content": "Bye."}])
    long_history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for i in range(200):
        long_history += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    long = [*long_history, *short[1:]]
    a = renderer.bridge(short, 2, short[2], None, OPTIONS)
    b = renderer.bridge(long, len(long) - 2, long[-2], None, OPTIONS)
    assert a.tokens == b.tokens


def test_gguf_encoding_matches_llama_cpp_pythons_own(tokenizer: GGUFTokenizer) -> None:
    """`encode` calls llama.cpp directly; llama-cpp-python's wrapper is the independent reference."""
    rng = random.Random(11)
    pieces = [*"ab z\n\t", "<|im_start|>", "<|im_end|>", "é", "日本", "🙂", "\u200b", "<|", "  \n\n", "x" * 40]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 40)))
        reference = tokenizer._llama.tokenize(text.encode("utf-8", "surrogatepass"), add_bos=False, special=True)
        assert tokenizer.encode(text) == reference, text
