"""The site builds strictly (a broken link, anchor or missing page fails), its generated reference is in
it, a reader gets from the home page to the TRL guide, and the README's links lead somewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = {"docs/reference/cli.md", "docs/reference/http.md", "docs/reference/export.md"}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_the_generated_reference_is_in_the_site(site: Path) -> None:
    cli = (site / "reference/cli/index.html").read_text()
    http = (site / "reference/http/index.html").read_text()
    export = (site / "reference/export/index.html").read_text()
    assert "tokentape serve" in cli and "--max-staleness" in cli
    assert "/v1/messages" in http and "AnthropicMessages dialect" in http
    assert "turn_index" in export and "Schema version" in export
    assert "InProcessGateway" in (site / "reference/python/index.html").read_text()  # mkdocstrings ran


def test_no_cell_of_a_generated_reference_page_is_empty(site: Path) -> None:
    """What a reader sees: every table cell of the CLI, HTTP routes and export pages holds something."""
    for page in ("reference/cli", "reference/http", "reference/export"):
        html = (site / page / "index.html").read_text()
        cells = re.findall(r"<td[^>]*>(.*?)</td>", html, re.S)
        assert len(cells) > 50, page
        empty = [i for i, cell in enumerate(cells) if not re.sub(r"<[^>]+>", "", cell).strip()]
        assert not empty, (page, empty[:5])


def test_train_with_trl_is_two_clicks_from_the_home_page(site: Path) -> None:
    home = (site / "index.html").read_text()
    assert re.search(r'href="guides/trl/"', home)  # one click from the home page's cards
    assert (site / "guides/trl/index.html").exists()


def test_every_relative_link_of_the_readme_exists() -> None:
    """On the repository host a link to a page the site generates (the CLI, HTTP and export
    references) would be a 404: every link is to a file in the repository."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    relative = [link for link in links if "://" not in link]
    assert len(relative) > 10
    for link in relative:
        assert (ROOT / link).exists(), link
    assert not GENERATED & set(relative)


def test_every_trainer_guide_is_one_click_from_the_home_page_and_the_readme(site: Path) -> None:
    home = (site / "index.html").read_text()
    readme = (ROOT / "README.md").read_text()
    for guide in ("trl", "atropos", "openrlhf", "verl", "skyrl"):
        assert f'href="guides/{guide}/"' in home, guide
    for guide in ("trl", "verl", "skyrl"):
        assert f"](docs/guides/{guide}.md)" in readme, guide


def test_the_getting_help_page_is_in_the_site_and_its_nav(site: Path) -> None:
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    assert {"Getting help": "help.md"} in nav
    page = re.sub(r"<[^>]+>", "", (site / "help/index.html").read_text())  # the text, out of its highlighting
    assert "tokentape --version" in page and "tokentape doctor" in page and "--log-level debug" in page


def test_no_page_installs_tokentape_from_an_index() -> None:
    """tokentape is not on PyPI: an install line names a clone, a path or a wheel, never the bare name."""
    bare = re.compile(r"""pip install (?:--?[\w-]+(?:=\S+)? )*['"]?tokentape(?:\[[\w,]+\])?['"]?(?:\s|$)""")
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "src").rglob("*.py"))]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in pages for m in bare.finditer(p.read_text())]
    assert not found, found
