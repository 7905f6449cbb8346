"""The tape: token records of one session, kept as a tree of turns.

A turn node holds the tokens the gateway put in front of one generation (`context`: the first prompt,
or the bridge after the parent's sampled tokens) and the tokens the engine sampled. A node continues
its parent's path after `keep` tokens: normally the parent's whole path, fewer when a rewrite forked
the path at a token inside it. A branch is the path from a root to a leaf; it is one training sample.
A node's tokens, logprobs and reply are fixed when it is attached; what changes afterwards is the
buffer its tokens live in, which a child may extend after them. Links go from child to parent only:
a tree holds no reference cycle, so a session's tokens leave memory as soon as the session does,
without waiting for the cycle collector, which a serving process runs rarely.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokentape.core.images import ImageRun
from tokentape.core.versions import PolicySpan

__all__ = ["Origin", "Rewrite", "RewriteKind", "RewritePolicy", "TurnNode", "BranchView", "FinishReason"]

FinishReason = Literal["stop", "length", "tool_calls", "abort"]
RewritePolicy = Literal["tape", "fork", "strict"]
RewriteKind = Literal["template", "assistant_edited", "image_changed"]


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


class TurnNode:
    """One generation: the context put before it and the tokens sampled in it.

    Tokens are kept as int32 in a buffer shared along a path: a node that continues its parent at
    the parent's end, while no sibling has done so yet, appends to the parent's buffer, so a linear
    conversation is one flat array and its path is one slice. A node that starts elsewhere (a root,
    a fork inside its parent, a second child) starts a new buffer after its parent's path. Logprobs
    are float32 when that loses nothing (engines compute them in float32), float64 otherwise.
    """

    __slots__ = (
        "_base",
        "_base_node",
        "_buffer",
        "_context_length",
        "_logprobs",
        "_sampled_length",
        "chain",
        "constrained",
        "context_origin",
        "depth",
        "finish_reason",
        "id",
        "images",
        "keep",
        "logprob_mode",
        "message_count",
        "parent",
        "policy_spans",
        "policy_version",
        "prompt_chain",
        "reply",
        "request",
        "request_key",
        "rewrite",
        "sampling",
        "shape_chain",
        "template_inputs",
        "trace_id",
    )

    def __init__(
        self,
        *,
        id: int,
        parent: TurnNode | None,
        keep: int,
        context: Sequence[int],
        context_origin: Origin,
        sampled: Sequence[int],
        logprobs: Sequence[float],
        finish_reason: FinishReason,
        depth: int,
        prompt_chain: bytes,
        chain: bytes,
        message_count: int,
        reply: Mapping[str, Any] | None = None,
        rewrite: Rewrite | None = None,
        request_key: bytes | None = None,
        request: int | None = None,
        trace_id: str | None = None,
        policy_version: str | None = None,
        logprob_mode: str | None = None,
        template_inputs: Mapping[str, Any] | None = None,
        constrained: bool = False,
        policy_spans: tuple[PolicySpan, ...] = (),
        images: tuple[ImageRun, ...] = (),
        shape_chain: bytes | None = None,
        sampling: Mapping[str, float] | None = None,
    ) -> None:
        if len(sampled) != len(logprobs):
            raise ValueError("every sampled token needs exactly one logprob")
        # a sum in C is NaN if any logprob is (or where +inf meets -inf: then looked at one by one)
        if (total := sum(logprobs)) != total and any(math.isnan(lp) for lp in logprobs):
            raise ValueError("sampled logprobs must be numbers")
        self.id = id
        self.parent = parent
        self.keep = keep
        self.context_origin = context_origin
        self.finish_reason: FinishReason = finish_reason
        self.depth = depth
        self.prompt_chain = prompt_chain  # chain hash of the request messages that led to this turn
        self.chain = chain  # chain hash of those messages plus the reply this turn returned
        self.message_count = message_count  # request messages + 1 (the reply)
        self.reply: Mapping[str, Any] = {} if reply is None else reply  # the assistant message returned
        self.rewrite = rewrite
        self.request_key = request_key  # names the request's body (an SDK retry repeats it)
        self.request = request  # the session's number for the request that made this turn
        self.trace_id = trace_id  # a second session name the client sent with the request
        self.policy_version = policy_version  # the weights that sampled this turn (a label)
        # the integer weights versions over its sampled tokens, one span per seam (core.versions)
        self.policy_spans = policy_spans
        self.logprob_mode = logprob_mode  # what its logprobs are, as its engine reported (None: not recorded)
        # what the template read besides the messages (tools, chat_template_kwargs); shared with the
        # parent's when equal
        self.template_inputs = template_inputs
        # sampled under a constraint (tool_choice, response_format): its logprobs are the constrained
        # distribution's, not the policy's
        self.constrained = constrained
        # the placeholder runs of the images its context brought, at their path positions
        self.images = images
        # chain hash of the request's messages and the reply with images anonymous (`images.masked_images`);
        # None when the request had none. A request that matches it but not `chain` changed an image.
        self.shape_chain = shape_chain
        # temperature, top_p, top_k, min_p as the request set them (None: recorded before they were)
        self.sampling = sampling
        self._context_length = len(context)
        self._sampled_length = len(sampled)
        self._logprobs = _compact_floats(logprobs)
        # buffer[i] is path token base + i; path tokens before base are base_node's path
        self._buffer: array[int]
        self._base: int
        self._base_node: TurnNode | None
        if parent is not None and keep == parent.end and len(parent._buffer) == parent.end - parent._base:
            self._buffer, self._base, self._base_node = parent._buffer, parent._base, parent._base_node
        else:
            self._buffer, self._base, self._base_node = array("i"), keep, parent if keep else None
        self._buffer.extend(context)
        self._buffer.extend(sampled)

    @property
    def end(self) -> int:
        """Length of the path from the root through this node."""
        return self.keep + self._context_length + self._sampled_length

    @property
    def sampled_start(self) -> int:
        return self.keep + self._context_length

    @property
    def context(self) -> tuple[int, ...]:
        start = self.keep - self._base
        return tuple(self._buffer[start : start + self._context_length])

    @property
    def sampled(self) -> tuple[int, ...]:
        start = self.sampled_start - self._base
        return tuple(self._buffer[start : start + self._sampled_length])

    @property
    def logprobs(self) -> tuple[float, ...]:
        return tuple(self._logprobs)

    @property
    def last_sampled(self) -> int | None:
        """The last token the engine sampled in this turn, if any."""
        return self._buffer[self.end - self._base - 1] if self._sampled_length else None

    def own_tokens(self, limit: int | None = None) -> array[int]:
        """This node's context and sampled tokens, up to path position `limit`."""
        stop = self.end if limit is None else max(self.keep, min(limit, self.end))
        return self._buffer[self.keep - self._base : stop - self._base]

    def path_buffer(self) -> array[int] | None:
        """The int32 array whose first `end` IDs are this node's path, when one array holds the whole
        path (it never branched inside a turn); None otherwise. Such arrays only grow."""
        return self._buffer if self._base_node is None else None

    def path_array(self) -> array[int]:
        """The token IDs of the path from the root through this node, as one int32 array."""
        if self._base_node is None:
            return self._buffer[: self.end - self._base]
        head = self._base_node.path_array()
        del head[self._base :]
        head.extend(self._buffer[: self.end - self._base])
        return head


