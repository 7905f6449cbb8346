"""OpenRLHF's agent executor through tokentape, driven as OpenRLHF drives it: the agent file is loaded
as its trainer loads it, `execute` gets a vLLM-shaped `llm_engine` (the embedded model behind vLLM's
`generate`/`RequestOutput` shape, an instrument: vLLM needs a GPU build). The result is compared with
the calls the engine saw, with tokentape's export, and with OpenRLHF's own `MultiTurnAgentExecutor`
given the same model outputs for the same episode."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers

from tests.integrations.openrlhf_agents import FEEDBACK
from tests.integrations.vllm_shape import Call, EmbeddedLLM, NoTorchTokenizer, ReplayLLM, SamplingParams
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.integrations.openrlhf import executor_base
from tokentape.render.tokenizer import GGUFTokenizer

AgentExecutorBase = executor_base()  # openrlhf/utils/agent.py, loaded without torch
agent_module = importlib.import_module("openrlhf.utils.agent")
MAX_LENGTH = 1024

AGENT_FILE = """from tokentape.integrations.openrlhf import agent_executor
AgentExecutor = agent_executor("tests.integrations.openrlhf_agents:{name}")
"""


def load_agent_file(path: Path) -> Any:
    """What OpenRLHF's `_load_agent_executor` does with `--train.agent_func_path` (its module also
    imports vllm and ray, so the same steps are written out here)."""
    spec = importlib.util.spec_from_file_location("agent_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert issubclass(module.AgentExecutor, AgentExecutorBase)
    return module.AgentExecutor()


@pytest.fixture(scope="module")
def hf_tokenizer(hf_dir: Path) -> NoTorchTokenizer:
    return NoTorchTokenizer(transformers.AutoTokenizer.from_pretrained(str(hf_dir)))


def _executor(tmp_path: Path, name: str) -> Any:
    path = tmp_path / f"{name}_file.py"
    path.write_text(AGENT_FILE.format(name=name))
    return load_agent_file(path)


def _check_against_calls(result: dict[str, Any], calls: list[Call]) -> None:
    """Every action range is one engine call: the observation up to it was that call's prompt, the
    range holds its output, its logprobs sit there and 0.0 everywhere else."""
    obs, logprobs = result["observation_tokens"], result["rollout_log_probs"]
    expected = [0.0] * len(obs)
    for start, end in result["action_ranges"]:
        matching = [c for c in calls if c.prompt == obs[:start] and c.output.token_ids == obs[start:end]]
        assert matching, f"no engine call made the action at {start}:{end}"
        call = matching[0]  # n samples of one prompt can make the same call (a scripted first turn)
        expected[start:end] = [call.output.logprobs[i][t].logprob for i, t in enumerate(obs[start:end])]
    assert result["action_ranges"][-1][1] == len(obs)
    assert logprobs == expected


def _check_against_export(result: dict[str, Any], export: dict[str, Any]) -> None:
    (row,) = [r for r in export["data"] if r["observation_tokens"] == result["observation_tokens"]]
    assert [tuple(r) for r in row["action_ranges"]] == result["action_ranges"]
    assert row["rollout_log_probs"] == result["rollout_log_probs"]
    assert row["truncated"] == result["truncated"] and row["reward"] == result["reward"]


async def test_the_agent_file_matches_openrlhfs_own_multi_turn_executor(
    tmp_path: Path, engine: LlamaCppEngine, tokenizer: GGUFTokenizer, hf_tokenizer: NoTorchTokenizer
) -> None:
    question, label = "What is the capital of France? Answer in one short sentence.", "Paris"
    # every turn ends on its close within its budget, whatever the model samples: the environment
    # below writes the follow-up after a sampled close, as OpenRLHF's own environments do
    (turn_end,) = tokenizer.encode("<|im_end|>")
    llm = EmbeddedLLM(engine, tokenizer, grammar='root ::= [A-Za-z ,]{1,24} "."', close=turn_end)
    executor = _executor(tmp_path, "feedback_agent")
    ours = await executor.execute(
        question, label, SamplingParams(temperature=0.0, logprobs=0), MAX_LENGTH, hf_tokenizer, llm
    )
    assert len(llm.calls) == len(FEEDBACK) + 1  # each call ends on its close or at max_tokens, as sampled
    assert ours["observation_tokens"] == llm.calls[-1].prompt + llm.calls[-1].output.token_ids
    assert all(call.output.token_ids[-1] == turn_end for call in llm.calls)
    for call in llm.calls:  # vLLM is told to stop at the turn's end and to stay within max_length
        assert call.params is not None and turn_end in (call.params.stop_token_ids or ())
        assert call.params.max_tokens is not None and len(call.prompt) + call.params.max_tokens <= MAX_LENGTH
    _check_against_calls(ours, llm.calls)
    export = await executor.gateway.export(ours["session_id"], format="openrlhf")
    _check_against_export(ours, export)

    class Feedback(agent_module.AgentInstanceBase):  # type: ignore[misc, name-defined]
        """The same episode as an OpenRLHF environment: it renders the follow-ups as text itself."""

        def __init__(self) -> None:
            self.messages: list[dict[str, str]] = []

        async def reset(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
            self.messages = [{"role": "user", "content": states["observation"]}]
            text = hf_tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
            return {"observation": text}

        async def step(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
            self.messages.append({"role": "assistant", "content": states["action_text"]})
            turn = sum(m["role"] == "assistant" for m in self.messages) - 1
            if turn == len(FEEDBACK):
                reward = 1.0 if label.lower() in states["action_text"].lower() else 0.0
                return {"rewards": np.float64(reward), "environment_feedback": "", "done": True}
            before = hf_tokenizer.apply_chat_template(self.messages, tokenize=False)
            self.messages.append({"role": "user", "content": FEEDBACK[turn]})
            after = hf_tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
            # the engine sampled the turn's close token; the rest of the close follows it
            feedback = after[len(before) - 1 :]
            return {"rewards": np.float64(0.0), "environment_feedback": feedback, "done": False}

    theirs = await agent_module.MultiTurnAgentExecutor(Feedback).execute(
        question, label, SamplingParams(temperature=0.0, logprobs=0), MAX_LENGTH, hf_tokenizer, ReplayLLM(llm.calls)
    )
    for key in ("observation_tokens", "action_ranges", "rollout_log_probs", "reward", "truncated"):
        assert (key, theirs[key]) == (key, ours[key])


async def test_a_tool_loop_with_n_samples_per_prompt(
    tmp_path: Path, engine: LlamaCppEngine, tokenizer: GGUFTokenizer, hf_tokenizer: NoTorchTokenizer
) -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>'
    llm = EmbeddedLLM(engine, tokenizer, first_reply=tokenizer.encode(call))
    executor = _executor(tmp_path, "tool_agent")
    question = "What is 17 + 25? Use the add tool."
    # OpenRLHF's rollout actor runs n samples of one prompt as concurrent `execute` calls
    results = await asyncio.gather(
        *[
            executor.execute(question, "43", SamplingParams(temperature=0.8, logprobs=0), MAX_LENGTH, hf_tokenizer, llm)
            for _ in range(2)
        ]
    )
    assert len({r["session_id"] for r in results}) == 2
    for result in results:
        assert result["extra_logs"]["tool_calls"] >= 1 and result["extra_logs"]["tokentape_turns"] >= 3
        _check_against_calls(result, llm.calls)
        assert "42" in tokenizer.decode(result["observation_tokens"])  # the tool's answer went back in
        export = await executor.gateway.export(result["session_id"], format="openrlhf")
        _check_against_export(result, export)


async def test_n_choices_inside_an_episode_return_the_branch_of_its_last_turn(
    tmp_path: Path, engine: LlamaCppEngine, tokenizer: GGUFTokenizer, hf_tokenizer: NoTorchTokenizer
) -> None:
    llm = EmbeddedLLM(engine, tokenizer)
    executor = _executor(tmp_path, "sibling_agent")
    params = SamplingParams(temperature=1.0, logprobs=0)
    result = await executor.execute("Describe the sea.", "", params, MAX_LENGTH, hf_tokenizer, llm)
    drafts, last = llm.calls[0], llm.calls[-1]
    assert len(llm.calls) == 3 and llm.calls[1].prompt == drafts.prompt  # two drafts of one prompt, then one more
    assert result["extra_logs"]["tokentape_branches"] == 2
    assert result["observation_tokens"] == last.prompt + last.output.token_ids
    second_draft = llm.calls[1].output.token_ids
    assert last.prompt[len(drafts.prompt) : len(drafts.prompt) + len(second_draft)] == second_draft
    _check_against_calls(result, llm.calls)


async def test_each_call_runs_in_its_own_max_length_and_an_episode_that_fills_it_ends_truncated(
    tmp_path: Path, engine: LlamaCppEngine, tokenizer: GGUFTokenizer, hf_tokenizer: NoTorchTokenizer
) -> None:
    """OpenRLHF passes the trainer's max sequence length on every call: a later, shorter one binds
    (it was the first call's), and a three-turn episode that outgrows it comes back truncated, never
    as an exception out of `execute`."""
    question, label, short = "What is the capital of France? Answer in one short sentence.", "Paris", 90
    params = SamplingParams(temperature=0.0, logprobs=0)
    executor = _executor(tmp_path, "feedback_agent")
    llm = EmbeddedLLM(engine, tokenizer)
    roomy = await executor.execute(question, label, params, MAX_LENGTH, hf_tokenizer, llm)
    assert roomy["extra_logs"]["tokentape_context_full"] == 0.0 and len(llm.calls) == len(FEEDBACK) + 1
    for fresh in (False, True):
        llm = EmbeddedLLM(engine, tokenizer)
        runner = _executor(tmp_path, "feedback_agent") if fresh else executor
        result = await runner.execute(question, label, params, short, hf_tokenizer, llm)
        assert len(result["observation_tokens"]) <= short
        for call in llm.calls:  # every engine call stayed inside this call's max_length
            assert call.params is not None and len(call.prompt) + (call.params.max_tokens or 0) <= short
        assert 1 <= len(llm.calls) <= len(FEEDBACK)  # the episode ended before its last turn
        assert result["truncated"] is True and result["extra_logs"]["tokentape_context_full"] == 1.0
        assert result["reward"] == 0.0
        _check_against_calls(result, llm.calls)
        summary = (await runner.gateway.http.get(f"/sessions/{result['session_id']}")).json()
        assert summary["metadata"]["status"] == "context_full"


async def test_an_episode_whose_first_request_does_not_fit_returns_its_prompt_untrained(
    tmp_path: Path, engine: LlamaCppEngine, tokenizer: GGUFTokenizer, hf_dir: Path, hf_tokenizer: NoTorchTokenizer
) -> None:
    """No turn was recorded, so there is no branch: the sample is the prompt alone, cut to
    `max_length - 1` from the end as OpenRLHF's own executors cut an initial observation, with no
    action, and the episode's status; never an exception out of `execute`."""
    question, tiny = "What is the capital of France? Answer in one short sentence, please.", 8
    params = SamplingParams(temperature=0.0, logprobs=0)
    executor = _executor(tmp_path, "feedback_agent")
    llm = EmbeddedLLM(engine, tokenizer)
    result = await executor.execute(question, "Paris", params, tiny, hf_tokenizer, llm)
    assert llm.calls == []  # the engine was never asked
    hf = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    expected = hf(question, add_special_tokens=False)["input_ids"][-(tiny - 1) :]
    assert result["observation_tokens"] == expected
    assert result["action_ranges"] == [] and result["rollout_log_probs"] == [0.0] * (tiny - 1)
    assert result["truncated"] is True and result["reward"] == 0.0
    assert result["extra_logs"]["tokentape_context_full"] == 1.0 and result["extra_logs"]["tokentape_turns"] == 0
    summary = (await executor.gateway.http.get(f"/sessions/{result['session_id']}")).json()
    assert summary["metadata"]["status"] == "context_full" and summary["turns"] == 0
    # no `logprobs` in the trainer's sampling: none asked for, none returned (0 above asks for the sampled token's)
    bare = await executor.execute(question, "Paris", SamplingParams(temperature=0.0), tiny, hf_tokenizer, llm)
    assert bare["rollout_log_probs"] is None and bare["observation_tokens"] == expected
