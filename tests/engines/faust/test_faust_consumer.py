"""The commit rule of the rebalance-safe Faust consumer: a committed offset never passes a
message that is not acknowledged. faust-streaming 0.15.3's own rule is run on the same input
beside it, so that the case it gets wrong is shown, not assumed."""

from __future__ import annotations

from typing import Any

from faust.transport.consumer import Consumer as FaustConsumer

from trainscope.engines.faust.consumer import committable_offset


class _FaustBookkeeping:
    """Just the attributes faust-streaming's ``Consumer._new_offset`` reads."""

    def __init__(self, acked: list[int], committed: int | None) -> None:
        self._acked: dict[str, list[int]] = {"tp": list(acked)}
        self._acked_index: dict[str, set[int]] = {"tp": set(acked)}
        self._gap: dict[str, Any] = {"tp": None}
        self._committed_offset: dict[str, int | None] = {"tp": committed}


def faust_rule(acked: list[int], committed: int | None) -> int | None:
    return FaustConsumer._new_offset(_FaustBookkeeping(acked, committed), "tp")  # type: ignore[arg-type]


def ours(acked: list[int], base: int | None) -> int | None:
    return committable_offset(list(acked), set(acked), base)


def test_a_run_from_the_committed_position_is_committed() -> None:
    assert ours([12, 10, 11, 14], base=10) == 13
    assert ours([0, 1, 2], base=0) == 3


def test_out_of_order_acknowledgements_hold_the_position_back() -> None:
    # Messages 0..4 still in flight on a partition with nothing committed yet: faust-streaming
    # commits 8, and a worker killed now loses 0..4.
    assert faust_rule([5, 6, 7], committed=None) == 8
    assert ours([5, 6, 7], base=0) is None
    # One past the committed position: faust-streaming skips offset 10.
    assert faust_rule([11, 12], committed=10) == 13
    assert ours([11, 12], base=10) is None


def test_without_a_known_base_nothing_is_committed() -> None:
    assert ours([3, 4], base=None) is None


def test_acknowledgements_below_the_base_are_dropped_not_blocking() -> None:
    acked = [4, 7, 5, 8]  # 4 and 5 acknowledged again after 7 was committed
    index = set(acked)
    assert committable_offset(acked, index, 7) == 9
    assert acked == [] and index == set()


def test_the_run_is_taken_out_and_the_rest_kept() -> None:
    acked, index = [3, 4, 6, 7], {3, 4, 6, 7}
    assert committable_offset(acked, index, 3) == 5
    assert acked == [6, 7] and index == {6, 7}
    assert committable_offset(acked, index, 5) is None  # 5 still in flight
    acked.append(5)
    index.add(5)
    assert committable_offset(acked, index, 5) == 8
