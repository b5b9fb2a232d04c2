"""Per-window condensation of what the collectors produced, with a bound on memory.

Collectors report every interval (1 s by default); the agent publishes once per window. Metric
samples of one series (job, host, rank, device, name) become one sample per window — the mean
for gauges, the OR of bits for the clock-event reason mask, the sum for event counts, the last
value for cumulative counters. The reason mask also yields ``throttled_frac``, the share of
readings with a throttling bit set, judged reading by reading: the OR over a window would call a
GPU throttled after a single power-cap blip (idle and clock-setting bits never count).
Function summaries of one function and rank merge exactly, and leave as one
:class:`SummaryBatch` per job and rank. A window's summaries carry its bounds and its condensed
readings its end (``ts_ns``): the stream job files a reading by the instant before its stamp,
so both land in the same window of the epoch grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from trainscope.schemas import metrics as m
from trainscope.schemas import summaries
from trainscope.schemas.records import FunctionSummary, MetricSample, Record, SummaryBatch

_BITS = frozenset({m.THROTTLE_REASONS})
_SUMS = frozenset({m.XID_EVENTS, m.ECC_ERRORS})
_LAST = frozenset({m.PCIE_REPLAY_COUNT, m.NVLINK_ERROR_COUNT})

SeriesKey = tuple[str, str, int, int, str]
FunctionKey = tuple[str, int, str, str, int]


@dataclass
class _Series:
    total: float = 0.0
    count: int = 0
    bits: int = 0
    throttled: int = 0  # readings with a throttling reason
    last: float = 0.0


class WindowAggregator:
    """Accumulates one window; ``max_series`` bounds the distinct series and functions kept."""

    def __init__(self, max_series: int = 50_000) -> None:
        if max_series < 1:
            raise ValueError(f"max_series must be >= 1, got {max_series}")
        self.max_series = max_series
        self.dropped = 0  # records refused because the window was full (cumulative)
        self._metrics: dict[SeriesKey, _Series] = {}
        self._functions: dict[FunctionKey, FunctionSummary] = {}

    def __len__(self) -> int:
        return len(self._metrics) + len(self._functions)

    def add(self, records: list[Record]) -> None:
        for record in records:
            if isinstance(record, MetricSample):
                self._add_metric(record)
            elif isinstance(record, FunctionSummary):
                self._add_summary(record)
            else:
                raise TypeError(f"the agent aggregates metrics and summaries, not {type(record)}")

    def _full(self) -> bool:
        if len(self) < self.max_series:
            return False
        self.dropped += 1
        return True

    def _add_metric(self, sample: MetricSample) -> None:
        key = (sample.job_id, sample.host, sample.rank, sample.device, sample.name)
        series = self._metrics.get(key)
        if series is None:
            if self._full():
                return
            series = self._metrics[key] = _Series()
        series.count += 1
        series.total += sample.value
        series.last = sample.value
        if sample.name in _BITS:
            series.bits |= int(sample.value)
            series.throttled += bool(int(sample.value) & m.THROTTLING_REASONS_MASK)

    def _add_summary(self, summary: FunctionSummary) -> None:
        key = (summary.job_id, summary.rank, summary.layer, summary.name, summary.callpath_id)
        previous = self._functions.get(key)
        if previous is None:
            if self._full():
                return
            self._functions[key] = summary
        else:
            self._functions[key] = summaries.merge(previous, summary)

    def flush(
        self, window_start_ns: int, window_end_ns: int
    ) -> list[MetricSample | SummaryBatch]:
        """The window's records, stamped with its bounds; the aggregator starts empty again."""
        out: list[MetricSample | SummaryBatch] = []
        for (job_id, host, rank, device, name), s in self._metrics.items():
            if name in _BITS:
                values = {name: float(s.bits), m.THROTTLED_FRAC: s.throttled / s.count}
            elif name in _SUMS:
                values = {name: s.total}
            elif name in _LAST:
                values = {name: s.last}
            else:
                values = {name: s.total / s.count}
            out += [
                MetricSample(
                    job_id=job_id,
                    host=host,
                    rank=rank,
                    device=device,
                    ts_ns=window_end_ns,
                    name=metric,
                    value=value,
                )
                for metric, value in values.items()
            ]
        by_rank: dict[tuple[str, int], list[FunctionSummary]] = {}
        for summary in self._functions.values():
            by_rank.setdefault((summary.job_id, summary.rank), []).append(
                msgspec.structs.replace(
                    summary, window_start_ns=window_start_ns, window_end_ns=window_end_ns
                )
            )
        # One batch per job and rank, so the daemon can key each by its rank's partition.
        for rows in by_rank.values():
            out += summaries.batches_of(rows)
        self._metrics.clear()
        self._functions.clear()
        return out
