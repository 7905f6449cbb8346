"""Bridge arithmetic on rendered text: what must follow sampled tokens to reach the next generation.

The renderer renders small anchored conversations with a sentinel in place of the reply being
continued from; these helpers cut the rendering at the reply's turn close. Sampled tokens are never
part of this text: the bridge starts where sampling stopped.
"""

from __future__ import annotations

__all__ = ["REPLY_SENTINEL", "turn_close_after", "strip_sampled_stop", "text_after_reply"]

# Plain ASCII so that templates which trim or escape content leave it intact.
REPLY_SENTINEL = "TOKENTAPEREPLYSENTINEL7Q"


def turn_close_after(rendered: str, sentinel: str = REPLY_SENTINEL) -> str:
    """The text a template renders right after a reply's content: its turn close."""
    at = rendered.rfind(sentinel)
    if at < 0:
        raise ValueError("the template did not render the reply content")
    return rendered[at + len(sentinel) :]


def strip_sampled_stop(text: str, stop_text: str | None) -> str:
    """What follows sampled tokens: `text` (turn close + next messages) minus the part the engine
    already sampled.

    `stop_text` is the text of the end-of-turn token the engine sampled last, or None when the turn
    ended otherwise (length, stop string, abort). A close that starts with that token is completed,
    never repeated (ChatML: `<|im_end|>` sampled, `\n` bridged); a stop token that is also the next
    role's opener (GLM's `<|user|>`) is not rendered twice; any other ending gets everything.
    """
    if stop_text and text.startswith(stop_text):
        return text[len(stop_text) :]
    return text


def text_after_reply(rendered: str, close: str, sentinel: str = REPLY_SENTINEL) -> str:
    """What a template renders after the sentinel reply's close (the new messages and the prompt)."""
    at = rendered.rfind(sentinel)
    if at < 0:
        raise ValueError("the template did not render the reply content")
    close_at = rendered.find(close, at + len(sentinel)) if close else at + len(sentinel)
    if close_at < 0:
        raise ValueError("the template did not close the reply with its usual turn close")
    return rendered[close_at + len(close) :]
