"""MkDocs hook: the reference pages written from the code at build time, so they cannot drift.

- reference/cli.md: every verb and option of `tokentape`, read from its typer app (click's parameters).
- reference/http.md: every route of the app (`server.app.create_app` over a scripted engine) with the
  dialect that serves it (`server.dialects.registry.DIALECTS`).
- reference/export.md: the export's schema version and fields, read off a real export of a small
  session tree, in every trainer format.

The three `*_markdown` functions are pure over what they are given; the tests call them with apps and
registries of their own to see a new option or route appear without a hand edit.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _first_line(doc: str | None) -> str:
    """The first sentence of a docstring."""
    if not doc:
        return ""
    paragraph = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]


# -- CLI ----------------------------------------------------------------------------------------------


def _param_row(param: Any, ctx: Any) -> str:
    """One parameter of a typer (or click) command as a table row; typer's parameters are read through
    their own display methods, click's through their type."""
    if param.param_type_name == "argument":
        name = f"`{param.name.upper()}`" + ("" if param.required else " (optional)")
    else:
        name = " / ".join(f"`{n}`" for n in [*param.opts, *param.secondary_opts])
    if getattr(param, "is_flag", False):
        kind = "flag"
    elif hasattr(param, "display_type"):
        kind = param.display_type(ctx).strip("<>")
    else:
        kind = param.type.name
    if param.multiple:
        kind += ", repeatable"
    default = param.default
    shown = "" if default is None or default == () or default is False or callable(default) else f"`{default}`"
    help_text = getattr(param, "help", None) or ""
    envvar = param.envvar
    if envvar:
        help_text += f" (env: `{envvar if isinstance(envvar, str) else ', '.join(envvar)}`)"
    return f"| {name} | {_cell(kind)} | {_cell(shown)} | {_cell(help_text)} |"


def _context(command: Any, info_name: str) -> Any:
    """A parsing context of the command's own click (typer ships its own copy of click)."""
    core = sys.modules[type(command).__mro__[1].__module__]
    return core.Context(command, info_name=info_name)


def cli_markdown(command: Any, prog: str = "tokentape") -> str:
    """The CLI reference of a click command (a group of verbs): usage, help and every parameter."""
    lines = [
        "# CLI reference",
        "",
        "Written from the command's own parsers at build time (`docs/hooks/reference.py`): every verb and",
        f"option of `{prog}`, with its type, default and help. `{prog} VERB --help` prints the same.",
        "",
    ]
    verbs: dict[str, Any] = dict(getattr(command, "commands", {}) or {prog: command})
    for name, verb in verbs.items():
        ctx = _context(verb, f"{prog} {name}")
        lines += [f"## `{prog} {name}`", ""]
        if verb.help:
            lines += [inspect.cleandoc(verb.help), ""]
        lines += ["```", verb.get_usage(ctx).strip(), "```", ""]
        params = [p for p in verb.params if p.name != "help"]
        if params:
            lines += ["| parameter | type | default | what |", "|---|---|---|---|"]
            lines += [_param_row(p, ctx) for p in params]
            lines.append("")
    return "\n".join(lines)


# -- HTTP routes --------------------------------------------------------------------------------------


