"""Every sampling field a dialect defines is applied (and recorded with the turn) or refused with a
400 naming it: never accepted and dropped. Through the real app and the embedded engine; the remote
engines' request bodies and the trainer's check of recorded settings, computed here."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tokentape.core.sampling import SamplingParams
from tokentape.engines.remote.wire import sampling_fields
from tokentape.render.tokenizer import GGUFTokenizer
from tokentape.server.dialects.common import UNAPPLIED_FIELDS
from tokentape.train.loss import check_sampling

HI = [{"role": "user", "content": "Tell me about fruit."}]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": HI, "max_tokens": 6, **fields}


async def _turns(http: httpx.AsyncClient, session: str) -> list[dict[str, Any]]:
    export = (await http.get(f"/sessions/{session}/export")).json()
    (branch,) = export["branches"]
    recorded: list[dict[str, Any]] = branch["sampling"]
    return recorded


async def test_a_positive_logit_bias_takes_over_the_distribution_and_is_recorded(
    http: httpx.AsyncClient, tokenizer: GGUFTokenizer
) -> None:
    (banana,) = tokenizer.encode(" banana")
    response = await http.post(
        "/sessions/lb/v1/chat/completions", json=_chat(logit_bias={str(banana): 100}, logprobs=True, temperature=1.0)
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == [banana] * 6  # +100 nats: no logit of this model is that far behind
    assert all(entry["logprob"] > -1e-3 for entry in choice["logprobs"]["content"])  # the biased distribution's
    (settings,) = await _turns(http, "lb")
    assert settings["logit_bias"] == {str(banana): 100.0}


async def test_a_negative_logit_bias_bans_the_token_greedy_decoding_would_take(http: httpx.AsyncClient) -> None:
    plain = (await http.post("/v1/chat/completions", json=_chat(temperature=0, max_tokens=1))).json()
    (first,) = plain["choices"][0]["token_ids"]
    banned = (
        await http.post("/v1/chat/completions", json=_chat(temperature=0, max_tokens=1, logit_bias={str(first): -100}))
    ).json()
    assert banned["choices"][0]["token_ids"] != [first]


async def test_penalties_are_applied_and_recorded(http: httpx.AsyncClient) -> None:
    body = _chat(presence_penalty=2.0, frequency_penalty=-0.5, repetition_penalty=1.3, temperature=0.7, max_tokens=8)
    response = await http.post("/sessions/pen/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (settings,) = await _turns(http, "pen")
    assert settings == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 2.0,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.3,
    }


async def test_the_embedded_engine_applies_the_penalties_by_vllms_formula(
    http: httpx.AsyncClient, tokenizer: GGUFTokenizer
) -> None:
    """Two tokens lifted far above the rest by the bias: greedy takes one of them first, and on the
    second step the penalised run holds that one `frequency + presence` = 4 nats further behind the
    other than the plain run does (read from the recorded logprobs of both; the model's own logits
    cancel). The two runs' second steps are computed in different batches and KV layouts, which moved
    the gap by 0.1 nats on one machine: the bound is 0.5, while a penalty left out moves it by 2."""
    (banana,) = tokenizer.encode(" banana")
    (apple,) = tokenizer.encode(" apple")
    body = _chat(
        temperature=0, max_tokens=2, logprobs=True, top_logprobs=5, logit_bias={str(banana): 100, str(apple): 100}
    )

    async def second_step_gap(**penalties: float) -> tuple[int, float]:
        choice = (await http.post("/v1/chat/completions", json={**body, **penalties})).json()["choices"][0]
        first = choice["token_ids"][0]
        other = apple if first == banana else banana
        top = {entry["token"]: entry["logprob"] for entry in choice["logprobs"]["content"][1]["top_logprobs"]}
        spelled = {banana: " banana", apple: " apple"}
        return first, top[spelled[first]] - top[spelled[other]]

    first, plain = await second_step_gap()
    again, penalised = await second_step_gap(frequency_penalty=2.0, presence_penalty=2.0)
    assert first == again and first in (banana, apple)
    assert penalised == pytest.approx(plain - 4.0, abs=0.5)


def _non_default(field: str) -> Any:
    no_ops = UNAPPLIED_FIELDS[field][0]
    for candidate in (2, True, 0.5, [1], ["audio"], "x", {"type": "object"}):
        if not any(candidate == v and type(candidate) is type(v) for v in no_ops):
            return candidate
    raise AssertionError(field)


@pytest.mark.parametrize("field", sorted(UNAPPLIED_FIELDS))
async def test_every_field_no_engine_applies_is_refused_by_name_and_changes_nothing(
    http: httpx.AsyncClient, field: str
) -> None:
    value = _non_default(field)
    chat = await http.post(f"/sessions/refused-{field}/v1/chat/completions", json=_chat(**{field: value}))
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["param"] == field and field in chat.json()["error"]["message"]
    assert (await http.get(f"/sessions/refused-{field}/export")).status_code == 404
    completion = await http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", field: value})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == field
    generate = await http.post(
        "/inference/v1/generate", json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, field: value}}
    )
    assert generate.status_code == 400 and generate.json()["error"]["param"] == f"sampling_params.{field}"
    no_op = UNAPPLIED_FIELDS[field][0][-1]
    assert (await http.post("/v1/chat/completions", json=_chat(max_tokens=1, **{field: no_op}))).status_code == 200


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # past the vocabulary
        ({"logit_bias": {"-4": 1}}, "logit_bias"),
        ({"logit_bias": {"5": "1"}}, None),  # a string where a number belongs: the body is malformed
        ({"temperature": -1e-300}, "temperature"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
        ({"stop": ["x" * 257]}, "stop"),
    ],
)
async def test_out_of_range_values_are_refused_in_the_dialects_shape(
    http: httpx.AsyncClient, fields: dict[str, Any], param: str | None
) -> None:
    response = await http.post("/sessions/bad-range/v1/chat/completions", json=_chat(**fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    assert (await http.get("/sessions/bad-range/export")).status_code == 404


async def test_the_token_route_applies_the_same_fields(http: httpx.AsyncClient, tokenizer: GGUFTokenizer) -> None:
    (banana,) = tokenizer.encode(" banana")
    body = {
        "token_ids": tokenizer.encode("Fruit:"),
        "sampling_params": {"max_tokens": 3, "logit_bias": {str(banana): 100}, "presence_penalty": -1.0},
    }
    response = await http.post("/inference/v1/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == [banana] * 3


def test_remote_engines_are_sent_the_bias_and_penalties_with_banned_tokens_merged() -> None:
    params = SamplingParams(
        logit_bias=((3, 1.5), (9, -2.0)), presence_penalty=0.5, repetition_penalty=1.1, banned_token_ids=(9, 12)
    )
    fields = sampling_fields([1, 2], params, 100, length_key="max_tokens")
    assert fields["logit_bias"] == {"3": 1.5, "9": -100, "12": -100}  # a banned token stays banned
    assert fields["presence_penalty"] == 0.5 and fields["repetition_penalty"] == 1.1
    assert "frequency_penalty" not in fields  # only what is set
    plain = sampling_fields([1, 2], SamplingParams(), 100, length_key="max_tokens")
    assert not {"logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty"} & set(plain)


def test_a_trainer_that_does_not_apply_a_penalty_refuses_the_turn() -> None:
    export = {"session_id": "s"}
    settings = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.5}
    branch = {"turn_ids": [1], "action_ranges": [(0, 3)], "sampling": [settings]}
    with pytest.raises(ValueError, match="presence_penalty"):
        check_sampling(export, branch, {"temperature": 1.0, "top_p": 1.0})
    check_sampling(export, branch, {"temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.5})
