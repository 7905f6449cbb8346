"""A Responses request's tools as the model is shown them: flat function tools as chat tools, the
functions of a `namespace` tool under flat names (vLLM's `{namespace}__{name}`), hosted tools left out;
`tool_choice` in chat terms; and a sampled call's flat name split back into namespace and name."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokentape.errors import InvalidRequest
from tokentape.server.dialects import common

__all__ = [
    "HOSTED_TOOLS",
    "NAMESPACE_SEPARATOR",
    "ToolTable",
    "chat_tool_choice",
    "chat_tools",
    "flat_name",
    "tool_table",
]


# Tools OpenAI's servers run (hosted): no engine here runs them, so the model is not shown them (as
# vLLM's Responses server leaves every tool but functions out) and the turn goes on without them.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "mcp",
        "tool_search",
    }
)
NAMESPACE_SEPARATOR = "__"  # a namespaced function's name as the model sees it: `{namespace}__{name}` (vLLM's)


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for `name` in `namespace` (vLLM's flat name), or `name` alone."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


@dataclass(frozen=True, slots=True)
class ToolTable:
    """A request's tools as the model is shown them: flat function tools as chat tools, the functions
    of each `namespace` tool under their flat names, hosted tools left out (`left_out`: their
    positions and types). `namespaced` maps a flat name back to (namespace, name)."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    left_out: list[tuple[int, str]] = field(default_factory=list)
    top_level: frozenset[str] = frozenset()

    def call_name(self, name: str) -> tuple[str | None, str]:
        """(namespace, name) of a sampled call's name: a flat namespaced name split back."""
        found = self.namespaced.get(name)
        return found if found is not None else (None, name)

    def input_name(self, namespace: Any, name: str) -> str:
        """The flat name of a `function_call` input item: with its `namespace`, or (where an agent
        echoed the call without it) a name only one namespace has and no flat function shares."""
        if isinstance(namespace, str) and namespace:
            return flat_name(namespace, name)
        if name in self.top_level:
            return name
        owners = [flat for flat, (_, inner) in self.namespaced.items() if inner == name]
        return owners[0] if len(owners) == 1 else name

    @property
    def note(self) -> str | None:
        """What the model was not shown, in words (None: it was shown every tool)."""
        if not self.left_out:
            return None
        listed = ", ".join(f"tools[{i}] ({kind})" for i, kind in self.left_out)
        return f"hosted tools left out of the prompt (no engine here runs them): {listed}"


def chat_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The request's tools as the chat tools the model is shown (`tool_table`)."""
    return tool_table(tools).chat or None


def tool_table(tools: Sequence[Mapping[str, Any]] | None) -> ToolTable:
    """Function tools, the functions of namespace tools (flat names), hosted tools left out; a tool
    the client runs that cannot be shown as a function (`custom`, `local_shell`, computer use) is
    refused by name."""
    table = ToolTable()
    top_level = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        where = f"tools[{i}]"
        if kind == "function":
            _check_name(tool, where)
            top_level.append(tool["name"])
            table.chat.append(common.chat_function_tool(tool, "parameters"))
        elif kind == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace or not isinstance(tool.get("tools"), list):
                raise InvalidRequest(f"{where}: a namespace tool needs a name and a list of tools", param=where)
            for j, inner in enumerate(tool["tools"]):
                inner_where = f"{where}.tools[{j}]"
                if not isinstance(inner, Mapping) or inner.get("type") != "function":
                    got = inner.get("type") if isinstance(inner, Mapping) else None
                    raise InvalidRequest(
                        f"{inner_where}: only function tools are supported in a namespace (got {got!r})",
                        param=inner_where,
                    )
                _check_name(inner, inner_where)
                flat = flat_name(namespace, inner["name"])
                table.namespaced[flat] = (namespace, inner["name"])
                table.chat.append(common.chat_function_tool({**inner, "name": flat}, "parameters"))
        elif kind in HOSTED_TOOLS:
            table.left_out.append((i, str(kind)))
        else:
            raise InvalidRequest(
                f"{where}: only function, namespace and hosted tools are supported (got {kind!r})", param=where
            )
    names = [t["function"]["name"] for t in table.chat]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise InvalidRequest(f"tools: function names must be unique (given twice: {', '.join(twice)})", param="tools")
    return dataclasses.replace(table, top_level=frozenset(top_level))


def _check_name(tool: Mapping[str, Any], where: str) -> None:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidRequest(f"{where}: a function tool needs a name", param=where)


def chat_tool_choice(tool_choice: str | Mapping[str, Any] | None) -> str | dict[str, Any] | None:
    """`tool_choice` in chat terms; a namespaced function by its flat name."""
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice
    if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
        raise InvalidRequest(
            "tool_choice must be 'none', 'auto', 'required' or a function (hosted tools are not run here)",
            param="tool_choice",
        )
    namespace = tool_choice.get("namespace")
    name = flat_name(namespace if isinstance(namespace, str) else None, tool_choice["name"])
    return {"type": "function", "function": {"name": name}}
