"""Every code block of the docs marked runnable (`<!-- runnable -->` on the line before its fence) is
run, as a reader would paste it, on the embedded model. The blocks assert what they show."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKED = re.compile(r"^<!-- runnable -->\n```(\w+)\n(.*?)^```", re.M | re.S)


def runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for number, match in enumerate(MARKED.finditer(path.read_text())):
            assert match.group(1) == "python", f"{path}: only python blocks can be run"
            blocks.append((f"{path.relative_to(ROOT)}#{number}", match.group(2)))
    return blocks


BLOCKS = runnable_blocks()


def test_the_front_page_and_the_first_session_have_runnable_examples() -> None:
    where = {name.split("#")[0] for name, _ in BLOCKS}
    assert {"README.md", "docs/getting-started/first-session.md"} <= where


@pytest.mark.parametrize(("name", "code"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_runnable_block(name: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # whatever a block writes stays out of the tree
    exec(compile(code, name, "exec"), {"__name__": "__main__"})
