"""The token-level viewer: one self-contained page (no build step, no external requests)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

__all__ = ["page", "static_page"]


def page() -> str:
    """The viewer page; without embedded data it reads the gateway it is served from."""
    return resources.files(__package__).joinpath("index.html").read_text(encoding="utf-8")


def static_page(data: dict[str, Any]) -> str:
    """The page with a snapshot embedded: {"sessions": [summaries], "exports": {id: export}}."""
    payload = json.dumps(data).replace("</", "<\\/")  # never close the script element early
    return page().replace("<!--DATA-->", f"<script>window.TOKENTAPE_DATA = {payload};</script>")
