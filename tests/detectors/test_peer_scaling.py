"""The peer detector's per-window lookups that replace a pass over every rank per suspect give
the answers of that pass (a 10,240-rank window holds hundreds of suspects: see
benchmarks/README.md). Each is checked against the straightforward computation it replaces, on
random windows with NaNs, ties, pipelines and many suspects."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest

from trainscope.detectors import peer_groups
from trainscope.detectors.features import robust_z, robust_z_matrix
from trainscope.detectors.peer_groups import (
    HEALTHY_QUANTILE,
    MAX_VICTIMS,
    VICTIM_WAIT_FRAC,
    Groups,
    LargerElsewhere,
    victims,
    victims_many,
)
from trainscope.detectors.peer_own import history_reference
from trainscope.detectors.throttle import PeerMedians


def random_layout(rng: np.random.Generator, dp: int, pp: int, tp: int) -> pd.DataFrame:
    ranks = rng.permutation(dp * pp * tp)[: dp * pp * tp - rng.integers(0, 3)]  # some missing
    return pd.DataFrame({"rank": ranks, "dp_rank": ranks // (pp * tp), "pp_stage": ranks // tp % pp,
                         "tp_rank": ranks % tp}).set_index("rank")


@pytest.mark.parametrize("seed", range(8))
def test_the_median_of_the_other_ranks_is_pandas_median_without_the_rank(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 40))
    frame = pd.DataFrame({
        "a": rng.integers(0, 4, rows).astype(float),  # ties
        "b": np.where(rng.random(rows) < 0.3, np.nan, rng.random(rows)),  # NaNs
        "c": np.full(rows, np.nan),  # nothing known
    }, index=rng.permutation(1000)[:rows])
    peers = PeerMedians(frame)
    for rank in [*frame.index, 5000]:  # and a rank without a row
        for column in ("a", "b", "c", "missing"):
            expected = (frame[column].drop(index=rank, errors="ignore").median()
                        if column in frame else np.nan)
            got = peers.without(column, rank)
            assert got == pytest.approx(expected, nan_ok=True), (rank, column)
        assert peers.has_peers(rank) == (not frame.drop(index=rank, errors="ignore").empty)


def naive_pipeline_neighbours(layout: pd.DataFrame, a: int, b: int) -> bool:
    ra, rb = layout.loc[a], layout.loc[b]  # NaN coordinates compare unequal: no neighbour
    return bool(ra["dp_rank"] == rb["dp_rank"] and ra["tp_rank"] == rb["tp_rank"]
                and abs(int(ra["pp_stage"]) - int(rb["pp_stage"])) == 1)


@pytest.mark.parametrize("seed", range(6))
def test_the_larger_suspects_elsewhere_are_those_of_a_pass_over_all(seed: int) -> None:
    rng = np.random.default_rng(seed)
    layout = random_layout(rng, 4, 4, 2)
    ranks = list(layout.index)
    totals = {(int(r), c): float(rng.choice([1e6, 2e6, rng.random() * 1e7]))  # ties too
              for r in rng.choice(ranks, 20, replace=False)
              for c in rng.choice(["network", "host", "gpu-compute"], rng.integers(1, 3),
                                  replace=False)}
    layout = layout.astype(float)
    layout.loc[int(rng.choice(ranks))] = np.nan  # a rank outside the declared topology
    larger = LargerElsewhere(totals, Groups(layout, pd.Series(0.0, index=layout.index)))
    for (rank, category), excess in totals.items():
        expected = sum(
            e for (r, c), e in totals.items()
            if r != rank and e > excess
            and not (c == category == "network" and naive_pipeline_neighbours(layout, r, rank)))
        assert larger.than(rank, category, excess) == pytest.approx(expected, abs=1e-3)


def naive_victims(layout: pd.DataFrame, waits: pd.Series, culprits: list[int], excess: float,
                  culprit_waits_too: bool) -> list[int]:
    present = [r for r in culprits if r in waits.index]
    baseline = (float(waits[present].min()) if present and not culprit_waits_too
                else float(waits.quantile(HEALTHY_QUANTILE)))
    related = pd.Series(False, index=layout.index)
    for _, c in layout.loc[[r for r in culprits if r in layout.index]].iterrows():
        same_stage = layout["pp_stage"] == c["pp_stage"]
        related |= same_stage & (layout["dp_rank"] == c["dp_rank"])
        related |= same_stage & (layout["tp_rank"] == c["tp_rank"])
        related |= (layout["dp_rank"] == c["dp_rank"]) & (layout["tp_rank"] == c["tp_rank"])
    related[[r for r in culprits if r in related.index]] = False
    inflated = waits.reindex(layout.index).fillna(0.0) >= baseline + VICTIM_WAIT_FRAC * excess
    return [int(r) for r in layout.index[related & inflated]][:MAX_VICTIMS]


@pytest.mark.parametrize("seed", range(6))
def test_victims_are_those_of_a_pass_over_the_layout_per_culprit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    layout = random_layout(rng, 8, 4, 2).astype(float)
    # Ranks that sent data but are not in the declared topology: no coordinates, no group.
    layout.iloc[-3:] = np.nan
    waits = pd.Series(rng.random(len(layout)) * 1e8, index=layout.index)
    waits = waits.drop(index=waits.index[:2])  # ranks without collective time
    groups = Groups(layout, waits)
    for _ in range(30):
        culprits = [int(r) for r in rng.choice(layout.index, rng.integers(1, 6), replace=False)]
        excess = float(rng.random() * 5e7)
        for network in (False, True):
            assert victims(groups, culprits, excess, network) == naive_victims(
                layout, waits, culprits, excess, network)


@pytest.mark.parametrize("share_waiting", [0.02, 0.3, 1.0])
def test_victims_in_groups_of_hundreds_are_those_of_a_pass_over_the_layout(
        share_waiting: float) -> None:
    """DP groups of about 700 ranks (a large job's), where the ranks that wait long enough are
    few and scattered, many, or all: the members are searched in blocks from the front, and
    the first victims found must be the pass's."""
    rng = np.random.default_rng(int(share_waiting * 100))
    layout = random_layout(rng, 700, 2, 1).astype(float)
    waiting = rng.random(len(layout)) < share_waiting
    waits = pd.Series(np.where(waiting, 5e7 + rng.random(len(layout)) * 5e7,
                               rng.random(len(layout)) * 1e6), index=layout.index)
    groups = Groups(layout, waits)
    for culprit in rng.choice(layout.index, 40, replace=False):
        excess = float(rng.random() * 3e8)
        for network in (False, True):
            found = victims(groups, [int(culprit)], excess, network)
            assert found == naive_victims(layout, waits, [int(culprit)], excess, network)


# As chosen; every group scanned from the front, in slices of the suspects; every group's
# waiting members sorted by time.
@pytest.mark.parametrize(("cells", "few"), [(peer_groups._CELLS, peer_groups._FEW),
                                            (3_000, 0), (peer_groups._CELLS, 10**6)])
def test_the_victims_of_many_suspects_at_once_are_each_ones_pass(
        cells: int, few: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window's suspects are searched for together (thousands in a large job's window):
    DP groups of ~300 ranks, some ranks outside the topology or without collective time,
    single culprits (slow links among them, whose baseline is the job's) and whole stages;
    each suspect's victims must be the pass's, whatever the others'."""
    monkeypatch.setattr(peer_groups, "_CELLS", cells)
    monkeypatch.setattr(peer_groups, "_FEW", few)
    rng = np.random.default_rng(cells + few)
    layout = random_layout(rng, 300, 4, 2).astype(float)
    layout.iloc[-5:] = np.nan
    waiting = rng.random(len(layout)) < 0.2
    waits = pd.Series(np.where(waiting, 5e7 + rng.random(len(layout)) * 5e7,
                               rng.random(len(layout)) * 1e6), index=layout.index)
    # Whole milliseconds, and excesses whose quarter is too: thresholds that equal waits.
    waits = waits.drop(index=waits.index[:4]).round(-6)
    groups = Groups(layout, waits)
    suspects = []
    for _ in range(400):
        size = 1 if rng.random() < 0.9 else int(rng.integers(2, 6))
        culprits = [int(r) for r in rng.choice(layout.index, size, replace=False)]
        suspects.append((culprits, float(rng.integers(0, 300) * 4e6), bool(rng.random() < 0.3)))
    suspects.append(([10**6], 1e7, False))  # a rank the window does not hold
    found = victims_many(groups, suspects)
    assert [len(v) for v in found] != [0] * len(found)
    for (culprits, excess, network), got in zip(suspects, found, strict=True):
        assert got == naive_victims(layout, waits, culprits, excess, network)


@pytest.mark.parametrize("seed", range(8))
def test_robust_z_of_all_columns_at_once_is_robust_z_of_each_bit_for_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, columns = int(rng.integers(1, 80)), 6
    values = rng.random((rows, columns)) * 1e7
    values[:, 0] = np.round(values[:, 0] / 1e6)  # ties
    values[rng.random((rows, columns)) < 0.1] = np.nan  # missing cells
    values[:, 1] = np.nan  # a column nothing is known of
    groups = rng.integers(0, 5, rows)  # some groups under 3 members
    floor = rng.random(columns) * 1e4
    for by, rel_floor in ((groups, 0.02), (None, 0.0)):
        z, reference = robust_z_matrix(values, by, floor, rel_floor)
        for j in range(columns):
            expected_z, expected_reference = robust_z(
                pd.Series(values[:, j]), None if by is None else pd.Series(by), floor[j],
                rel_floor)
            np.testing.assert_array_equal(z[:, j], expected_z.to_numpy())
            np.testing.assert_array_equal(reference[:, j], expected_reference.to_numpy())


@pytest.mark.parametrize("windows", [5, 6])  # the middle one, the mean of two
@pytest.mark.parametrize("with_nan", [False, True])
def test_the_history_reference_is_numpy_nanmedian_of_the_stacked_windows(
        with_nan: bool, windows: int) -> None:
    rng = np.random.default_rng(int(with_nan) + 2 * windows)
    index = pd.Index(range(40), name="rank")
    columns = pd.MultiIndex.from_tuples([("torch_op", f"f{j}") for j in range(5)])
    history = []
    for _ in range(windows):
        values = np.round(rng.random((40, 5)) * 20)  # ties
        if with_nan:
            values[rng.random((40, 5)) < 0.2] = np.nan
        history.append(pd.DataFrame(values, index=index, columns=columns))
    median, mad = history_reference(history, index, columns)
    stack = np.stack([h.to_numpy() for h in history])
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = np.nanmedian(stack, axis=0)
        expected_mad = np.nanmedian(np.abs(stack - expected), axis=0)
    np.testing.assert_array_equal(median, expected)
    np.testing.assert_array_equal(mad, expected_mad)
