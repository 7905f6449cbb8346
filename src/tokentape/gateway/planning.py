"""Where a request goes in its session and what the engine is given: the prompt is built from the
tape (recorded tokens plus a rendered bridge), never from re-rendered history. Rewrites are settled
by the session's policy in core (`settle_rewrite`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tokentape.core.images import ImageRun
from tokentape.core.messages import EMPTY_CHAIN, Message, chain_step
from tokentape.core.session import Extend, Fresh, NewTurn, SessionTree, plan_request, settle_rewrite
from tokentape.core.tape import Origin, Rewrite, TurnNode, path_images, path_tokens
from tokentape.core.token_ids import FirstPromptIds, PromptIds
from tokentape.errors import InvalidRequest
from tokentape.gateway import images
from tokentape.gateway.calls import ChatCall
from tokentape.gateway.generation import ReplyMode
from tokentape.render.bounds import PromptTooLong, TokenFloor
from tokentape.render.renderer import Renderer, RenderOptions

__all__ = ["Plan", "Planner", "deepest_prefix_node"]

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Plan:
    turn: NewTurn
    prompt: Sequence[int]  # an int32 array sliced from the tape, or a list
    prompt_chain: bytes  # chain hash of the request's messages
    prompt_length: int  # how many messages the request had
    reply_mode: ReplyMode | None = None  # None: raw completion text
    template_inputs: Mapping[str, Any] | None = None  # what the template read besides the messages
    images: tuple[ImageRun, ...] = ()  # every image run of `prompt`, recorded ones and new ones
    shape_chain: bytes | None = None  # the messages' chain with images anonymous (requests with images)


class Planner:
    def __init__(self, renderer: Renderer, image_reader: images.Reader | None = None) -> None:
        self.renderer = renderer
        self.image_reader = image_reader  # the bytes of images a session holds, read back by digest
        self._end_of_turn = renderer.tokenizer.end_of_turn_ids
        self._floor: TokenFloor | None = None
        self._floor_known = False

    async def token_floor(self) -> TokenFloor | None:
        """The renderer's lower bounds on token counts, made off the event loop the first time."""
        if not self._floor_known:
            self._floor = await asyncio.to_thread(lambda: self.renderer.floor)
            self._floor_known = True
        return self._floor

    async def chat(self, tree: SessionTree, call: ChatCall, room: int | None = None) -> Plan:
        """`room`: the most tokens the prompt may hold. A request that holds more by the length of
        its text alone raises PromptTooLong before it is rendered (`render.bounds`), and one whose
        rendered text does before it is tokenized."""
        if not call.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        chains = tree.digests.chains(call.messages)
        decision = plan_request(tree, call.messages, chains)
        if room is not None and _request_size(call.messages, call.options.tools) >= INLINE_RENDER_CHARS:
            await self._check_floor(call, decision, room)
        else:
            room = None  # a small request: the bound is not worth its cost
        if call.has_images:  # text-only requests never come here
            return await self._with_images(tree, call, decision, chains, room)
        if isinstance(decision, Fresh):
            return await self._fresh(tree, call, decision, chains[-1], room=room)
        return await self._extend(tree, call, decision, chains, room=room)

    async def _check_floor(self, call: ChatCall, decision: Extend | Fresh, room: int) -> None:
        floor = await self.token_floor()
        if floor is None:
            return
        if isinstance(decision, Fresh):
            least = floor.of_messages(call.messages, call.options.tools)
        else:  # the recorded path, and the new messages' text
            least = decision.node.end + floor.of_messages(call.messages[decision.new_from :], None)
        if least > room:
            raise PromptTooLong(least)

    async def _with_images(
        self,
        tree: SessionTree,
        call: ChatCall,
        decision: Extend | Fresh,
        chains: Sequence[bytes],
        room: int | None = None,
    ) -> Plan:
        """A request whose messages hold images: planned as any other, each new image's placeholder
        expanded once by the model's processor; a request that differs from a recorded history only
        in an earlier image is a rewrite (`image_changed`) under the session's policy."""
        vision = self.renderer.vision
        if vision is None:
            raise InvalidRequest("this model has no vision: images are not taken", param="messages")
        shape = images.shape_chains(call.messages)
        if isinstance(decision, Fresh) and decision.fork_from is None:
            node, covered = tree.locate_shape(shape)
            if node is not None:
                rewrite = Rewrite(
                    kind="image_changed",
                    policy=tree.policy,
                    at_message=images.first_image_message(call.messages, covered),
                    at_token=None,
                    detail="an image of the recorded history differs from the image that was sent",
                )
                decision = Extend(node, covered, rewrite) if settle_rewrite(rewrite) == "keep" else Fresh(node, rewrite)
        expand = images.Expansion(vision, call.images, self.image_reader, tree.images)
        if isinstance(decision, Fresh):
            plan = await self._fresh(tree, call, decision, chains[-1], expand, room)
        else:
            plan = await self._extend(tree, call, decision, chains, expand, room)
        return dataclasses.replace(plan, shape_chain=shape[-1])

    async def _extend(
        self,
        tree: SessionTree,
        call: ChatCall,
        decision: Extend,
        chains: Sequence[bytes],
        expand: images.Expansion | None = None,
        room: int | None = None,
    ) -> Plan:
        node = decision.node
        whole = self.renderer.renders_whole(call.messages, call.options)
        if whole is None:  # the first bridge under these settings probes the template (tens of ms)
            size = INLINE_RENDER_CHARS
        elif whole:  # a template with state across messages renders the whole conversation
            size = _request_size(call.messages, call.options.tools)
        else:  # the anchor
            anchored = [call.messages[0], *call.messages[max(1, decision.new_from - 2) :]]
            size = _request_size(anchored, call.options.tools)
        bridge = await _render(
            size,
            self.renderer.bridge,
            call.messages,
            decision.new_from - 1,
            node.reply,
            self._stop_token(node),
            call.options,
            RenderOptions.of(node.template_inputs),  # the history was rendered with these
            None if room is None else room - node.end,
        )
        rewrite = decision.rewrite
        if bridge.template_rewrite:
            rewrite = Rewrite(
                kind="template",
                policy=tree.policy,
                at_message=decision.new_from - 1,
                at_token=None,
                detail=bridge.detail,
            )
            if settle_rewrite(rewrite) == "fork":
                return await self._fresh(tree, call, Fresh(node, rewrite), chains[-1], expand, room)
        tokens = bridge.tokens
        runs: tuple[ImageRun, ...] = ()
        recorded: tuple[ImageRun, ...] = ()
        if expand is not None:  # the new messages' images, expanded once; the recorded ones stay as they are
            expand.check_sampled(node)
            tokens, runs = await expand(bridge.tokens, call.messages[decision.new_from :], node.end)
            recorded = tuple(path_images(node))
        turn = NewTurn(node, node.end, tuple(tokens), Origin.BRIDGE, rewrite, runs)
        mode = self._reply_mode(call, bridge.opens_reasoning)
        prompt = PromptIds(node.path_array())  # its JSON is written once, for the engine and the response
        prompt.extend(tokens)
        buffer = node.path_buffer()
        if buffer is not None:  # its JSON starts from the session's previous prompt's
            prompt.on_path(tree.prompt_text, buffer, node.end)
        inputs = call.options.inputs()
        return Plan(turn, prompt, chains[-1], len(chains), mode, template_inputs=inputs, images=(*recorded, *runs))

    async def _fresh(
        self,
        tree: SessionTree,
        call: ChatCall,
        decision: Fresh,
        chain: bytes,
        expand: images.Expansion | None = None,
        room: int | None = None,
    ) -> Plan:
        size = _request_size(call.messages, call.options.tools)
        prompt = await _render(size, self.renderer.prompt, call.messages, call.options, room)
        tokens, count = prompt.tokens, len(call.messages)
        runs: tuple[ImageRun, ...] = ()
        if expand is not None:
            tokens, runs = await expand(tokens, call.messages, 0)
        mode = self._reply_mode(call, prompt.opens_reasoning)
        inputs = call.options.inputs()
        if decision.fork_from is None:  # its JSON is written once, and the session keeps it (`_record`)
            turn = NewTurn(None, 0, tuple(tokens), Origin.PROMPT, None, runs)
            return Plan(turn, FirstPromptIds(tokens), chain, count, mode, template_inputs=inputs, images=runs)
        parent, shared = tree.fork_point(decision.fork_from, tokens, runs)
        rewrite = decision.rewrite
        if rewrite is not None:
            rewrite = dataclasses.replace(rewrite, at_token=shared)
        own = tuple(run for run in runs if run.start >= shared)
        turn = NewTurn(parent, shared, tuple(tokens[shared:]), Origin.PROMPT, rewrite, own)
        return Plan(turn, tokens, chain, count, mode, template_inputs=inputs, images=runs)

    def _reply_mode(self, call: ChatCall, opens_reasoning: bool) -> ReplyMode:
        tool_format = self.renderer.tool_format if call.parse_tool_calls else "none"
        return ReplyMode(tool_format, self.renderer.reasoning, opens_reasoning)

    def _stop_token(self, node: TurnNode) -> int | None:
        """The end-of-turn token a turn ended on, if it ended on one."""
        last = node.last_sampled
        return last if last in self._end_of_turn else None

    async def completion_prompt(self, prompt: str | Sequence[int], room: int | None = None) -> list[int]:
        """A completion's prompt as token IDs (text is tokenized; IDs are checked against the vocabulary).
        `room`: the most tokens it may hold; a text longer by its length alone raises PromptTooLong
        before it is tokenized."""
        if isinstance(prompt, str):
            floor = await self.token_floor() if room is not None and len(prompt) >= INLINE_RENDER_CHARS else None
            if floor is not None and room is not None and floor.of_text(prompt) > room:
                raise PromptTooLong(floor.of_text(prompt))
            tokens = await asyncio.to_thread(self.renderer.encode_prompt_text, prompt)
        else:
            tokens = list(prompt)
            vocab = self.renderer.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in tokens):
                raise InvalidRequest(f"prompt token IDs must be between 0 and {vocab - 1}", param="prompt")
        if not tokens:
            raise InvalidRequest("the prompt is empty", param="prompt")
        return tokens

    def completion(self, tree: SessionTree, prompt: list[int]) -> Plan:
        """Inside a session a raw completion extends the branch its token prompt starts with, and
        carries that branch's images to the engine. An image placeholder outside every recorded run
        would reach the engine with no image behind it: refused (images come in chat messages)."""
        parent = deepest_prefix_node(tree.nodes, prompt)
        keep = parent.end if parent is not None else 0
        recorded = tuple(path_images(parent)) if parent is not None else ()
        vision = self.renderer.vision
        stray = images.stray_placeholder(prompt, vision.vision_token_ids if vision else frozenset(), recorded)
        if stray is not None:
            raise InvalidRequest(
                f"prompt token {stray} ({prompt[stray]}) is an image placeholder with no image behind it: "
                "images come in chat messages, and a completion may only continue their recorded runs",
                param="prompt",
                code="placeholder_without_image",
            )
        turn = NewTurn(parent, keep, tuple(prompt[keep:]), Origin.PROMPT, None)
        # Token prompts have no message history; a placeholder chain keeps them out of chat matching.
        chain = chain_step(EMPTY_CHAIN, {"role": "_completion", "content": prompt})
        return Plan(turn, prompt, chain, 1, images=recorded)


