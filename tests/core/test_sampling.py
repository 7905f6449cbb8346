"""Sampling parameters out of range are rejected with the parameter's name."""

from __future__ import annotations

from typing import Any

import pytest

from tokentape.core.sampling import SamplingParams
from tokentape.errors import InvalidRequest


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -1.0),
        ("top_k", -1),
        ("seed", 2**70),
        ("stop", ("a", "b", "c", "d", "e")),
        ("stop", ("",)),
        ("top_logprobs", 21),
        ("n", 0),
        ("n", 17),
    ],
)
def test_out_of_range_values_name_their_parameter(field: str, value: Any) -> None:
    extra: dict[str, Any] = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(**{field: value, **extra})
    assert caught.value.param == field


def test_top_logprobs_needs_logprobs() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(top_logprobs=3)
    assert caught.value.param == "top_logprobs"


def test_each_choice_gets_its_own_reproducible_seed() -> None:
    params = SamplingParams(seed=41, n=3)
    assert [params.choice_seed(i) for i in range(3)] == [41, 42, 43]
    assert SamplingParams().choice_seed(0) is None
