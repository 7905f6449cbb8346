"""The Atropos ManagedSession builds its nodes from each reply alone (no export, no detokenizing per
call) and they equal tokentape's export, forks included; an episode that fills the context ends with
status `context_full` instead of an exception out of the environment's call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2
import transformers

from tokentape.client import InProcessGateway
from tokentape.integrations.atropos import TokentapeServerManager
from tokentape.served import Served

FILLER = "one two three four five six seven eight nine ten " * 15  # most of small_built's 256-token context


def _count_requests(local: InProcessGateway) -> list[str]:
    paths: list[str] = []

    async def hook(request: httpx2.Request) -> None:
        paths.append(request.url.path)

    local.http.event_hooks["request"].append(hook)
    return paths


async def test_nodes_come_from_the_replies_and_equal_the_export(built: Served, hf_dir: Path) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    local = InProcessGateway(served=built)
    paths = _count_requests(local)
    sampling: dict[str, Any] = {"max_tokens": 12, "temperature": 1.0}
    try:
        async with TokentapeServerManager(local).managed_server(tokenizer=hf) as managed:
            question = [{"role": "user", "content": "Name a colour."}]
            first = await managed.chat_completion(messages=question, n=2, seed=1, **sampling)
            assert first.choices[0].logprobs is None  # not asked for: not returned, though recorded
            answer = {"role": "assistant", "content": first.choices[0].message.content}
            follow = [*question, answer, {"role": "user", "content": "Another one?"}]
            await managed.chat_completion(messages=follow, seed=2, **sampling)
            # a fork: the same first answer, followed up differently
            fork = [*question, answer, {"role": "user", "content": "And a fruit?"}]
            await managed.chat_completion(messages=fork, seed=3, logprobs=True, **sampling)
            assert not [p for p in paths if "export" in p or "detokenize" in p]  # each call read its reply only
            nodes = managed.get_state()["nodes"]
            await managed.set_scores([0.1 * i for i in range(len(nodes))])
        export = await local.export(managed.session_id)
        branches = sorted(export["branches"], key=lambda b: b["turn_ids"])
        assert len(nodes) == len(branches) == 3
        for node, branch in zip(nodes, branches, strict=True):
            assert node.tokens == branch["tokens"]
            assert node.masked_tokens == [
                t if m else -100 for t, m in zip(branch["tokens"], branch["loss_mask"], strict=True)
            ]
            assert node.logprobs == [1.0 if lp is None else lp for lp in branch["logprobs"]]
            assert node.full_text == hf.decode(branch["tokens"])
        assert sorted(b["reward"] for b in branches) == [0.0, 0.1, 0.2]
    finally:
        await local.aclose()


async def test_an_episode_that_fills_the_context_ends_with_its_status(small_built: Served) -> None:
    local = InProcessGateway(served=small_built)
    try:
        # no tokenizer given: full_text is the gateway's, detokenized a call's new tokens at a time
        async with TokentapeServerManager(local).managed_server() as managed:
            messages: list[dict[str, Any]] = [{"role": "user", "content": FILLER}]
            replies = []
            for _ in range(4):
                reply = await managed.chat_completion(messages=messages, max_tokens=200, temperature=0.0)
                replies.append(reply)
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": "Go on."},
                ]
            assert managed.status == "context_full"
            assert replies[0].choices[0].finish_reason == "length"  # clipped to the room left
            assert [r.choices[0].message.content for r in replies[1:]] == ["", "", ""]
            (node,) = managed.get_state()["nodes"]
            assert node.metadata["status"] == "context_full"
            assert len(node.tokens) == small_built.gateway.engine.context_length
            whole = await local.detokenize(node.tokens)
            assert node.full_text == whole
            await managed.set_scores([0.0])
        summary = (await local.http.get(f"/sessions/{managed.session_id}")).json()
        assert summary["metadata"]["status"] == "context_full" and summary["turns"] == 1
    finally:
        await local.aclose()


async def test_an_episode_whose_first_request_does_not_fit_has_no_node_and_its_status(small_built: Served) -> None:
    local = InProcessGateway(served=small_built)
    try:
        async with TokentapeServerManager(local).managed_server() as managed:
            messages = [{"role": "user", "content": FILLER * 2}]  # past the context alone
            reply = await managed.chat_completion(messages=messages, n=2, max_tokens=8)
            assert [(c.finish_reason, c.message.content) for c in reply.choices] == [("length", "")] * 2
            assert managed.status == "context_full" and managed.get_state()["nodes"] == []
            again = await managed.completion(prompt="Go on.", max_tokens=8)
            assert [c.text for c in again.choices] == [""]  # the episode has ended
            await managed.set_scores([])
        summary = (await local.http.get(f"/sessions/{managed.session_id}")).json()
        assert summary["metadata"]["status"] == "context_full" and summary["turns"] == 0
    finally:
        await local.aclose()
