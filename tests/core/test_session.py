"""How a request finds its place in a session: extension, echo normalisation, siblings, rewrites."""

from __future__ import annotations

import unicodedata
from typing import Any

import pytest

from tokentape.core.messages import Message, chain_of, hash_chain
from tokentape.core.session import Extend, Fresh, NewTurn, SessionTree, plan_request
from tokentape.core.tape import Origin, RewritePolicy, TurnNode
from tokentape.errors import Conflict

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Plan a trip."}


def record(
    tree: SessionTree,
    parent: TurnNode | None,
    messages: list[dict[str, Any]],
    reply: dict[str, Any],
    sampled: tuple[int, ...] = (7, 8, 9),
) -> TurnNode:
    keep = parent.end if parent else 0
    turn = NewTurn(parent, keep, (1, 2, 3), Origin.PROMPT if parent is None else Origin.BRIDGE, None)
    return tree.attach(
        turn,
        sampled=list(sampled),
        logprobs=[-0.5] * len(sampled),
        finish_reason="stop",
        prompt_chain=chain_of(messages),
        prompt_length=len(messages),
        reply=reply,
    )


def plan(tree: SessionTree, messages: list[Message]) -> Extend | Fresh:
    return plan_request(tree, messages, list(hash_chain(messages)))


def test_a_first_request_renders_a_fresh_prompt() -> None:
    assert plan(SessionTree("s"), [SYSTEM, USER]) == Fresh(None, None)


def test_a_request_that_echoes_the_reply_extends_that_turn() -> None:
    tree = SessionTree("s")
    node = record(tree, None, [SYSTEM, USER], {"role": "assistant", "content": "Go to Rome."})
    echoed = [SYSTEM, USER, {"role": "assistant", "content": "Go to Rome."}, {"role": "user", "content": "Why?"}]
    assert plan(tree, echoed) == Extend(node, 3, None)


@pytest.mark.parametrize(
    ("sent", "echoed"),
    [
        ({"content": "Go to Rome."}, {"content": "  Go to Rome.\n"}),
        ({"content": ""}, {"content": None}),
        ({"content": unicodedata.normalize("NFC", "Café")}, {"content": unicodedata.normalize("NFD", "Café")}),
        ({"content": "Go."}, {"content": [{"type": "text", "text": "Go."}]}),
        (
            {
                "content": None,
                "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": '{"x": 1, "y": [true]}'}}],
            },
            {"content": "", "tool_calls": [{"id": "b", "function": {"name": "f", "arguments": '{"y":[true],"x":1}'}}]},
        ),
        (
            {"content": "", "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
        ),
        ({"content": "Go."}, {"content": "Go.", "reasoning_content": "thinking it over"}),
    ],
)
def test_echoes_are_recognised_however_the_agent_reserialises_them(
    sent: dict[str, Any], echoed: dict[str, Any]
) -> None:
    tree = SessionTree("s")
    node = record(tree, None, [USER], {"role": "assistant", **sent})
    request = [USER, {"role": "assistant", **echoed}, {"role": "user", "content": "Next."}]
    assert plan(tree, request) == Extend(node, 2, None)


def test_tool_call_arguments_that_differ_in_value_are_not_the_same_reply() -> None:
    tree = SessionTree("s")
    record(
        tree, None, [USER], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}]}
    )
    request = [USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 2}'}}]}]
    decision = plan(tree, [*request, {"role": "tool", "content": "3"}])
    assert decision.rewrite is not None and decision.rewrite.kind == "assistant_edited"


def test_each_of_n_siblings_can_be_continued() -> None:
    tree = SessionTree("s")
    first = record(tree, None, [USER], {"role": "assistant", "content": "A"})
    second = record(tree, None, [USER], {"role": "assistant", "content": "B"})
    assert plan(tree, [USER, {"role": "assistant", "content": "A"}, USER]) == Extend(first, 2, None)
    assert plan(tree, [USER, {"role": "assistant", "content": "B"}, USER]) == Extend(second, 2, None)


def test_the_deepest_recorded_turn_wins() -> None:
    tree = SessionTree("s")
    one = record(tree, None, [USER], {"role": "assistant", "content": "A"})
    history = [USER, {"role": "assistant", "content": "A"}, {"role": "user", "content": "more"}]
    two = record(tree, one, history, {"role": "assistant", "content": "B"})
    request = [*history, {"role": "assistant", "content": "B"}, {"role": "user", "content": "end"}]
    assert plan(tree, request) == Extend(two, 4, None)
    # a retry of the second user turn with other words branches from the first turn
    assert plan(tree, [*history[:2], {"role": "user", "content": "other"}]) == Extend(one, 2, None)


@pytest.mark.parametrize("policy", ["tape", "fork", "strict"])
def test_an_edited_reply_is_a_rewrite_handled_by_the_policy(policy: RewritePolicy) -> None:
    tree = SessionTree("s", policy)
    node = record(tree, None, [SYSTEM, USER], {"role": "assistant", "content": "Go to Rome."})
    edited = [SYSTEM, USER, {"role": "assistant", "content": "Go to Paris."}, {"role": "user", "content": "Why?"}]
    if policy == "strict":  # the policy is settled here, once: strict rejects
        with pytest.raises(Conflict) as rejected:
            plan(tree, edited)
        assert rejected.value.code == "rewrite_rejected" and "at message 2" in rejected.value.message
        return
    decision = plan(tree, edited)
    assert decision.rewrite is not None
    assert (decision.rewrite.kind, decision.rewrite.at_message, decision.rewrite.policy) == (
        "assistant_edited",
        2,
        policy,
    )
    if policy == "tape":
        assert isinstance(decision, Extend) and decision.node is node and decision.new_from == 3
    else:
        assert isinstance(decision, Fresh) and decision.fork_from is node


def test_an_unrelated_conversation_is_a_new_root_not_a_rewrite() -> None:
    tree = SessionTree("s")
    record(tree, None, [SYSTEM, USER], {"role": "assistant", "content": "Go to Rome."})
    assert plan(tree, [SYSTEM, {"role": "user", "content": "Something else."}]) == Fresh(None, None)


def test_fork_point_shares_the_longest_token_prefix() -> None:
    tree = SessionTree("s")
    root = record(tree, None, [USER], {"role": "assistant", "content": "A"}, sampled=(7, 8, 9))
    child = record(
        tree, root, [USER, {"role": "assistant", "content": "A"}, USER], {"role": "assistant", "content": "B"}
    )
    # root path: 1 2 3 7 8 9; child path: 1 2 3 7 8 9 1 2 3 7 8 9
    parent, shared = tree.fork_point(child, [1, 2, 3, 7, 8, 9, 1, 2, 99])
    assert (parent, shared) == (child, 8)
    parent, shared = tree.fork_point(child, [1, 2, 3, 7, 5])
    assert (parent, shared) == (root, 4)
    assert tree.fork_point(child, [42]) == (None, 0)
