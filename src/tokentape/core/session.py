"""A session: every call of one episode, as a tree of turns, and how a new request finds its place.

A request *extends* a turn when its messages start with exactly the messages that led to that turn
plus the reply it returned (compared in canonical form, see `messages`); only the messages after that
are new and get rendered. A request whose echo of one of our replies differs is a rewrite and goes to
the session's policy. Anything else opens a new root: a fresh conversation in the same session.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from tokentape.core.digests import ChainCache
from tokentape.core.held import parsed_bytes
from tokentape.core.images import ImageFacts, ImageRun
from tokentape.core.messages import Message, chain_step, same_inputs
from tokentape.core.outcome import Outcome
from tokentape.core.tape import (
    BranchView,
    FinishReason,
    Origin,
    Rewrite,
    RewritePolicy,
    TurnNode,
    path,
    path_images,
    path_tokens,
)
from tokentape.core.token_ids import PathTextSlot
from tokentape.core.versions import PolicySpan
from tokentape.errors import Conflict

__all__ = [
    "SessionTree",
    "Extend",
    "Fresh",
    "NewTurn",
    "plan_request",
    "settle_rewrite",
    "common_prefix_length",
]


@dataclass(frozen=True, slots=True)
class Extend:
    """Continue after `node`: render `messages[new_from:]` as a bridge after its sampled tokens."""

    node: TurnNode
    new_from: int
    rewrite: Rewrite | None  # set when the echo of `node`'s reply was edited and the tape was kept


@dataclass(frozen=True, slots=True)
class Fresh:
    """Render the whole request; share tokens with `fork_from`'s path up to the first difference."""

    fork_from: TurnNode | None
    rewrite: Rewrite | None


@dataclass(frozen=True, slots=True)
class NewTurn:
    """What one generation adds to the tree, ready to attach."""

    parent: TurnNode | None
    keep: int
    context: tuple[int, ...]
    context_origin: Origin
    rewrite: Rewrite | None
    images: tuple[ImageRun, ...] = ()  # the runs of the images `context` brings, at path positions


