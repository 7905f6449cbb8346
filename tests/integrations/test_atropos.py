"""An Atropos environment (atroposlib's own BaseEnv) collecting a two-turn group with n=2 through
tokentape: the ScoredDataGroup it writes equals tokentape's export, token for token, and each
sequence is exactly what the engine was given and sampled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from atroposlib.envs.base import BaseEnv, BaseEnvConfig
from atroposlib.envs.server_handling.server_baseline import ServerBaseline

from tests.conftest import MODEL_NAME
from tokentape.client import InProcessGateway
from tokentape.gateway.service import Gateway
from tokentape.integrations.atropos import TokentapeServerManager, scored_data_group

GROUP = "colours-0"


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
        question = [{"role": "user", "content": item["question"]}]
        sampling = {"max_tokens": 12, "temperature": 1.0, "logprobs": True}
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            first = await managed.chat_completion(messages=question, n=self.config.group_size, seed=3, **sampling)
            self.replies.append(first)
            for choice in first.choices:
                history = [
                    *question,
                    {"role": "assistant", "content": choice.message.content},
                    {"role": "user", "content": item["follow_up"]},
                ]
                self.replies.append(await managed.chat_completion(messages=history, seed=5, **sampling))
            nodes = managed.get_state()["nodes"]
            scores = [sum(m != -100 for m in node.masked_tokens) / len(node.tokens) for node in nodes]
            await managed.set_scores(scores)
        return scored_data_group(nodes, scores), []


def _logprobs(choice: Any) -> list[float]:
    return [entry.logprob for entry in choice.logprobs.content]


async def test_an_atropos_environment_collects_its_group_through_tokentape(
    gateway: Gateway, hf_dir: Path, tmp_path: Path
) -> None:
    saved = tmp_path / "groups.jsonl"
    config = BaseEnvConfig(
        tokenizer_name=str(hf_dir),
        group_size=2,
        use_wandb=False,
        data_path_to_save_groups=str(saved),
        ensure_scores_are_not_same=False,
    )
    env = TwoTurnEnv(config, ServerBaseline(), testing=True)
    local = InProcessGateway(gateway=gateway, model=MODEL_NAME)
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
