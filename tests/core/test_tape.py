"""Property tests of the tape and the session tree: whatever tokens arrive and however the tree
branches, every branch exports equal-length per-token lists that agree with each other."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tokentape.core.export import export_session
from tokentape.core.messages import EMPTY_CHAIN, chain_of
from tokentape.core.session import NewTurn, SessionTree
from tokentape.core.tape import BranchView, Origin, TurnNode, path_tokens

# Token IDs across a real-sized vocabulary, biased toward the ends where byte and special tokens live.
token_ids = st.one_of(st.integers(0, 300), st.integers(0, 151_000), st.integers(151_600, 151_700))
token_lists = st.lists(token_ids, min_size=0, max_size=12)
# engines compute logprobs in float32 (kept as float32); others must survive exactly too
logprob = st.one_of(
    st.floats(min_value=-50.0, max_value=0.0, allow_nan=False),
    st.floats(min_value=-50.0, max_value=0.0, allow_nan=False, width=32),
)


drawn: dict[TurnNode, tuple[list[int], list[float]]] = {}


@st.composite
def grown_trees(draw: st.DrawFn) -> tuple[SessionTree, list[tuple[TurnNode, list[int]]]]:
    """A tree grown by random extensions, siblings and token-level forks, with each turn's prompt
    (and, in `drawn`, what each turn sampled, as given)."""
    tree = SessionTree("s")
    prompts: list[tuple[TurnNode, list[int]]] = []
    drawn.clear()
    for step in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["root", "extend", "fork"])) if tree.nodes else "root"
        context = draw(token_lists.filter(bool)) if kind == "root" else draw(token_lists)
        if kind == "root":
            turn = NewTurn(None, 0, tuple(context), Origin.PROMPT, None)
            prompt = list(context)
        else:
            base = draw(st.sampled_from(tree.nodes))
            if kind == "extend":
                turn = NewTurn(base, base.end, tuple(context), Origin.BRIDGE, None)
                prompt = path_tokens(base) + context
            else:
                keep = draw(st.integers(base.keep + 1, base.end)) if base.end > base.keep else base.end
                turn = NewTurn(base, keep, tuple(context), Origin.PROMPT, None)
                prompt = path_tokens(base)[:keep] + context
        sampled = draw(st.lists(token_ids, min_size=0, max_size=10))
        logprobs = draw(st.lists(logprob, min_size=len(sampled), max_size=len(sampled)))
        finish = draw(st.sampled_from(["stop", "length", "abort"]))
        node = tree.attach(
            turn,
            sampled=sampled,
            logprobs=logprobs,
            finish_reason=finish,
            prompt_chain=chain_of([{"role": "user", "content": str(step)}]),
            prompt_length=1,
            reply={"role": "assistant", "content": f"r{step}"},
        )
        prompts.append((node, prompt))
        drawn[node] = (sampled, logprobs)
    return tree, prompts


@given(grown_trees())
@settings(max_examples=300, deadline=None)
def test_every_branch_is_consistent(grown: tuple[SessionTree, list[tuple[TurnNode, list[int]]]]) -> None:
    tree, _ = grown
    for branch in tree.branches():
        n = len(branch.tokens)
        assert len(branch.origins) == len(branch.logprobs) == len(branch.turns) == len(branch.loss_mask) == n
        assert branch.tokens == path_tokens(branch.leaf)
        for origin, mask, lp in zip(branch.origins, branch.loss_mask, branch.logprobs, strict=True):
            assert mask == (1 if origin is Origin.SAMPLED else 0)
            assert (lp is not None) == (origin is Origin.SAMPLED)
            assert lp is None or (math.isfinite(lp) and lp <= 0.0)
        covered = [i for start, end in branch.action_ranges() for i in range(start, end)]
        assert covered == [i for i, o in enumerate(branch.origins) if o is Origin.SAMPLED]
        assert branch.turns == sorted(branch.turns)


@given(grown_trees())
@settings(max_examples=300, deadline=None)
def test_each_turn_is_recorded_after_the_exact_prompt_it_was_sampled_from(
    grown: tuple[SessionTree, list[tuple[TurnNode, list[int]]]],
) -> None:
    _, prompts = grown
    for node, prompt in prompts:
        sampled, logprobs = drawn[node]
        view = BranchView.of(node)
        assert view.tokens[: len(prompt)] == prompt
        assert view.tokens[len(prompt) :] == sampled
        assert view.logprobs[len(prompt) :] == logprobs  # bit for bit, float32 storage or not
        assert view.loss_mask[len(prompt) :] == [1] * len(sampled)
        assert node.path_array().tolist() == prompt + sampled


@given(grown_trees())
@settings(max_examples=200, deadline=None)
def test_every_recorded_token_is_in_some_branch(grown: tuple[SessionTree, list[tuple[TurnNode, list[int]]]]) -> None:
    tree, prompts = grown
    branches = [b.tokens for b in tree.branches()]
    for node, prompt in prompts:
        whole = prompt + list(node.sampled)
        assert any(tokens[: len(whole)] == whole for tokens in branches)


@given(grown_trees())
@settings(max_examples=100, deadline=None)
def test_export_lists_one_branch_per_branch_end(grown: tuple[SessionTree, list[tuple[TurnNode, list[int]]]]) -> None:
    tree, _ = grown
    exported = export_session(tree)
    ends = [n for n in tree.nodes if not any(m.parent is n and m.keep == n.end for m in tree.nodes)]
    assert [b["branch_id"] for b in exported["branches"]] == [end.id for end in ends]
    for branch in exported["branches"]:
        assert set(branch["origins"]) <= {"prompt", "sampled", "bridge"}
        assert len(branch["finish_reasons"]) == len(branch["turn_ids"])
        assert sum(branch["loss_mask"]) == sum(end - start for start, end in branch["action_ranges"])


@given(grown_trees())
@settings(max_examples=300, deadline=None)
def test_a_path_buffer_starts_with_its_path_once_the_tree_has_grown(
    grown: tuple[SessionTree, list[tuple[TurnNode, list[int]]]],
) -> None:
    """What a prompt's JSON text is reused for (`token_ids.PathTextSlot`): a node's buffer, where it
    has one, begins with the node's path, and still does after every later turn."""
    _, prompts = grown
    for node, prompt in prompts:
        buffer = node.path_buffer()
        if buffer is not None:
            assert buffer[: node.end].tolist() == prompt + drawn[node][0]
    assert any(node.path_buffer() is not None for node, _ in prompts)


