"""Chromium for the viewer's browser tests, or a skip that says why: `make browser` installs Debian's
chromium only as root with apt-get, and says so in one line elsewhere. What a skip leaves untested: the
viewer page as a browser draws it (token colours, image thumbnails, the turn tree); the page's HTML and
the data it is drawn from are tested without a browser."""

from __future__ import annotations

import shutil

import pytest


def chromium() -> str:
    """The chromium binary; skips the test when there is none."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip(
            "chromium is not installed: the viewer is not drawn in a browser here "
            "(`make browser` installs Debian's chromium as root with apt-get)"
        )
    return binary
