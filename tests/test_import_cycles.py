"""No import circle in `src/tokentape`, counting every import a module makes: at its top, inside a
function (a lazy import only hides a circle until it runs), but not under `TYPE_CHECKING`. Computed
from the source with `ast` (Tarjan's strongly connected components), so a new circle fails here
whatever imports first at run time.

And the layering rule on the arrows that remain, counting type-only imports too: `render/` imports
nothing from `engines/` (what both need lives in `formats/` and `native.py`), and `gateway/` names no
engine or store class, only their interfaces (`engines/base.py`, `engines/weights.py`, `store/base.py`)
and the store's value types; which engine and which store is the assembling code's choice."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "tokentape").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path], *, type_only: bool = False) -> set[str]:
    """The modules of the package that `name` imports anywhere outside a TYPE_CHECKING block (and
    inside one too with `type_only`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def targets(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            return
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*parent, *([node.module] if node.module else [])])
        yield base
        yield from (f"{base}.{alias.name}" for alias in node.names)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                for target in targets(child):
                    while target and target not in modules:  # `pkg.mod.name` -> `pkg.mod`
                        target = target.rpartition(".")[0]
                    if target and target != name:
                        out.add(target)
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_finder_sees_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_round_a_circle() -> None:
    modules = _modules()
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 100 and graph["tokentape.server.app"]  # the whole package, with its imports read
    assert _circles(graph) == []


# What each layer may import from the package (a module, or every module under a package); the rest
# of `tokentape` is out of bounds for it.
MAY_IMPORT = {
    "tokentape.render": (
        "tokentape.render",
        "tokentape.core",
        "tokentape.errors",
        "tokentape.formats",  # the GGUF header, shared with the embedded engine
        "tokentape.native",  # llama-cpp-python, loaded the one way the embedded engine loads it
    ),
    "tokentape.gateway": (
        "tokentape.gateway",
        "tokentape.core",
        "tokentape.errors",
        "tokentape.metrics",
        "tokentape.formats",  # GBNF, the grammar a tool-call constraint is written in
        "tokentape.render",  # the renderer is the gateway's own: it alone tokenizes text
        "tokentape.engines.base",  # the Engine and EnginePool protocols and their values
        "tokentape.engines.weights",  # the weight-update seam every engine that takes updates offers
        "tokentape.store.base",  # the TrajectoryStore protocol
        "tokentape.store.scan",  # the values a store's listing is read in (filters, keys, pages)
        "tokentape.store.images",  # image bytes by digest, cached over any TrajectoryStore
    ),
}


def _out_of_bounds(graph: dict[str, set[str]], layer: str, allowed: tuple[str, ...]) -> list[str]:
    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if inside(name, layer)
        for target in targets
        if not any(inside(target, package) for package in allowed)
    )


def test_the_finder_sees_an_arrow_out_of_bounds() -> None:
    graph = {
        "tokentape.render.a": {"tokentape.render.b", "tokentape.engines.gbnf"},
        "tokentape.render": {"tokentape.core.x"},
        "tokentape.gateway.c": {"tokentape.engines.base", "tokentape.engines.router", "tokentape.store"},
        "tokentape.renderer": {"tokentape.engines.x"},  # another package whose name starts alike
    }
    assert _out_of_bounds(graph, "tokentape.render", MAY_IMPORT["tokentape.render"]) == [
        "tokentape.render.a -> tokentape.engines.gbnf"
    ]
    assert _out_of_bounds(graph, "tokentape.gateway", MAY_IMPORT["tokentape.gateway"]) == [
        "tokentape.gateway.c -> tokentape.engines.router",
        "tokentape.gateway.c -> tokentape.store",  # the package: whatever it exports is a concrete class
    ]


def test_each_layer_imports_only_what_it_may() -> None:
    modules = _modules()
    graph = {name: _imported(name, path, modules, type_only=True) for name, path in modules.items()}
    assert graph["tokentape.render.tokenizer"] and graph["tokentape.gateway.service"]  # their imports were read
    out_of_bounds = {layer: _out_of_bounds(graph, layer, allowed) for layer, allowed in MAY_IMPORT.items()}
    assert out_of_bounds == {layer: [] for layer in MAY_IMPORT}
