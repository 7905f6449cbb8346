"""Template settings that reach images: Qwen2-VL's `add_vision_id` numbers images across the whole
conversation ("Picture 3:"), so a bridge rendered from the last user message would number the third
turn's image 2. The probe learns this per setting and the bridge renders the whole conversation;
every prompt the engine got equals transformers' processor render with the same setting."""

from __future__ import annotations

from typing import Any

import pytest

from tests.images.conftest import App, Oracle, data_url, png
from tokentape.render.renderer import Renderer, RenderOptions

COLORS = [(200, 30, 30), (30, 30, 200), (30, 160, 30), (220, 120, 20)]


def part(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


@pytest.mark.parametrize("vision_id", [True, False])
async def test_add_vision_id_numbers_every_turns_image_as_the_full_render(
    app: App, oracle: Oracle, vision_id: bool
) -> None:
    session = f"numbered-{vision_id}"
    kwargs = {"add_vision_id": vision_id}
    sent: list[dict[str, Any]] = []
    hf: list[dict[str, Any]] = []
    images: list[bytes] = []
    for turn, color in enumerate(COLORS):
        image = png(color, (64 + 8 * turn, 48))
        sent.append({"role": "user", "content": [{"type": "text", "text": f"Screen {turn}?"}, part(image)]})
        hf.append({"role": "user", "content": [{"type": "text", "text": f"Screen {turn}?"}, {"type": "image"}]})
        images.append(image)
        reply = f"Screen {turn} is shown."
        app.queue(oracle.answer(reply))
        response = await app.openai.chat.completions.create(
            model="m",
            messages=sent,  # type: ignore[arg-type]
            max_tokens=40,
            extra_headers={"X-Session-ID": session},
            extra_body={"chat_template_kwargs": kwargs},
        )
        assert response.choices[0].message.content == reply
        expected = oracle.ids(hf, images, **kwargs)
        assert app.engine.state.requests[-1]["token_ids"] == expected, f"turn {turn}: the engine's prompt"
        sent.append({"role": "assistant", "content": reply})
        hf.append({"role": "assistant", "content": reply})
    (branch,) = (await app.export(session))["branches"]
    assert branch["rewrites"] == []  # one tape: every turn extended the last
    if vision_id:
        assert "Picture 4: " in oracle.tokenizer.decode(app.engine.state.requests[-1]["token_ids"])


def test_the_probe_learns_image_numbering_per_setting(vl_renderer: Renderer) -> None:
    """Without the setting, or without images, Qwen2-VL's bridges render from the anchor; with both
    the probe finds the counter and bridges render the whole conversation."""
    numbered = RenderOptions(template_kwargs={"add_vision_id": True})
    assert vl_renderer.anchor_verdict(RenderOptions(), images=True).safe
    assert vl_renderer.anchor_verdict(numbered, images=False).safe
    verdict = vl_renderer.anchor_verdict(numbered, images=True)
    assert not verdict.safe and "Picture" in verdict.difference
    messages: list[dict[str, Any]] = []
    for turn in range(3):
        image = {"type": "image", "image": f"digest-{turn}"}
        messages += [
            {"role": "user", "content": [{"type": "text", "text": "Look."}, image]},
            {"role": "assistant", "content": "Seen."},
        ]
    bridge = vl_renderer.bridge(messages[:-1], 3, messages[3], None, numbered)
    assert bridge.whole and "Picture 3: " in bridge.text
