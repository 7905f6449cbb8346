"""Property-based API fuzzing from the gateway's own OpenAPI schema (schemathesis): no input may
produce a 5xx. Runs in process over a scripted engine so thousands of calls stay fast; the figure
(cases, 5xx) goes to test-output/schemathesis.json for the reliability table."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings

from tests.conftest import MODEL_NAME
from tests.support.served import build
from tokentape.engines.scripted import ScriptedEngine
from tokentape.runtime import embedded_model_path, gguf_renderer

EXAMPLES = int(os.environ.get("TOKENTAPE_FUZZ_EXAMPLES", "25"))
OUTPUT = Path(__file__).resolve().parents[2] / "test-output" / "schemathesis.json"

_renderer = gguf_renderer(embedded_model_path())
_engine = ScriptedEngine(
    _renderer.tokenizer.encode("Hello there"), _renderer.tokenizer.encode("<|im_end|>")[0], context_length=4096
)
app = build(_engine, _renderer).app
schema = schemathesis.openapi.from_asgi("/openapi.json", app)
FIGURES: dict[str, Any] = {"cases": 0, "server_errors": 0, "failures": []}


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_the_gateway_fail(case: Any) -> None:
    generation = ("/chat/completions", "/completions", "/responses", "/messages", "/inference/v1/generate")
    if case.path.endswith(generation) and isinstance(case.body, dict):
        case.body.setdefault("model", MODEL_NAME)  # reach the generation path, not only the model check
    response = case.call()
    FIGURES["cases"] += 1
    if response.status_code >= 500:
        FIGURES["server_errors"] += 1
        FIGURES["failures"].append(f"{case.method} {case.path}: {response.status_code} {response.text[:200]}")
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(json.dumps(FIGURES))
    assert response.status_code < 500, response.text
    anthropic = case.path.endswith(("/v1/messages", "/v1/messages/count_tokens"))
    if response.status_code >= 400 and anthropic:  # Anthropic's error shape
        assert response.json()["type"] == "error" and set(response.json()["error"]) == {"message", "type"}
    elif response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
