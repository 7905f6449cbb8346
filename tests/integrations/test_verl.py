"""verl's agent loop through tokentape, driven by verl's own classes: rows come from verl's
`RLHFDataset` (a parquet file with a chat `prompt` column), `AgentLoopWorker.generate_sequences`
(called unbound on a bare worker, as verl's CPU tests call its methods) registers `tokentape_agent`
from the YAML the package ships, instantiates it through hydra, runs it and pads the batch.

The server manager is an instrument shaped like verl's `LLMServerClient` (its servers need GPUs):
`generate` samples with the embedded llama.cpp model and answers verl's `TokenOutput`; it records
every call (request id, prompt IDs, sampling parameters, what it returned). Every assertion compares
verl's padded batch with that record, never with a sampled text: the cases the tests are about
(a tool call, a weight sync, an overflow, a failing agent) are scripted or forced."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from verl.experimental.agent_loop import agent_loop as verl_loop
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, DictConfigWrap, ToolListWrap
from verl.protocol import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
from verl.utils.tokenizer import hf_tokenizer
from verl.workers.rollout.replica import TokenOutput

from tokentape.core.sampling import SamplingParams
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.integrations import verl as tape_verl
from tokentape.render.tokenizer import GGUFTokenizer

TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>'
QUESTIONS = ("What is 17 plus 25?", "Name a primary colour.")


@dataclass
class Call:
    request_id: str
    prompt_ids: list[int]
    sampling_params: dict[str, Any]
    output: TokenOutput


Script = Callable[["EmbeddedServers", str, list[int]], tuple[list[int], list[float], str] | None]


class EmbeddedServers:
    """verl's `LLMServerClient.generate`, sampling with the embedded model. `script(servers,
    request_id, prompt_ids)` may answer a call instead (token IDs, logprobs, stop reason). A plain
    class, as verl's is: hydra would turn a dataclass passed to the loop into a config."""

    def __init__(self, engine: LlamaCppEngine, global_steps: int = 0, script: Script | None = None) -> None:
        self.engine, self.global_steps, self.script = engine, global_steps, script
        self.calls: list[Call] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        sp = dict(sampling_params)
        answer = self.script(self, request_id, list(prompt_ids)) if self.script else None
        if answer is None:
            params = SamplingParams(
                max_tokens=sp["max_tokens"],
                temperature=sp["temperature"],
                top_p=sp["top_p"],
                top_k=max(sp["top_k"], 0),
                stop_token_ids=tuple(sp["stop_token_ids"]),
            )
            tokens, logprobs = [], []
            async for sample in self.engine.generate(list(prompt_ids), params, seed=sp.get("seed")):
                tokens.append(sample.token_id)
                logprobs.append(sample.logprob)
            answer = (tokens, logprobs, "completed")
        tokens, logprobs, stop = answer
        steps = self.global_steps  # as LLMServerClient: the server's version, min/max set from it
        extra = {"global_steps": steps, "min_global_steps": steps, "max_global_steps": steps}
        output = TokenOutput(token_ids=tokens, log_probs=logprobs, stop_reason=stop, extra_fields=extra)
        self.calls.append(Call(request_id, list(prompt_ids), sp, output.model_copy(deep=True)))
        return output


@pytest.fixture(scope="module")
def verl_tokenizer(hf_dir: Path) -> Any:
    return hf_tokenizer(str(hf_dir))


def _config(prompt_length: int = 512, response_length: int = 256) -> DictConfig:
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": prompt_length,
                    "response_length": response_length,
                    "temperature": 0.9,
                    "top_p": 0.95,
                    "top_k": 30,
                    "calculate_log_probs": True,
                    "logprobs_mode": "processed_logprobs",
                    "val_kwargs": {"temperature": 0.0, "top_p": 1.0, "top_k": -1},
                    "agent": {"default_agent_loop": "tokentape_agent", "agent_loop_config_path": None},
                    "multi_turn": {"tool_config_path": None},
                },
                "model": {"path": "unused"},
            },
            "data": {"apply_chat_template_kwargs": {}, "prompt_key": "prompt", "return_raw_chat": True},
        }
    )


def _worker(config: DictConfig, servers: EmbeddedServers, tokenizer: Any) -> Any:
    """A bare `AgentLoopWorker` with what its `generate_sequences` reads (its __init__ needs Ray)."""
    worker = object.__new__(AgentLoopWorker)
    worker.config, worker.llm_client, worker.tokenizer = config, servers, tokenizer
    worker.rollout_config = config.actor_rollout_ref.rollout
    worker.processor, worker.hf_model_type, worker.dataset_cls, worker.tools = None, None, RLHFDataset, []
    worker.mm_processor_kwargs, worker.reward_loop_worker_handles, worker.distillation_enabled = {}, None, False
    for entry in OmegaConf.load(tape_verl.CONFIG_PATH):  # what AgentLoopWorker.__init__ does with the YAML
        verl_loop._agent_loop_registry[entry.name] = entry
    return worker


def _batch(
    tmp_path: Path, tokenizer: Any, config: DictConfig, questions: tuple[str, ...], repeat: int = 1
) -> DataProto:
    """Rows as verl's trainer builds them: RLHFDataset over a parquet file, collated, repeated n times."""
    frame = pd.DataFrame(
        {
            "prompt": [[{"role": "user", "content": q}] for q in questions],
            "data_source": ["test"] * len(questions),
            "reward_model": [{"ground_truth": str(i)} for i in range(len(questions))],
            "extra_info": [{"index": i} for i in range(len(questions))],
        }
    )
    path = tmp_path / "rows.parquet"
    frame.to_parquet(path)
    data = OmegaConf.merge(config.data, {"filter_overlong_prompts": False, "cache_dir": str(tmp_path)})
    dataset = RLHFDataset(str(path), tokenizer, data)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    batch = batch.repeat(repeat, interleave=True)
    batch.non_tensor_batch["uid"] = np.array([f"uid-{i // repeat}" for i in range(len(batch))], dtype=object)
    return batch


async def _generate(
    monkeypatch: pytest.MonkeyPatch, worker: Any, batch: DataProto, agent: str, **keys: Any
) -> DataProto:
    monkeypatch.setenv("TOKENTAPE_AGENT", f"tests.integrations.verl_agents:{agent}")
    entry = verl_loop._agent_loop_registry["tokentape_agent"]
    verl_loop._agent_loop_registry["tokentape_agent"] = OmegaConf.merge(entry, keys)
    out: DataProto = await AgentLoopWorker.generate_sequences(worker, batch)
    return out


def _episodes(servers: EmbeddedServers) -> dict[str, list[Call]]:
    calls: dict[str, list[Call]] = {}
    for call in servers.calls:
        calls.setdefault(call.request_id, []).append(call)
    return calls


@dataclass
class Expected:
    prompt: list[int]
    response: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]


def _expected(calls: list[Call], response_length: int) -> Expected:
    """From the server calls alone: the last call's prompt and output are the sequence; each call's
    output sits where its prompt ends (the prompt of a later call extends it), mask 1 there, its
    logprobs and its server's global_steps there."""
    last = calls[-1]
    sequence = last.prompt_ids + list(last.output.token_ids)
    mask, logprobs, versions = [0] * len(sequence), [0.0] * len(sequence), [-1] * len(sequence)
    for call in calls:
        start, tokens = len(call.prompt_ids), list(call.output.token_ids)
        assert sequence[: start + len(tokens)] == call.prompt_ids + tokens, "a call's turn is not on the sequence"
        mask[start : start + len(tokens)] = [1] * len(tokens)
        logprobs[start : start + len(tokens)] = list(call.output.log_probs or ())
        versions[start : start + len(tokens)] = [call.output.extra_fields["global_steps"]] * len(tokens)
    first = len(calls[0].prompt_ids)
    cut = slice(first, first + response_length)
    return Expected(sequence[:first], sequence[cut], mask[cut], logprobs[cut], versions[cut])


def _row(out: DataProto, i: int) -> tuple[list[int], list[int], list[int], list[float]]:
    """Row i of verl's padded batch, its padding taken off by its own attention mask."""
    prompt_width = out.batch["prompts"].shape[1]
    attention = out.batch["attention_mask"][i]
    prompt = out.batch["prompts"][i][attention[:prompt_width].bool()].tolist()
    n = int(attention[prompt_width:].sum())
    assert attention[prompt_width:][:n].all(), "the response is right-padded"
    response = out.batch["responses"][i][:n].tolist()
    assert int(out.batch["response_mask"][i][n:].abs().sum()) == 0
    logprobs = out.batch["rollout_log_probs"][i][:n]
    return prompt, response, out.batch["response_mask"][i][:n].tolist(), logprobs.tolist()


def _check_row(out: DataProto, i: int, calls: list[Call], response_length: int) -> Expected:
    prompt, response, mask, logprobs = _row(out, i)
    want = _expected(calls, response_length)
    assert prompt == want.prompt and response == want.response and mask == want.mask
    assert logprobs == torch.tensor(want.logprobs, dtype=torch.float32).tolist()  # verl keeps float32
    assert list(out.non_tensor_batch["tokentape_versions"][i]) == want.versions
    return want


def _tool_call_first(tokenizer: GGUFTokenizer) -> Script:
    call = tokenizer.encode(TOOL_CALL)

    def script(servers: EmbeddedServers, request_id: str, prompt_ids: list[int]) -> Any:
        if not any(c.request_id == request_id for c in servers.calls):  # an episode's first call
            return call, [-0.5] * len(call), "completed"
        return None

    return script


async def test_the_padded_batch_is_what_the_servers_received_and_sampled(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    engine: LlamaCppEngine,
    tokenizer: GGUFTokenizer,
    verl_tokenizer: Any,
) -> None:
    config = _config()
    servers = EmbeddedServers(engine, global_steps=5, script=_tool_call_first(tokenizer))
    worker = _worker(config, servers, verl_tokenizer)
    batch = _batch(tmp_path, verl_tokenizer, config, QUESTIONS[:1], repeat=2)  # one GRPO group of two
    out = await _generate(monkeypatch, worker, batch, "tool_agent")
    episodes = _episodes(servers)
    assert len(out) == 2 and len(episodes) == 2, out.non_tensor_batch["tokentape_error"]
    assert list(out.non_tensor_batch["uid"]) == ["uid-0", "uid-0"]
    (turn_end,) = tokenizer.encode("<|im_end|>")
    rollout = config.actor_rollout_ref.rollout
    for i in range(len(out)):
        session = out.non_tensor_batch["tokentape_session_id"][i]
        calls = episodes[session]  # the session id is verl's request_id, on every call of the episode
        assert len(calls) == 3 and out.non_tensor_batch["tokentape_status"][i] == "done"
        _check_row(out, i, calls, rollout.response_length)
        for call in calls:  # the trainer's sampling, logprobs asked for, the turn's end a stop
            sp = call.sampling_params
            assert (sp["temperature"], sp["top_p"], sp["top_k"]) == (0.9, 0.95, 30)
            assert sp["logprobs"] is True and turn_end in sp["stop_token_ids"]
            assert 1 <= sp["max_tokens"] <= 24
        assert out.non_tensor_batch["min_global_steps"][i] == out.non_tensor_batch["max_global_steps"][i] == 5
        # the agent's reward (0.25 per tool call it served) sits on the response's last token
        n = int(out.batch["attention_mask"][i][rollout.prompt_length :].sum())
        scores = out.batch["rm_scores"][i]
        assert scores[n - 1] > 0 and int(torch.count_nonzero(scores)) == 1
    assert out.non_tensor_batch["raw_prompt"][0] == [{"role": "user", "content": QUESTIONS[0]}]


async def test_a_weight_sync_between_turns_and_inside_one_shows_in_each_tokens_version(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    engine: LlamaCppEngine,
    tokenizer: GGUFTokenizer,
    verl_tokenizer: Any,
) -> None:
    """global_steps 3 for the first turn, 4 for the second, whose call verl aborts after three tokens
    (its servers pause for a weight sync); resumed under 5, the turn goes on from those tokens."""
    partial = tokenizer.encode("The answer")

    def script(servers: EmbeddedServers, request_id: str, prompt_ids: list[int]) -> Any:
        made = len(servers.calls)
        servers.global_steps = (3, 4, 5)[min(made, 2)]
        return (partial, [-0.25] * len(partial), "aborted") if made == 1 else None

    config = _config()
    servers = EmbeddedServers(engine, script=script)
    worker = _worker(config, servers, verl_tokenizer)
    out = await _generate(
        monkeypatch, worker, _batch(tmp_path, verl_tokenizer, config, QUESTIONS[:1]), "two_turn_agent"
    )
    calls = servers.calls
    assert len(calls) == 3 and len({c.request_id for c in calls}) == 1
    assert calls[2].prompt_ids == calls[1].prompt_ids + partial  # resumed where the abort left it
    assert calls[2].sampling_params["max_tokens"] == calls[1].sampling_params["max_tokens"] - len(partial)
    want = _check_row(out, 0, calls, config.actor_rollout_ref.rollout.response_length)
    assert {v for v in want.versions if v >= 0} == {3, 4, 5}
    assert (out.non_tensor_batch["min_global_steps"][0], out.non_tensor_batch["max_global_steps"][0]) == (3, 5)
    assert "rm_scores" not in out.batch  # the agent gave no reward: verl's reward manager scores it


async def test_preemptions_are_reported_per_sample_each_step(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    engine: LlamaCppEngine,
    tokenizer: GGUFTokenizer,
    verl_tokenizer: Any,
) -> None:
    """Three steps, each with one call aborted by a weight sync and resumed: every step's metrics give
    its sample `num_preempted` 1 (the episode's own), not every resume since the start (1, 2, 3) and
    not verl's "not available" (-1)."""
    partial = tokenizer.encode("The answer")

    def script(servers: EmbeddedServers, request_id: str, prompt_ids: list[int]) -> Any:
        if sum(c.request_id == request_id for c in servers.calls) == 1:  # the episode's second call
            servers.global_steps += 1
            return partial, [-0.25] * len(partial), "aborted"
        return None

    config = _config()
    servers = EmbeddedServers(engine, script=script)
    worker = _worker(config, servers, verl_tokenizer)
    batch = _batch(tmp_path, verl_tokenizer, config, QUESTIONS[:1])
    per_step = []
    for _ in range(3):
        out = await _generate(monkeypatch, worker, batch, "two_turn_agent")
        per_step.append([metrics["num_preempted"] for metrics in out.meta_info["metrics"]])
    assert len(servers.calls) == 9  # three per step: the first turn, the aborted call, its resumption
    assert per_step == [[1]] * 3


async def test_an_episode_past_response_length_ends_context_full_and_is_cut_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: LlamaCppEngine, verl_tokenizer: Any
) -> None:
    config = _config(response_length=40)
    servers = EmbeddedServers(engine)
    worker = _worker(config, servers, verl_tokenizer)
    batch = _batch(tmp_path, verl_tokenizer, config, QUESTIONS[1:])
    out = await _generate(monkeypatch, worker, batch, "long_agent", overflow_reward=-1.0)
    assert out.non_tensor_batch["tokentape_status"][0] == "context_full"
    assert out.non_tensor_batch["tokentape_truncated"][0]
    first = len(servers.calls[0].prompt_ids)
    for call in servers.calls:  # no call asked for more than the response_length left
        assert len(call.prompt_ids) - first + call.sampling_params["max_tokens"] <= 40
    _check_row(out, 0, servers.calls, 40)
    n = int(out.batch["attention_mask"][0][config.actor_rollout_ref.rollout.prompt_length :].sum())
    assert n <= 40 and out.batch["rm_scores"][0][n - 1] == -1.0


async def test_a_first_request_past_the_context_is_the_rendered_prompt_and_one_untrained_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: LlamaCppEngine, verl_tokenizer: Any
) -> None:
    config = _config(prompt_length=8, response_length=8)  # the servers hold 16 tokens: no prompt fits
    servers = EmbeddedServers(engine)
    worker = _worker(config, servers, verl_tokenizer)
    out = await _generate(monkeypatch, worker, _batch(tmp_path, verl_tokenizer, config, QUESTIONS[:1]), "long_agent")
    assert servers.calls == [] and out.non_tensor_batch["tokentape_status"][0] == "context_full"
    prompt, response, mask, logprobs = _row(out, 0)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    rendered = verl_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    rendered = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    assert prompt == list(rendered)[-8:]  # left-truncated to prompt_length, as verl caps a prompt
    assert (response, mask, logprobs) == ([verl_tokenizer.eos_token_id], [0], [0.0])


async def test_a_failing_agent_and_a_refused_request_end_their_episodes_untrained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: LlamaCppEngine, verl_tokenizer: Any
) -> None:
    """Rows choose their loop by `agent_name` (verl's column): one agent raises, one is refused."""
    config = _config()
    servers = EmbeddedServers(engine)
    worker = _worker(config, servers, verl_tokenizer)
    entry = verl_loop._agent_loop_registry["tokentape_agent"]
    refused = OmegaConf.merge(entry, {"agent": "tests.integrations.verl_agents:refused_agent", "error_reward": -0.5})
    verl_loop._agent_loop_registry["tokentape_refused"] = refused
    batch = _batch(tmp_path, verl_tokenizer, config, QUESTIONS)
    batch.non_tensor_batch["agent_name"] = np.array(["tokentape_agent", "tokentape_refused"], dtype=object)
    out = await _generate(monkeypatch, worker, batch, "failing_agent", error_reward=-0.5)
    episodes = _episodes(servers)
    statuses = list(out.non_tensor_batch["tokentape_status"])
    assert statuses == ["error", "refused"]
    assert "KeyError" in out.non_tensor_batch["tokentape_error"][0]
    assert out.non_tensor_batch["tokentape_error"][1] == "invalid_value"
    for i in range(2):
        calls = episodes[out.non_tensor_batch["tokentape_session_id"][i]]
        assert len(calls) == 1  # the refused request reached no server
        prompt, response, mask, logprobs = _row(out, i)
        want = _expected(calls, config.actor_rollout_ref.rollout.response_length)
        assert (prompt, response) == (want.prompt, want.response) and mask == [0] * len(response)
        assert logprobs == [0.0] * len(response)  # off the loss: no logprob, no version for staleness
        assert list(out.non_tensor_batch["tokentape_versions"][i]) == [-1] * len(response)
        assert out.non_tensor_batch["min_global_steps"][i] is None
        assert out.batch["rm_scores"][i][len(response) - 1] == -0.5


async def test_a_dead_server_ends_its_episode_engine_error_or_fails_the_step_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: LlamaCppEngine, verl_tokenizer: Any
) -> None:
    def script(servers: EmbeddedServers, request_id: str, prompt_ids: list[int]) -> Any:
        raise ConnectionError("the Ray actor died")

    config = _config()
    worker = _worker(config, EmbeddedServers(engine, script=script), verl_tokenizer)
    batch = _batch(tmp_path, verl_tokenizer, config, QUESTIONS[:1])
    out = await _generate(monkeypatch, worker, batch, "two_turn_agent", error_reward=-0.5)
    assert out.non_tensor_batch["tokentape_status"][0] == "engine_error"
    assert out.non_tensor_batch["tokentape_error"][0] == "engine_error"
    _, response, mask, _ = _row(out, 0)
    assert mask == [0] * len(response) and out.batch["rm_scores"][0][len(response) - 1] == -0.5
    with pytest.raises(RuntimeError, match=r"server_manager\.generate failed"):
        await _generate(monkeypatch, worker, batch, "two_turn_agent", fail_on_engine_error=True)


async def test_every_branch_is_its_own_output_for_the_transfer_queue_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: LlamaCppEngine, verl_tokenizer: Any
) -> None:
    """n=2 drafts (two server calls with one prompt), a follow-up on the second, then a compacted
    history: three branches, each its own output, the one holding the last turn last."""
    config = _config()
    servers = EmbeddedServers(engine)
    _worker(config, servers, verl_tokenizer)  # registers the shipped YAML
    monkeypatch.setenv("TOKENTAPE_AGENT", "tests.integrations.verl_agents:sibling_and_compacting_agent")
    entry = OmegaConf.merge(verl_loop._agent_loop_registry["tokentape_agent"], {"all_branches": True})
    loop = hydra.utils.instantiate(
        entry,
        trainer_config=DictConfigWrap(config),
        server_manager=servers,
        tokenizer=verl_tokenizer,
        processor=None,
        hf_model_type=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(config.data),
        tools=ToolListWrap([]),
    )
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    outputs = await loop.run(params, raw_prompt=[{"role": "user", "content": QUESTIONS[1]}], index=0)
    assert isinstance(outputs, list) and len(outputs) == 3
    assert servers.calls[0].prompt_ids == servers.calls[1].prompt_ids  # n=2 as two calls
    assert outputs[-1].response_ids[-len(servers.calls[-1].output.token_ids) :] == servers.calls[-1].output.token_ids
    for output in outputs:
        sequence = output.prompt_ids + output.response_ids
        mine = [
            c
            for c in servers.calls
            if sequence[: len(c.prompt_ids) + len(c.output.token_ids)] == c.prompt_ids + c.output.token_ids
        ]
        want = _expected(mine, 256)
        assert (output.prompt_ids, output.response_ids, output.response_mask) == (want.prompt, want.response, want.mask)
        assert output.response_logprobs == want.logprobs and output.reward_score == 0.5
        fields = output.as_dict()  # what verl's TransferQueue worker stores for each output
        assert fields["rm_scores"][-1] == 0.5 and fields["rollout_log_probs"].shape == fields["responses"].shape
    assert sum(output.extra_fields["loss_weight"] for output in outputs) == pytest.approx(1.0)  # one vote


def test_a_branch_is_cut_to_response_length_and_a_long_prompt_moves_into_the_response() -> None:
    branch = {
        "tokens": list(range(100, 112)),
        "loss_mask": [0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1],
        "logprobs": [None] * 5 + [-0.1, -0.2, None, None, -0.3, -0.4, -0.5],
        "versions": [-1] * 5 + [2, 2, -1, -1, 3, 3, 3],
    }
    sample = tape_verl.verl_sample(branch, prompt_length=3, response_length=6)
    assert sample.prompt_ids == [100, 101, 102]  # at most prompt_length; the rest of the prompt is response, mask 0
    assert sample.response_ids == [103, 104, 105, 106, 107, 108] and sample.truncated
    assert sample.response_mask == [0, 0, 1, 1, 0, 0] and sample.response_logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, 0.0]
    assert sample.versions == [-1, -1, 2, 2, -1, -1] and sample.global_steps == (2, 2)
    whole = tape_verl.verl_sample(branch, prompt_length=64, response_length=64)
    assert whole.prompt_ids == list(range(100, 105)) and not whole.truncated and whole.global_steps == (2, 3)


def test_the_cli_prints_the_shipped_yaml() -> None:
    from typer.testing import CliRunner

    from tokentape.cli import app

    result = CliRunner().invoke(app, ["verl-config"])
    path = Path(result.output.strip())
    assert result.exit_code == 0 and path == tape_verl.CONFIG_PATH
    (entry,) = OmegaConf.load(path)
    assert entry.name == "tokentape_agent" and entry._target_ == "tokentape.integrations.verl.TokentapeAgentLoop"
