"""The real tokenizers and chat templates of every family, loaded once per test run."""

from __future__ import annotations

import pytest

from tests.support.models import SOURCES, materialise
from tokentape.render.hf import load_model_dir
from tokentape.render.renderer import Renderer


@pytest.fixture(scope="session")
def renderers(tmp_path_factory: pytest.TempPathFactory, renderer: Renderer) -> dict[str, Renderer]:
    root = tmp_path_factory.mktemp("models")
    built = {"smollm2": renderer}
    for name in SOURCES:
        template, tokenizer = load_model_dir(materialise(name, root))
        built[name] = Renderer(template, tokenizer)
    return built
