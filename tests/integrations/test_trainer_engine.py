"""The trainer-side engine's shared parts, against values written out by hand: `trainer_sampling` on
the sampling dicts verl's agent loop and SkyRL's generator hand an episode (and on their edges), the
`sampling_params` each adapter sends its trainer's servers, and the resume loop both adapters run."""

from __future__ import annotations

from typing import Any

import pytest

from tokentape.core.sampling import SamplingParams
from tokentape.errors import ContextOverflow, EngineFailure, InvalidRequest
from tokentape.integrations import trainer_engine
from tokentape.integrations.skyrl_engine import SkyRLEngine
from tokentape.integrations.trainer_engine import TrainerSampling, asks_logprobs, trainer_sampling
from tokentape.integrations.verl_engine import VerlEngine

# verl's agent loop (`AgentLoopManager.generate_sequences`): rollout.temperature/top_p/top_k, a fixed
# repetition_penalty, logprobs from rollout.calculate_log_probs
VERL = {"temperature": 0.9, "top_p": 0.95, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
# SkyRL's `get_vllm_sampling_params` over its default `SamplingParams` (max_generate_length 1024)
SKYRL = {
    "min_tokens": 1,
    "skip_special_tokens": True,
    "include_stop_str_in_output": True,
    "max_tokens": 1024,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "logprobs": 1,
    "stop": None,
}


def test_verl_and_skyrl_dicts_read_as_their_sampling() -> None:
    assert trainer_sampling(VERL) == TrainerSampling(
        SamplingParams(temperature=0.9, top_p=0.95),
        logprobs=True,
        passed={"temperature": 0.9, "top_p": 0.95, "top_k": -1, "repetition_penalty": 1.0},
    )
    assert trainer_sampling(SKYRL) == TrainerSampling(
        SamplingParams(),
        logprobs=True,
        passed={
            "min_tokens": 1,
            "skip_special_tokens": True,
            "include_stop_str_in_output": True,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
        },
    )


def test_skyrl_own_dict_builder_reads_the_same() -> None:
    """The dict SkyRL's own helper builds from its config, read as the hand-written one above."""
    pytest.importorskip("tokentape.integrations.skyrl")  # first: it makes skyrl's config importable on 3.11
    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_vllm_sampling_params
    from skyrl.train.config.config import SamplingParams as SkyRLSampling

    built = get_vllm_sampling_params(SkyRLSampling(temperature=0.7, top_k=20, min_p=0.05, stop=["</answer>"]))
    read = trainer_sampling(built)
    assert read.params == SamplingParams(temperature=0.7, top_k=20, min_p=0.05)
    assert read.passed["stop"] == ["</answer>"] and read.passed["top_k"] == 20
    assert "max_tokens" not in read.passed and "logprobs" not in read.passed


@pytest.mark.parametrize(("top_k", "expected"), [(-1, 0), (0, 0), (None, 0), (1, 1), (40, 40), (40.0, 40)], ids=str)
def test_top_k_minus_one_and_zero_are_both_no_cut(top_k: Any, expected: int) -> None:
    assert trainer_sampling({"top_k": top_k}).params.top_k == expected


def test_temperature_zero_is_greedy_and_missing_keys_take_vllms_defaults() -> None:
    greedy = trainer_sampling({"temperature": 0, "top_p": 1.0, "top_k": -1})
    assert (greedy.params.temperature, greedy.params.top_p, greedy.params.top_k) == (0.0, 1.0, 0)
    assert trainer_sampling({}) == TrainerSampling(SamplingParams(), logprobs=False, passed={})
    nones = {"temperature": None, "top_p": None, "top_k": None, "min_p": None, "stop": None, "logprobs": None}
    assert trainer_sampling(nones) == TrainerSampling(SamplingParams(), logprobs=False, passed={})


def test_the_engines_own_keys_are_dropped_and_any_other_key_goes_to_the_servers() -> None:
    read = trainer_sampling(
        {
            "n": 4,
            "max_tokens": 100,
            "max_new_tokens": 100,  # SGLang's name
            "max_generate_length": 100,  # SkyRL's
            "seed": 7,
            "logprobs": 5,
            "stop_token_ids": [9, 3, 9],
            "stop": ["\n\n"],
            "ignore_eos": False,
            "frequency_penalty": 0.5,
        }
    )
    assert read.params.stop_token_ids == (3, 9)
    assert read.logprobs is True
    assert read.passed == {"stop": ["\n\n"], "ignore_eos": False, "frequency_penalty": 0.5}


@pytest.mark.parametrize(
    ("value", "asked"), [(True, True), (False, False), (None, False), (0, True), (1, True), (20, True)], ids=str
)
def test_logprobs_asked_as_verl_and_skyrl_mean_it(value: Any, asked: bool) -> None:
    assert asks_logprobs(value) is asked
    assert trainer_sampling({"logprobs": value}).logprobs is asked


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),  # as vLLM refuses it
        ({"temperature": "hot"}, "temperature"),
    ],
    ids=str,
)
def test_a_value_out_of_range_is_refused_by_name(sampling: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        trainer_sampling(sampling)
    assert refused.value.param == param


# -- the calls each adapter sends --------------------------------------------------------------------

EOT = frozenset({2, 5})


def _verl(manager: Any = None, **kwargs: Any) -> VerlEngine:
    return VerlEngine(
        manager, model_id="m", prompt_length=100, response_length=50, end_of_turn_ids=EOT, resume_delay=0.0, **kwargs
    )


def _skyrl(client: Any = None) -> SkyRLEngine:
    return SkyRLEngine(
        client,
        model_id="m",
        model="policy",
        max_input_length=100,
        max_generate_length=50,
        end_of_turn_ids=EOT,
        resume_delay=0.0,
    )


def test_each_adapters_call_carries_the_trainers_sampling_and_the_requests_budget_stops_and_seed() -> None:
    request = SamplingParams(max_tokens=30, stop_token_ids=(7,), presence_penalty=0.25)
    trainer = trainer_sampling({**VERL, "stop_token_ids": [11]})
    verl: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "top_k": -1, "repetition_penalty": 1.0}
    verl |= {"logprobs": True, "max_tokens": 30, "stop_token_ids": [2, 5, 7, 11], "presence_penalty": 0.25}
    assert _verl().request(trainer, request, max_tokens=30, seed=3) == {**verl, "seed": 3}
    assert _verl(takes_seed=False).request(trainer, request, max_tokens=30, seed=3) == verl  # SGLang: no seed
    skyrl: dict[str, Any] = {k: v for k, v in SKYRL.items() if k not in ("max_tokens", "stop")}
    skyrl |= {"max_tokens": 12, "logprobs": 0, "stop_token_ids": [2, 5, 7], "presence_penalty": 0.25, "seed": 3}
    assert _skyrl().request(trainer_sampling(SKYRL), request, max_tokens=12, seed=3) == skyrl