INLINE_RENDER_CHARS = 16_384  # renders of less text than this take well under a millisecond


async def _render(size: int, fn: Callable[..., _T], *args: Any) -> _T:
    """Render on the event loop when the text is small: a hop to a worker thread and back costs more
    CPU than the render itself; large renders go to a thread so other requests are not held up."""
    if size < INLINE_RENDER_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


TOOL_CHARS = 256  # what one tool counts for in `_request_size` (its JSON is not measured: that costs as much)


def _request_size(messages: Sequence[Message], tools: Sequence[Any] | None) -> int:
    """About how much text rendering `messages` and `tools` handles, in characters."""
    return _text_size(messages) + TOOL_CHARS * len(tools or ())


def _text_size(messages: Sequence[Message]) -> int:
    """About how much text rendering `messages` handles (content and tool calls, in characters)."""
    size = 0
    for message in messages:
        content = message.get("content")
        size += len(content) if isinstance(content, str) else len(str(content or ""))
        if message.get("tool_calls"):
            size += len(str(message["tool_calls"]))
    return size


def deepest_prefix_node(nodes: Sequence[TurnNode], prompt: Sequence[int]) -> TurnNode | None:
    """The most recent turn whose whole path is a prefix of `prompt`."""
    for node in reversed(nodes):
        if node.end <= len(prompt) and path_tokens(node) == list(prompt[: node.end]):
            return node
    return None
