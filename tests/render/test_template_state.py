"""What a template reads besides the messages, and state it carries across messages.

- Qwen2.5 lists the tools in its system prompt: a request offering other tools changes how the
  recorded history renders. That is a rewrite, counted under `tape`, forked under `fork`, rejected
  under `strict`, also after the session was reloaded from the store.
- A change that only reaches the new segment (Qwen3's `enable_thinking`, read by the generation
  prompt alone) is no rewrite.
- DeepSeek-R1 opens `<｜tool▁outputs▁begin｜>` once per conversation: the bridge of the second tool
  round must not open it again, as a bridge rendered from the last user message would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.render.corpus import CLOCK, WEATHER, Episode
from tokentape.core.export import export_session
from tokentape.errors import Conflict
from tokentape.gateway.service import Gateway
from tokentape.gateway.sessions import Session, SessionRegistry
from tokentape.render.probe import anchor
from tokentape.render.renderer import Renderer, RenderOptions
from tokentape.render.template import ChatTemplate
from tokentape.store.sqlite import SqliteStore


def _session(ep: Episode) -> Session:
    session = ep.gateway.sessions.in_memory(ep.session)
    assert session is not None
    return session


async def _first_round(ep: Episode) -> None:
    await ep.turn([{"role": "user", "content": "Weather in Paris?"}], ep.calling([("get_weather", {"city": "Paris"})]))
    call_id = ep.replies[-1]["tool_calls"][0]["id"]
    await ep.turn([{"role": "tool", "tool_call_id": call_id, "content": "sunny"}], ep.sample("Sunny."))


async def test_changed_tools_on_qwen25_are_a_counted_rewrite_under_tape(renderers: dict[str, Renderer]) -> None:
    ep = Episode.of(renderers["qwen2.5"], "qwen2.5", tools=True)
    await _first_round(ep)
    ep.tools = [WEATHER, CLOCK]
    await ep.turn([{"role": "user", "content": "And the time?"}], ep.sample("Noon."))
    ep.check()
    summary = _session(ep).tree.summary()
    assert summary["rewrites"] == 1
    (branch,) = export_session(_session(ep).tree)["branches"]
    (rewrite,) = branch["rewrites"]
    assert rewrite["kind"] == "template" and "tools" in rewrite["detail"]
    # tape: the engine still sees the recorded history, whose system prompt lists only the first tool
    prompt, _ = ep.calls[-1]
    assert "get_time" not in ep.renderer.tokenizer.decode_all(prompt[: len(ep.calls[0][0])])


async def test_changed_tools_on_qwen25_are_rejected_under_strict(renderers: dict[str, Renderer]) -> None:
    ep = Episode.of(renderers["qwen2.5"], "qwen2.5", tools=True, policy="strict")
    await _first_round(ep)
    ep.tools = [WEATHER, CLOCK]
    with pytest.raises(Conflict, match="tools"):
        await ep.turn([{"role": "user", "content": "And the time?"}], ep.sample("Noon."))
    assert len(_session(ep).tree.nodes) == 2  # nothing recorded


async def test_changed_tools_on_qwen25_fork_to_the_templates_rendering(renderers: dict[str, Renderer]) -> None:
    ep = Episode.of(renderers["qwen2.5"], "qwen2.5", tools=True, policy="fork")
    await _first_round(ep)
    ep.tools = [WEATHER, CLOCK]
    await ep.turn([{"role": "user", "content": "And the time?"}], ep.sample("Noon."))
    prompt, _ = ep.calls[-1]
    whole = ep.renderer.render_text(ep.messages[:-1], True, ep.current)
    assert prompt == ep.renderer.tokenizer.encode(whole)  # the new tools, history as the template renders it
    tree = _session(ep).tree
    assert tree.nodes[-1].parent is None or tree.nodes[-1].keep < tree.nodes[1].end  # a new branch
    assert len(tree.branches()) == 2


async def test_changed_tools_are_seen_after_the_session_is_reloaded(
    renderers: dict[str, Renderer], tmp_path: Path
) -> None:
    renderer = renderers["qwen2.5"]
    path = tmp_path / "tape.sqlite3"
    ep = Episode.of(renderer, "qwen2.5", tools=True, policy="strict")
    ep.gateway = Gateway(ep.engine, renderer, SessionRegistry(SqliteStore(path), default_policy="strict"))
    await _first_round(ep)
    await ep.gateway.sessions.aclose()
    ep.gateway = Gateway(ep.engine, renderer, SessionRegistry(SqliteStore(path), default_policy="strict"))  # a restart
    same = Episode(ep.family, renderer, ep.gateway, ep.engine, tools=[WEATHER])
    same.messages, same.replies, same.reply_at, same.options = ep.messages, ep.replies, ep.reply_at, ep.options
    same.calls, same.stops = ep.calls, ep.stops
    await same.turn([{"role": "user", "content": "Thanks."}], same.sample("Welcome."))  # same tools: extends
    same.tools = [WEATHER, CLOCK]
    with pytest.raises(Conflict, match="tools"):
        await same.turn([{"role": "user", "content": "Time?"}], same.sample("Noon."))
    ep.gateway.sessions.store.close()


async def test_enable_thinking_reaches_only_the_new_segment_on_qwen3(renderers: dict[str, Renderer]) -> None:
    """Qwen3 drops the last reply's (empty) reasoning block once a user message follows, a rewrite
    with or without the kwargs; `enable_thinking` adds nothing to that."""
    rewrites = []
    for kwargs in (None, {"enable_thinking": False}):
        ep = Episode.of(renderers["qwen3"], "qwen3")
        await ep.turn([{"role": "user", "content": "Hi"}], ep.sample("Hello."))
        ep.template_kwargs = kwargs
        await ep.turn([{"role": "user", "content": "Quick answer: 2+2?"}], ep.sample("4"))
        ep.check()
        (branch,) = export_session(_session(ep).tree)["branches"]
        rewrites.append([(r["at_message"], r["detail"]) for r in branch["rewrites"]])
    assert rewrites[0] == rewrites[1]
    assert "kwargs" not in str(rewrites[1])
    prompt, _ = ep.calls[-1]
    assert ep.renderer.tokenizer.decode_all(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


async def test_deepseek_r1_second_tool_round_bridge_is_the_full_rendering(renderers: dict[str, Renderer]) -> None:
    renderer = renderers["deepseek-r1"]
    assert not renderer.anchor_safe and "tool▁outputs▁begin" in renderer.anchor_difference
    ep = Episode.of(renderer, "deepseek-r1", tools=True)
    await _first_round(ep)
    await ep.turn([{"role": "user", "content": "And in Oslo?"}], ep.calling([("get_weather", {"city": "Oslo"})]))
    call_id = ep.replies[-1]["tool_calls"][0]["id"]
    await ep.turn([{"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 18}'}], ep.sample("18."))
    ep.check()
    bridge, _ = ep.bridges()[-1]
    text = renderer.tokenizer.decode_all(bridge)
    assert text == '<｜tool▁output▁begin｜>{"temp_c": 18}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>'


async def test_an_anchor_safe_template_renders_bridges_from_the_anchor(renderers: dict[str, Renderer]) -> None:
    """Qwen3 carries no state across messages: the probe says so, and long histories do not change
    its bridges."""
    renderer = renderers["qwen3"]
    assert renderer.anchor_safe
    history: list[dict[str, Any]] = []
    for i in range(40):
        history += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    new = [{"role": "user", "content": "Bye"}]
    a = renderer.bridge([*short, *new], 1, short[1], None, RenderOptions())
    b = renderer.bridge([*history, *short, *new], len(history) + 1, short[1], None, RenderOptions())
    assert a.tokens == b.tokens


def _tool_rounds(rounds: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go."}]
    for i in range(rounds):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"output {i}"},
        ]
    return messages


def test_the_anchor_leaves_out_the_tool_rounds_before_the_last_one() -> None:
    """An agent's tool rounds pile up after its one user message; the anchor keeps the system and
    user messages and the round right before the reply, however many rounds came before it."""
    messages = [*_tool_rounds(30), {"role": "assistant", "content": "Done."}]
    reply = len(messages) - 1
    assert anchor(messages, reply) == [messages[0], messages[1], messages[-3], messages[-2]]
    plain = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert anchor([*plain, {"role": "assistant", "content": "d"}], 3) == [plain[2]]  # from the last user message
    # no user message: nothing is left out; a message other than a tool round between: neither
    no_user = [messages[0], *messages[2:]]
    assert anchor(no_user, len(no_user) - 1) == no_user[:-1]
    noted = [*messages[:5], {"role": "system", "content": "Mind the budget."}, *messages[5:]]
    assert anchor(noted, len(noted) - 1) == noted[:-1]


async def test_rendering_a_bridge_costs_the_same_after_3_or_30_tool_rounds(renderers: dict[str, Renderer]) -> None:
    renderer = renderers["qwen2.5"]
    assert renderer.anchor_safe
    rendered: list[int] = []
    template_render = renderer.template.render

    def counting(messages: Any, **kwargs: Any) -> str:
        rendered.append(len(messages))
        return template_render(messages, **kwargs)

    renderer.template.render = counting  # type: ignore[method-assign]
    sizes, bridges = [], []
    for rounds in (3, 30):
        messages = _tool_rounds(rounds)
        messages[-1]["content"] = "the last output"
        reply = messages[-2]
        rendered.clear()
        bridges.append(renderer.bridge(messages, len(messages) - 2, reply, None, RenderOptions()).tokens)
        sizes.append(max(rendered))
    assert sizes[0] == sizes[1] <= 6, sizes  # system, user, the round before, the reply, the new message
    assert bridges[0] == bridges[1]


COUNTING_TEMPLATE = (
    "{%- set ns = namespace(results=0) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' %}{% set ns.results = 0 %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}{% set ns.results = ns.results + 1 %}"
    "<|im_start|>user\nResult {{ ns.results }}: {{ m.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content or 'call' }}<|im_end|>\n{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


async def test_a_template_counting_tool_results_since_the_user_is_bridged_from_the_first_message(
    renderer: Renderer,
) -> None:
    """Numbering tool results from the last user message depends on the rounds the anchor leaves
    out: the probe sees the anchor render differently, and bridges are rendered whole (exact)."""
    counting = Renderer(ChatTemplate(COUNTING_TEMPLATE), renderer.tokenizer)
    assert not counting.anchor_safe and "Result" in counting.anchor_difference
    messages = [*_tool_rounds(5), {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next?"}]
    bridge = counting.bridge(messages, len(messages) - 2, messages[-2], None, RenderOptions())
    whole = counting.render_text(messages, True, RenderOptions())
    assert bridge.whole
    assert whole.endswith(counting.tokenizer.decode_all(bridge.tokens))
