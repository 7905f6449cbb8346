"""The generated reference pages against the code they are written from, checked by other means: the
CLI page against `tokentape VERB --help`, the routes page against the app's OpenAPI schema and the
dialect registry, the export page against a real export through the gateway. A new option, route or
dialect appears without a hand edit; a route without a docstring, or an export field without a type
and meaning, stops the build, and no table cell of either page is empty."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any
from unittest import mock

import typer
import typer.rich_utils
from typer.testing import CliRunner

from tokentape.cli import app as cli_app
from tokentape.client import InProcessGateway
from tokentape.core.export import EXPORT_SCHEMA_VERSION
from tokentape.core.formats import FORMATS
from tokentape.engines.scripted import ScriptedEngine
from tokentape.runtime import embedded_model_path, gguf_renderer
from tokentape.served import ServeSpec, build_served
from tokentape.server import app as app_module
from tokentape.server.dialects.openai_chat import OpenAIChat
from tokentape.server.dialects.registry import DIALECTS, PATHS

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _help_options(verb: str) -> set[str]:
    # rich gives a console it takes for a terminal on TERM=dumb 80 columns whatever COLUMNS says (option
    # names cut short), and whether it takes one depends on what ran before in the worker: a wide
    # ordinary terminal, and its styling stripped
    env = {"COLUMNS": "400", "LINES": "50", "TERM": "xterm", "NO_COLOR": "1"}
    with mock.patch.object(typer.rich_utils, "MAX_WIDTH", 400):  # the console's width, set outright
        result = CliRunner().invoke(cli_app, [verb, "--help"], env=env)
    assert result.exit_code == 0, result.output
    return set(OPTION.findall(ANSI.sub("", result.output))) - {"--help"}


def _section(page: str, heading: str) -> str:
    start = page.index(heading)
    following = page.find("\n#", start + len(heading))
    return page[start : following if following >= 0 else None]


def test_every_verb_and_option_of_the_cli_is_on_the_page(hook: ModuleType) -> None:
    page = hook.cli_reference()
    verbs = typer.main.get_command(cli_app).commands  # type: ignore[attr-defined]
    assert {"serve", "status", "demo", "doctor", "rollout", "train", "export", "view"} <= set(verbs)
    for verb in verbs:
        section = _section(page, f"## `tokentape {verb}`")
        assert set(OPTION.findall(section)) - {"--help"} == _help_options(verb), verb


def test_an_option_without_help_stops_the_build(hook: ModuleType) -> None:
    app = typer.Typer()

    @app.command()
    def serve(port: int = 8000, quiet: bool = False) -> None:
        """Serve."""

    @app.command()
    def other() -> None:
        """Another verb, so that the app is a group."""

    try:
        hook.cli_markdown(typer.main.get_command(app))
    except hook.Undocumented as exc:
        assert "--port" in str(exc)
    else:
        raise AssertionError("an option without help was let through")


def test_a_new_verb_and_option_appear_without_a_hand_edit(hook: ModuleType) -> None:
    app = typer.Typer()

    @app.command()
    def serve(port: Annotated[int, typer.Option(help="Port.")] = 8000) -> None:
        """Serve."""

    @app.command()
    def replay(
        speed: Annotated[float, typer.Option(help="How fast to replay the tape.")] = 1.5,
        dry_run: Annotated[bool, typer.Option(help="Print instead of sending.")] = False,
    ) -> None:
        """Replay a recorded session against another engine."""

    page = hook.cli_markdown(typer.main.get_command(app))
    section = _section(page, "## `tokentape replay`")
    assert "Replay a recorded session against another engine." in section
    assert re.search(r"\| `--speed` \| float \| `1.5` \| How fast to replay the tape. \|", section)
    assert "`--dry-run` / `--no-dry-run` | flag" in section


def _route_rows(page: str) -> set[tuple[str, str]]:
    return {(m.group(1), m.group(2)) for m in re.finditer(r"^\| ([A-Z ]+) \| `([^`]+)` \|", page, re.M)}


def test_every_route_of_the_app_and_every_dialect_is_on_the_page(hook: ModuleType) -> None:
    routes, dialects, schema_paths = hook.app_routes()
    page = hook.routes_markdown(routes, dialects, schema_paths)
    rows = _route_rows(page)
    listed = {path for _, path in rows}
    # the OpenAPI schema, read independently of the route objects
    assert {p.replace("{session_id}", "{session_id}") for p in schema_paths} <= listed
    for path in PATHS:  # the registry: each dialect at the root and under a session's base URL
        assert ("POST", path) in rows and ("POST", "/sessions/{session_id}" + path) in rows
    for dialect in DIALECTS:  # described once, at the root; under a base URL "as" the root's route
        assert page.count(f"{dialect.__name__} dialect") == 1, dialect
        assert f"| As `{dialect.path}`, inside the session the path names. |" in page, dialect
    assert ("GET", "/metrics") in rows and ("GET", "/view") in rows  # served, though not in the schema


def test_a_new_dialect_shows_up_without_a_hand_edit(hook: ModuleType, monkeypatch: Any) -> None:
    class ChatV2(OpenAIChat):
        """Chat completions, version two."""

        path = "/v2/chat/completions"

    monkeypatch.setattr(app_module, "DIALECTS", (*DIALECTS, ChatV2))
    renderer = gguf_renderer(embedded_model_path())
    app = build_served(ServeSpec(served_model_name="m"), engine=ScriptedEngine([], 0), renderer=renderer).app

    @app.get("/admin/snapshot")
    async def snapshot() -> dict[str, str]:
        """Write a snapshot of the store."""
        return {}

    page = hook.routes_markdown(app.routes, [*DIALECTS, ChatV2], app.openapi()["paths"])
    rows = _route_rows(page)
    assert ("POST", "/v2/chat/completions") in rows and ("POST", "/sessions/{session_id}/v2/chat/completions") in rows
    assert page.count("ChatV2 dialect (openai errors): Chat completions, version two.") == 1
    assert "| As `/v2/chat/completions`, inside the session the path names. |" in page
    assert re.search(r"\| GET \| `/admin/snapshot` \| Write a snapshot of the store. \| .*\| yes \|", page)


def _cells(page: str) -> list[list[str]]:
    """The cells of every table row of a page (header and rule rows left out)."""
    headers = ("| field ", "| method ", "| parameter ")
    rows = [line for line in page.splitlines() if line.startswith("| ") and not line.startswith(headers)]
    return [_split_row(row) for row in rows]


def _split_row(row: str) -> list[str]:
    """A table row's cells, split as the tables extension splits them: not at an escaped pipe, nor
    inside a code span."""
    cells, cell, code, previous = [], "", False, ""
    for char in row:
        if char == "`":
            code = not code
        if char == "|" and not code and previous != "\\":
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
        previous = char
    return cells[1:]


def test_every_route_is_described_and_no_cell_but_reads_is_empty(hook: ModuleType) -> None:
    page = hook.http_reference()
    rows = _cells(page)
    assert len(rows) >= 40
    for method, path, what, _reads, who, schema in rows:
        assert method and path and who and schema in ("yes", "no"), path
        assert len(what) > 20, path  # a sentence, not a placeholder
    by_path = {(r[0], r[1]): r for r in rows}
    assert "completions: one prompt" in by_path[("POST", "`/v1/completions`")][2]  # not chat's line
    assert "OpenAI chat completions" in by_path[("POST", "`/v1/chat/completions`")][2]
    assert by_path[("GET", "`/health`")][4] == "anyone (no key)"
    assert by_path[("POST", "`/sessions/{session_id}/reward`")][4] == "trainer key"
    assert by_path[("POST", "`/sessions/{session_id}/v1/chat/completions`")][4] == "trainer key or the session's key"
    assert "query `format`" in by_path[("GET", "`/export`")][3]


def test_a_route_or_dialect_without_a_docstring_stops_the_build(hook: ModuleType, monkeypatch: Any) -> None:
    class Bare(OpenAIChat):  # inherits a docstring, has none of its own
        path = "/v2/bare"

    monkeypatch.setattr(app_module, "DIALECTS", (*DIALECTS, Bare))
    renderer = gguf_renderer(embedded_model_path())
    app = build_served(ServeSpec(served_model_name="m"), engine=ScriptedEngine([], 0), renderer=renderer).app

    @app.get("/admin/quiet")
    async def quiet() -> dict[str, str]:
        return {}

    try:
        hook.routes_markdown(app.routes, [*DIALECTS, Bare], app.openapi()["paths"])
    except hook.Undocumented as exc:
        assert "GET /admin/quiet" in str(exc) and "POST /v2/bare" in str(exc)
    else:
        raise AssertionError("an undocumented route was let through")


def _fields(section: str) -> set[str]:
    return set(re.findall(r"^\| `([a-z_]+)` \|", section, re.M))


async def test_the_export_page_lists_what_a_real_export_holds(hook: ModuleType) -> None:
    """Two turns through the gateway (scripted engine: the fields, not the tokens, are the point),
    exported natively and in every trainer format; the page's field tables must name exactly those."""
    renderer = gguf_renderer(embedded_model_path())
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine = ScriptedEngine(renderer.tokenizer.encode("Four."), end)
    gateway = InProcessGateway(ServeSpec(served_model_name="m"), engine=engine, renderer=renderer)
    await gateway.create_session("s", group_id="g")
    agent = gateway.client("s")
    messages: list[Any] = [{"role": "user", "content": "2+2?"}]
    first = await agent.chat.completions.create(model="m", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "+1?"}]
    await agent.chat.completions.create(model="m", messages=messages)
    await gateway.finish("s", reward=1.0)
    native = await gateway.export("s")
    rows = {fmt: (await gateway.export_all(format=fmt))["data"][0] for fmt in FORMATS}
    await gateway.aclose()

    page = hook.export_reference()
    assert f"**Schema version: {EXPORT_SCHEMA_VERSION}**" in page and native["schema_version"] == EXPORT_SCHEMA_VERSION
    session_part = _section(page, "## A session")
    assert _fields(session_part) == set(native)
    assert _fields(_section(page, "### A branch")) == set(native["branches"][0])
    assert "| `turn_index` | `list[int]`, one per token |" in page
    assert "| `turn_ids` | `list[int]`, one per turn |" in page
    assert "| `tokens` | `list[list[int]]`, one per member |" in _section(page, "### `atropos`")
    assert "| `scores` | `list[float | null]`, one per member |" in _section(page, "### `atropos`")
    assert "| `completion_ids` | `list[int]`, one per sampled token |" in _section(page, "### `stepwise`")
    assert "| `policy_version` | `str | null` |" in _section(page, "### `stepwise`")
    for fmt in FORMATS:
        assert _fields(_section(page, f"### `{fmt}`")) == set(rows[fmt]), fmt
    for cells in _cells(page):
        assert len(cells) == 3 and all(cells), cells  # every field has a type and a meaning


