"""JSON strings in the grammars the embedded engine enforces hold no raw control characters: driven
with llama.cpp's own grammar sampler on the embedded model, a newline pushed far above every other
token still cannot enter a string (with llama-cpp-python's converter as shipped, it fills it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt
import pytest
from llama_cpp.llama_grammar import LlamaGrammar, json_schema_to_gbnf

from tokentape.engines.base import Constraint
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.formats.gbnf import strict_strings
from tokentape.gateway.constraints import output_constraint

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
    "additionalProperties": False,
}
TOOL: dict[str, Any] = {"type": "function", "function": {"name": "person", "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def llm(model_path: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(str(model_path), n_ctx=512, n_threads=1, verbose=False)


def _with_newlines_pushed(llm: llama_cpp.Llama, gbnf: str, prompt: str, max_tokens: int = 16) -> str:
    (newline,) = llm.tokenize(b"\n", add_bos=False, special=False)

    def push(ids: npt.NDArray[np.intc], scores: npt.NDArray[np.single]) -> npt.NDArray[np.single]:
        pushed = scores.copy()
        pushed[newline] += 40.0
        return pushed

    grammar = LlamaGrammar.from_string(gbnf, verbose=False)
    out: Any = llm.create_completion(
        prompt,
        grammar=grammar,
        max_tokens=max_tokens,
        temperature=0.0,
        logits_processor=llama_cpp.LogitsProcessorList([push]),
    )
    return str(out["choices"][0]["text"])


def test_a_pushed_newline_fills_a_string_of_the_converters_own_grammar(llm: llama_cpp.Llama) -> None:
    """What the fix is for, seen on the converter as shipped (if a later version fixes it upstream,
    this says so and the fix can go)."""
    text = _with_newlines_pushed(llm, str(json_schema_to_gbnf(json.dumps(SCHEMA))), "A person as JSON:")
    assert '"name": "\n' in text.replace(" ", "").replace('"name":"', '"name": "')


def test_response_format_strings_take_no_raw_newline(llm: llama_cpp.Llama) -> None:
    gbnf = LlamaCppEngine.grammar_text(Constraint("json_schema", json.dumps(SCHEMA)))
    text = _with_newlines_pushed(llm, gbnf, "A person as JSON:")
    assert "\n" not in text.split('"name"', 1)[1]
    assert gbnf == strict_strings(gbnf)


def test_tool_call_strings_take_no_raw_newline(llm: llama_cpp.Llama) -> None:
    constraint = output_constraint([TOOL], "required", None, "hermes")
    assert constraint is not None
    text = _with_newlines_pushed(llm, constraint.value, "Call the tool:", max_tokens=48)
    arguments = text.split('"arguments"', 1)[1]
    assert "\n" not in arguments.split("}", 1)[0]
