"""The real tokenizers and chat templates of every family, loaded once per test run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import SOURCES, materialise
from tokentape.render.hf import load_model_dir
from tokentape.render.renderer import Renderer


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: materialise(name, root) for name in SOURCES}


@pytest.fixture(scope="session")
def renderers(model_dirs: dict[str, Path], renderer: Renderer) -> dict[str, Renderer]:
    built = {"smollm2": renderer}
    for name, directory in model_dirs.items():
        template, tokenizer = load_model_dir(directory)
        built[name] = Renderer(template, tokenizer)
    return built
