"""The generated reference pages against the code they are written from, checked by other means: the
CLI page against `tokentape VERB --help`, the routes page against the app's OpenAPI schema and the
dialect registry, the export page against a real export through the gateway. A new option, route or
dialect appears without a hand edit."""

from __future__ import annotations

import re
from types import ModuleType
from typing import Annotated, Any

import typer
from typer.testing import CliRunner

from tokentape.cli import app as cli_app
from tokentape.client import InProcessGateway
from tokentape.core.export import EXPORT_SCHEMA_VERSION
from tokentape.core.formats import FORMATS
from tokentape.engines.scripted import ScriptedEngine
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import SessionRegistry
from tokentape.runtime import embedded_model_path, gguf_renderer
from tokentape.server import app as app_module
from tokentape.server.dialects.openai_chat import OpenAIChat
from tokentape.server.dialects.registry import DIALECTS, PATHS

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _help_options(verb: str) -> set[str]:
    result = CliRunner().invoke(cli_app, [verb, "--help"], env={"COLUMNS": "400", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    return set(OPTION.findall(result.output)) - {"--help"}


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


def test_a_new_verb_and_option_appear_without_a_hand_edit(hook: ModuleType) -> None:
    app = typer.Typer()

    @app.command()
    def serve(port: int = 8000) -> None:
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
    for dialect in DIALECTS:
        assert page.count(f"{dialect.__name__} dialect") == 2, dialect
    assert ("GET", "/metrics") in rows and ("GET", "/view") in rows  # served, though not in the schema


def test_a_new_dialect_shows_up_without_a_hand_edit(hook: ModuleType, monkeypatch: Any) -> None:
    class ChatV2(OpenAIChat):
        path = "/v2/chat/completions"

    monkeypatch.setattr(app_module, "DIALECTS", (*DIALECTS, ChatV2))
    renderer = gguf_renderer(embedded_model_path())
    app = app_module.create_app(Gateway(ScriptedEngine([], 0), renderer, SessionRegistry()), model_id="m")

    @app.get("/admin/snapshot")
    async def snapshot() -> dict[str, str]:
        """Write a snapshot of the store."""
        return {}

    page = hook.routes_markdown(app.routes, [*DIALECTS, ChatV2], app.openapi()["paths"])
    rows = _route_rows(page)
    assert ("POST", "/v2/chat/completions") in rows and ("POST", "/sessions/{session_id}/v2/chat/completions") in rows
    assert page.count("ChatV2 dialect (openai errors)") == 2
    assert re.search(r"\| GET \| `/admin/snapshot` \| Write a snapshot of the store. \| yes \|", page)


def _fields(section: str) -> set[str]:
    return set(re.findall(r"^\| `([a-z_]+)` \|", section, re.M))


async def test_the_export_page_lists_what_a_real_export_holds(hook: ModuleType) -> None:
    """Two turns through the gateway (scripted engine: the fields, not the tokens, are the point),
    exported natively and in every trainer format; the page's field tables must name exactly those."""
    renderer = gguf_renderer(embedded_model_path())
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine = ScriptedEngine(renderer.tokenizer.encode("Four."), end)
    gateway = InProcessGateway(gateway=Gateway(engine, renderer, SessionRegistry()), model="m")
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
    assert re.search(r"\| `turn_index` \| per token \|", page) and re.search(r"\| `turn_ids` \| per turn \|", page)
    for fmt in FORMATS:
        assert _fields(_section(page, f"### `{fmt}`")) == set(rows[fmt]), fmt
