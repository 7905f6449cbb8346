"""Cutting rendered text at a reply's turn close."""

from __future__ import annotations

import pytest

from tokentape.core.bridge import REPLY_SENTINEL, strip_sampled_stop, text_after_reply, turn_close_after


def test_the_sampled_close_is_completed_never_repeated() -> None:
    assert strip_sampled_stop("<|im_end|>\n<|im_start|>user", "<|im_end|>") == "\n<|im_start|>user"
    assert strip_sampled_stop("<|eot_id|><|start_header_id|>", "<|eot_id|>") == "<|start_header_id|>"


def test_a_stop_token_that_opens_the_next_role_is_not_repeated() -> None:
    assert strip_sampled_stop("<|user|>\nhi<|assistant|>", "<|user|>") == "\nhi<|assistant|>"
    assert strip_sampled_stop("<|observation|><tool_response>", "<|user|>") == "<|observation|><tool_response>"


def test_a_turn_without_its_close_gets_the_whole_close() -> None:
    assert strip_sampled_stop("<|im_end|>\n", None) == "<|im_end|>\n"
    assert strip_sampled_stop("<|im_end|>\n", "<|endoftext|>") == "<|im_end|>\n"


def test_text_after_reply_skips_rendered_tool_calls_up_to_the_close() -> None:
    rendered = f"<|im_start|>assistant\n{REPLY_SENTINEL}\n<tool_call>{{}}</tool_call><|im_end|>\n<|im_start|>tool\n"
    assert turn_close_after(f"x{REPLY_SENTINEL}<|im_end|>\n") == "<|im_end|>\n"
    assert text_after_reply(rendered, "<|im_end|>\n") == "<|im_start|>tool\n"


def test_a_template_that_drops_the_reply_is_an_error() -> None:
    with pytest.raises(ValueError, match="did not render"):
        text_after_reply("<|im_start|>user\nhi", "<|im_end|>\n")