def _compact_floats(values: Sequence[float]) -> array[float]:
    """float32 when every value survives the round trip, else float64."""
    try:
        single = array("f", values)
    except OverflowError:
        return array("d", values)
    if all(a == b for a, b in zip(single, values, strict=True)):
        return single
    return array("d", values)


@dataclass(frozen=True, slots=True)
class BranchView:
    """A root-to-leaf path, flattened into per-token lists of equal length."""

    leaf: TurnNode
    tokens: list[int]
    origins: list[Origin]
    logprobs: list[float | None]
    turns: list[int]
    nodes: list[TurnNode]
    images: list[ImageRun] = dataclasses.field(default_factory=list)  # each image's run, in path order

    @classmethod
    def of(cls, leaf: TurnNode) -> BranchView:
        nodes = list(path(leaf))
        tokens: array[int] = array("i")
        origins: list[Origin] = []
        logprobs: list[float | None] = []
        turns: list[int] = []
        images: list[ImageRun] = []
        for node, limit in zip(nodes, _limits(nodes), strict=True):
            images += _kept_runs(node, limit)
            own = node.own_tokens(limit)
            context = max(0, min(limit, node.sampled_start) - node.keep)
            sampled = len(own) - context
            tokens.extend(own)
            origins += [node.context_origin] * context + [Origin.SAMPLED] * sampled
            logprobs += [None] * context
            logprobs += node._logprobs[:sampled].tolist()
            turns += [node.depth] * (context + sampled)
        return cls(leaf, tokens.tolist(), origins, logprobs, turns, nodes, images)

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


def path_images(leaf: TurnNode) -> list[ImageRun]:
    """The image runs on `leaf`'s path, in order: a run of a node that a later fork cut off is not."""
    nodes = list(path(leaf))
    return [run for node, limit in zip(nodes, _limits(nodes), strict=True) for run in _kept_runs(node, limit)]


def _kept_runs(node: TurnNode, limit: int) -> list[ImageRun]:
    return [run for run in node.images if run.end <= limit]


def _limits(nodes: Sequence[TurnNode]) -> list[int]:
    """How far along the path each node's tokens are kept: up to where its child continues."""
    return [child.keep for child in nodes[1:]] + [nodes[-1].end]


def path_tokens(leaf: TurnNode) -> list[int]:
    """The token IDs of the path from the root to `leaf`."""
    return leaf.path_array().tolist()
