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
from tokentape.render.renderer import Renderer
from tokentape.served import Served, ServeSpec, build_served


@pytest.fixture(scope="module")
def own_engine(model_path: Path) -> Iterator[LlamaCppEngine]:
    # Flash attention off, as the cold reference contexts compute (tests/weights/reference.py): its
    # kernel splits a one-row attention over 512 cells or more by thread count, and the engine's
    # thread tuner changes that count between steps, so bit-identity to a cold context would then
    # hang on how full this module's cache has grown. The plain kernels round alike at any count.
    yield LlamaCppEngine(LlamaCppSettings(model_path=model_path, context_length=1024, flash_attention=False))


@pytest.fixture
def spec() -> ServeSpec:
    """What `fresh` is built from; a test parametrized with `spec` builds it from its own."""
    return ServeSpec(served_model_name="smollm2")


@pytest.fixture
async def fresh_served(own_engine: LlamaCppEngine, renderer: Renderer, spec: ServeSpec) -> Served:
    """A gateway on the module's engine, its weights back at the start weights (version 0), and its app."""
    if own_engine.weights_version != 0 or own_engine.adapter_path is not None:
        await own_engine.load_weights(own_engine.start_source, 0)
    return build_served(spec, engine=own_engine, renderer=renderer)  # not closed: that would close the engine


@pytest.fixture
def fresh(fresh_served: Served) -> Gateway:
    return fresh_served.gateway


@pytest.fixture
async def admin(fresh_served: Served) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=fresh_served.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tokentape") as client:
        yield client


@pytest.fixture(scope="session")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three different adapters (random A, small random B) for the embedded model."""
    folder = tmp_path_factory.mktemp("adapters")
    return [write_lora(folder / f"adapter-{i}.gguf", seed=i) for i in range(3)]
