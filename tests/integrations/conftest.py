"""The embedded model's tokenizer as a transformers directory: the frameworks load theirs that way."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import gguf_tokenizer_dir


@pytest.fixture(scope="session")
def hf_dir(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gguf_tokenizer_dir(model_path, tmp_path_factory.mktemp("tokenizer"))
