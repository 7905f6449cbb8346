"""`tokentape doctor`: audit a chat template against the hard cases before the first training run.

Every finding comes from rendering probe conversations with the model's own template and tokenizer
and comparing what the gateway records with what a full re-render would give.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tokentape.core.bridge import REPLY_SENTINEL
from tokentape.core.reply import parse_reply
from tokentape.core.session import common_prefix_length
from tokentape.render.probe import kwargs_read
from tokentape.render.renderer import Renderer, RenderOptions

__all__ = ["Finding", "audit"]

Verdict = Literal["exact", "bridged", "rewrite", "note", "problem"]
_OPTIONS = RenderOptions()
_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}


@dataclass(frozen=True, slots=True)
class Finding:
    case: str
    verdict: Verdict
    detail: str


def _tokens(renderer: Renderer, text: str) -> str:
    ids = renderer.tokenizer.encode(text)
    return " ".join(f"{renderer.tokenizer.decode_all([t])!r}={t}" for t in ids) or "(none)"


def _tape_after(
    renderer: Renderer,
    history: list[dict[str, Any]],
    reply: dict[str, Any],
    sampled: list[int],
    stop: int | None,
    new: list[dict[str, Any]],
) -> tuple[list[int], list[int], bool]:
    """(tape after one bridged turn, naive re-render tokens, template rewrite?)."""
    prompt = renderer.prompt(history, _OPTIONS).tokens
    messages = [*history, reply, *new]
    bridge = renderer.bridge(messages, len(history), reply, stop, _OPTIONS)
    naive = renderer.tokenizer.encode(renderer.render_text(messages, True, _OPTIONS))
    return prompt + sampled + bridge.tokens, naive, bridge.template_rewrite


def audit(renderer: Renderer) -> list[Finding]:
    tokenizer = renderer.tokenizer
    close = renderer.turn_close
    findings: list[Finding] = []
    user = [{"role": "user", "content": "What is a cat?"}]
    answer = "A small domesticated feline."
    stops = sorted(tokenizer.end_of_turn_ids)
    close_ids = tokenizer.encode(close) if close else []
    stop = close_ids[0] if close_ids and close_ids[0] in tokenizer.end_of_turn_ids else None

    # 1. turn close
    if not close:
        findings.append(
            Finding(
                "1 turn close",
                "note",
                "the template renders no turn close: a reply ends where "
                "the next role's opener starts; a sampled stop token that is that opener is "
                "not rendered again",
            )
        )
    elif stop is not None:
        rest = tokenizer.decode_all(close_ids[1:])
        findings.append(
            Finding(
                "1 turn close",
                "bridged",
                f"close {close!r} = {_tokens(renderer, close)}; the "
                f"engine samples {tokenizer.decode_all([stop])!r}, the gateway bridges {rest!r} "
                "(not trained)",
            )
        )
    else:
        findings.append(
            Finding(
                "1 turn close",
                "problem",
                f"close {close!r} does not start with an end-of-turn "
                "token the engine stops on; every close will be bridged whole",
            )
        )
    findings.append(Finding("  stop tokens", "note", ", ".join(f"{tokenizer.decode_all([t])!r}={t}" for t in stops)))

    # 2. truncated turn: the bridge after a reply cut by max_tokens, against the full rendering
    reply = {"role": "assistant", "content": "A small"}
    go_on = [{"role": "user", "content": "Go on."}]
    bridge = renderer.bridge([*user, reply, *go_on], len(user), reply, None, _OPTIONS)
    exact = _continues_full_rendering(renderer, [*user, reply], go_on, bridge.text)
    findings.append(
        Finding(
            "2 truncated turn",
            "bridged" if exact else "problem",
            f"a reply cut by max_tokens gets the whole close {close!r} bridged ({len(close_ids)} tokens), never "
            "trained, then what the full rendering writes after it"
            if exact
            else f"the bridge after a reply cut by max_tokens ({bridge.text!r}) is NOT what the full rendering "
            "writes there",
        )
    )

    # 3. BPE boundaries and exactness of bridges
    closing = [stop] if stop is not None else []
    sampled = [*tokenizer.encode(answer), *closing]
    spelled = [t for ch in answer for t in tokenizer.encode(ch)] + closing  # what BPE would have merged
    reply, follow = {"role": "assistant", "content": answer}, [{"role": "user", "content": "And a dog?"}]
    tape, naive, _ = _tape_after(renderer, user, reply, sampled, stop, follow)
    tape2, naive2, _ = _tape_after(renderer, user, reply, spelled, stop, follow)
    verdict: Verdict = "exact" if tape == naive else "note"
    findings.append(
        Finding(
            "3 BPE boundaries",
            verdict,
            (
                "canonical replies: tape equals a full re-render"
                if tape == naive
                else "even canonical replies differ from a full re-render (the template re-renders history)"
            )
            + f"; a reply sampled character by character stays as sampled ({len(spelled)} tokens; a "
            f"re-render would give {len(naive2) - len(tape2) + len(spelled)})",
        )
    )

    # 4. reasoning in history
    if renderer.reasoning:
        thought = {"role": "assistant", "content": answer, "reasoning_content": "Cats are felines."}
        _, _, after_user = _tape_after(renderer, user, thought, sampled, stop, [{"role": "user", "content": "Ok"}])
        findings.append(
            Finding(
                "4 reasoning in history",
                "rewrite" if after_user else "exact",
                "the template drops earlier reasoning once a user message follows: a rewrite, "
                "handled by the rewrite policy (tape keeps the sampled reasoning)"
                if after_user
                else "earlier reasoning renders the same after a new user message",
            )
        )
    else:
        findings.append(Finding("4 reasoning in history", "note", "the template has no reasoning blocks"))

    # 5. tool calls
    findings.append(_tool_finding(renderer))

    # 6. injected text, generation prompt, trimming
    bare = renderer.render_text(user, True, _OPTIONS)
    with_system = renderer.render_text([{"role": "system", "content": REPLY_SENTINEL}, *user], True, _OPTIONS)
    injected = bare.split("What is a cat?")[0]
    six = []
    if len(injected) > len(with_system.split(REPLY_SENTINEL)[0]):
        six.append(f"without a system message the template injects {injected[:80]!r}...")
    if "strftime_now" in renderer.template.source:
        six.append("the template writes today's date (strftime_now): prompts change at midnight")
    if renderer.prompt(user, _OPTIONS).opens_reasoning:
        six.append("the generation prompt opens a reasoning block: replies are parsed as reasoning first")
    spaced = renderer.render_text([*user, {"role": "assistant", "content": "  padded  "}], False, _OPTIONS)
    if "  padded  " not in spaced:
        six.append("the template trims message content (sampled white space stays on the tape)")
    findings.append(Finding("6 template text", "note" if six else "exact", "; ".join(six) or "nothing injected"))

    findings.append(_state_finding(renderer))
    findings.append(_settings_finding(renderer))
    findings.append(_tools_in_history_finding(renderer))
    return findings


def _continues_full_rendering(
    renderer: Renderer, recorded: list[dict[str, Any]], new: list[dict[str, Any]], bridge: str
) -> bool:
    """Whether `bridge` (after a reply whose end the engine did not sample) is the turn close and what
    the whole conversation's rendering writes after it."""
    close = renderer.turn_close
    head = renderer.render_text(recorded, False, _OPTIONS)
    full = renderer.render_text([*recorded, *new], True, _OPTIONS)
    if full.startswith(head) and head.endswith(close):
        return bridge == full[len(head) - len(close) :]
    # the template renders the reply otherwise once new messages follow: compare what follows it
    after = bridge[len(close) :]
    return bridge.startswith(close) and full.endswith(after) and full[: len(full) - len(after)].endswith(close)


