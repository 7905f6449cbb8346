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
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from tokentape.client import GatewayClient
from tokentape.core.formats import ATROPOS_MASKED, ATROPOS_MASKED_LOGPROB

__all__ = ["ManagedSession", "TokentapeServerManager", "scored_data_group", "sequence_node"]

# Keyword arguments Atropos's server manager takes that are not part of the OpenAI request.
_ATROPOS_ONLY = ("split",)


def sequence_node(branch: dict[str, Any], full_text: str) -> Any:
    """One exported branch as atroposlib's `SequenceNode`."""
    from atroposlib.envs.server_handling.managed_server import SequenceNode

    tokens = list(branch["tokens"])
    masked = [t if keep else ATROPOS_MASKED for t, keep in zip(tokens, branch["loss_mask"], strict=True)]
    logprobs = [ATROPOS_MASKED_LOGPROB if lp is None else lp for lp in branch["logprobs"]]
    return SequenceNode(
        full_text=full_text,
        tokens=tokens,
        masked_tokens=masked,
        logprobs=logprobs,
        metadata={
            "finish_reason": branch["finish_reasons"][-1] if branch["finish_reasons"] else None,
            "finish_reasons": list(branch["finish_reasons"]),
            "branch_id": branch["branch_id"],
            "turn_ids": list(branch["turn_ids"]),
        },
    )


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


class ManagedSession:
    """What `managed_server()` yields: atroposlib ManagedServer's calls, recorded by tokentape."""

    def __init__(
        self, gateway: GatewayClient, session_id: str, tokenizer: Any = None, group_id: str | None = None
    ) -> None:
        self.gateway = gateway
        self.session_id = session_id
        self.tokenizer = tokenizer  # only to write `full_text`; tokentape renders with its own
        self._nodes: list[Any] = []
        self._client = gateway.client(session_id)
        self._group_id = group_id
        self._created = True  # the manager created the first session; `reset()` defers the next

    async def _ensure_session(self) -> None:
        if not self._created:
            fields = {"group_id": self._group_id} if self._group_id else {}
            await self.gateway.create_session(self.session_id, **fields)
            self._client = self.gateway.client(self.session_id)  # with the new session's own key
            self._created = True

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """A chat completion in this session (any OpenAI field: n, max_tokens, tools, ...)."""
        await self._ensure_session()
        reply: ChatCompletion = await self._client.chat.completions.create(**self._request(kwargs))
        await self._refresh()
        return reply

    async def completion(self, **kwargs: Any) -> Completion:
        """A raw completion in this session; a token-ID prompt extends the branch it starts with."""
        await self._ensure_session()
        reply: Completion = await self._client.completions.create(**self._request(kwargs))
        await self._refresh()
        return reply

    def get_state(self) -> dict[str, list[Any]]:
        """`{"nodes": [...]}`: one SequenceNode per branch, in the order their first turn was made."""
        return {"nodes": list(self._nodes)}

    def reset(self) -> None:
        """Forget the tracked nodes: later calls go to a new session (the old one stays recorded)."""
        self.session_id = f"atropos-{uuid.uuid4().hex}"
        self._nodes = []
        self._created = False

    async def set_scores(self, scores: Sequence[float]) -> None:
        """Record the environment's scores on the session's branches (node order) and finish it."""
        nodes = self._nodes
        if len(nodes) != len(scores):
            raise ValueError(f"{len(nodes)} nodes but {len(scores)} scores")
        rewards = {str(node.metadata["branch_id"]): float(s) for node, s in zip(nodes, scores, strict=True)}
        await self.gateway.finish(self.session_id, branch_rewards=rewards)

    def _request(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        request = {k: v for k, v in kwargs.items() if k not in _ATROPOS_ONLY}
        request.setdefault("model", self.gateway.model)
        return request

    async def _refresh(self) -> None:
        export = await self.gateway.export(self.session_id)
        branches = sorted(export["branches"], key=lambda b: b["turn_ids"])
        self._nodes = [sequence_node(b, await self._text(b["tokens"])) for b in branches]

    async def _text(self, tokens: list[int]) -> str:
        if self.tokenizer is not None:
            return str(self.tokenizer.decode(tokens))
        return await self.gateway.detokenize(tokens)


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
        await self.gateway.create_session(session_id, **fields)
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
