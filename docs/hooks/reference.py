"""MkDocs hook: the reference pages written from the code at build time, so they cannot drift.

- reference/cli.md: every verb and option of `tokentape`, read from its typer app (click's parameters).
- reference/http.md: every route of the app (`served.build_served` over a scripted engine) with the
  first paragraph of its handler's docstring (a dialect's route: its class's docstring), what it
  reads, and who may call it (`server.auth.decide`). A route without a docstring stops the build.
- reference/export.md: the export's schema version and fields, read off a real export of a small
  session tree, in every trainer format, each field described from `export_fields.py` (type, what a
  list's entries stand for, meaning). A field without an entry, or a value that contradicts its
  entry, stops the build.

The three `*_markdown` functions are pure over what they are given; the tests call them with apps and
registries of their own to see a new option or route appear without a hand edit, and an undescribed
one stop the build.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any


def _cell(text: object) -> str:
    """Text for one table cell, on one line. A pipe is escaped outside code spans only: the tables
    extension does not split a cell inside backticks, and would show the escape there."""
    parts = " ".join(str(text).split()).split("`")
    return "`".join(part if i % 2 else part.replace("|", "\\|") for i, part in enumerate(parts))


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
    if getattr(param, "is_flag", False) and isinstance(default, bool):
        shown = "on" if default else "off"
    elif param.required:
        shown = "required"
    elif default is None or default == () or callable(default):
        shown = "none"
    else:
        shown = f"`{default}`"
    help_text = getattr(param, "help", None) or ""
    if not help_text.strip():
        raise Undocumented(f"{ctx.info_name}: {'/'.join(param.opts) or param.name} has no help text")
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


class Undocumented(Exception):
    """A route or an export field the reference cannot describe from the code: the build stops."""


# FastAPI's own pages: their handlers are FastAPI's, not this project's, so their lines are written here.
FASTAPI_OWN = {
    "/openapi.json": "The OpenAPI schema of the routes marked yes in the last column (FastAPI's own page).",
    "/docs": "Swagger UI over the OpenAPI schema (FastAPI's own page).",
    "/docs/oauth2-redirect": "Swagger UI's OAuth2 redirect (FastAPI's own page).",
    "/redoc": "ReDoc over the OpenAPI schema (FastAPI's own page).",
}


def _paragraph(doc: str | None) -> str:
    """The first paragraph of a docstring, on one line."""
    if not doc:
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def _flat(routes: Iterable[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Each route with its full path; a router included in another (FastAPI's included routers keep
    their own routes and a prefix) is walked into."""
    for route in routes:
        include = getattr(route, "include_context", None)
        if include is not None:
            yield from _flat(route.original_router.routes, prefix + include.prefix)
        elif getattr(route, "path", None):
            yield prefix + route.path, route


def _description(path: str, route: Any, dialect: type | None) -> str:
    """A route's line: its dialect class's own docstring, else its handler's; FastAPI's own pages
    from `FASTAPI_OWN`. Empty when there is none (the caller refuses that)."""
    if dialect is not None:
        doc = dialect.__dict__.get("__doc__")  # the class's own, never a base class's
        return f"{dialect.__name__} dialect ({dialect.errors.name} errors): {_paragraph(doc)}" if doc else ""
    endpoint = getattr(route, "endpoint", None)
    if (getattr(endpoint, "__module__", None) or "").startswith("fastapi.") and path in FASTAPI_OWN:
        return FASTAPI_OWN[path]
    return _paragraph(getattr(endpoint, "__doc__", None))


def _request(route: Any) -> str:
    """What a route reads: its JSON body's model (as declared to the schema) and its query parameters;
    for a POST that declares no model, the JSON body its line describes."""
    parts = []
    extra = getattr(route, "openapi_extra", None) or {}
    body = extra.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    if body.get("title"):
        parts.append(f"body `{body['title']}`")
    dependant = getattr(route, "dependant", None)
    query = [param.name for param in getattr(dependant, "query_params", [])]
    if query:
        parts.append("query " + ", ".join(f"`{name}`" for name in query))
    if parts:
        return "; ".join(parts)
    return "JSON body, if any: see its line" if "POST" in (getattr(route, "methods", None) or ()) else "nothing"


