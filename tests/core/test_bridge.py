"""Cutting rendered text at a reply's turn close."""

from __future__ import annotations

import pytest

from tokentape.core.bridge import REPLY_SENTINEL, remaining_close, text_after_reply, turn_close_after


def test_the_sampled_close_is_completed_never_repeated() -> None:
    assert remaining_close("<|im_end|>\n", "<|im_end|>") == "\n"
    assert remaining_close("<|eot_id|>", "<|eot_id|>") == ""


def test_a_turn_without_its_close_gets_the_whole_close() -> None:
    assert remaining_close("<|im_end|>\n", None) == "<|im_end|>\n"
    assert remaining_close("<|im_end|>\n", "<|endoftext|>") == "<|im_end|>\n"


def test_text_after_reply_skips_rendered_tool_calls_up_to_the_close() -> None:
    rendered = f"<|im_start|>assistant\n{REPLY_SENTINEL}\n<tool_call>{{}}</tool_call><|im_end|>\n<|im_start|>tool\n"
    assert turn_close_after(f"x{REPLY_SENTINEL}<|im_end|>\n") == "<|im_end|>\n"
    assert text_after_reply(rendered, "<|im_end|>\n") == "<|im_start|>tool\n"


def test_a_template_that_drops_the_reply_is_an_error() -> None:
    with pytest.raises(ValueError, match="did not render"):
        text_after_reply("<|im_start|>user\nhi", "<|im_end|>\n")
