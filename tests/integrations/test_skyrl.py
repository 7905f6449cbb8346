"""SkyRL's generator seam through tokentape, driven by SkyRL's own classes: the batch comes from its
`prepare_generator_input` (`TrajectoryID`s, `BatchMetadata`, the sampling its trainer derives from a
`SkyRLTrainConfig`), the output goes through its `validate_generator_output`, and in step-wise mode
through its trainer's post-processing, padding and advantages (`RayPPOTrainer`'s own methods on a
bare trainer, as its CPU tests call them).

The inference client is an instrument shaped like SkyRL's `RemoteInferenceClient` (its servers need
GPUs): `generate(InferenceEngineInput, model=)` samples with the embedded llama.cpp model, refuses
n>1 as SkyRL's does, has a `weight_version`, and records every call (session id, prompt IDs,
sampling, model, what it returned, the version). Every assertion compares SkyRL's batch with that
record, never with a sampled text: the cases the tests are about (a tool call, a weight sync, an
abort, a failing agent, a dead server) are scripted or forced."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

# isort: off
from tokentape.integrations import skyrl as tape_skyrl  # first: it makes skyrl importable on Python 3.11
from tokentape.integrations.skyrl import TokentapeGenerator
from tokentape.core.sampling import SamplingParams
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.render.tokenizer import GGUFTokenizer

from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineOutput
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.generators.base import GeneratorInterface, GeneratorOutput
from skyrl.train.generators.utils import merge_stepwise_output, prepare_generator_input
from skyrl.train.trainer import RayPPOTrainer
from skyrl.train.utils.trainer_utils import validate_generator_output
from skyrl.utils.tok import get_tokenizer
# isort: on

TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>'
QUESTIONS = ("What is 17 plus 25?", "Name a primary colour.", "Say yes.", "Say no.")
POLICY = "skyrl-lora"  # the name SkyRL passes as `model` when it trains a LoRA adapter


@dataclass
class Call:
    session_id: str
    prompt_ids: list[int]
    sampling_params: dict[str, Any]
    model: str | None
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    version: int | None  # weight_version when the call was sent


Script = Callable[["RecordingClient", str, list[int]], tuple[list[int], list[float], str] | None]


class RecordingClient:
    """SkyRL's `RemoteInferenceClient.generate`, sampling with the embedded model. `script(client,
    session_id, prompt_ids)` may answer a call instead, or raise (a dead server)."""

    def __init__(self, engine: LlamaCppEngine, weight_version: int | None = 0, script: Script | None = None) -> None:
        self.engine, self.weight_version, self.script = engine, weight_version, script
        self.model_name = "base-model"
        self.calls: list[Call] = []
        self.finished: list[str] = []

    async def generate(self, input_batch: dict[str, Any], model: str | None = None) -> InferenceEngineOutput:
        (prompt,) = input_batch["prompt_token_ids"]
        (session_id,) = input_batch["session_ids"]
        sp = dict(input_batch["sampling_params"])
        if sp.get("n", 1) > 1:
            raise ValueError("n > 1 is not supported. Use `config.generator.n_samples_per_prompt` instead.")
        version = self.weight_version
        answer = self.script(self, session_id, list(prompt)) if self.script else None
        if answer is None:
            params = SamplingParams(
                max_tokens=sp["max_tokens"],
                temperature=sp["temperature"],
                top_p=sp["top_p"],
                top_k=max(sp["top_k"], 0),
                min_p=sp["min_p"],
                stop_token_ids=tuple(sp["stop_token_ids"]),
            )
            tokens, logprobs = [], []
            async for sample in self.engine.generate(list(prompt), params, seed=sp.get("seed")):
                tokens.append(sample.token_id)
                logprobs.append(sample.logprob)
            answer = (tokens, logprobs, "length" if len(tokens) >= sp["max_tokens"] else "stop")
        tokens, logprobs, stop = answer
        self.calls.append(Call(session_id, list(prompt), sp, model, list(tokens), list(logprobs), stop, version))
        return InferenceEngineOutput(
            responses=[""],
            response_ids=[list(tokens)],
            stop_reasons=[stop],
            response_logprobs=[list(logprobs)] if sp.get("logprobs") is not None else None,
            prompt_logprobs=None,
            rollout_expert_indices=None,
        )

    async def finish_session(self, session_id: str) -> None:
        self.finished.append(session_id)

    def sessions(self) -> dict[str, list[Call]]:
        calls: dict[str, list[Call]] = {}
        for call in self.calls:
            calls.setdefault(call.session_id, []).append(call)
        return calls


@pytest.fixture(scope="module")
def skyrl_tokenizer(hf_dir: Path) -> Any:
    return get_tokenizer(str(hf_dir), padding_side="left")


def _config(**generator: Any) -> SkyRLTrainConfig:
    overrides = {
        "generator.n_samples_per_prompt": 2,
        "generator.sampling_params.temperature": 0.9,
        "generator.sampling_params.top_p": 0.95,
        "generator.sampling_params.top_k": 30,
        "generator.sampling_params.max_generate_length": 24,
        "generator.max_input_length": 512,
        "trainer.algorithm.advantage_estimator": "grpo",
        "trainer.train_batch_size": 2,  # prompts a step
        "trainer.policy_mini_batch_size": 2,
        **{f"generator.{k}": v for k, v in generator.items()},
    }
    return SkyRLTrainConfig.from_cli_overrides(overrides)


def _input(cfg: SkyRLTrainConfig, questions: tuple[str, ...], agents: list[str] | None = None, step: int = 1) -> Any:
    """SkyRL's trainer's own batch: one row per prompt, repeated n_samples_per_prompt times."""
    rows = [
        {
            "prompt": [{"role": "user", "content": q}],
            "env_class": "tokentape",
            "env_extras": {"agent": agents[i] if agents else None},
            "uid": f"uid-{i}",
        }
        for i, q in enumerate(questions)
    ]
    sampling = get_sampling_params_for_backend("vllm", cfg.generator.sampling_params)
    batch, uids = prepare_generator_input(rows, cfg.generator.n_samples_per_prompt, sampling, "gsm8k", "train", step)
    return batch, uids


def _generator(
    cfg: SkyRLTrainConfig, client: RecordingClient, tokenizer: Any, agent: str, **keys: Any
) -> TokentapeGenerator:
    generator = TokentapeGenerator(
        cfg.generator, tokenizer, client, agent=f"tests.integrations.{agent}", policy_model_name=POLICY, **keys
    )
    assert isinstance(generator, GeneratorInterface)
    return generator


@dataclass
class Expected:
    prompt: list[int]
    response: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]


def _expected(calls: list[Call], label: Callable[[Call], int | None] = lambda c: c.version) -> Expected:
    """From the client's calls alone: the last call's prompt and output are the sequence; each call's
    output sits where its prompt ends (a later call's prompt extends it), mask 1 there, its logprobs and
    version there; the prompt ends where the first call's prompt ends."""
    last = calls[-1]
    sequence = last.prompt_ids + last.tokens
    mask, logprobs, versions = [0] * len(sequence), [0.0] * len(sequence), [-1] * len(sequence)
    for call in calls:
        start = len(call.prompt_ids)
        assert sequence[: start + len(call.tokens)] == call.prompt_ids + call.tokens, (
            "a call's turn is off the sequence"
        )
        mask[start : start + len(call.tokens)] = [1] * len(call.tokens)
        logprobs[start : start + len(call.tokens)] = call.logprobs
        versions[start : start + len(call.tokens)] = [label(call)] * len(call.tokens)  # type: ignore[list-item]
    first = len(calls[0].prompt_ids)
    return Expected(sequence[:first], sequence[first:], mask[first:], logprobs[first:], versions[first:])


def _check_row(out: GeneratorOutput, i: int, want: Expected) -> None:
    assert out["prompt_token_ids"][i] == want.prompt
    assert out["response_ids"][i] == want.response
    assert out["loss_masks"][i] == want.mask
    assert out["rollout_logprobs"] is not None and out["rollout_logprobs"][i] == want.logprobs
    assert out["tokentape_versions"][i] == want.versions  # type: ignore[typeddict-item]


def _tool_call_first(tokenizer: GGUFTokenizer) -> Script:
    call = tokenizer.encode(TOOL_CALL)

    def script(client: RecordingClient, session_id: str, prompt_ids: list[int]) -> Any:
        if not any(c.session_id == session_id for c in client.calls):  # an episode's first call
            return call, [-0.5] * len(call), "stop"
        return None

    return script


async def test_the_merged_batch_is_what_the_client_received_and_sampled(
    engine: LlamaCppEngine, tokenizer: GGUFTokenizer, skyrl_tokenizer: Any
) -> None:
    """Two prompts, two repetitions each; a client with no weight_version: tokens carry the batch's
    global_step."""
    cfg = _config()
    client = RecordingClient(engine, weight_version=None, script=_tool_call_first(tokenizer))
    generator = _generator(cfg, client, skyrl_tokenizer, "verl_agents:tool_agent")
    batch, uids = _input(cfg, QUESTIONS[:2], step=7)
    out = await generator.generate(batch)
    validate_generator_output(len(batch["prompts"]), out)
    sessions = client.sessions()
    assert len(out["response_ids"]) == 4 and len(sessions) == 4
    assert out["trajectory_ids"] is None and out["is_last_step"] is None  # merged: SkyRL's uids say the groups
    assert uids == ["uid-0", "uid-0", "uid-1", "uid-1"]
    (turn_end,) = tokenizer.encode("<|im_end|>")
    for i in range(4):
        calls = sessions[out["tokentape_session_ids"][i]]  # type: ignore[typeddict-item]
        assert len(calls) == 3 and out["tokentape_status"][i] == "done"  # type: ignore[typeddict-item]
        _check_row(out, i, _expected(calls, label=lambda c: 7))
        for call in calls:  # the trainer's sampling, logprobs asked for, the turn's end a stop, SkyRL's model
            sp = call.sampling_params
            assert (sp["temperature"], sp["top_p"], sp["top_k"]) == (0.9, 0.95, 30)
            assert sp["logprobs"] == 0 and turn_end in sp["stop_token_ids"] and 1 <= sp["max_tokens"] <= 24
            assert call.model == POLICY
        assert out["rewards"][i] >= 0.25 and out["stop_reasons"][i] in ("stop", "length")
    # repetitions are siblings: one prompt, their own sessions, SkyRL's order
    assert out["prompt_token_ids"][0] == out["prompt_token_ids"][1] != out["prompt_token_ids"][2]
    assert sorted(client.finished) == sorted(sessions)  # every session released at SkyRL's router
    assert len(out["trajectory_generation_times"] or ()) == 4
    assert out["rollout_metrics"]["tokentape/status_done"] == 4.0
    assert out["rollout_metrics"]["tokentape/min_version"] == out["rollout_metrics"]["tokentape/max_version"] == 7


async def test_step_wise_rows_are_the_turns_and_skyrl_gives_each_rollout_one_advantage(
    tokenizer: GGUFTokenizer, engine: LlamaCppEngine, skyrl_tokenizer: Any
) -> None:
    """The first trajectory to call calls the add tool on each of its three turns (rewarded 0.75), every
    other answers plainly (0.0): its group's advantages are non-zero, the other group's zero."""
    tool, plain = tokenizer.encode(TOOL_CALL), tokenizer.encode("Fine.<|im_end|>")
    first: list[str] = []

    def script(client: RecordingClient, session_id: str, prompt_ids: list[int]) -> Any:
        first.append(session_id) if not first else None
        tokens = tool if session_id == first[0] else plain
        return tokens, [-0.5 - 0.01 * len(client.calls)] * len(tokens), "stop"

    cfg = _config(step_wise_trajectories=True)
    client = RecordingClient(engine, weight_version=2, script=script)
    generator = _generator(cfg, client, skyrl_tokenizer, "verl_agents:tool_agent")
    batch, _ = _input(cfg, QUESTIONS[2:])
    out = await generator.generate(batch)
    validate_generator_output(len(batch["prompts"]), out, step_wise=True)
    sessions = client.sessions()
    rows = 0
    for tid in batch["trajectory_ids"]:  # each trajectory: its calls, in order, one row each
        sid = out["tokentape_session_ids"][rows]  # type: ignore[typeddict-item]
        calls = sessions[sid]
        for j, call in enumerate(calls):
            r = rows + j
            assert out["trajectory_ids"][r] == tid and out["is_last_step"][r] == (j == len(calls) - 1)
            assert out["prompt_token_ids"][r] == call.prompt_ids and out["response_ids"][r] == call.tokens
            assert out["loss_masks"][r] == [1] * len(call.tokens) and out["rollout_logprobs"][r] == call.logprobs
            assert out["tokentape_versions"][r] == [2] * len(call.tokens)  # type: ignore[typeddict-item]
        # SkyRL's own prefix merge of the steps is the merged row the client's record gives
        mine = [i for i in range(len(out["response_ids"])) if out["trajectory_ids"][i] == tid]
        sliced: Any = {k: [v[i] for i in mine] if isinstance(v, list) else v for k, v in out.items()}
        merged = merge_stepwise_output(sliced)
        assert len(merged["response_ids"]) == 1
        want = _expected(calls)
        assert (merged["prompt_token_ids"][0], merged["response_ids"][0]) == (want.prompt, want.response)
        assert merged["loss_masks"][0] == want.mask and merged["rollout_logprobs"][0] == want.logprobs
        rows += len(calls)
    assert rows == len(out["response_ids"]) and rows > len(batch["prompts"])

    # SkyRL's trainer: per-token rewards, padding, advantages from each rollout's last step, broadcast
    trainer: Any = object.__new__(RayPPOTrainer)
    trainer.cfg, trainer.tokenizer, trainer.all_metrics = cfg, skyrl_tokenizer, {}
    trainer.dispatch = SimpleNamespace(get_lcm_dp_size=lambda: 1)
    uids, rewards = [tid.instance_id for tid in out["trajectory_ids"]], list(out["rewards"])
    post, uids = trainer.postprocess_generator_output(out, uids)
    data = trainer.convert_to_training_input(post, uids)
    data["values"] = None
    data = trainer.compute_advantages_and_returns(data)
    advantages, masks = data["advantages"], data["response_mask"]
    n = len(post["response_ids"])
    assert data["sequences"].shape[0] == n
    for r in range(n):
        width = len(post["response_ids"][r])
        assert masks[r, -width:].all() and not masks[r, :-width].any()  # one left-padded block: responses end it
        last = next(i for i in range(r, n) if post["is_last_step"][i])  # this step's rollout's last step
        assert torch.allclose(advantages[r, -width:], advantages[last, -1].expand(width))  # one per rollout
    rewarded = [r for r in range(n) if out["tokentape_session_ids"][r] == first[0]]  # type: ignore[typeddict-item]
    assert len(rewarded) == 3 and all(rewards[r] == 0.75 for r in rewarded)
    group = [r for r in range(n) if uids[r] == uids[rewarded[0]]]
    assert all(advantages[r, -1] > 0 if r in rewarded else advantages[r, -1] < 0 for r in group)
    assert not advantages[[r for r in range(n) if r not in group]].any()


async def test_step_wise_rows_hold_every_turn_of_siblings_and_a_compacted_history_once(
    engine: LlamaCppEngine, skyrl_tokenizer: Any
) -> None:
    """n=2 drafts (two calls, one prompt), a follow-up on the second, then a compacted history: four
    turns on three branches, four rows; SkyRL's prefix merge makes three sequences of them."""
    cfg = _config(step_wise_trajectories=True, n_samples_per_prompt=1)
    client = RecordingClient(engine)
    generator = _generator(cfg, client, skyrl_tokenizer, "verl_agents:sibling_and_compacting_agent")
    batch, _ = _input(cfg, QUESTIONS[1:2])
    out = await generator.generate(batch)
    validate_generator_output(1, out, step_wise=True)
    calls = client.calls
    assert len(calls) == 4 and calls[0].prompt_ids == calls[1].prompt_ids  # n=2 as two calls
    rows = [(p, r) for p, r in zip(out["prompt_token_ids"], out["response_ids"], strict=True)]
    assert sorted(rows) == sorted((c.prompt_ids, c.tokens) for c in calls)  # every turn once
    assert rows[2:] == [(c.prompt_ids, c.tokens) for c in calls[2:]]  # the follow-up, then the compacted turn
    assert out["is_last_step"] == [False, False, False, True]
    merged = merge_stepwise_output(out)
    assert len(merged["response_ids"]) == 3 and merged["is_last_step"] == [False, False, True]


async def test_a_weight_sync_between_turns_and_inside_a_call_labels_each_token(
    engine: LlamaCppEngine, tokenizer: GGUFTokenizer, skyrl_tokenizer: Any
) -> None:
    """weight_version 3 for the first turn; the second turn's call is sent under 4, aborted after
    three tokens (SkyRL pausing its servers in abort mode) and returns under 5; resumed under 5, the
    turn goes on from those tokens. The tokens of the call that straddled the sync get 4, the older."""
    partial = tokenizer.encode("The answer")

    def script(client: RecordingClient, session_id: str, prompt_ids: list[int]) -> Any:
        if len(client.calls) == 1:  # the second turn's call
            client.weight_version = 5  # the sync lands while the call is out
            return partial, [-0.25] * len(partial), "abort"
        return None

    cfg = _config(n_samples_per_prompt=1)
    client = RecordingClient(engine, weight_version=3, script=script)
    generator = _generator(cfg, client, skyrl_tokenizer, "skyrl_agents:syncing_agent")
    await generator.gateway()
    assert generator.engine is not None
    generator.engine.resume_delay = 0.0
    batch, _ = _input(cfg, QUESTIONS[:1])
    batch["env_extras"][0]["between_turns"] = lambda: setattr(client, "weight_version", 4)
    out = await generator.generate(batch)
    calls = client.calls
    assert len(calls) == 3 and len({c.session_id for c in calls}) == 1
    assert [c.version for c in calls] == [3, 4, 5]  # as each call was sent
    assert calls[2].prompt_ids == calls[1].prompt_ids + partial  # resumed where the abort left it
    assert calls[2].sampling_params["max_tokens"] == calls[1].sampling_params["max_tokens"] - len(partial)
    labels = {id(calls[0]): 3, id(calls[1]): 4, id(calls[2]): 5}
    want = _expected(calls, label=lambda c: labels[id(c)])
    _check_row(out, 0, want)
    assert {v for v in want.versions if v >= 0} == {3, 4, 5}
    assert out["rollout_metrics"]["tokentape/straddled_calls"] == 1.0
    assert out["rewards"] == [0.0]  # the agent gave no reward: SkyRL takes rewards from the generator only


async def test_resumes_and_straddled_calls_are_counted_per_step(
    engine: LlamaCppEngine, tokenizer: GGUFTokenizer, skyrl_tokenizer: Any
) -> None:
    """Three steps, each with one call aborted mid-way by a weight sync and resumed: every step's
    metrics count that step's one resume and one straddled call (1, 1, 1), not every call since the
    start (1, 2, 3); the engine's description keeps the totals."""
    partial = tokenizer.encode("The answer")

    def script(client: RecordingClient, session_id: str, prompt_ids: list[int]) -> Any:
        if sum(c.session_id == session_id for c in client.calls) == 1:  # the episode's second turn
            client.weight_version = (client.weight_version or 0) + 1  # the sync lands while the call is out
            return partial, [-0.25] * len(partial), "abort"
        return None

    cfg = _config(n_samples_per_prompt=1)
    client = RecordingClient(engine, weight_version=3, script=script)
    generator = _generator(cfg, client, skyrl_tokenizer, "skyrl_agents:syncing_agent")
    await generator.gateway()
    assert generator.engine is not None
    generator.engine.resume_delay = 0.0
    per_step = []
    for step in (1, 2, 3):
        batch, _ = _input(cfg, QUESTIONS[:1], step=step)
        batch["env_extras"][0]["between_turns"] = lambda: None
        metrics = (await generator.generate(batch))["rollout_metrics"]
        per_step.append((metrics["tokentape/resumed_calls"], metrics["tokentape/straddled_calls"]))
    assert len(client.calls) == 9  # three per step: the first turn, the aborted call, its resumption
    assert per_step == [(1.0, 1.0)] * 3
    described = generator.engine.describe()
    assert (described["resumed"], described["straddled_calls"]) == (3, 3)


async def test_failures_end_their_rollouts_with_a_status_untrained_in_their_group(
    engine: LlamaCppEngine, skyrl_tokenizer: Any
) -> None:
    """One batch, one agent per prompt: it raises, a request is refused, SkyRL's server fails under
    it, its context fills up. Each ends with a status, stays in its group, trains nothing (but the
    full context), and the step goes on; with `fail_on_engine_error` the dead server fails the step."""
    dead: set[str] = set()

    def script(client: RecordingClient, session_id: str, prompt_ids: list[int]) -> Any:
        if QUESTIONS[2] in skyrl_tokenizer.decode(prompt_ids):  # the third prompt's server is gone
            dead.add(session_id)
            raise ConnectionError("the Ray actor died")
        return None

    agents = ["failing_agent", "refused_agent", "two_turn_agent", "long_agent"]
    cfg = _config(max_input_length=120)
    client = RecordingClient(engine, script=script)
    keys = {"error_reward": -0.5, "overflow_reward": -1.0}
    generator = _generator(cfg, client, skyrl_tokenizer, "skyrl_agents:by_row", **keys)
    batch, _ = _input(cfg, QUESTIONS, agents)
    out = await generator.generate(batch)
    validate_generator_output(len(batch["prompts"]), out)
    statuses = out["tokentape_status"]  # type: ignore[typeddict-item]
    assert statuses == ["error"] * 2 + ["refused"] * 2 + ["engine_error"] * 2 + ["context_full"] * 2
    assert out["stop_reasons"] == statuses[:6] + ["length"] * 2
    assert out["rewards"] == [-0.5] * 6 + [-1.0] * 2
    sessions = client.sessions()
    for i in range(8):
        sid = out["tokentape_session_ids"][i]  # type: ignore[typeddict-item]
        n = len(out["response_ids"][i])
        if i in (4, 5):  # no call came back: the rendered prompt and one end-of-sequence token
            assert sid not in sessions and n == 1
            assert out["response_ids"][i] == [skyrl_tokenizer.eos_token_id]
        else:
            want = _expected(sessions[sid])
            assert (out["prompt_token_ids"][i], out["response_ids"][i]) == (want.prompt, want.response)
        if i < 6:  # nothing to the loss: mask, logprobs and versions all off
            assert out["loss_masks"][i] == [0] * n and out["rollout_logprobs"][i] == [0.0] * n
            assert out["tokentape_versions"][i] == [-1] * n  # type: ignore[typeddict-item]
        else:  # the full context: the branch so far, trained
            _check_row(out, i, want)
            assert 1 in out["loss_masks"][i]
    assert len(dead) == 2 and all(len(c.prompt_ids) <= 120 for c in client.calls)
    assert out["prompt_token_ids"][0] == out["prompt_token_ids"][1]  # the group stays whole

    failing = _generator(cfg, client, skyrl_tokenizer, "skyrl_agents:by_row", fail_on_engine_error=True)
    with pytest.raises(RuntimeError, match="inference failed under 2 of 8"):
        await failing.generate(_input(cfg, QUESTIONS, agents)[0])


def test_the_entrypoint_builds_the_generator_from_skyrls_config(hf_dir: Path, skyrl_tokenizer: Any) -> None:
    from tokentape.integrations import skyrl_main

    args, keys = skyrl_main.split_args(
        [
            "trainer.override_entrypoint=tokentape.integrations.skyrl_main",
            f"trainer.policy.model.path={hf_dir}",
            "generator.step_wise_trajectories=true",
            "tokentape.agent=tests.integrations.verl_agents:two_turn_agent",
            "tokentape.error_reward=-1",
            "tokentape.fail_on_engine_error=true",
        ]
    )
    assert keys == {
        "agent": "tests.integrations.verl_agents:two_turn_agent",
        "error_reward": -1.0,
        "fail_on_engine_error": True,
    }
    cfg = SkyRLTrainConfig.from_cli_overrides(args)
    exp: Any = object.__new__(skyrl_main.TokentapeExp)  # its __init__ loads datasets and placement groups
    exp.tokentape = keys
    generator = exp.get_generator(cfg, skyrl_tokenizer, RecordingClient.__new__(RecordingClient))
    assert isinstance(generator, TokentapeGenerator) and generator.step_wise and generator.fail_on_engine_error
    assert generator.tokenizer_dir == hf_dir and generator.policy_model_name == str(hf_dir)
    with pytest.raises(SystemExit):
        skyrl_main.split_args(["tokentape.agnet=x:y"])


def test_a_branch_becomes_a_merged_row_and_its_turns_step_rows() -> None:
    branch = {
        "tokens": list(range(100, 110)),
        "loss_mask": [0, 0, 0, 1, 1, 0, 0, 1, 1, 1],
        "logprobs": [None] * 3 + [-0.1, -0.2, None, None, -0.3, -0.4, -0.5],
        "versions": [-1] * 3 + [2, 2, -1, -1, 3, 3, 3],
        "turn_index": [0] * 5 + [1] * 5,
        "turn_ids": [11, 12],
        "action_ranges": [[3, 5], [7, 10]],
        "finish_reasons": ["stop", "length"],
    }
    row = tape_skyrl.merged_row(branch)
    assert row.prompt_ids == [100, 101, 102] and row.response_ids == list(range(103, 110))
    assert row.loss_mask == [1, 1, 0, 0, 1, 1, 1] and row.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4, -0.5]
    assert row.versions == [2, 2, -1, -1, 3, 3, 3] and row.stop_reason == "length"
    first, second = tape_skyrl.step_rows({"branches": [branch, branch]})  # a turn shared by branches: once
    assert (first.prompt_ids, first.response_ids, first.stop_reason) == ([100, 101, 102], [103, 104], "stop")
    assert second.prompt_ids == list(range(100, 107)) and second.response_ids == [107, 108, 109]
    assert second.versions == [3, 3, 3] and second.stop_reason == "length"
