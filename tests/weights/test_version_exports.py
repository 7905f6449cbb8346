"""Per-token weights versions in every export: AReaL's `versions`, verl's `param_version_start/end`,
per-turn spans; OpenRLHF and Atropos rows carry them too."""

from __future__ import annotations

from tokentape.core.export import export_session
from tokentape.core.formats import FORMATS, format_rows, samples_of
from tokentape.core.session import NewTurn, SessionTree
from tokentape.core.tape import Origin
from tokentape.core.versions import PolicySpan


def _tree() -> SessionTree:
    """A prompt of 3, a turn of 4 sampled (versions 2, 2, 3, 3), a bridge of 2, a turn of 2 recorded
    with a label only ("5")."""
    tree = SessionTree("v", "tape")
    first = tree.attach(
        NewTurn(parent=None, keep=0, context=(1, 2, 3), context_origin=Origin.PROMPT, rewrite=None),
        sampled=[10, 11, 12, 13],
        logprobs=[-0.1] * 4,
        finish_reason="stop",
        prompt_chain=b"a",
        prompt_length=1,
        reply={"role": "assistant", "content": "x"},
        policy_version="2",
        policy_spans=(PolicySpan(2, 0, 2), PolicySpan(3, 2, 4, kv_version=2)),
    )
    tree.attach(
        NewTurn(parent=first, keep=first.end, context=(4, 5), context_origin=Origin.BRIDGE, rewrite=None),
        sampled=[20, 21],
        logprobs=[-0.2] * 2,
        finish_reason="stop",
        prompt_chain=b"b",
        prompt_length=3,
        reply={"role": "assistant", "content": "y"},
        policy_version="5",
    )
    return tree


EXPECTED = [-1, -1, -1, 2, 2, 3, 3, -1, -1, 5, 5]
SPANS = [
    [{"version": 2, "start": 0, "end": 2}, {"version": 3, "start": 2, "end": 4, "kv_version": 2}],
    [],
]


def test_every_format_carries_the_versions() -> None:
    tree = _tree()
    (branch,) = export_session(tree)["branches"]
    assert branch["versions"] == EXPECTED and len(branch["versions"]) == len(branch["tokens"])
    assert (branch["param_version_start"], branch["param_version_end"]) == (2, 5)
    assert branch["policy_spans"] == SPANS
    samples = samples_of([tree])
    for fmt in FORMATS:
        rows = format_rows(samples, fmt)
        if fmt == "atropos":
            (row,) = rows
            assert row["versions"] == [EXPECTED] and row["param_version_end"] == [5]
            assert row["policy_spans"] == [SPANS]
        elif fmt == "stepwise":
            assert [r["completion_versions"] for r in rows] == [[2, 2, 3, 3], [5, 5]]
        elif fmt == "packed":  # one branch: the packed row is the branch
            (row,) = rows
            assert row["versions"] == EXPECTED and (row["param_version_start"], row["param_version_end"]) == (2, 5)
        else:
            (row,) = rows
            assert row["versions"] == EXPECTED, fmt
            assert (row["param_version_start"], row["param_version_end"]) == (2, 5)
    # versions line up with the sampled tokens: exactly where the loss mask is 1
    assert [v >= 0 for v in EXPECTED] == [bool(m) for m in branch["loss_mask"]]


def test_max_lag_drops_or_masks_the_samples_with_too_old_tokens() -> None:
    import pytest

    from tokentape.core.staleness import LagWindow
    from tokentape.errors import InvalidRequest

    samples = samples_of([_tree()])
    for fmt in FORMATS:  # current 5, lag 3: nothing older than 2 -> everything stays
        assert format_rows(samples, fmt, lag=LagWindow(5, 3)) == format_rows(samples, fmt)
        assert format_rows(samples, fmt, lag=LagWindow(5, 2)) == []  # the tokens of version 2 are too old
    (row,) = format_rows(samples, "tokentape", lag=LagWindow(5, 2, "mask"))
    assert row["loss_mask"] == [0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1] and row["masked_by_lag"] == 2
    (row,) = format_rows(samples, "verifiers", lag=LagWindow(5, 2, "mask"))
    assert row["completion_mask"] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(InvalidRequest, match="per-token mask"):
        format_rows(samples, "openrlhf", lag=LagWindow(5, 2, "mask"))