def _access(path: str) -> str:
    """Who may call a path once the gateway has trainer keys, as `server.auth.decide` rules."""
    from tokentape.server.auth import Kind, decide

    concrete = path.replace("{session_id}", "s")
    if decide(Kind.NONE, concrete, trainer_keys=True) is None:
        return "anyone (no key)"
    if decide(Kind.SESSION, concrete, key_session="s") is None:
        return "trainer key or the session's key"
    return "trainer key"


SESSION_BASE = "/sessions/{session_id}"  # a session's base URL: the root's routes again, inside one session


def routes_markdown(routes: Iterable[Any], dialects: Sequence[type], schema_paths: Iterable[str]) -> str:
    """The route table of an app: `routes` are its starlette routes, `dialects` the registry's classes
    (a route at a dialect's path, or under a session's base URL, is that dialect's), `schema_paths` the
    paths its OpenAPI schema lists. A route without a description raises `Undocumented`."""
    in_schema = set(schema_paths)
    by_path = {d.path: d for d in dialects}
    listed = []
    for path, route in _flat(routes):
        methods = sorted((getattr(route, "methods", None) or set()) - {"HEAD"})
        if path and methods:
            listed.append((" ".join(methods), path, path.replace("{session_id:session}", "{session_id}"), route))
    at_root = {(methods, shown) for methods, _, shown, _ in listed}
    rows, missing = [], []
    for methods, path, shown, route in listed:
        dialect = next((d for p, d in by_path.items() if shown == p or shown.endswith("}" + p)), None)
        what = _description(shown, route, dialect)
        if not what:
            where = dialect.__qualname__ if dialect is not None else getattr(route.endpoint, "__qualname__", "?")
            missing.append(f"{methods} {shown} ({where})")
        rest = shown.removeprefix(SESSION_BASE)
        if what and rest != shown and (methods, rest) in at_root:  # the same route under a session's base URL
            what = f"As `{rest}`, inside the session the path names."
        schema = "yes" if path in in_schema or shown in in_schema else "no"
        reads, who = _cell(_request(route)), _access(shown)
        rows.append(f"| {methods} | `{shown}` | {_cell(what)} | {reads} | {who} | {schema} |")
    if missing:
        raise Undocumented(
            "routes without a description (give the handler, or the dialect class, a docstring): " + "; ".join(missing)
        )
    return "\n".join(
        [
            "---",
            "hide: [toc]",
            "---",
            "",
            "# HTTP routes",
            "",
            "Written at build time from the app's own routes (`served.build_served`), the dialect",
            "registry (`server/dialects/registry.py`) and the key rules (`server/auth.py`). Each line is the",
            "first paragraph of the route's own docstring (a dialect's: its class's), and a route without one",
            "stops `make docs`. What each dialect's fields do, and how sessions are named:",
            "[Connect an agent](../guides/connect.md).",
            "",
            "- **reads**: the JSON body's model, as the OpenAPI schema declares it, and the query parameters.",
            "  A POST that declares no model reads the JSON fields its line names.",
            "- **who may call**: once the gateway has a trainer key (`--api-key`). Without one (open mode:",
            "  loopback, or `--insecure-open`) every route is open. With `--session-keys required`, generation",
            "  takes the session's key, not a trainer key. More: [Secure a deployment](../guides/security.md).",
            "- **in the schema**: whether the route is in the OpenAPI schema the gateway serves at",
            "  `/openapi.json`.",
            "",
            "| method | path | what | reads | who may call | in the schema |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )


def app_routes() -> tuple[list[Any], list[type], list[str]]:
    """The routes of a real app over a scripted engine (no inference runs to list them)."""
    from tokentape.engines.scripted import ScriptedEngine
    from tokentape.runtime import embedded_model_path, gguf_renderer
    from tokentape.served import ServeSpec, build_served
    from tokentape.server.dialects.registry import DIALECTS

    renderer = gguf_renderer(embedded_model_path())
    app = build_served(ServeSpec(served_model_name="model"), engine=ScriptedEngine([], 0), renderer=renderer).app
    return list(app.routes), list(DIALECTS), list(app.openapi()["paths"])


# -- export fields ------------------------------------------------------------------------------------

SAMPLE_TOKENS, SAMPLE_TURNS, SAMPLE_MEMBERS = 10, 2, 3


def _fields_table() -> ModuleType:
    """`export_fields.py` beside this file, loaded by path as MkDocs loads this hook."""
    name = "docs_export_fields"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("export_fields.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def _sample_trees() -> list[Any]:
    """One group of three sessions, two turns each (prompt, sampled, bridge, sampled): ten tokens, two
    turns and three members, so per-token, per-turn and per-member lists cannot be confused."""
    from tokentape.core.messages import chain_of
    from tokentape.core.session import NewTurn, SessionTree
    from tokentape.core.tape import Origin
    from tokentape.core.versions import PolicySpan

    trees = []
    for s in range(SAMPLE_MEMBERS):
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


def _alternatives(type_: str) -> list[str]:
    """`A | B` split at the top level (not inside brackets)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(type_):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "|" and depth == 0:
            parts.append(type_[start:i].strip())
            start = i + 1
    return [*parts, type_[start:].strip()]


def conforms(value: Any, type_: str) -> bool:
    """Whether a JSON value has a declared type (`int`, `float`, `str`, `bool`, `object`, `null`,
    `list[T]`, `A | B`)."""
    for alternative in _alternatives(type_):
        if alternative.startswith("list[") and alternative.endswith("]"):
            if isinstance(value, list) and all(conforms(v, alternative[5:-1]) for v in value):
                return True
        elif {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, int | float) and not isinstance(value, bool),
            "str": isinstance(value, str),
            "bool": isinstance(value, bool),
            "object": isinstance(value, dict),
            "null": value is None,
        }.get(alternative, False):
            return True
    return False


def _type_cell(field: tuple[str, str, str]) -> str:
    type_, per, _ = field
    return f"`{type_}`" + (f", one per {per}" if per else "")


def _table(
    fields: dict[str, Any],
    lookup: Any,
    where: str,
    units: dict[str, int],
    problems: list[str],
) -> list[str]:
    """The field table of one exported object; what the fields table lacks or contradicts goes to
    `problems`."""
    lines = ["| field | type | meaning |", "|---|---|---|"]
    for name, value in fields.items():
        field = lookup(name)
        if field is None:
            problems.append(f"{where}: `{name}` has no entry in docs/hooks/export_fields.py")
            lines.append(f"| `{name}` |  |  |")
            continue
        type_, per, meaning = field
        if not meaning.strip():
            problems.append(f"{where}: `{name}` has no meaning")
        if not conforms(value, type_):
            problems.append(f"{where}: `{name}` is {value!r}, not {type_}")
        elif per in units and isinstance(value, list) and len(value) != units[per]:
            problems.append(f"{where}: `{name}` has {len(value)} entries, not one per {per} ({units[per]})")
        lines.append(f"| `{name}` | {_cell(_type_cell(field))} | {_cell(meaning)} |")
    return [*lines, ""]


def _stale(declared: Iterable[str], exported: Iterable[str], where: str, problems: list[str]) -> None:
    for name in sorted(set(declared) - set(exported)):
        problems.append(f"{where}: `{name}` is declared in docs/hooks/export_fields.py but not exported")


def export_markdown(
    session_export: dict[str, Any],
    rows: dict[str, list[dict[str, Any]]],
    version: int,
    units: dict[str, int] | None = None,
) -> str:
    """The export reference from a real session export and real rows of each format, every field
    described from `export_fields.py`; `units` the sample's tokens, turns and group members. A field
    without an entry, of another type or length, or an entry for no field, raises `Undocumented`."""
    table = _fields_table()
    units = units or {"token": SAMPLE_TOKENS, "turn": SAMPLE_TURNS, "member": SAMPLE_MEMBERS}
    problems: list[str] = []
    branch = session_export["branches"][0]
    lines = [
        "# Export fields",
        "",
        "Written at build time from a real export of a small session tree (`docs/hooks/reference.py`), so",
        "the field lists are the code's. Each field's type and meaning come from one table beside the hook",
        "(`docs/hooks/export_fields.py`); the build checks every exported value against its declared type",
        "and length, and stops on a field the table does not describe. The ideas behind the fields:",
        "[The tape and the export](../concepts/export.md); how to get them:",
        "[Rewards, groups and trainer formats](../guides/export.md).",
        "",
        f"**Schema version: {version}** (`tokentape.core.export.EXPORT_SCHEMA_VERSION`; in every row and in",
        "the Parquet metadata as `tokentape.schema_version`). Changes between versions:",
        "[Changelog](../changelog.md).",
        "",
        "How to read a type: `list[int], one per token` is a list with one entry per token of the branch; `one per",
        "turn` has an entry for each turn of the branch, in order; `one per member` (Atropos) one for each",
        "session of the group. `float | null` is a number or `null`.",
        "",
        "## A session (`GET /sessions/{id}/export`)",
        "",
        *_table(session_export, table.SESSION.get, "session", units, problems),
        "### Its `summary`",
        "",
        *_table(session_export["summary"], table.SUMMARY.get, "summary", units, problems),
        "### A branch (each entry of `branches`)",
        "",
        *_table(branch, table.BRANCH.get, "branch", units, problems),
        "### Fields only some exports hold",
        "",
        "| field | type | meaning |",
        "|---|---|---|",
        *(f"| `{k}` | {_cell(_type_cell(f))} | {_cell(f[2])} |" for k, f in table.OPTIONAL.items()),
        "",
        "## Trainer formats (`?format=...`, `tokentape export --format ...`)",
        "",
    ]
    _stale(table.SESSION, session_export, "session", problems)
    _stale(table.SUMMARY, session_export["summary"], "summary", problems)
    _stale(table.BRANCH, branch, "branch", problems)
    from tokentape.core import formats

    lines += [inspect.cleandoc(formats.__doc__ or ""), ""]
    for fmt, fmt_rows in rows.items():
        row = fmt_rows[0]
        lines += [f"### `{fmt}`", ""]
        lines += _table(row, lambda name, fmt=fmt: table.field_of(fmt, name), fmt, units, problems)
        _stale(table.FORMATS.get(fmt, {}), row, fmt, problems)
        if fmt == "tokentape":
            _stale(table.HEAD, row, "every format's head", problems)
    unknown = set(table.FORMATS) - set(rows)
    problems += [f"format {fmt!r} is declared in docs/hooks/export_fields.py but not exported" for fmt in unknown]
    missing = set(rows) - set(table.FORMATS)
    problems += [f"format {fmt!r} has no table in docs/hooks/export_fields.py FORMATS" for fmt in missing]
    if problems:
        raise Undocumented(
            "export fields the reference cannot describe (give each a (type, per, meaning) entry in "
            "docs/hooks/export_fields.py): " + "; ".join(problems)
        )
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


# -- the Python API page ------------------------------------------------------------------------------

INTEGRATIONS_MARKER = "<!-- integrations -->"


def integration_modules() -> list[str]:
    """Every public module of `tokentape.integrations`, by name, from the package's own directory."""
    import pkgutil

    import tokentape.integrations as package

    return sorted(
        f"{package.__name__}.{info.name}"
        for info in pkgutil.iter_modules(package.__path__)
        if not info.name.startswith("_")
    )


def python_markdown(markdown: str) -> str:
    """The Python API page with its integrations marker replaced by one mkdocstrings block per module."""
    if INTEGRATIONS_MARKER not in markdown:
        raise Undocumented(f"reference/python.md lost its {INTEGRATIONS_MARKER} marker")
    blocks = "\n\n".join(f"::: {name}" for name in integration_modules())
    return markdown.replace(INTEGRATIONS_MARKER, blocks)


# -- the hook -----------------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    try:
        written = pages()
    except Undocumented as exc:
        raise PluginError(f"docs/hooks/reference.py: {exc}") from exc
    for uri, content in written.items():
        files.append(File.generated(config, uri, content=content))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != "reference/python.md":
        return markdown
    from mkdocs.exceptions import PluginError

    try:
        return python_markdown(markdown)
    except Undocumented as exc:
        raise PluginError(f"docs/hooks/reference.py: {exc}") from exc
