"""Bounded staleness as properties over a fake version clock: sessions are refused exactly when their
first token is older than current - K; the admitted groups never exceed (K + version + 1) x B, and a
group is refused only when admitting it would exceed that; max_lag drops or masks exactly the tokens
older than current - lag."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokentape.core.staleness import GroupAdmission, admission_limit, is_stale, lag_filter

events = st.lists(
    st.one_of(st.just(("bump", "")), st.tuples(st.just("group"), st.sampled_from([f"g{i}" for i in range(30)]))),
    max_size=200,
)


@given(st.integers(0, 5), st.integers(1, 4), events)
def test_admitted_groups_never_exceed_the_limit_and_refusals_are_exact(k: int, b: int, steps: list) -> None:
    admission = GroupAdmission(k, b)
    version = 0
    for kind, group in steps:
        if kind == "bump":
            version += 1
            continue
        before = len(admission.admitted)
        known = group in admission.admitted
        admitted = admission.admit(group, version)
        # independent statement of the rule: a new group fits iff one more stays within the limit
        assert admitted == (known or before + 1 <= (k + version + 1) * b)
        assert len(admission.admitted) <= admission_limit(version, k, b)
        if not admitted:
            assert admission.versions_to_wait(version) >= 1
            assert admission.admit(group, version + admission.versions_to_wait(version)) is True
            admission.admitted.discard(group)  # that was a look ahead only


@given(st.integers(0, 50), st.integers(0, 60), st.one_of(st.none(), st.integers(0, 10)))
def test_a_session_is_stale_exactly_when_its_first_token_is_older_than_current_minus_k(
    first: int, current: int, k: int | None
) -> None:
    stale = is_stale(first, current, k)
    assert stale == (k is not None and current - first > k)
    assert not is_stale(None, current, k)  # nothing sampled yet: not stale


@given(st.lists(st.integers(-1, 20), min_size=1, max_size=40), st.integers(0, 25), st.integers(0, 5))
def test_max_lag_drops_or_masks_exactly_the_old_tokens(versions: list[int], current: int, lag: int) -> None:
    row = {"versions": versions, "loss_mask": [1 if v >= 0 else 0 for v in versions]}
    old = [0 <= v < current - lag for v in versions]
    dropped = lag_filter(row, current, lag, "drop")
    assert (dropped is None) == any(old)
    masked = lag_filter(row, current, lag, "mask")
    assert masked is not None
    assert masked["loss_mask"] == [0 if o else m for m, o in zip(row["loss_mask"], old, strict=True)]
