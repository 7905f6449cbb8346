"""The troubleshooting page names only error codes the code answers: each code in its tables is a
string the source raises (an error's `code=`, a class's `default_code`, or a refusal of the key rules)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_error_code_on_the_page_is_raised_somewhere() -> None:
    page = (ROOT / "docs/guides/troubleshooting.md").read_text()
    first_cells = re.findall(r"^\| ([^|]+) \|", page, re.M)
    codes = {code for cell in first_cells for code in re.findall(r"`([a-z]+(?:_[a-z]+)+)`", cell)}
    assert {"session_stale", "rewrite_rejected", "invalid_api_key", "session_key_forbidden"} <= codes
    source = "\n".join(path.read_text() for path in (ROOT / "src/tokentape").rglob("*.py"))
    for code in codes:
        assert f'"{code}"' in source, code
