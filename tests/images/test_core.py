"""The pure pieces: placeholder expansion, its refusals, and the runs' round trip through JSON."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import materialise
from tokentape.core.images import ImageRun, expand_placeholders, masked_images, runs_from_json, runs_to_json
from tokentape.runtime import hf_renderer

OPEN, PAD, CLOSE = 7, 8, 9


def test_each_placeholder_becomes_its_own_count_and_its_run_is_located() -> None:
    tokens = [1, OPEN, PAD, CLOSE, 2, OPEN, PAD, CLOSE]
    expanded, runs = expand_placeholders(tokens, PAD, OPEN, CLOSE, [3, 1])
    assert expanded == [1, OPEN, PAD, PAD, PAD, CLOSE, 2, OPEN, PAD, CLOSE]
    assert runs == [(1, 5), (7, 3)]
    assert [expanded[s : s + n] for s, n in runs] == [[OPEN, PAD, PAD, PAD, CLOSE], [OPEN, PAD, CLOSE]]


@pytest.mark.parametrize(
    ("tokens", "lengths", "words"),
    [
        ([OPEN, PAD, CLOSE], [], "more image placeholders"),
        ([OPEN, PAD, CLOSE], [2, 2], "1 image placeholder(s) for 2"),
        ([1, PAD, CLOSE], [2], "not framed"),
        ([OPEN, PAD], [2], "not framed"),
    ],
)
def test_a_rendering_that_does_not_frame_one_pad_per_image_is_refused(
    tokens: list[int], lengths: list[int], words: str
) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        expand_placeholders(tokens, PAD, OPEN, CLOSE, lengths)


def test_runs_survive_json_and_masking_forgets_only_the_image() -> None:
    runs = (ImageRun("ab" * 32, 17, 6, (1, 4, 4)), ImageRun("cd" * 32, 40, 66, (1, 16, 16)))
    assert runs_from_json(runs_to_json(runs)) == runs
    message = {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image", "image": "ab" * 32}]}
    other = {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image", "image": "cd" * 32}]}
    assert masked_images(message) == masked_images(other) != masked_images({**message, "content": "x"})


def test_a_text_model_sharing_the_vision_vocabulary_is_no_vision_model(tmp_path: Path, vl_dir: Path) -> None:
    """Qwen2.5's and Qwen3's text models have the vision tokens in their vocabulary; only a template
    that writes the image placeholder, or an image processor's config, makes a vision model."""
    text_dir = materialise("qwen2.5", tmp_path)
    assert hf_renderer(text_dir).tokenizer.encode("<|image_pad|>") == hf_renderer(vl_dir).tokenizer.encode(
        "<|image_pad|>"
    )
    assert hf_renderer(text_dir).vision is None
    assert hf_renderer(vl_dir).vision is not None
    (text_dir / "preprocessor_config.json").write_text('{"min_pixels": 3136, "max_pixels": 12845056}')
    configured = hf_renderer(text_dir).vision
    assert configured is not None and configured.processor.size.shortest_edge == 3136
