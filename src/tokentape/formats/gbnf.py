"""JSON schemas as llama.cpp grammars (GBNF), through llama-cpp-python's own schema converter, with
JSON's rule on strings put back, and with the limits that keep one request's grammar from stopping the
engine for everyone.

The converter lets a string hold any character but `"` and `\\`, raw control characters included: a
constrained reply could then carry a raw newline inside a string, which JSON forbids and strict parsers
(Python's `json.loads`) reject. llama.cpp's own converter has since excluded them
(`[^"\\\\\\x7F\\x00-\\x1F]`); the same class is used here. Every grammar the embedded engine enforces from
a schema (`response_format`, forced tool calls) comes from `schema_grammar`.

Limits (each refused with a ValueError naming it, which callers answer with a 400):

- Repetitions: the converter writes `minLength`, `maxLength`, `minItems`, `maxItems` and a pattern's
  `{m,n}` out in full, one copy per count, so `"minLength": 1e9` would build gigabytes of text on the
  gateway's event loop. Their sum over a schema is bounded (`MAX_REPETITIONS`).
- Nesting: an upper bound (`maxLength` above `minLength`, `maxItems`, `{m,n}`) becomes one nested
  group per count, `(c (c (c)?)?)?`, and llama.cpp's grammar parser recurses once per group on the
  engine's worker thread: about 20,000 levels overflow its stack and kill the process. llama.cpp refuses
  deeper than about 1,000 levels itself once parsed; past `MAX_GRAMMAR_DEPTH` a grammar never reaches it.
- Ambiguity: optional items side by side (`a?a?a?...`), or a group that can match in more than one
  way (`(a?)`, `(a+)`, `(a|ab)`) repeated `{n}` times, leave llama.cpp's grammar sampler as many ways
  to be at once, and its cost grows about with the fourth power of that: `^(a?){160}$` took half a
  minute a token, 160 `a?` side by side 17 s, `^((a?){10}){10}$` five seconds. That measure (nested
  counts multiplied) is bounded (`MAX_AMBIGUOUS_REPEATS`); a repeated single character or class
  (`[a-z]{1,64}`) nests its optional copies, one way to be at a time, and counts once.
- Size: every alternative of a grammar is followed on every token, over the whole vocabulary; an enum
  of 50,000 values cost the worker seconds per token, for every generation in its batch. A grammar's
  alternatives are bounded (`MAX_GRAMMAR_ALTERNATIVES`), and so is its text (`MAX_GRAMMAR_CHARS`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_GRAMMAR_ALTERNATIVES",
    "MAX_GRAMMAR_CHARS",
    "MAX_GRAMMAR_DEPTH",
    "MAX_REPETITIONS",
    "check_grammar",
    "schema_grammar",
    "strict_strings",
]

LOOSE_CHAR = r'char ::= [^"\\] |'
STRICT_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'

MAX_REPETITIONS = 10_000  # summed over a schema: minLength, maxLength, minItems, maxItems, {m,n}
MAX_GRAMMAR_DEPTH = 1_000  # nested groups; llama.cpp's parser recurses per level on the worker's stack
MAX_GRAMMAR_ALTERNATIVES = 1_024  # `|` in the grammar: each one a path followed over the vocabulary
MAX_GRAMMAR_CHARS = 4 * 1024 * 1024
MAX_AMBIGUOUS_REPEATS = 32  # `(a?){32}`: a few ms a token; `(a?){80}`: about two seconds

_REPEATING = ("minLength", "maxLength", "minItems", "maxItems")
# values, not schemas: a "maxLength" key inside them is data
_DATA = frozenset({"const", "enum", "default", "examples", "description", "title"})
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def strict_strings(gbnf: str) -> str:
    """`gbnf` with its JSON string characters limited to what JSON allows unescaped."""
    return gbnf.replace(LOOSE_CHAR, STRICT_CHAR)


def _repetitions(schema: Any) -> int:
    """What the converter will write out for the schema's repetitions, summed (a walk without
    recursion: the schema may nest as deeply as its JSON did)."""
    total = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, Mapping):
            continue
        for key, value in node.items():
            if key in _DATA:
                continue
            if key in _REPEATING and isinstance(value, (int, float)) and not isinstance(value, bool):
                count = value if math.isfinite(value) else MAX_REPETITIONS + 1  # infinity is past any bound
                total += max(0, int(min(count, MAX_REPETITIONS + 1)))
            elif key == "pattern" and isinstance(value, str):
                repeats = _ambiguous_repeats(value)
                if repeats > MAX_AMBIGUOUS_REPEATS:
                    raise ValueError(
                        f"the pattern {value[:80]!r} can match in several ways at {repeats} places at once (optional"
                        f" items, repeated groups that hold a choice); at most {MAX_AMBIGUOUS_REPEATS} are enforced"
                    )
                for low, high in _QUANTIFIER.findall(value):
                    total += min(max(int(low or 0), int(high or 0)), MAX_REPETITIONS + 1)
            elif isinstance(value, (Mapping, list)):
                stack.append(value)
        if total > MAX_REPETITIONS:
            break
    return total


def _ambiguous_repeats(pattern: str) -> int:
    """How many ways a regular expression leaves to be at once, roughly: per group (and the whole),
    its optional or variable items (`?`, `*`, `+`, `{m,n}`) side by side, or the measure of a group
    nested in it, whichever is larger; a group that holds a choice, repeated `{n}` times, counts n times
    its measure. `^(a?){160}$`, `^a?a?...a?$` (160) and `^((a?){10}){10}$` measure 160, 160 and 100."""
    stack: list[list[int]] = [[0, 1, 0]]  # per open group: holds a choice, its deepest measure, its variable items
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        frame = stack[-1]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif c == "(":
            frame[0] = 1
            stack.append([0, 1, 0])
        elif c == ")" and len(stack) > 1:
            choice, inner, variable = stack.pop()
            measure = max(inner, variable, 1)
            quantifier = _QUANTIFIER.match(pattern, i + 1)
            count = 1
            if quantifier is not None and quantifier.group(2) is None:  # {n}: exactly n times
                count = min(int(quantifier.group(1) or 1), MAX_REPETITIONS + 1)
            elif quantifier is not None:  # {m,n}: n times at most (an open end counts as one more choice)
                low, high = quantifier.groups()
                count = min(max(int(low or 0), int(high or 0), 1), MAX_REPETITIONS + 1)
            stack[-1][1] = max(stack[-1][1], measure * count if choice else measure)
        elif c in "?*+|":
            frame[0] = 1
            frame[2] += c != "|"
        elif c == "{":
            frame[0] = 1
            quantifier = _QUANTIFIER.match(pattern, i)
            if quantifier is not None and quantifier.group(2) not in (None, quantifier.group(1)):  # {m,n}, m != n
                frame[2] += 1
        i += 1
    return max(max(frame[1], frame[2]) for frame in stack)


def check_grammar(gbnf: str) -> None:
    """Refuse (ValueError) a grammar too large, too branched or too deeply nested for the embedded
    engine's worker to parse and follow; literals and character classes are skipped."""
    if len(gbnf) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the grammar has {len(gbnf)} characters; at most {MAX_GRAMMAR_CHARS} are enforced")
    depth = deepest = alternatives = 0
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c == '"' or c == "[":
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and gbnf[i] != close:
                i += 2 if gbnf[i] == "\\" else 1
        elif c == "#":  # a comment, to the end of its line
            while i < n and gbnf[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        elif c == "|":
            alternatives += 1
        i += 1
    if deepest > MAX_GRAMMAR_DEPTH:
        raise ValueError(
            f"the grammar nests {deepest} groups deep (a maxLength, maxItems or {{m,n}} far above its minimum);"
            f" at most {MAX_GRAMMAR_DEPTH} are enforced"
        )
    if alternatives > MAX_GRAMMAR_ALTERNATIVES:
        raise ValueError(
            f"the grammar has {alternatives} alternatives (enum values, anyOf branches);"
            f" at most {MAX_GRAMMAR_ALTERNATIVES} are enforced"
        )


def schema_grammar(schemas: Mapping[str, Mapping[str, Any]]) -> str:
    """JSON schemas as GBNF rules, each entered by the rule it is keyed by ("" is the grammar's root);
    one converter, so the rules they share are written once. Raises ValueError for a schema the
    converter cannot take or one past the limits above (KeyError, TypeError or RecursionError from
    callers that still name them)."""
    from llama_cpp.llama_grammar import SchemaConverter

    repetitions = _repetitions(list(schemas.values()))
    if repetitions > MAX_REPETITIONS:
        raise ValueError(
            f"the schema asks for more than {MAX_REPETITIONS} repetitions in all (minLength, maxLength, minItems,"
            " maxItems, a pattern's {m,n}), more than the embedded engine enforces"
        )
    converter: Any = SchemaConverter(  # type: ignore[no-untyped-call]
        prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
    )
    try:
        for rule, schema in schemas.items():
            converter.visit(converter.resolve_refs(json.loads(json.dumps(schema)), "request"), rule)
        gbnf = strict_strings(str(converter.format_grammar()))
    except RecursionError as exc:
        raise ValueError("the schema nests too deeply") from exc
    except (ValueError, KeyError, TypeError):
        raise
    except Exception as exc:  # the converter asserts, and indexes into, the shapes it expects
        raise ValueError(f"unsupported schema: {type(exc).__name__}: {exc}") from exc
    check_grammar(gbnf)
    return gbnf
