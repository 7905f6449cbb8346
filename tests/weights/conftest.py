"""Fixtures for weight updates: an engine of its own (the shared one must keep the base weights), a
gateway on it, and LoRA adapters written by the tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.lora import write_lora
from tokentape.engines.llamacpp import LlamaCppEngine, LlamaCppSettings
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import SessionRegistry
from tokentape.render.renderer import Renderer
from tokentape.server.app import create_app


@pytest.fixture(scope="module")
def own_engine(model_path: Path) -> Iterator[LlamaCppEngine]:
    # Flash attention off, as the cold reference contexts compute (tests/weights/reference.py): its
    # kernel splits a one-row attention over 512 cells or more by thread count, and the engine's
    # thread tuner changes that count between steps, so bit-identity to a cold context would then
    # hang on how full this module's cache has grown. The plain kernels round alike at any count.
    yield LlamaCppEngine(LlamaCppSettings(model_path=model_path, context_length=1024, flash_attention=False))


@pytest.fixture
async def fresh(own_engine: LlamaCppEngine, renderer: Renderer) -> AsyncIterator[Gateway]:
    """A gateway on the module's engine, its weights back at the start weights (version 0)."""
    if own_engine.weights_version != 0 or own_engine.adapter_path is not None:
        await own_engine.load_weights(own_engine.start_source, 0)
    gateway = Gateway(own_engine, renderer, SessionRegistry())
    yield gateway  # not closed: that would close the module's engine


@pytest.fixture
async def admin(fresh: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(fresh, model_id="smollm2")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tokentape") as client:
        yield client


@pytest.fixture(scope="session")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three different adapters (random A, small random B) for the embedded model."""
    folder = tmp_path_factory.mktemp("adapters")
    return [write_lora(folder / f"adapter-{i}.gguf", seed=i) for i in range(3)]