def common_prefix_length(a: Sequence[object], b: Sequence[object]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


BYTES_PER_TOKEN = 14
# what the tree keeps per image (`ImageFacts`, its digest's text and the dictionary's entry): never the
# bytes, which are in the store once whatever the number of sessions showing the image
BYTES_PER_IMAGE = 384


class SessionTree:
    """The recorded turns of one session. Append-only: nodes are added, never removed or edited."""

    def __init__(self, session_id: str, policy: RewritePolicy = "tape", *, created_at: float = 0.0) -> None:
        self.session_id = session_id
        self.policy: RewritePolicy = policy
        self.outcome = Outcome(created_at=created_at)
        self.nodes: list[TurnNode] = []
        self.rewrites: list[Rewrite] = []
        self._by_chain: dict[bytes, TurnNode] = {}
        self._by_prompt_chain: dict[bytes, TurnNode] = {}
        self._by_shape: dict[bytes, TurnNode] = {}  # turns by their history with images anonymous
        # every image the session's turns show, by digest: its facts only, the bytes are in the store
        self.images: dict[str, ImageFacts] = {}
        self.digests = ChainCache()  # chain hashes of recent requests' messages, reused by the next ones
        self.prompt_text = PathTextSlot()  # the JSON of its latest prompt, which the next one starts with
        self.template_bytes = 0  # what its turns' template inputs hold (`template_inputs_bytes`), each copy once

    # -- reading -----------------------------------------------------------------------------------
    @property
    def leaves(self) -> list[TurnNode]:
        """Nodes where a branch ends: no child continues after their last token. A node whose
        children all fork inside it still ends a branch, so none of its tokens drop out of the export."""
        continued = {id(node.parent) for node in self.nodes if node.parent is not None and node.keep >= node.parent.end}
        return [node for node in self.nodes if id(node) not in continued]

    def branches(self) -> list[BranchView]:
        return [BranchView.of(leaf) for leaf in self.leaves]

    def has_chain(self, chain: bytes) -> bool:
        """Whether some turn recorded exactly this history, its own reply included."""
        return chain in self._by_chain

    @property
    def token_count(self) -> int:
        return sum(n.end - n.keep for n in self.nodes)

    @property
    def held_bytes(self) -> int:
        """About what the session holds in memory: its tokens as measured (`benchmarks/memory.py`:
        13.9 bytes per recorded token, ids, logprobs, messages and indexes together) and its images'
        facts, the JSON text of its latest prompt where an engine was sent one (`PathTextSlot`), and
        its turns' template inputs (`template_bytes`); no image bytes, which the store holds and
        `store.images.ImageLibrary` reads back."""
        return self.tape_bytes + self.template_bytes

    @property
    def tape_bytes(self) -> int:
        """`held_bytes` less the template inputs."""
        return BYTES_PER_TOKEN * self.token_count + BYTES_PER_IMAGE * len(self.images) + self.prompt_text.held_bytes

    def summary(self) -> dict[str, object]:
        return {
            "session_id": self.session_id,
            "policy": self.policy,
            "turns": len(self.nodes),
            "branches": len(self.leaves),
            "tokens": self.token_count,
            "sampled_tokens": sum(n.end - n.sampled_start for n in self.nodes),
            "rewrites": len(self.rewrites),
            **self.outcome.as_dict(),
        }

    # -- finding a request's place -----------------------------------------------------------------
    def locate(
        self, messages: Sequence[Message], chains: Sequence[bytes]
    ) -> tuple[TurnNode | None, int, TurnNode | None, int]:
        """Longest recorded turn the request extends, and the deepest turn whose reply it edited.

        `chains` are the chain hashes of the request's message prefixes (`messages.hash_chain`).
        Returns (extended node, messages it covers, edited node, index of the edited reply).
        """
        # Scanned from the newest message back: the deepest match is usually the reply before the
        # last user message, so this costs the messages the request adds, not the history.
        extended: TurnNode | None = None
        covered = 0
        for i in range(len(chains), 0, -1):
            if (node := self._by_chain.get(chains[i - 1])) is not None:
                extended, covered = node, i
                break
        edited: TurnNode | None = None
        edited_at = -1
        for i in range(len(chains), covered - 1, -1):  # an edit before `covered` is a sibling's reply
            candidate = self._by_prompt_chain.get(chains[i - 1]) if i > 0 else None
            if candidate is not None and i < len(messages) and messages[i].get("role") == "assistant":
                edited, edited_at = candidate, i
                break
        return extended, covered, edited, edited_at

    # -- recording ---------------------------------------------------------------------------------
    def attach(
        self,
        turn: NewTurn,
        *,
        sampled: Sequence[int],
        logprobs: Sequence[float],
        finish_reason: FinishReason,
        prompt_chain: bytes,
        prompt_length: int,
        reply: Message,
        request_key: bytes | None = None,
        request: int | None = None,
        trace_id: str | None = None,
        policy_version: str | None = None,
        logprob_mode: str | None = None,
        template_inputs: Mapping[str, Any] | None = None,
        constrained: bool = False,
        policy_spans: tuple[PolicySpan, ...] = (),
        shape_chain: bytes | None = None,
        sampling: Mapping[str, float] | None = None,
    ) -> TurnNode:
        """Record one generation under `turn.parent`; `prompt_chain` names the request's messages,
        `template_inputs` what else the template read (`messages.template_inputs`), `shape_chain`
        the messages with their images anonymous (requests with images only)."""
        if turn.parent is not None and same_inputs(turn.parent.template_inputs, template_inputs):
            template_inputs = turn.parent.template_inputs  # one copy per run of equal turns
        node = TurnNode(
            id=len(self.nodes),
            parent=turn.parent,
            keep=turn.keep,
            context=turn.context,
            context_origin=turn.context_origin,
            sampled=sampled,
            logprobs=logprobs,
            finish_reason=finish_reason,
            depth=0 if turn.parent is None else turn.parent.depth + 1,
            prompt_chain=prompt_chain,
            chain=chain_step(prompt_chain, reply),
            message_count=prompt_length + 1,
            reply=dict(reply),
            rewrite=turn.rewrite,
            request_key=request_key,
            request=request,
            trace_id=trace_id,
            policy_version=policy_version,
            logprob_mode=logprob_mode,
            template_inputs=template_inputs,
            constrained=constrained,
            policy_spans=policy_spans,
            images=turn.images,
            shape_chain=None if shape_chain is None else chain_step(shape_chain, reply),
            sampling=sampling,
        )
        self.restore(node)
        return node

    def restore(self, node: TurnNode) -> None:
        """Add a node built elsewhere (attach, or a store reloading a session): index it."""
        if node.id != len(self.nodes):
            raise ValueError(f"turn {node.id} restored out of order (expected {len(self.nodes)})")
        self.nodes.append(node)
        inputs = node.template_inputs
        if inputs is not None and (node.parent is None or inputs is not node.parent.template_inputs):
            self.template_bytes += template_inputs_bytes(inputs)
        self._by_chain.setdefault(node.chain, node)
        self._by_prompt_chain.setdefault(node.prompt_chain, node)
        if node.shape_chain is not None:
            self._by_shape.setdefault(node.shape_chain, node)
        if node.rewrite is not None and (not self.rewrites or self.rewrites[-1] != node.rewrite):
            self.rewrites.append(node.rewrite)

    def locate_shape(self, shape_chains: Sequence[bytes]) -> tuple[TurnNode | None, int]:
        """The deepest turn whose history equals the request's once images are anonymous, and how many
        of the request's messages it covers (`shape_chains`: the chain hashes of those messages)."""
        if not self._by_shape:
            return None, 0
        for i in range(len(shape_chains), 0, -1):
            if (node := self._by_shape.get(shape_chains[i - 1])) is not None:
                return node, i
        return None, 0

    def turns_of_request(self, request: int) -> list[TurnNode]:
        """The turns (one per choice) the session's request number `request` produced."""
        return [node for node in self.nodes if node.request == request]

    def latest_requests(self) -> dict[bytes, int]:
        """For each request key, the number of the latest request with that key that made a turn."""
        latest: dict[bytes, int] = {}
        for node in self.nodes:
            if node.request_key is not None and node.request is not None:
                latest[node.request_key] = max(node.request, latest.get(node.request_key, 0))
        return latest

    def fork_point(
        self, branch_end: TurnNode, tokens: Sequence[int], runs: Sequence[ImageRun] = ()
    ) -> tuple[TurnNode | None, int]:
        """Where a fully rendered prompt leaves `branch_end`'s path: (parent node, shared tokens).
        `runs`: the prompt's image runs; the same placeholder tokens for another image are a
        difference too, so the paths part before the first image that is not the recorded one."""
        shared = common_prefix_length(path_tokens(branch_end), tokens)
        if runs:  # only the runs still on this path: a fork may have cut an earlier image off
            recorded = {(run.start, run.digest) for run in path_images(branch_end)}
            for run in runs:
                if run.start < shared and (run.start, run.digest) not in recorded:
                    shared = run.start
                    break
        parent: TurnNode | None = None
        for node in path(branch_end):
            if node.keep < shared:
                parent = node
        return parent, shared if parent is not None else 0


def template_inputs_bytes(inputs: Mapping[str, Any]) -> int:
    """A bound on what one turn's template inputs hold (tools, `chat_template_kwargs`): they were
    parsed from the request's JSON, and `held.parsed_bytes` bounds what such a parse holds. A turn
    whose inputs are its parent's holds no copy of its own (`SessionTree.attach`)."""
    try:
        return parsed_bytes(orjson.dumps(inputs))
    except TypeError:  # not JSON orjson writes (never from a request): counted by its text
        return 4 * len(repr(inputs))


def settle_rewrite(rewrite: Rewrite) -> Literal["keep", "fork"]:
    """The one place a rewrite policy is applied: `tape` keeps appending to the recorded tape,
    `fork` starts a new branch from the template's rendering, `strict` rejects the request."""
    if rewrite.policy == "strict":
        raise Conflict(
            f"this session's rewrite policy is strict and the request rewrites its history at message "
            f"{rewrite.at_message}: {rewrite.detail}",
            param="messages",
            code="rewrite_rejected",
        )
    return "keep" if rewrite.policy == "tape" else "fork"


def plan_request(tree: SessionTree, messages: Sequence[Message], chains: Sequence[bytes]) -> Extend | Fresh:
    """Decide, from message identity alone, how a request continues the tree (`chains`: the chain
    hashes of the request's message prefixes).

    An edited reply goes to the session's policy (`settle_rewrite`, which raises `Conflict` under
    `strict`); template rewrites are only known once the bridge is rendered, and go there too.
    """
    extended, covered, edited, edited_at = tree.locate(messages, chains)
    if edited is not None:
        rewrite = Rewrite(
            kind="assistant_edited",
            policy=tree.policy,
            at_message=edited_at,
            at_token=None,
            detail="the request's copy of a recorded reply differs from the reply that was sent",
        )
        if settle_rewrite(rewrite) == "keep":
            return Extend(edited, edited_at + 1, rewrite)
        return Fresh(edited, rewrite)
    if extended is not None:
        return Extend(extended, covered, None)
    return Fresh(None, None)
