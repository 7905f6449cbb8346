"""Every dialect the gateway speaks, in one list. Everything that depends on which routes exist is
built from it: the lean path's table and FastAPI's routes and schema (`server.app`), the error shape
of an answer given before any route runs (`shape_for_path`), the routes whose body may name the
session for Ray's hand-off (`ray.routing`) and what a session key may call (`server.auth`). A new API
family is one module in this package (a `Dialect` subclass with its path, request model and error
shape) and one entry here."""

from __future__ import annotations

from typing import Any

from tokentape.server.dialects.anthropic import COUNT_TOKENS_PATH, AnthropicMessages
from tokentape.server.dialects.generate import VLLMGenerate
from tokentape.server.dialects.openai_chat import OpenAIChat, OpenAICompletions
from tokentape.server.dialects.responses import OpenAIResponses
from tokentape.server.errors import OPENAI_ERRORS, ErrorShape
from tokentape.server.serving import Dialect

__all__ = ["DIALECTS", "PATHS", "SIDE_PATHS", "shape_for_path"]

DIALECTS: tuple[type[Dialect[Any]], ...] = (
    OpenAIChat,
    OpenAICompletions,
    OpenAIResponses,
    AnthropicMessages,
    VLLMGenerate,
)
PATHS = tuple(dialect.path for dialect in DIALECTS)  # each also served under /sessions/{session_id}
# a dialect's routes that sample nothing and record nothing (Messages' token count), also under a session
SIDE_PATHS = (COUNT_TOKENS_PATH,)
_SHAPES = {dialect.path: dialect.errors for dialect in DIALECTS} | {COUNT_TOKENS_PATH: AnthropicMessages.errors}


def shape_for_path(path: str) -> ErrorShape:
    """The error shape of the client at `path` (its dialect's, also under a session's base URL), for
    answers given before any route runs; OpenAI's for every other path."""
    path = path.rstrip("/")
    for route, shape in _SHAPES.items():
        if path.endswith(route):
            return shape
    return OPENAI_ERRORS
