"""JSON schemas as llama.cpp grammars (GBNF), through llama-cpp-python's own schema converter, with
JSON's rule on strings put back.

The converter lets a string hold any character but `"` and `\\`, raw control characters included: a
constrained reply could then carry a raw newline inside a string, which JSON forbids and strict parsers
(Python's `json.loads`) reject. llama.cpp's own converter has since excluded them
(`[^"\\\\\\x7F\\x00-\\x1F]`); the same class is used here. Every grammar the embedded engine enforces from
a schema (`response_format`, forced tool calls) comes from `schema_grammar`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["schema_grammar", "strict_strings"]

LOOSE_CHAR = r'char ::= [^"\\] |'
STRICT_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def strict_strings(gbnf: str) -> str:
    """`gbnf` with its JSON string characters limited to what JSON allows unescaped."""
    return gbnf.replace(LOOSE_CHAR, STRICT_CHAR)


def schema_grammar(schemas: Mapping[str, Mapping[str, Any]]) -> str:
    """JSON schemas as GBNF rules, each entered by the rule it is keyed by ("" is the grammar's root);
    one converter, so the rules they share are written once. Raises ValueError, KeyError, TypeError or
    RecursionError for a schema the converter cannot take."""
    from llama_cpp.llama_grammar import SchemaConverter

    converter: Any = SchemaConverter(  # type: ignore[no-untyped-call]
        prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
    )
    for rule, schema in schemas.items():
        converter.visit(converter.resolve_refs(json.loads(json.dumps(schema)), "request"), rule)
    return strict_strings(str(converter.format_grammar()))
