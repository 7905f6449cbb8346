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

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from verl.experimental.agent_loop import agent_loop as verl_loop
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
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


@dataclass
class EmbeddedServers:
    """verl's `LLMServerClient.generate`, sampling with the embedded model. `script(servers,
    request_id, prompt_ids)` may answer a call instead (token IDs, logprobs, stop reason)."""

    engine: LlamaCppEngine
    global_steps: int = 0
    script: Script | None = None
    calls: list[Call] = field(default_factory=list)

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


def _expected(calls: list[Call], response_length: int) -> tuple[list[int], list[int], list[int], list[float]]:
    """From the server calls alone: the last call's prompt and output are the sequence; each call's
    output sits where its prompt ends (prompt of a later call extends it), mask 1 and its logprobs there."""
    last = calls[-1]
    sequence = last.prompt_ids + list(last.output.token_ids)
    mask, logprobs = [0] * len(sequence), [0.0] * len(sequence)
    for call in calls:
        start, tokens = len(call.prompt_ids), list(call.output.token_ids)
        assert sequence[: start + len(tokens)] == call.prompt_ids + tokens, "a call's turn is not on the sequence"
        mask[start : start + len(tokens)] = [1] * len(tokens)
        logprobs[start : start + len(tokens)] = list(call.output.log_probs or ())
    first = len(calls[0].prompt_ids)
    cut = slice(first, first + response_length)
    return sequence[:first], sequence[cut], mask[cut], logprobs[cut]


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


def _check_row(out: DataProto, i: int, calls: list[Call], response_length: int) -> None:
    prompt, response, mask, logprobs = _row(out, i)
    want_prompt, want_response, want_mask, want_logprobs = _expected(calls, response_length)
    assert prompt == want_prompt and response == want_response and mask == want_mask
    assert logprobs == torch.tensor(want_logprobs, dtype=torch.float32).tolist()  # verl keeps float32


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
    batch = _batch(tmp_path, verl_tokenizer, config, QUESTIONS, repeat=2)
    started = time.perf_counter()
    out = await _generate(monkeypatch, worker, batch, "tool_agent")
    wall = time.perf_counter() - started
    episodes = _episodes(servers)
    assert len(out) == 4 and len(episodes) == 4, out.non_tensor_batch["tokentape_error"]
    (turn_end,) = tokenizer.encode("<|im_end|>")
    rollout = config.actor_rollout_ref.rollout
    for i in range(len(out)):
        session = out.non_tensor_batch["tokentape_session_id"][i]
        calls = episodes[session]  # the session id is verl's request_id, on every call of the episode
        assert len(calls) >= 3 and out.non_tensor_batch["tokentape_status"][i] == "done"
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
    print(f"\nverl batch of 4: {wall:.2f} s, {len(servers.calls)} server calls")
