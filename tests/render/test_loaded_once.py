"""A process loads a tokenizer once for each set of files it is built from, and again when they change:
the same files in another directory share one, a changed config or a rewritten GGUF gets its own."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tests.support.models import materialise
from tokentape.render.hf import load_model_dir
from tokentape.runtime import gguf_renderer


def test_the_same_files_share_a_tokenizer_and_a_changed_config_does_not(tmp_path: Path) -> None:
    first = materialise("qwen2.5", tmp_path / "a")
    second = materialise("qwen2.5", tmp_path / "b")  # the same bytes, another directory
    _, tokenizer = load_model_dir(first)
    assert load_model_dir(second)[1] is tokenizer

    config = json.loads((second / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|im_start|>"  # a different end of turn, declared only in the config
    (second / "tokenizer_config.json").write_text(json.dumps(config))
    _, changed = load_model_dir(second)
    assert changed is not tokenizer
    start = changed.encode("<|im_start|>")[0]
    assert start in changed.end_of_turn_ids and start not in tokenizer.end_of_turn_ids


def test_a_gguf_rewritten_in_place_gets_its_own_tokenizer(model_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model.gguf"
    shutil.copy(model_path, copy)
    tokenizer = gguf_renderer(copy).tokenizer
    assert gguf_renderer(copy).tokenizer is tokenizer
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # written again, same size
    assert gguf_renderer(copy).tokenizer is not tokenizer
