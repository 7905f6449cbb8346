"""The tape: token records of one session, kept as a tree of turns.

A turn node holds the tokens the gateway put in front of one generation (`context`: the first prompt,
or the bridge after the parent's sampled tokens) and the tokens the engine sampled. A node continues
its parent's path after `keep` tokens: normally the parent's whole path, fewer when a rewrite forked
the path at a token inside it. A branch is the path from a root to a leaf; it is one training sample.
A node's tokens, logprobs and reply are fixed when it is attached; the only thing that changes
afterwards is its `children` list, which grows as later turns attach below it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Origin", "Rewrite", "RewriteKind", "RewritePolicy", "TurnNode", "BranchView", "FinishReason"]

FinishReason = Literal["stop", "length", "tool_calls", "abort"]
RewritePolicy = Literal["tape", "fork", "strict"]
RewriteKind = Literal["template", "assistant_edited"]


class Origin(enum.IntEnum):
    """Where a token on the tape came from."""

    PROMPT = 0  # rendered and tokenized by the gateway as a whole prompt
    SAMPLED = 1  # produced by the engine; the only trainable origin
    BRIDGE = 2  # rendered by the gateway after sampled tokens to reach the next generation point

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Rewrite:
    """A request whose history no longer matched the tape, and what was done about it."""

    kind: RewriteKind
    policy: RewritePolicy
    at_message: int  # index of the first message whose rendering or content differs
    at_token: int | None  # token offset of the fork on the branch, when the policy forked
    detail: str

    def as_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "policy": self.policy,
            "at_message": self.at_message,
            "at_token": self.at_token,
            "detail": self.detail,
        }


@dataclass(slots=True, eq=False)
class TurnNode:
    """One generation: the context put before it and the tokens sampled in it."""

    id: int
    parent: TurnNode | None
    keep: int
    context: tuple[int, ...]
    context_origin: Origin
    sampled: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    depth: int
    prompt_chain: bytes  # chain hash of the request messages that led to this turn
    chain: bytes  # chain hash of those messages plus the reply this turn returned
    message_count: int  # request messages + 1 (the reply)
    reply: Mapping[str, Any] = field(default_factory=dict)  # the assistant message this turn returned
    rewrite: Rewrite | None = None
    request_key: bytes | None = None  # names the request's body (an SDK retry repeats it)
    request: int | None = None  # the session's number for the request that made this turn
    trace_id: str | None = None  # a second session name the client sent with the request
    policy_version: str | None = None  # the weights that sampled this turn
    logprob_mode: str | None = None  # what its logprobs are, as its engine reported (None: not recorded)
    # what the template read besides the messages (tools, chat_template_kwargs); shared with the
    # parent's when equal
    template_inputs: Mapping[str, Any] | None = None
    # sampled under a constraint (tool_choice, response_format): its logprobs are the constrained
    # distribution's, not the policy's
    constrained: bool = False
    children: list[TurnNode] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.sampled) != len(self.logprobs):
            raise ValueError("every sampled token needs exactly one logprob")
        if any(math.isnan(lp) for lp in self.logprobs):
            raise ValueError("sampled logprobs must be numbers")

    @property
    def end(self) -> int:
        """Length of the path from the root through this node."""
        return self.keep + len(self.context) + len(self.sampled)

    @property
    def sampled_start(self) -> int:
        return self.keep + len(self.context)


@dataclass(frozen=True, slots=True)
class BranchView:
    """A root-to-leaf path, flattened into per-token lists of equal length."""

    leaf: TurnNode
    tokens: list[int]
    origins: list[Origin]
    logprobs: list[float | None]
    turns: list[int]
    nodes: list[TurnNode]

    @classmethod
    def of(cls, leaf: TurnNode) -> BranchView:
        nodes = list(path(leaf))
        tokens: list[int] = []
        origins: list[Origin] = []
        logprobs: list[float | None] = []
        turns: list[int] = []
        for node, limit in zip(nodes, _limits(nodes), strict=True):
            context = node.context[: max(0, limit - node.keep)]
            sampled = node.sampled[: max(0, limit - node.sampled_start)]
            tokens += context
            tokens += sampled
            origins += [node.context_origin] * len(context) + [Origin.SAMPLED] * len(sampled)
            logprobs += [None] * len(context)
            logprobs += node.logprobs[: len(sampled)]
            turns += [node.depth] * (len(context) + len(sampled))
        return cls(leaf, tokens, origins, logprobs, turns, nodes)

    @property
    def loss_mask(self) -> list[int]:
        return [1 if origin is Origin.SAMPLED else 0 for origin in self.origins]

    def action_ranges(self) -> list[tuple[int, int]]:
        """Half-open token ranges of each turn's sampled span on this branch."""
        ranges = []
        for node, limit in zip(self.nodes, _limits(self.nodes), strict=True):
            end = min(node.end, limit)
            if end > node.sampled_start:
                ranges.append((node.sampled_start, end))
        return ranges


def path(leaf: TurnNode) -> Iterator[TurnNode]:
    """Nodes from the root to `leaf`."""
    chain = []
    node: TurnNode | None = leaf
    while node is not None:
        chain.append(node)
        node = node.parent
    return reversed(chain)


def _limits(nodes: Sequence[TurnNode]) -> list[int]:
    """How far along the path each node's tokens are kept: up to where its child continues."""
    return [child.keep for child in nodes[1:]] + [nodes[-1].end]


def path_tokens(leaf: TurnNode) -> list[int]:
    """The token IDs of the path from the root to `leaf`."""
    tokens: list[int] = []
    nodes = list(path(leaf))
    for node, limit in zip(nodes, _limits(nodes), strict=True):
        own = node.context + node.sampled
        tokens += own[: max(0, limit - node.keep)]
    return tokens