class Manager:
    """verl's `server_manager.generate`, answering from a list; every call recorded."""

    def __init__(self, answers: list[tuple[list[int], str, dict[str, Any]]]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, list[int], dict[str, Any]]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]) -> Any:
        from types import SimpleNamespace

        self.calls.append((request_id, list(prompt_ids), dict(sampling_params)))
        tokens, reason, extra = self.answers.pop(0)
        return SimpleNamespace(
            token_ids=tokens, log_probs=[-0.5] * len(tokens), stop_reason=reason, extra_fields=extra, num_preempted=1
        )


class Client:
    """SkyRL's inference client, answering from a list; its `weight_version` moves as scripted."""

    def __init__(self, answers: list[tuple[list[int], str, int]]) -> None:
        self.answers, self.weight_version = answers, 0
        self.calls: list[tuple[str | None, list[int], dict[str, Any]]] = []

    async def generate(self, batch: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        self.calls.append((batch["session_ids"][0], list(batch["prompt_token_ids"][0]), dict(batch["sampling_params"])))
        tokens, reason, version_after = self.answers.pop(0)
        self.weight_version = version_after
        return {"response_ids": [tokens], "response_logprobs": [[-0.5] * len(tokens)], "stop_reasons": [reason]}


async def _sampled(engine: Any, prompt: list[int], session_id: str | None = "s") -> list[tuple[int, int | None]]:
    params = SamplingParams(max_tokens=6)
    return [(t.token_id, t.version) async for t in engine.generate(prompt, params, seed=None, session_id=session_id)]


async def test_an_aborted_answer_is_resumed_with_its_tokens_appended_in_both_adapters() -> None:
    steps = {"global_steps": 3, "min_global_steps": 3, "max_global_steps": 3}
    later = {"global_steps": 4, "min_global_steps": 4, "max_global_steps": 4}
    manager = Manager([([10, 11], "aborted", steps), ([12, 2], "completed", later)])
    verl = _verl(manager)
    verl.open_episode("s", VERL)
    assert await _sampled(verl, [1, 1, 1]) == [(10, 3), (11, 3), (12, 4), (2, 4)]
    assert [(c[0], c[1], c[2]["max_tokens"]) for c in manager.calls] == [
        ("s", [1, 1, 1], 6),
        ("s", [1, 1, 1, 10, 11], 4),
    ]
    assert verl.episode_preempted("s") == 1 + 2  # one resumed here, one reported by each call
    assert verl.describe() == {
        "kind": "verl",
        "model": "m",
        "tokens_generated": 4,
        "resumed": 1,
        "straddled_calls": 0,
        "episodes_open": 1,
    }
    assert verl.times.calls == 2 and verl.close_episode("s") >= 0.0

    client = Client([([10], "abort", 0), ([11, 12], "abort", 1), ([2], "stop", 1)])
    skyrl = _skyrl(client)
    skyrl.open_episode("s", SKYRL, 9)
    assert await _sampled(skyrl, [1]) == [(10, 0), (11, 0), (12, 0), (2, 1)]
    assert [c[1] for c in client.calls] == [[1], [1, 10], [1, 10, 11, 12]]
    assert [c[2]["max_tokens"] for c in client.calls] == [6, 5, 3]
    assert skyrl.episode_calls("s") == (2, 1)  # two resumed; the second call straddled the sync
    assert (skyrl.describe()["kind"], skyrl.resumed, skyrl.straddled_calls) == ("skyrl", 2, 1)


async def test_a_call_outside_a_session_keeps_one_request_id_across_its_resumes() -> None:
    manager = Manager([([10], "aborted", {}), ([2], "completed", {})])
    assert await _sampled(_verl(manager), [1], session_id=None) == [(10, None), (2, None)]
    first, second = manager.calls[0][0], manager.calls[1][0]
    assert first == second and first.startswith("tokentape-")


async def test_endless_aborts_fail_and_budgets_are_the_trainers() -> None:
    manager = Manager([([], "aborted", {})] * trainer_engine.MAX_RESUMES)
    with pytest.raises(EngineFailure, match="aborted the request 64 times"):
        await _sampled(_verl(manager), [1])
    with pytest.raises(ContextOverflow, match="response_length of 50"):
        await _sampled(_verl(Manager([])), [1] * 151)  # room: min(151, 100) + 50 - 151 < 0
    with pytest.raises(ContextOverflow, match="max_input_length of 100"):
        await _sampled(_skyrl(Client([])), [1] * 101)


# (verl's default, processed logprobs: after the temperature and the cuts; SkyRL's, raw: before them)
@pytest.mark.parametrize(
    ("sampling", "processed", "raw"),
    [
        ({"temperature": 0.5, "top_k": 20}, "temperature_scaled_truncated", "raw"),
        ({"temperature": 0.5, "top_k": -1}, "temperature_scaled_untruncated", "raw"),  # -1: no cut
        ({"temperature": 0.5, "top_k": 0}, "temperature_scaled_untruncated", "raw"),
        ({"temperature": 1.0, "min_p": 0.1}, "temperature_scaled_truncated", "temperature_scaled_untruncated"),
        ({"temperature": 0, "top_p": 0.9}, "raw", "raw"),  # greedy
        ({}, "temperature_scaled_untruncated", "temperature_scaled_untruncated"),
    ],
    ids=str,
)
async def test_the_logprobs_mode_is_read_from_the_trainers_sampling(
    sampling: dict[str, Any], processed: str, raw: str
) -> None:
    verl = _verl(Manager([([2], "completed", {})]))
    verl.open_episode("s", sampling)
    (token,) = [t async for t in verl.generate([1], SamplingParams(), seed=None, session_id="s")]
    assert token.logprob_mode == processed
    skyrl = _skyrl(Client([([2], "stop", 0)]))
    skyrl.open_episode("s", sampling)
    (token,) = [t async for t in skyrl.generate([1], SamplingParams(), seed=None, session_id="s")]
    assert token.logprob_mode == raw


async def test_an_aborted_answer_that_ends_on_a_stop_token_is_not_resumed() -> None:
    """The request's stop token (7) or the trainer's (11) last: the turn ended, whatever the reason says."""
    manager = Manager([([10, 7], "aborted", {})])
    verl = _verl(manager)
    params = SamplingParams(max_tokens=6, stop_token_ids=(7,))
    assert [t.token_id async for t in verl.generate([1], params, seed=None)] == [10, 7]
    assert (len(manager.calls), verl.resumed) == (1, 0)
    client = Client([([10, 11], "abort", 0)])
    skyrl = _skyrl(client)
    skyrl.open_episode("s", {"stop_token_ids": [11]})
    assert [t.token_id async for t in skyrl.generate([1], params, seed=None, session_id="s")] == [10, 11]
    assert (len(client.calls), skyrl.resumed) == (1, 0)
