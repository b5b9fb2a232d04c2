"""One closed window of one job, as data frames: what the engine produces and detectors read.

It lives with the records because it is the contract between the window engine, the detectors
and the sinks; none of them owns it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from trainscope.schemas.records import Finding, Topology

SUMMARY_COLUMNS = (
    "rank",
    "layer",
    "name",
    "callpath_id",
    "count",
    "total_ns",
    "m2_ns2",
    "min_ns",
    "max_ns",
    "bytes_total",
)
STEP_COLUMNS = (
    "rank",
    "step",
    "start_ns",
    "duration_ns",
    "samples",
    "tokens",
    "seq_len_mean",
    "seq_len_max",
    "collective_ns",
    "device_collective_ns",
)
METRIC_COLUMNS = ("rank", "host", "device", "ts_ns", "name", "value")


def empty_frame(columns: tuple[str, ...]) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="object" if c in ("layer", "name", "host") else "int64")
                         for c in columns})


@dataclass(frozen=True)
class WindowView:
    """Everything one job produced in one closed window, as data frames.

    - ``summaries``: one row per (rank, layer, name, callpath_id), columns ``SUMMARY_COLUMNS``;
    - ``steps``: one row per step record that started in the window, ``STEP_COLUMNS``;
    - ``metrics``: one row per metric sample taken in the window, ``METRIC_COLUMNS``;
    - ``topology``: the job's declared layout, if a producer sent one;
    - ``clock_offsets``: ranks whose clock was off and whose times were corrected.
    Detectors must not modify these frames.
    """

    job_id: str
    window_start_ns: int
    window_end_ns: int
    summaries: pd.DataFrame = field(default_factory=lambda: empty_frame(SUMMARY_COLUMNS))
    steps: pd.DataFrame = field(default_factory=lambda: empty_frame(STEP_COLUMNS))
    metrics: pd.DataFrame = field(default_factory=lambda: empty_frame(METRIC_COLUMNS))
    topology: Topology | None = None
    # Ranks whose clock the engine found off its peers' and corrected: rank -> (offset ns, the
    # steps the estimate rests on); their times in the frames above are already corrected.
    clock_offsets: dict[int, tuple[int, int]] = field(default_factory=dict)

    def finding(self, detector: str, **fields: object) -> Finding:
        """A Finding stamped with this window's job and bounds."""
        return Finding(
            job_id=self.job_id,
            window_start_ns=self.window_start_ns,
            window_end_ns=self.window_end_ns,
            detector=detector,
            **fields,  # type: ignore[arg-type]
        )

    def derived(self, key: str, compute: Callable[[WindowView], Any]) -> Any:
        """``compute(self)``, computed once per view under ``key``: the per-rank tables that
        several detectors derive alike from the same frames (at 10,240 ranks a pivot of the
        summaries costs a tenth of a second). Callers hand out copies of what is mutable."""
        cache: dict[str, Any] | None = self.__dict__.get("_derived")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_derived", cache)  # frozen: the frames never change
        if key not in cache:
            cache[key] = compute(self)
        return cache[key]

    def ranks(self) -> np.ndarray:
        """Every rank with a summary or a step record in the window, sorted."""
        return self.derived("ranks", lambda view: np.union1d(
            pd.unique(view.summaries["rank"].to_numpy()),
            pd.unique(view.steps["rank"].to_numpy())).astype(np.int64))

    def rank_layout(self) -> pd.DataFrame:
        """dp_rank / pp_stage / tp_rank per rank (index), from the topology or defaults."""
        return self.derived("rank_layout", WindowView._rank_layout).copy()

    def _rank_layout(self) -> pd.DataFrame:
        if self.topology is not None and self.topology.workers:
            return pd.DataFrame(
                {
                    "rank": [w.rank for w in self.topology.workers],
                    "host": [w.host for w in self.topology.workers],
                    "dp_rank": [w.dp_rank for w in self.topology.workers],
                    "pp_stage": [w.pp_stage for w in self.topology.workers],
                    "tp_rank": [w.tp_rank for w in self.topology.workers],
                }
            ).set_index("rank")
        ranks = self.ranks().tolist()
        return pd.DataFrame(
            {"rank": ranks, "host": "", "dp_rank": ranks, "pp_stage": 0, "tp_rank": 0}
        ).set_index("rank")
