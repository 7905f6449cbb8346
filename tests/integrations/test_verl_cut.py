"""A compacted history cut at `response_length` through verl's own worker: the room each server call
gets is counted from the episode's first prompt, but the output is the compacted branch from its own
first sampled token, so a compacted branch shorter in prompt than the first can hold more response
than verl keeps. When the cut drops tokens of the agent's last turn, the episode ends `truncated`:
trained (mask and logprobs as sampled), rewarded `overflow_reward`, not the agent's reward.

The server manager answers every call with scripted tokens (`tests.integrations.test_verl`'s
instrument with a script for all calls); the expectations come from its record of calls alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from omegaconf import OmegaConf
from verl.experimental.agent_loop import agent_loop as verl_loop
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

from tests.integrations.test_verl import EmbeddedServers, _batch, _config, _expected, _row, _worker
from tokentape.render.tokenizer import GGUFTokenizer

LONG_SYSTEM = "You answer questions. " * 20  # the first prompt: longer than the compacted one by far
TURN = 12  # tokens each call may sample
AGENT_REWARD = 1.0


async def compacting_agent(client: openai.AsyncOpenAI, prompt: list[dict[str, Any]]) -> float:
    """One turn under a long system prompt, then the history compacted to the question alone and two
    turns on it: the last turn (the one the reward is for) on the compacted branch."""
    model = (await client.models.list()).data[0].id
    first = [{"role": "system", "content": LONG_SYSTEM}, *prompt]
    await client.chat.completions.create(model=model, messages=first, max_tokens=TURN)
    messages: list[Any] = list(prompt)
    answer = await client.chat.completions.create(model=model, messages=messages, max_tokens=TURN)
    messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""}]
    messages += [{"role": "user", "content": "Go on."}]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=TURN)
    return AGENT_REWARD


def _scripted(tokenizer: GGUFTokenizer) -> Any:
    words = tokenizer.encode(" ".join(["yes"] * 40))
    (turn_end,) = tokenizer.encode("<|im_end|>")

    def script(servers: EmbeddedServers, request_id: str, prompt_ids: list[int]) -> Any:
        n = min(TURN, int(servers.pending_max_tokens))
        tokens = [*words[: n - 1], turn_end]
        return tokens, [-0.25] * len(tokens), "completed"

    return script


class Servers(EmbeddedServers):
    """The recording instrument, its script told the call's max_tokens (a server never passes it)."""

    async def generate(self, request_id: str, **kwargs: Any) -> Any:
        self.pending_max_tokens = kwargs["sampling_params"]["max_tokens"]
        return await super().generate(request_id, **kwargs)


async def _run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: GGUFTokenizer, verl_tokenizer: Any, response: int
) -> tuple[Any, Servers]:
    config = _config(response_length=response)
    servers = Servers(None, script=_scripted(tokenizer))  # type: ignore[arg-type]
    worker = _worker(config, servers, verl_tokenizer)
    batch = _batch(tmp_path, verl_tokenizer, config, ("What is 17 plus 25?",))
    monkeypatch.setenv("TOKENTAPE_AGENT", f"{__name__}:compacting_agent")
    entry = verl_loop._agent_loop_registry["tokentape_agent"]
    verl_loop._agent_loop_registry["tokentape_agent"] = OmegaConf.merge(entry, {"overflow_reward": -1.0})
    try:
        out = await AgentLoopWorker.generate_sequences(worker, batch)
    finally:
        verl_loop._agent_loop_registry["tokentape_agent"] = entry
    return out, servers


@pytest.fixture(scope="module")
def verl_tokenizer(hf_dir: Path) -> Any:
    from verl.utils.tokenizer import hf_tokenizer

    return hf_tokenizer(str(hf_dir))


async def test_a_compacted_branch_cut_inside_its_last_turn_ends_truncated_with_the_overflow_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: GGUFTokenizer, verl_tokenizer: Any
) -> None:
    response = 2 * TURN  # the compacted branch's two turns and the bridge between them need more
    out, servers = await _run(tmp_path, monkeypatch, tokenizer, verl_tokenizer, response)
    first, compact_a, compact_b = servers.calls
    assert len(compact_a.prompt_ids) < len(first.prompt_ids)  # the compacted prompt is the shorter
    # the record alone: the compacted branch, from its first sampled token, passes response_length
    # inside the last call's tokens
    start = len(compact_a.prompt_ids)
    last_end = len(compact_b.prompt_ids) + len(compact_b.output.token_ids)
    assert start + response < last_end
    want = _expected([compact_a, compact_b], response)
    prompt, got, mask, logprobs = _row(out, 0)
    assert (prompt, got, mask) == (want.prompt, want.response, want.mask)
    assert any(mask) and logprobs == want.logprobs  # trained: what it kept of the sampled turns
    assert out.non_tensor_batch["tokentape_status"][0] == "truncated"
    assert out.non_tensor_batch["tokentape_truncated"][0]
    rewards = out.batch["rm_scores"][0]
    assert rewards[len(got) - 1] == -1.0 and float(rewards.sum()) == -1.0  # not the agent's 1.0


async def test_a_compacted_branch_kept_whole_keeps_the_agents_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: GGUFTokenizer, verl_tokenizer: Any
) -> None:
    out, servers = await _run(tmp_path, monkeypatch, tokenizer, verl_tokenizer, 256)
    _, compact_a, compact_b = servers.calls
    want = _expected([compact_a, compact_b], 256)
    prompt, got, mask, _ = _row(out, 0)
    assert (prompt, got, mask) == (want.prompt, want.response, want.mask)
    assert out.non_tensor_batch["tokentape_status"][0] == "done"
    assert not out.non_tensor_batch["tokentape_truncated"][0]
    assert out.batch["rm_scores"][0][len(got) - 1] == AGENT_REWARD


def test_only_a_cut_inside_the_last_sampled_turn_counts() -> None:
    """The boundary, on a branch made here: the last turn's sampled tokens end at position 10; a cut
    there or later keeps the turn (tokens after it under mask 0 may go), a cut before it does not."""
    from tokentape.integrations.verl import TokentapeAgentLoop

    branch = {
        "tokens": list(range(12)),
        "loss_mask": [0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0],
        "logprobs": [None, None, -0.1, -0.1, None, None, -0.2, -0.2, -0.2, -0.2, None, None],
        "versions": [-1, -1, 1, 1, -1, -1, 1, 1, 1, 1, -1, -1],
        "action_ranges": [[2, 4], [6, 10]],
    }
    loop = object.__new__(TokentapeAgentLoop)
    loop.prompt_length = 64
    for response, cut in ((10, False), (8, False), (7, True), (2, True)):  # the response starts at 2
        loop.response_length = response
        assert loop._cuts_last_turn(branch) is cut, response
    loop.response_length = 1
    assert not loop._cuts_last_turn({**branch, "action_ranges": []})  # nothing sampled: nothing to cut