def _state_finding(renderer: Renderer) -> Finding:
    """Whether the template carries state across messages (then bridges render from the start)."""
    if renderer.anchor_safe:
        return Finding(
            "  state across messages",
            "exact",
            "none on tool rounds, several tool results, reasoning, system prompts: bridges are rendered "
            "from the last user message, cost stays flat with history",
        )
    return Finding(
        "  state across messages",
        "note",
        "the template renders new messages differently depending on older ones "
        f"({renderer.anchor_difference}): bridges are rendered from the first message (Jinja "
        "only; only the new segment is tokenized)",
    )


def _settings_finding(renderer: Renderer) -> Finding:
    """Which `chat_template_kwargs` the template reads, and under which (set to true, with images
    where the model takes them) its state across messages shows: bridges then render whole."""
    names = kwargs_read(renderer.template.source)
    if not names:
        return Finding("  template settings", "exact", "the template reads no chat_template_kwargs")
    images = renderer.vision is not None
    verdicts = {n: renderer.anchor_verdict(RenderOptions(template_kwargs={n: True}), images) for n in names}
    whole = [n for n, v in verdicts.items() if v.probed and not v.safe]  # a non-boolean setting may not render
    read = ", ".join(names)
    if not whole:
        return Finding(
            "  template settings",
            "exact",
            f"reads {read}; set to true, none makes new messages render differently from the last user message on",
        )
    return Finding(
        "  template settings",
        "note",
        f"reads {read}; with {', '.join(whole)} set{' and images' if images else ''} the template carries state "
        "across messages: those requests' bridges render the whole conversation (Jinja only; exact)",
    )


