"""A session's later bodies share the parsed history elements of its earlier ones (`server/reparse.py`):
with a vision model, whose routes turn image parts into digests and placeholders, none of them is
changed in place."""

from __future__ import annotations

import base64

import pytest

from tests.images.conftest import MODEL, App, png
from tests.support.histories import shared_parses_unchanged


async def test_images_leave_the_shared_parse_as_it_was(app: App, monkeypatch: pytest.MonkeyPatch) -> None:
    image = base64.b64encode(png((200, 30, 30))).decode()
    await shared_parses_unchanged(app.http, monkeypatch, MODEL, image=image)