def _flat(routes: Iterable[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Each route with its full path; a router included in another (FastAPI's included routers keep
    their own routes and a prefix) is walked into."""
    for route in routes:
        include = getattr(route, "include_context", None)
        if include is not None:
            yield from _flat(route.original_router.routes, prefix + include.prefix)
        elif getattr(route, "path", None):
            yield prefix + route.path, route


def routes_markdown(routes: Iterable[Any], dialects: Sequence[type], schema_paths: Iterable[str]) -> str:
    """The route table of an app: `routes` are its starlette routes, `dialects` the registry's classes
    (a route at a dialect's path, or under a session's base URL, is that dialect's), `schema_paths` the
    paths its OpenAPI schema lists."""
    in_schema = set(schema_paths)
    by_path = {d.path: d for d in dialects}
    rows = []
    for path, route in _flat(routes):
        methods = sorted((getattr(route, "methods", None) or set()) - {"HEAD"})
        if not path or not methods:
            continue
        shown = path.replace("{session_id:session}", "{session_id}")
        dialect = next((d for p, d in by_path.items() if shown == p or shown.endswith("}" + p)), None)
        if dialect is not None:
            doc = dialect.__doc__ or sys.modules[dialect.__module__].__doc__
            what = f"{dialect.__name__} dialect ({dialect.errors.name} errors): {_first_line(doc)}"
        else:
            what = _first_line(getattr(route, "endpoint", None).__doc__ if hasattr(route, "endpoint") else None)
        schema = "yes" if path in in_schema or shown in in_schema else "no"
        rows.append(f"| {' '.join(methods)} | `{shown}` | {_cell(what)} | {schema} |")
    return "\n".join(
        [
            "# HTTP routes",
            "",
            "Written at build time from the app's own routes (`server.app.create_app`) and the dialect",
            "registry (`server/dialects/registry.py`): a dialect added to the registry, or a route added to",
            "the app, appears here without a hand edit. What each dialect's fields do, and how sessions are",
            "named: [Connect an agent](../guides/connect.md); who may call what:",
            "[Secure a deployment](../guides/security.md). The gateway also serves its OpenAPI schema at",
            "`/openapi.json` (the last column: whether a route is in it).",
            "",
            "| method | path | what | in the OpenAPI schema |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )


def app_routes() -> tuple[list[Any], list[type], list[str]]:
    """The routes of a real app over a scripted engine (no inference runs to list them)."""
    from tokentape.engines.scripted import ScriptedEngine
    from tokentape.gateway.service import Gateway
    from tokentape.gateway.sessions import SessionRegistry
    from tokentape.runtime import embedded_model_path, gguf_renderer
    from tokentape.server.app import create_app
    from tokentape.server.dialects.registry import DIALECTS

    renderer = gguf_renderer(embedded_model_path())
    app = create_app(Gateway(ScriptedEngine([], 0), renderer, SessionRegistry()), model_id="model")
    return list(app.routes), list(DIALECTS), list(app.openapi()["paths"])


# -- export fields ------------------------------------------------------------------------------------


def _sample_trees() -> list[Any]:
    """Two small sessions of one group, two turns each (prompt, sampled, bridge, sampled), lengths chosen
    so per-token and per-turn lists cannot be confused."""
    from tokentape.core.messages import chain_of
    from tokentape.core.session import NewTurn, SessionTree
    from tokentape.core.tape import Origin
    from tokentape.core.versions import PolicySpan

    trees = []
    for s in range(2):
        tree = SessionTree(f"s{s}", created_at=100.0 + s)
        tree.outcome.group_id = "g"
        node = None
        for turn, (context, sampled) in enumerate((([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10]))):
            parent = node
            new = NewTurn(
                parent, parent.end if parent else 0, tuple(context), Origin.BRIDGE if parent else Origin.PROMPT, None
            )
            node = tree.attach(
                new,
                sampled=sampled,
                logprobs=[-0.5] * len(sampled),
                finish_reason="stop",
                prompt_chain=chain_of([{"role": "user", "content": str(turn)}]),
                prompt_length=1,
                reply={"role": "assistant", "content": str(turn)},
                policy_version="0",
                logprob_mode="temperature_scaled_untruncated",
                policy_spans=(PolicySpan(0, 0, len(sampled)),),
            )
        tree.outcome.set_rewards(reward=1.0, turn_ids={n.id for n in tree.nodes}, branch_ids={tree.leaves[0].id})
        trees.append(tree)
    return trees


def _kind(value: Any, tokens: int, turns: int) -> str:
    if isinstance(value, list):
        if len(value) == tokens:
            return "per token"
        if len(value) == turns:
            return "per turn"
        return "list"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "null" if value is None else type(value).__name__


def export_markdown(session_export: dict[str, Any], rows: dict[str, list[dict[str, Any]]], version: int) -> str:
    """The export reference from a real session export and real rows of each format."""
    tokens, turns = 10, 2
    branch = session_export["branches"][0]
    lines = [
        "# Export fields",
        "",
        "Written at build time from a real export of a small session (`docs/hooks/reference.py`), so the",
        "field lists are the code's. What the fields mean: [The tape and the export](../concepts/export.md);",
        "how to get them: [Rewards, groups and trainer formats](../guides/export.md).",
        "",
        f"**Schema version: {version}** (`tokentape.core.export.EXPORT_SCHEMA_VERSION`; in every row and in",
        "the Parquet metadata as `tokentape.schema_version`). Changes between versions:",
        "[Changelog](../changelog.md).",
        "",
        "## A session (`GET /sessions/{id}/export`)",
        "",
        "| field | kind |",
        "|---|---|",
        *(f"| `{k}` | {_kind(v, -1, -1)} |" for k, v in session_export.items()),
        "",
        "`summary` holds: " + ", ".join(f"`{k}`" for k in session_export["summary"]) + ".",
        "",
        "### A branch (each entry of `branches`)",
        "",
        "| field | kind |",
        "|---|---|",
        *(f"| `{k}` | {_kind(v, tokens, turns)} |" for k, v in branch.items()),
        "",
        "## Trainer formats (`?format=...`, `tokentape export --format ...`)",
        "",
    ]
    from tokentape.core import formats

    lines += [inspect.cleandoc(formats.__doc__ or ""), ""]
    for fmt, fmt_rows in rows.items():
        row = fmt_rows[0]
        lines += [f"### `{fmt}`", "", "| field | kind |", "|---|---|"]
        lines += [f"| `{k}` | {_kind(v, tokens, turns)} |" for k, v in row.items()]
        lines.append("")
    return "\n".join(lines)


def export_reference() -> str:
    from tokentape.core.export import EXPORT_SCHEMA_VERSION, export_session
    from tokentape.core.formats import FORMATS, format_rows, samples_of

    trees = _sample_trees()
    rows = {fmt: format_rows(samples_of(trees), fmt) for fmt in FORMATS}
    return export_markdown(export_session(trees[0]), rows, EXPORT_SCHEMA_VERSION)


def cli_reference() -> str:
    import typer

    from tokentape.cli import app

    return cli_markdown(typer.main.get_command(app))


def http_reference() -> str:
    return routes_markdown(*app_routes())


def pages() -> dict[str, str]:
    return {
        "reference/cli.md": cli_reference(),
        "reference/http.md": http_reference(),
        "reference/export.md": export_reference(),
    }


# -- the hook -----------------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for uri, content in pages().items():
        files.append(File.generated(config, uri, content=content))
    return files
