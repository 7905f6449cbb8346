"""JSON's rule on strings in the grammars llama-cpp-python's schema converter writes.

The converter (`json_schema_to_gbnf`, `SchemaConverter`) lets a string hold any character but `"` and
`\\`, raw control characters included: a constrained reply could then carry a raw newline inside a
string, which JSON forbids and strict parsers (Python's `json.loads`) reject. llama.cpp's own
converter has since excluded them (`[^"\\\\\\x7F\\x00-\\x1F]`); the same class is put back here.
"""

from __future__ import annotations

__all__ = ["strict_strings"]

LOOSE_CHAR = r'char ::= [^"\\] |'
STRICT_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def strict_strings(gbnf: str) -> str:
    """`gbnf` with its JSON string characters limited to what JSON allows unescaped."""
    return gbnf.replace(LOOSE_CHAR, STRICT_CHAR)
