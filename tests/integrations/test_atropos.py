"""An Atropos environment (atroposlib's own BaseEnv) collecting a two-turn group with n=2 through
tokentape: the ScoredDataGroup it writes equals tokentape's export, token for token, and each
sequence is exactly what the engine was given and sampled."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import transformers

from tests.conftest import MODEL_NAME
from tokentape.client import InProcessGateway
from tokentape.engines.scripted import ScriptedEngine
from tokentape.integrations.atropos import TokentapeServerManager, scored_data_group
from tokentape.render.renderer import Renderer
from tokentape.served import Served, ServeSpec

GROUP = "colours-0"


async def two_turns(managed: Any, item: dict[str, str], n: int) -> list[Any]:
    """The episode: ask with n choices, follow each choice up once. Returns every reply, in order."""
    question = [{"role": "user", "content": item["question"]}]
    sampling = {"max_tokens": 20, "temperature": 1.0, "logprobs": True}
    first = await managed.chat_completion(messages=question, n=n, seed=3, **sampling)
    replies = [first]
    for choice in first.choices:
        history = [
            *question,
            {"role": "assistant", "content": choice.message.content},
            {"role": "user", "content": item["follow_up"]},
        ]
        replies.append(await managed.chat_completion(messages=history, seed=5, **sampling))
    return replies


@pytest.fixture(scope="module")
def two_turn_env() -> type[Any]:
    """The environment class, defined when its test runs: atroposlib's BaseEnv imports wandb, torch
    and transformers' model configs (seconds), which every worker's collection would otherwise pay."""
    from atroposlib.envs.base import BaseEnv

    class TwoTurnEnv(BaseEnv):  # type: ignore[misc]
        """Ask, let each of n=2 answers be followed up once, score each trajectory."""

        name = "tokentape_two_turn"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.replies: list[Any] = []  # every ChatCompletion the environment received, in order

        async def setup(self) -> None:
            return None

        async def evaluate(self, *args: Any, **kwargs: Any) -> None:
            return None

        async def get_next_item(self) -> dict[str, str]:
            return {"question": "Name a colour.", "follow_up": "Now name another one."}

        async def collect_trajectories(self, item: dict[str, str]) -> tuple[dict[str, Any], list[Any]]:
            async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
                self.replies = await two_turns(managed, item, self.config.group_size)
                nodes = managed.get_state()["nodes"]
                scores = [sum(m != -100 for m in node.masked_tokens) / len(node.tokens) for node in nodes]
                await managed.set_scores(scores)
            return scored_data_group(nodes, scores), []

    return TwoTurnEnv


def _logprobs(choice: Any) -> list[float]:
    return [entry.logprob for entry in choice.logprobs.content]


async def test_an_atropos_environment_collects_its_group_through_tokentape(
    built: Served, hf_dir: Path, tmp_path: Path, two_turn_env: type[Any]
) -> None:
    from atroposlib.envs.base import BaseEnvConfig
    from atroposlib.envs.server_handling.server_baseline import ServerBaseline

    saved = tmp_path / "groups.jsonl"
    config = BaseEnvConfig(
        tokenizer_name=str(hf_dir),
        group_size=2,
        use_wandb=False,
        data_path_to_save_groups=str(saved),
        ensure_scores_are_not_same=False,
    )
    env = two_turn_env(config, ServerBaseline(), testing=True)
    local = InProcessGateway(served=built)
    env.server = TokentapeServerManager(local, group_id=GROUP)
    env.max_token_len = 1024
    try:
        item = await env.get_next_item()
        group, backlog = await env.collect_trajectories(item)
        group = await env.postprocess_histories(group)
        await env.handle_send_to_api(group, item, do_send_to_api=False)  # Atropos validates and writes it
        env.jsonl_writer.close()

        # What each sequence must be, from the replies alone: first prompt, first answer as sampled,
        # the bridge to the follow-up (masked), the second answer as sampled.
        first, *seconds = env.replies
        assert len(seconds) == 2 and backlog == []
        expected_tokens, expected_masks, expected_logprobs = [], [], []
        for choice, second in zip(first.choices, seconds, strict=True):
            answer, follow = choice.token_ids, second.choices[0].token_ids
            head = first.prompt_token_ids + answer
            assert second.prompt_token_ids[: len(head)] == head  # the first answer was not re-tokenized
            bridge = len(second.prompt_token_ids) - len(head)
            expected_tokens.append(second.prompt_token_ids + follow)
            expected_masks.append([-100] * len(first.prompt_token_ids) + answer + [-100] * bridge + follow)
            expected_logprobs.append(
                [1.0] * len(first.prompt_token_ids) + _logprobs(choice) + [1.0] * bridge + _logprobs(second.choices[0])
            )
        assert group["tokens"] == expected_tokens
        assert group["masks"] == expected_masks
        assert len(group["inference_logprobs"]) == len(expected_logprobs)
        for row, expected in zip(group["inference_logprobs"], expected_logprobs, strict=True):
            assert row == pytest.approx(expected, abs=1e-9)

        # What Atropos wrote is tokentape's own export of the group, token for token.
        (written,) = [json.loads(line) for line in saved.read_text().splitlines()]
        (exported,) = (await local.export_all(format="atropos", group_id=GROUP))["data"]
        for key in ("tokens", "masks", "inference_logprobs", "scores"):
            assert written[key] == exported[key], key
        assert written["scores"] == group["scores"]
    finally:
        await local.aclose()


class ReplayServer:
    """Stands where atroposlib's APIServer stands under its ManagedServer: answers each call with
    what tokentape's engine sampled for the same call of the same episode, whatever the prompt."""

    def __init__(self, replies: list[Any]) -> None:
        self.config = SimpleNamespace(model_name=MODEL_NAME)
        self.replies = list(replies)
        self.prompts: list[list[int]] = []

    async def tokens_and_logprobs_completion(self, **kwargs: Any) -> tuple[Any, ...]:
        self.prompts.append(list(kwargs["input_ids"]))
        reply = self.replies.pop(0)
        tokens = [c.token_ids for c in reply.choices]
        logprobs = [_logprobs(c) for c in reply.choices]
        return kwargs["input_ids"], tokens, logprobs, [c.finish_reason for c in reply.choices]