def test_an_export_field_without_an_entry_or_of_another_type_stops_the_build(hook: ModuleType) -> None:
    from tokentape.core.export import export_session
    from tokentape.core.formats import format_rows, samples_of

    trees = hook._sample_trees()
    native = export_session(trees[0])
    rows = {fmt: format_rows(samples_of(trees), fmt) for fmt in FORMATS}
    hook.export_markdown(native, rows, EXPORT_SCHEMA_VERSION)  # as exported: described
    cases = {
        "`surprise` has no entry": lambda n, r: r["openrlhf"][0].update(surprise=1),
        "`truncated` is 'no', not bool": lambda n, r: n["branches"][0].update(truncated="no"),
        "`turn_ids` has 3 entries, not one per turn": lambda n, r: n["branches"][0].update(turn_ids=[0, 1, 2]),
        "`step` is declared": lambda n, r: [row.pop("step") for row in r["stepwise"]],
    }
    for expected, change in cases.items():
        broken_native = export_session(trees[0])
        broken_rows = {fmt: format_rows(samples_of(trees), fmt) for fmt in FORMATS}
        change(broken_native, broken_rows)
        try:
            hook.export_markdown(broken_native, broken_rows, EXPORT_SCHEMA_VERSION)
        except hook.Undocumented as exc:
            assert expected in str(exc), (expected, str(exc))
        else:
            raise AssertionError(f"not refused: {expected}")


def test_the_python_api_page_lists_every_integration(hook: ModuleType) -> None:
    import pkgutil

    import tokentape.integrations as package

    page = hook.python_markdown((Path(__file__).parents[2] / "docs/reference/python.md").read_text())
    for info in pkgutil.iter_modules(package.__path__):
        assert f"::: tokentape.integrations.{info.name}" in page, info.name
    assert "::: tokentape.integrations.verl" in page
