"""Where a request goes in its session and what the engine is given: the prompt is built from the
tape (recorded tokens plus a rendered bridge), never from re-rendered history. Rewrites are settled
by the session's policy in core (`settle_rewrite`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from tokentape.core.messages import EMPTY_CHAIN, chain_step
from tokentape.core.session import Fresh, NewTurn, SessionTree, plan_request, settle_rewrite
from tokentape.core.tape import Origin, Rewrite, TurnNode, path_tokens
from tokentape.errors import InvalidRequest
from tokentape.gateway.calls import ChatCall
from tokentape.gateway.generation import ReplyMode
from tokentape.render.renderer import Renderer

__all__ = ["Plan", "Planner", "deepest_prefix_node"]


@dataclass(frozen=True, slots=True)
class Plan:
    turn: NewTurn
    prompt: Sequence[int]  # an int32 array sliced from the tape, or a list
    prompt_chain: bytes  # chain hash of the request's messages
    prompt_length: int  # how many messages the request had
    reply_mode: ReplyMode | None = None  # None: raw completion text


class Planner:
    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer
        self._end_of_turn = renderer.tokenizer.end_of_turn_ids

    async def chat(self, tree: SessionTree, call: ChatCall) -> Plan:
        if not call.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        chains = tree.digests.chains(call.messages)
        decision = plan_request(tree, call.messages, chains)
        if isinstance(decision, Fresh):
            return await self._fresh(tree, call, decision, chains[-1])
        node = decision.node
        bridge = await asyncio.to_thread(
            self.renderer.bridge, call.messages, decision.new_from - 1, node.reply, self._stop_token(node), call.options
        )
        rewrite = decision.rewrite
        if bridge.template_rewrite:
            rewrite = Rewrite(
                kind="template",
                policy=tree.policy,
                at_message=decision.new_from - 1,
                at_token=None,
                detail="the chat template renders an earlier reply differently once new messages follow",
            )
            if settle_rewrite(rewrite) == "fork":
                return await self._fresh(tree, call, Fresh(node, rewrite), chains[-1])
        turn = NewTurn(node, node.end, tuple(bridge.tokens), Origin.BRIDGE, rewrite)
        mode = self._reply_mode(call, bridge.opens_reasoning)
        prompt = node.path_array()
        prompt.extend(bridge.tokens)
        return Plan(turn, prompt, chains[-1], len(chains), mode)

    async def _fresh(self, tree: SessionTree, call: ChatCall, decision: Fresh, chain: bytes) -> Plan:
        prompt = await asyncio.to_thread(self.renderer.prompt, call.messages, call.options)
        tokens, count = prompt.tokens, len(call.messages)
        mode = self._reply_mode(call, prompt.opens_reasoning)
        if decision.fork_from is None:
            return Plan(NewTurn(None, 0, tuple(tokens), Origin.PROMPT, None), tokens, chain, count, mode)
        parent, shared = tree.fork_point(decision.fork_from, tokens)
        rewrite = decision.rewrite
        if rewrite is not None:
            rewrite = dataclasses.replace(rewrite, at_token=shared)
        return Plan(NewTurn(parent, shared, tuple(tokens[shared:]), Origin.PROMPT, rewrite), tokens, chain, count, mode)

    def _reply_mode(self, call: ChatCall, opens_reasoning: bool) -> ReplyMode:
        tool_format = self.renderer.tool_format if call.parse_tool_calls else "none"
        return ReplyMode(tool_format, self.renderer.reasoning, opens_reasoning)

    def _stop_token(self, node: TurnNode) -> int | None:
        """The end-of-turn token a turn ended on, if it ended on one."""
        last = node.last_sampled
        return last if last in self._end_of_turn else None

    async def completion_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """A completion's prompt as token IDs (text is tokenized; IDs are checked against the vocabulary)."""
        if isinstance(prompt, str):
            tokens = await asyncio.to_thread(self.renderer.tokenizer.encode, prompt)
        else:
            tokens = list(prompt)
            vocab = self.renderer.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in tokens):
                raise InvalidRequest(f"prompt token IDs must be between 0 and {vocab - 1}", param="prompt")
        if not tokens:
            raise InvalidRequest("the prompt is empty", param="prompt")
        return tokens

    @staticmethod
    def completion(tree: SessionTree, prompt: list[int]) -> Plan:
        """Inside a session a raw completion extends the branch its token prompt starts with."""
        parent = deepest_prefix_node(tree.nodes, prompt)
        keep = parent.end if parent is not None else 0
        turn = NewTurn(parent, keep, tuple(prompt[keep:]), Origin.PROMPT, None)
        # Token prompts have no message history; a placeholder chain keeps them out of chat matching.
        chain = chain_step(EMPTY_CHAIN, {"role": "_completion", "content": prompt})
        return Plan(turn, prompt, chain, 1)


def deepest_prefix_node(nodes: Sequence[TurnNode], prompt: Sequence[int]) -> TurnNode | None:
    """The most recent turn whose whole path is a prefix of `prompt`."""
    for node in reversed(nodes):
        if node.end <= len(prompt) and path_tokens(node) == list(prompt[: node.end]):
            return node
    return None
