"""Bounded staleness as properties over a fake version clock: sessions are refused exactly when their
first token is older than current - K; the admitted groups never exceed (K + version + 1) x B, and a
group is refused only when admitting it would exceed that; max_lag drops or masks exactly the tokens
older than current - lag."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokentape.core.staleness import GroupAdmission, is_stale, lag_filter

events = st.lists(
    st.one_of(st.just(("bump", "")), st.tuples(st.just("group"), st.sampled_from([f"g{i}" for i in range(30)]))),
    max_size=200,
)


@given(st.integers(0, 5), st.integers(1, 4), events)
def test_admitted_groups_never_exceed_the_limit_and_refusals_are_exact(k: int, b: int, steps: list) -> None:
    """The rule stated as AReaL states it, not as the code computes it: the trainer takes B groups per
    version, so the i-th group admitted (from 0) is trained on at version i // B; admitting it at
    version v is allowed iff it is then at most K versions old (i // B - v <= K). A group the gateway
    still knows (admitted in the last K + 1 versions) is not admitted twice; one admitted earlier is
    forgotten, so the record holds only the groups of the last K + 1 versions."""
    admission = GroupAdmission(k, b)
    version, count = 0, 0
    admitted: dict[str, int] = {}  # the oracle's record: group -> the version of its last admission
    for kind, group in steps:
        if kind == "bump":
            version += 1
            continue
        known = group in admitted and admitted[group] >= version - k
        fits = count // b - version <= k  # the next group would be the count-th
        assert admission.admit(group, version) == (known or fits)
        if not known and fits:
            admitted[group] = version
            count += 1
        if not (known or fits):
            wait = admission.versions_to_wait(version)  # the first version at which it fits
            assert count // b - (version + wait) <= k < count // b - (version + wait - 1)
        assert len(admission.recent) == sum(1 for v in admitted.values() if v >= version - k)


@given(st.integers(0, 50), st.integers(0, 60), st.one_of(st.none(), st.integers(0, 10)))
def test_a_session_is_stale_exactly_when_its_first_token_is_older_than_current_minus_k(
    first: int, current: int, k: int | None
) -> None:
    stale = is_stale(first, current, k)
    # the versions a session would span if it sampled now: more than K + 1 of them is too many
    spans = len(range(first, current + 1))
    assert stale == (k is not None and spans > k + 1)
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
