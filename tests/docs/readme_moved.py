"""Checks that every fact of an earlier README is somewhere in docs/ (or the README or CHANGELOG).

    python tests/docs/readme_moved.py [REV]   # REV: the commit whose README.md is checked (default HEAD~1)

Each paragraph, list item and table row of that README is cut into sentences (table rows: cells) and
each sentence, with its white space normalised, is looked up in the concatenated text of docs/*.md,
README.md and CHANGELOG.md. Prints what was not found (headings are only listed, not required); exits 1
if any sentence is missing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pieces(markdown: str) -> tuple[list[str], list[str]]:
    """The README's sentences and table cells, and its headings."""
    sentences: list[str] = []
    headings: list[str] = []
    fence = False
    block: list[str] = []

    def flush() -> None:
        text = " ".join(block)
        block.clear()
        for sentence in re.split(r"(?<=[.:;])\s+(?=[A-Z`(*])", text):
            if len(sentence.strip()) > 3:
                sentences.append(sentence.strip())

    for line in markdown.splitlines():
        if line.startswith("```"):
            fence = not fence
            flush()
            continue
        if fence:
            if line.strip():
                sentences.append(line.strip())
            continue
        stripped = line.strip()
        if stripped.startswith("#"):
            flush()
            headings.append(stripped.lstrip("#").strip())
        elif stripped.startswith("|"):
            flush()
            if not re.fullmatch(r"[|\-: ]+", stripped):
                sentences += [c.strip() for c in re.split(r"(?<!\\)\|", stripped) if c.strip()]
        elif not stripped or stripped.startswith(("- ", "1. ", "2. ", "3. ", "4. ", "5. ")):
            flush()
            if stripped:
                block.append(re.sub(r"^(- |\d\. )", "", stripped))
        else:
            block.append(stripped)
    flush()
    return sentences, headings


def normal(text: str) -> str:
    return " ".join(text.split())


def main() -> int:
    rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD~1"
    old = subprocess.run(["git", "show", f"{rev}:README.md"], cwd=ROOT, check=True, capture_output=True, text=True)
    corpus = normal(
        " ".join(
            p.read_text() for p in [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md", ROOT / "CHANGELOG.md"]
        )
    )
    sentences, headings = pieces(old.stdout)
    missing = [s for s in sentences if normal(s) not in corpus]
    print(f"{len(sentences)} sentences and table cells, {len(headings)} headings in README.md at {rev}")
    for sentence in missing:
        print("MISSING:", sentence[:160])
    print(f"{len(missing)} missing")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