async def test_atroposlibs_own_managed_server_doubles_the_close_where_tokentape_does_not(
    renderer: Renderer, hf_dir: Path
) -> None:
    """The same episode and the same sampled tokens through atroposlib's ManagedServer: its text
    matching re-renders the end-of-turn token the model already sampled. The engine is scripted so
    that one choice samples its close and the other is cut by max_tokens, on any machine."""
    from atroposlib.envs.server_handling.managed_server import ManagedServer

    hf = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    item = {"question": "Name a colour.", "follow_up": "Now name another one."}
    (close,) = hf.encode("<|im_end|>", add_special_tokens=False)
    engine = ScriptedEngine([], close)
    words = renderer.tokenizer.encode
    engine.push([*words("Red."), close])  # choice 0 ends on the close it sampled
    engine.push(words(" ".join(["Blue, like the sky and the deep sea"] * 4)))  # choice 1: cut by max_tokens
    engine.push([*words("Green."), close])
    engine.push([*words("Yellow."), close])
    local = InProcessGateway(ServeSpec(served_model_name=MODEL_NAME), engine=engine, renderer=renderer)
    try:
        async with TokentapeServerManager(local).managed_server(tokenizer=hf) as ours:
            replies = await two_turns(ours, item, 2)
            our_nodes = ours.get_state()["nodes"]
    finally:
        await local.aclose()
    server = ReplayServer(replies)
    theirs = ManagedServer(server, tokenizer=hf)
    await two_turns(theirs, item, 2)
    their_nodes = theirs.get_state()["nodes"]

    first = replies[0]
    assert server.prompts[0] == first.prompt_token_ids  # the first prompt is the same render
    assert len(their_nodes) == len(our_nodes) == 2
    for choice, second, ours_node, their_node in zip(first.choices, replies[1:], our_nodes, their_nodes, strict=True):
        head = first.prompt_token_ids + choice.token_ids
        follow = second.choices[0].token_ids
        our_bridge = second.prompt_token_ids[len(head) :]
        assert ours_node.tokens == head + our_bridge + follow
        assert their_node.tokens[: len(head)] == head and their_node.tokens[-len(follow) :] == follow
        their_bridge = their_node.tokens[len(head) : len(their_node.tokens) - len(follow)]
        if choice.token_ids[-1] == close:  # the model sampled the close: atroposlib renders it again
            assert their_bridge == [close, *our_bridge]
        else:  # cut by max_tokens: both render the close
            assert their_bridge == our_bridge
        # the masks agree on what was sampled; only the extra close differs
        assert [t for t in their_node.masked_tokens if t != -100] == [t for t in ours_node.masked_tokens if t != -100]
    assert sorted(c.finish_reason for c in first.choices) == ["length", "stop"]  # both cases compared
