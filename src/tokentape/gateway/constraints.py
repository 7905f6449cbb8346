"""What a request asks the model's output to be (`tool_choice`, `response_format`) -> one engine
`Constraint`, in the syntax of the model's own tool-call format.

- `tool_choice` "required" or a named function: the reply is one tool call of the offered tools (or
  of the named one), with arguments valid for its schema, then the end of the turn.
- `response_format` json_object / json_schema: the reply is JSON (of that schema). With tools offered
  and tool_choice "auto", a tool call is allowed instead.
- "auto" without a response format, and "none": nothing is enforced.

Tool calls need a grammar (the call syntax around the JSON), built here in llama.cpp's GBNF from the
JSON schemas with llama.cpp's own converter; a bare JSON reply is a `json_schema` constraint that
each engine maps to its own structured-output field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tokentape.core.reply import ToolFormat
from tokentape.engines.base import Constraint
from tokentape.errors import InvalidRequest
from tokentape.formats.gbnf import MAX_GRAMMAR_ALTERNATIVES, schema_grammar

__all__ = ["output_constraint"]

# How each format writes one call around its JSON object; formats missing here cannot be enforced.
_CALL_SYNTAX: dict[ToolFormat, tuple[str, str, str]] = {
    # (text before the JSON, text after it, the key that holds the arguments)
    "hermes": ("<tool_call>\n", "\n</tool_call>", "arguments"),
    "llama3": ("", "", "parameters"),
}
# A schema that accepts any JSON object (json_object mode; tools without parameters).
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _named(tool_choice: Any) -> str | None:
    """The function a tool_choice object names (chat's nested form or the Responses' flat form)."""
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else tool_choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("tool_choice must name a function", param="tool_choice")
        return name
    return None


def _response_schema(response_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(_ANY_OBJECT)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else response_format.get("schema")
        if not isinstance(schema, Mapping):
            raise InvalidRequest("response_format json_schema needs a 'schema' object", param="response_format")
        return dict(schema)
    raise InvalidRequest(
        "response_format type must be 'text', 'json_object' or 'json_schema'", param="response_format.type"
    )


def _call_schema(tool: Mapping[str, Any], arguments_key: str) -> dict[str, Any]:
    function = tool.get("function") or {}
    parameters = function.get("parameters") or _ANY_OBJECT
    return {
        "type": "object",
        "properties": {"name": {"const": function.get("name")}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _gbnf(schemas: Mapping[str, Mapping[str, Any]]) -> str:
    """The tool schemas as GBNF rules (`formats.gbnf`), each entered by the rule it is keyed by."""
    try:
        return schema_grammar(schemas)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise InvalidRequest(f"this schema cannot be enforced: {exc}", param="tools") from exc


def _tool_grammar(
    tools: Sequence[Mapping[str, Any]], tool_format: ToolFormat, or_json: Mapping[str, Any] | None
) -> str:
    syntax = _CALL_SYNTAX.get(tool_format)
    if syntax is None:
        raise InvalidRequest(
            f"this model's tool-call format ({tool_format}) cannot be enforced; use tool_choice 'auto'",
            param="tool_choice",
        )
    before, after, key = syntax
    if len(tools) > MAX_GRAMMAR_ALTERNATIVES:  # one alternative a tool: refused before any is converted
        raise InvalidRequest(
            f"{len(tools)} tools cannot be enforced: a call of any of them is a grammar of one alternative a "
            f"tool, and at most {MAX_GRAMMAR_ALTERNATIVES} are enforced; name the tool, or offer fewer",
            param="tool_choice",
        )
    schema = {"anyOf": [_call_schema(tool, key) for tool in tools]} if len(tools) > 1 else _call_schema(tools[0], key)
    # one call: a small model asked for "at least one" tends to repeat it until max_tokens
    calls = f"{json.dumps(before)} call {json.dumps(after)}" if before or after else "call"
    if or_json is None:
        return f"root ::= {calls}\n" + _gbnf({"call": schema})
    # a tool call, or the JSON answer the response format asks for
    return f"root ::= ({calls}) | answer\n" + _gbnf({"call": schema, "answer": or_json})


def output_constraint(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    response_format: Mapping[str, Any] | None,
    tool_format: ToolFormat,
) -> Constraint | None:
    """The constraint a request asks for, or None when nothing is enforced."""
    tools = list(tools or ())
    if tool_choice is not None and not isinstance(tool_choice, (str, Mapping)):
        raise InvalidRequest("tool_choice must be a string or an object", param="tool_choice")
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or a function", param="tool_choice")
    answer = _response_schema(response_format)
    name = _named(tool_choice)
    if name is not None or tool_choice == "required":
        if not tools:
            raise InvalidRequest("tool_choice requires tools", param="tool_choice")
        if name is not None:
            tools = [tool for tool in tools if (tool.get("function") or {}).get("name") == name]
            if not tools:
                raise InvalidRequest(f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
        return Constraint("grammar", _tool_grammar(tools, tool_format, None))
    if answer is None:
        return None
    if tools and tool_choice != "none":
        return Constraint("grammar", _tool_grammar(tools, tool_format, answer))
    return Constraint("json_schema", json.dumps(answer))