def test_a_node_rejects_logprobs_that_do_not_match_its_tokens() -> None:
    tree = SessionTree("s")
    turn = NewTurn(None, 0, (1, 2), Origin.PROMPT, None)
    try:
        tree.attach(
            turn,
            sampled=[5, 6],
            logprobs=[-0.1],
            finish_reason="stop",
            prompt_chain=EMPTY_CHAIN,
            prompt_length=0,
            reply={},
        )
    except ValueError as exc:
        assert "logprob" in str(exc)
    else:
        raise AssertionError("a sampled token without a logprob was accepted")
    assert tree.nodes == []


@given(st.lists(st.sampled_from([-0.5, -1e-9, 0.0, -math.inf, math.inf, math.nan, -3.25]), min_size=1, max_size=12))
def test_a_node_rejects_logprobs_that_are_not_numbers_and_only_those(logprobs: list[float]) -> None:
    tree = SessionTree("s")
    turn = NewTurn(None, 0, (1, 2), Origin.PROMPT, None)
    nan = any(value != value for value in logprobs)  # NaN is the one value unequal to itself
    try:
        tree.attach(
            turn,
            sampled=list(range(10, 10 + len(logprobs))),
            logprobs=logprobs,
            finish_reason="stop",
            prompt_chain=EMPTY_CHAIN,
            prompt_length=0,
            reply={},
        )
    except ValueError as exc:
        assert nan and "numbers" in str(exc)
    else:
        assert not nan, "a NaN logprob was accepted"
