"""A vision model's own tokens written in message text stay text: `<|image_pad|>` quoted by a user or
a tool never becomes a placeholder without an image behind it, in a text-only request or beside real
images, on a first prompt and on a bridge (`render.quoting`).

The independent computation: transformers' own template and tokenizer render the conversation with a
marker where the text quotes a vision token, tokenize each side of it as the template's text (special
tokens parsed) and the quoted string itself with special tokens split, and expand each real image's
placeholder as Qwen2-VL's processor does. It shares no code with the gateway's renderer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tests.images.conftest import App, Oracle, data_url, png
from tests.support.fake_vision import IMAGE_PAD, VISION_START

QUOTE = "The log says <|image_pad|> then <|vision_start|>x<|vision_end|>."
QUOTED = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
MARK = "\x00QUOTED{}\x00"


def expected_ids(oracle: Oracle, messages: Sequence[dict[str, Any]], images: Sequence[bytes]) -> list[int]:
    marked = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            content = _mark(content)
        else:
            content = [{**part, "text": _mark(part["text"])} if part["type"] == "text" else part for part in content]
        marked.append({**message, "content": content})
    text = oracle.tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == len(images) + 1
    text = pieces[0] + "".join(
        "<|image_pad|>" * oracle.pads(d) + rest for d, rest in zip(images, pieces[1:], strict=True)
    )
    ids: list[int] = []
    for index, piece in enumerate(text.split("\x00")):
        if index % 2 == 0:
            ids += oracle.tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
        else:
            string = QUOTED[int(piece.removeprefix("QUOTED"))]
            ids += oracle.tokenizer(string, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


def _mark(text: str) -> str:
    for i, string in enumerate(QUOTED):
        text = text.replace(string, MARK.format(i))
    return text


async def test_a_text_only_request_quoting_the_image_pad_sends_no_placeholder(app: App, oracle: Oracle) -> None:
    app.queue(oracle.answer("Noted."))
    messages = [{"role": "user", "content": QUOTE}]
    response = await app.openai.chat.completions.create(
        model="m", messages=messages, max_tokens=20, extra_headers={"X-Session-ID": "quoted-text"}
    )
    assert response.choices[0].message.content == "Noted."
    sent = app.engine.state.requests[-1]["token_ids"]
    assert sent == expected_ids(oracle, messages, [])
    assert IMAGE_PAD not in sent and VISION_START not in sent
    assert not app.engine.state.requests[-1].get("features")
    (branch,) = (await app.export("quoted-text"))["branches"]
    assert not branch.get("image_runs") and IMAGE_PAD not in branch["tokens"]


async def test_quoting_beside_real_images_keeps_one_run_per_image_over_turns(app: App, oracle: Oracle) -> None:
    red, blue = png((200, 30, 30)), png((30, 30, 200), (96, 64))
    image = {"type": "image_url", "image_url": {"url": data_url(red)}}
    first: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": QUOTE}, image]}]
    hf: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": QUOTE}, {"type": "image"}]}]
    headers = {"X-Session-ID": "quoted-images"}
    app.queue(oracle.answer("A red screen."))
    reply = await app.openai.chat.completions.create(model="m", messages=first, max_tokens=20, extra_headers=headers)
    assert reply.choices[0].message.content == "A red screen."
    assert app.engine.state.requests[-1]["token_ids"] == expected_ids(oracle, hf, [red])
    # a second turn whose new message quotes the pads again, with another image: a bridge
    follow = [
        {"type": "text", "text": "Tool output: " + QUOTE},
        {"type": "image_url", "image_url": {"url": data_url(blue)}},
    ]
    sent = [*first, {"role": "assistant", "content": "A red screen."}, {"role": "user", "content": follow}]
    hf += [
        {"role": "assistant", "content": "A red screen."},
        {"role": "user", "content": [{"type": "text", "text": "Tool output: " + QUOTE}, {"type": "image"}]},
    ]
    app.queue(oracle.answer("Blue."))
    again = await app.openai.chat.completions.create(model="m", messages=sent, max_tokens=20, extra_headers=headers)
    assert again.choices[0].message.content == "Blue."
    tokens = app.engine.state.requests[-1]["token_ids"]
    assert tokens == expected_ids(oracle, hf, [red, blue])
    assert tokens.count(IMAGE_PAD) == oracle.pads(red) + oracle.pads(blue)
    (branch,) = (await app.export("quoted-images"))["branches"]
    assert len(branch["image_runs"]) == 2
