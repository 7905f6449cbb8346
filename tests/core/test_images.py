"""Whether a conversation holds an image part, against the parts each message lists."""

from __future__ import annotations

from collections import UserDict
from typing import Any

import pytest

from tokentape.core.images import IMAGE_PART, has_images, image_digests

IMAGE = {"type": IMAGE_PART, IMAGE_PART: "sha256:ab"}
CONTENTS: list[Any] = [
    "a string that names image parts: {'type': 'image'}",
    None,
    [],
    [{"type": "text", "text": "no image"}],
    ["a bare string part", 3, None],
    [{"type": "image_url", "image_url": {"url": "data:,"}}],  # a part the dialect has not turned into an image
    [{"type": "text", "text": "look"}, IMAGE],
    [UserDict(IMAGE)],  # any mapping counts, as the template sees it
    ("a tuple", IMAGE),  # not a list: not parts
    {"type": IMAGE_PART},  # a mapping as the whole content: not parts
]


@pytest.mark.parametrize("content", CONTENTS)
def test_has_images_is_any_listed_part_an_image(content: Any) -> None:
    expected = isinstance(content, list) and any(hasattr(p, "get") and p.get("type") == IMAGE_PART for p in content)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}, {"role": "assistant"}]
    assert has_images(messages) is expected
    assert bool(image_digests(messages)) is expected
    assert has_images([messages[0], messages[2]]) is False


def test_the_answer_holds_for_a_whole_conversation() -> None:
    messages = [{"role": "user", "content": content} for content in CONTENTS]
    assert has_images(messages) is True
    assert has_images([m for m in messages if m["content"] not in (CONTENTS[6], CONTENTS[7])]) is False
