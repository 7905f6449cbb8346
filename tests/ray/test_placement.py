"""Session placement: pure bookkeeping, checked without Ray."""

from __future__ import annotations

from tokentape.ray.placement import EngineBook, SessionPlacement


def _placement(gateways: int) -> SessionPlacement:
    placement = SessionPlacement()
    for index in range(gateways):
        placement.add_gateway(index, f"http://127.0.0.1:{9000 + index}")
    return placement


def test_new_sessions_go_to_the_gateway_with_fewest_unfinished_sessions() -> None:
    placement = _placement(3)
    owners = [placement.place(f"s{i}") for i in range(7)]
    assert owners == [0, 1, 2, 0, 1, 2, 0]
    placement.finished("s1")
    placement.finished("s4")  # gateway 1 now has none open
    assert placement.place("s7") == 1


def test_a_session_keeps_its_gateway() -> None:
    placement = _placement(2)
    first = placement.place("a")
    for _ in range(5):
        placement.place(f"other-{_}")
    assert placement.place("a") == first


def test_a_group_stays_on_one_gateway() -> None:
    placement = _placement(2)
    placement.place("filler")  # gateway 0 busier
    owners = {placement.place(f"g{i}", group_id="prompt-1") for i in range(4)}
    assert owners == {1}


def test_a_placement_learnt_from_a_shard_counts_once() -> None:
    placement = _placement(2)
    placement.record("old", 1)
    placement.record("old", 1)
    assert placement.load() == {0: 0, 1: 1}
    placement.finished("old")
    placement.finished("old")
    assert placement.load() == {0: 0, 1: 0}
    placement.forget("old")
    assert placement.owner("old") is None


def test_engines_take_sessions_by_load_then_keep_them() -> None:
    book = EngineBook()
    engines = ["a", "b"]
    assert [book.acquire(f"s{i}", engines) for i in range(4)] == ["a", "b", "a", "b"]  # none in flight
    for _ in range(3):
        assert book.acquire("s1", engines) == "b"  # sticky, although b is now busier
    assert book.in_flight == {"a": 2, "b": 5}
    assert book.acquire("new", engines) == "a"  # least in flight
    book.release("b")
    assert book.in_flight["b"] == 4


def test_a_session_moves_only_when_its_engine_is_not_usable() -> None:
    book = EngineBook()
    assert book.acquire("s", ["a", "b"]) == "a"
    assert book.acquire("s", ["b"]) == "b"  # a is unhealthy or draining
    assert book.moves == 1
    assert book.sessions == {"a": 0, "b": 1}