def _tools_in_history_finding(renderer: Renderer) -> Finding:
    """Whether offering other tools changes how the recorded history renders."""
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
    other = {**_TOOL, "function": {**_TOOL["function"], "name": "define"}}
    first = renderer.render_text(history, False, RenderOptions(tools=[_TOOL]))
    second = renderer.render_text(history, False, RenderOptions(tools=[_TOOL, other]))
    where = "by the template" if renderer.native_tools else "by tokentape's default tool prompt"
    if first != second:
        return Finding(
            "  tools in history",
            "rewrite",
            f"the tool list is rendered in the system prompt ({where}): offering other tools mid-episode "
            "changes the recorded history, a rewrite handled by the rewrite policy",
        )
    return Finding("  tools in history", "exact", "the tools offered do not change how the history renders")


def _tool_finding(renderer: Renderer) -> Finding:
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "cat"}'}}
    history = [{"role": "user", "content": "Look up cat."}]
    options = RenderOptions(tools=[_TOOL])
    before = renderer.render_text(history, True, options)
    rendered = renderer.render_text(
        [*history, {"role": "assistant", "content": None, "tool_calls": [call]}], False, options
    )
    region = rendered[common_prefix_length(before, rendered) :]
    if renderer.turn_close and region.endswith(renderer.turn_close):
        region = region[: -len(renderer.turn_close)]
    opens = renderer.prompt(history, options).opens_reasoning
    if opens:  # the model's own output closes the reasoning the generation prompt opened
        region = "Let me look it up.\n</think>\n\n" + region
    parsed = parse_reply(region, renderer.tool_format, reasoning=renderer.reasoning, starts_inside=opens)
    round_trip = [_loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"word": "cat"}]
    how = (
        "tool list rendered by the template"
        if renderer.native_tools
        else (
            "the template ignores `tools`: the tool list goes into the system prompt"
            + ("" if renderer.native_tool_calls else ", calls and results as Hermes-style text")
        )
    )
    detail = (
        f"{how}; calls parsed as {renderer.tool_format}; the template's own rendering of a call "
        f"{'parses back' if round_trip else 'does NOT parse back'}; echoed calls with re-serialised "
        "arguments keep the sampled tokens"
    )
    return Finding("5 tool calls", "exact" if round_trip else "problem", detail)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
