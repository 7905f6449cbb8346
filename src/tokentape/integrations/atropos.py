"""Atropos environments on tokentape: the environment keeps its code, its `self.server` becomes a
`TokentapeServerManager`.

    env.server = TokentapeServerManager(InProcessGateway())     # or `await GatewayClient.connect(url)`
    async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
        reply = await managed.chat_completion(messages=messages, n=2, max_tokens=64)
        ...                                                     # later turns: extend each choice's messages
        nodes = managed.get_state()["nodes"]                    # atroposlib SequenceNodes, one per branch
    group = scored_data_group(nodes, scores)                    # atroposlib's ScoredDataGroup

One managed context is one tokentape session. Its calls are ordinary chat (or completion) requests,
so n>1 choices become sibling branches and a later request continues the branch whose reply its
messages echo; `get_state()` gives one node per branch in Atropos's shape: `tokens`, `masked_tokens`
(the token where the model sampled it, -100 elsewhere), `logprobs` (the sampling logprob there, 1.0
elsewhere). Unlike atroposlib's own ManagedServer, no text is matched or re-tokenized: a turn's
sampled tokens (its end-of-turn token included) are kept as sampled, only the rest of the turn close
and the new messages are rendered, and they stay masked.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import openai
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from tokentape.client import GatewayClient
from tokentape.core.formats import ATROPOS_MASKED, ATROPOS_MASKED_LOGPROB
from tokentape.rollout import context_overflow

__all__ = ["ManagedSession", "TokentapeServerManager", "scored_data_group"]

# Keyword arguments Atropos's server manager takes that are not part of the OpenAI request.
_ATROPOS_ONLY = ("split",)


def scored_data_group(nodes: Sequence[Any], scores: Sequence[float]) -> dict[str, Any]:
    """Atropos's `ScoredDataGroup` for nodes and their scores, with the sampling logprobs as
    `inference_logprobs`; the fields an environment fills itself are None (`group_overrides` empty)."""
    if len(nodes) != len(scores):
        raise ValueError(f"{len(nodes)} nodes but {len(scores)} scores")
    return {
        "tokens": [list(node.tokens) for node in nodes],
        "masks": [list(node.masked_tokens) for node in nodes],
        "scores": [float(s) for s in scores],
        "advantages": None,
        "ref_logprobs": None,
        "messages": None,
        "generation_params": None,
        "inference_logprobs": [list(node.logprobs) for node in nodes],
        "group_overrides": {},
        "overrides": None,
        "images": None,
    }


@dataclass
class _Branch:
    """One branch as the session's replies built it: the tape's tokens, mask and logprobs, kept
    without asking the gateway (each call adds its own turn, not the whole history again)."""

    tokens: list[int]
    masked: list[int]
    logprobs: list[float]
    ends: list[int]  # where each of its turns' sampled tokens end: the points a later call may fork from
    finish_reasons: list[str | None]
    order: tuple[int, ...]  # its turns, numbered in the order they were made (the export's order)
    texts: list[str] | None = None  # without a tokenizer: the gateway's text up to each of `ends`
    text: str | None = None  # detokenized on demand, once


class ManagedSession:
    """What `managed_server()` yields: atroposlib ManagedServer's calls, recorded by tokentape.

    Each call reads only its own reply (prompt token IDs, sampled token IDs and their logprobs, which
    tokentape returns with every reply): its new turns extend the branch whose tokens the prompt
    continues, at the end of one of its turns, as the gateway's session tree does. Nothing is exported
    or detokenized per call; `get_state()` detokenizes only branches that changed. A request that no
    longer fits the context ends the episode: the call answers with empty `length` choices,
    `status` becomes `context_full` (in every node's metadata) and later calls answer the same; when
    that was the first request, `get_state()` has no node (and `set_scores([])` finishes the session).
    The overflow is told apart from other errors by the gateway's error code (`context_overflow`);
    any other error propagates, as from atroposlib's own ManagedServer.
    """

    def __init__(
        self, gateway: GatewayClient, session_id: str, tokenizer: Any = None, group_id: str | None = None
    ) -> None:
        self.gateway = gateway
        self.session_id = session_id
        self.tokenizer = tokenizer  # only to write `full_text`; tokentape renders with its own
        self.status = "running"
        self._branches: list[_Branch] = []
        self._turns = 0
        self._client = gateway.client(session_id)
        self._group_id = group_id
        self._created = True  # the manager created the first session; `reset()` defers the next

    async def _ensure_session(self) -> None:
        if not self._created:
            fields = {"group_id": self._group_id} if self._group_id else {}
            await self.gateway.create_session(self.session_id, metadata={"max_tokens": "clip"}, **fields)
            self._client = self.gateway.client(self.session_id)  # with the new session's own key
            self._created = True

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """A chat completion in this session (any OpenAI field: n, max_tokens, tools, ...)."""
        await self._ensure_session()
        request, asked = self._request(kwargs, chat=True)
        if self.status == "context_full":
            return _empty_chat(request)
        try:
            reply: ChatCompletion = await self._client.chat.completions.create(**request)
        except openai.APIStatusError as exc:
            if not context_overflow(exc):
                raise
            self.status = "context_full"
            return _empty_chat(request)
        await self._record(
            reply, [[e.logprob for e in (c.logprobs.content or [])] if c.logprobs else [] for c in reply.choices]
        )
        if not asked:
            for choice in reply.choices:
                choice.logprobs = None
        return reply

    async def completion(self, **kwargs: Any) -> Completion:
        """A raw completion in this session; a token-ID prompt extends the branch it starts with."""
        await self._ensure_session()
        request, asked = self._request(kwargs, chat=False)
        if self.status == "context_full":
            return _empty_completion(request)
        try:
            reply: Completion = await self._client.completions.create(**request)
        except openai.APIStatusError as exc:
            if not context_overflow(exc):
                raise
            self.status = "context_full"
            return _empty_completion(request)
        await self._record(
            reply,
            [
                [float(lp or 0.0) for lp in (c.logprobs.token_logprobs or [])] if c.logprobs else []
                for c in reply.choices
            ],
        )
        if not asked:
            for choice in reply.choices:
                choice.logprobs = None
        return reply

    def get_state(self) -> dict[str, list[Any]]:
        """`{"nodes": [...]}`: one SequenceNode per branch, in the order their first turn was made."""
        from atroposlib.envs.server_handling.managed_server import SequenceNode

        nodes = []
        for branch in self._branches:
            if branch.text is None:
                branch.text = self._text(branch.tokens)
            nodes.append(
                SequenceNode(
                    full_text=branch.text,
                    tokens=list(branch.tokens),
                    masked_tokens=list(branch.masked),
                    logprobs=list(branch.logprobs),
                    metadata={
                        "finish_reason": branch.finish_reasons[-1],
                        "finish_reasons": list(branch.finish_reasons),
                        "status": self.status,
                    },
                )
            )
        return {"nodes": nodes}

    def reset(self) -> None:
        """Forget the tracked nodes: later calls go to a new session (the old one stays recorded)."""
        self.session_id = f"atropos-{uuid.uuid4().hex}"
        self._branches, self._turns, self.status = [], 0, "running"
        self._created = False

    async def set_scores(self, scores: Sequence[float]) -> None:
        """Record the environment's scores on the session's branches (node order) and finish it."""
        if len(self._branches) != len(scores):
            raise ValueError(f"{len(self._branches)} nodes but {len(scores)} scores")
        export = await self.gateway.export(self.session_id)  # once per episode: the branches' ids
        ids = {tuple(b["tokens"]): str(b["branch_id"]) for b in export["branches"]}
        rewards = {ids[tuple(b.tokens)]: float(s) for b, s in zip(self._branches, scores, strict=True)}
        await self.gateway.finish(self.session_id, branch_rewards=rewards, metadata={"status": self.status})

    def _request(self, kwargs: dict[str, Any], *, chat: bool) -> tuple[dict[str, Any], bool]:
        """The OpenAI request, asking for the sampled tokens' logprobs (they build the nodes); and
        whether the caller asked for them."""
        request = {k: v for k, v in kwargs.items() if k not in _ATROPOS_ONLY}
        request.setdefault("model", self.gateway.model)
        asked = request.get("logprobs") not in (None, False)
        if not asked:
            request["logprobs"] = True if chat else 0
        return request, asked

    async def _record(self, reply: Any, logprobs: list[list[float]]) -> None:
        prompt: list[int] = list(reply.prompt_token_ids)
        parent, cut = self._parent(prompt)
        for choice, sampled_logprobs in zip(reply.choices, logprobs, strict=True):
            sampled = list(choice.token_ids)
            self._turns += 1
            order: tuple[int, ...] = ()
            k = 0  # the parent's turns this branch shares
            if parent is None:
                head_tokens, head_mask, head_logprobs, ends, reasons = [], [], [], [], []
            else:
                k = parent.ends.index(cut) + 1
                head_tokens, head_mask, head_logprobs = parent.tokens[:cut], parent.masked[:cut], parent.logprobs[:cut]
                ends, reasons, order = parent.ends[:k], parent.finish_reasons[:k], parent.order[:k]
            bridge = len(prompt) - len(head_tokens)
            branch = _Branch(
                tokens=prompt + sampled,
                masked=head_mask + [ATROPOS_MASKED] * bridge + sampled,
                logprobs=head_logprobs + [ATROPOS_MASKED_LOGPROB] * bridge + list(sampled_logprobs),
                ends=[*ends, len(prompt) + len(sampled)],
                finish_reasons=[*reasons, choice.finish_reason],
                order=(*order, self._turns),
            )
            if self.tokenizer is None:  # no tokenizer here: the gateway's, for the new tokens alone
                texts = parent.texts[:k] if parent is not None and parent.texts else []
                new = prompt[len(head_tokens) :] + sampled
                branch.texts = [*texts, (texts[-1] if texts else "") + await self.gateway.detokenize(new)]
                branch.text = branch.texts[-1]
            self._branches.append(branch)
        if parent is not None and cut == parent.ends[-1]:  # the branch went on: its old end is no leaf now
            self._branches.remove(parent)
        self._branches.sort(key=lambda b: b.order)

    def _parent(self, prompt: list[int]) -> tuple[_Branch | None, int]:
        """The branch, and the end of its turn, that the prompt continues (the latest such point)."""
        best: tuple[_Branch | None, int] = (None, 0)
        for branch in self._branches:
            for end in reversed(branch.ends):
                if end <= len(prompt) and end > best[1] and prompt[:end] == branch.tokens[:end]:
                    best = (branch, end)
                    break
        return best

    def _text(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens))


def _empty_chat(request: dict[str, Any]) -> ChatCompletion:
    """The answer to a call the context no longer holds: `n` empty choices cut by `length`."""
    return ChatCompletion.model_validate(
        {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(request.get("model")),
            "choices": [
                {"index": i, "finish_reason": "length", "message": {"role": "assistant", "content": ""}}
                for i in range(int(request.get("n") or 1))
            ],
        }
    )


def _empty_completion(request: dict[str, Any]) -> Completion:
    return Completion.model_validate(
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": str(request.get("model")),
            "choices": [{"index": i, "finish_reason": "length", "text": ""} for i in range(int(request.get("n") or 1))],
        }
    )


class TokentapeServerManager:
    """Stands where an Atropos environment's `ServerManager` stands (`self.server`)."""

    def __init__(self, gateway: GatewayClient, *, group_id: str | None = None) -> None:
        self.gateway = gateway
        self.group_id = group_id  # recorded on every session this manager opens

    @contextlib.asynccontextmanager
    async def managed_server(
        self, tokenizer: Any = None, base_url: str | None = None, preserve_think_blocks: bool = False
    ) -> AsyncIterator[ManagedSession]:
        """One tokentape session for one context, as atroposlib's `managed_server()`.

        `base_url` and `preserve_think_blocks` are accepted for compatibility: tokentape routes
        sessions itself and never re-renders recorded replies, so reasoning blocks are never lost.
        """
        session_id = f"atropos-{uuid.uuid4().hex}"
        fields = {"group_id": self.group_id} if self.group_id else {}
        await self.gateway.create_session(session_id, metadata={"max_tokens": "clip"}, **fields)
        yield ManagedSession(self.gateway, session_id, tokenizer, self.group_id)

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """An untracked call (Atropos's plain `server.chat_completion`): its own one-call session."""
        request = {k: v for k, v in kwargs.items() if k not in _ATROPOS_ONLY}
        request.setdefault("model", self.gateway.model)
        reply: ChatCompletion = await self.gateway.client().chat.completions.create(**request)
        return reply

    async def completion(self, **kwargs: Any) -> Completion:
        request = {k: v for k, v in kwargs.items() if k not in _ATROPOS_ONLY}
        request.setdefault("model", self.gateway.model)
        reply: Completion = await self.gateway.client().completions.create(**request)
        return reply
