"""Load a Megatron-style op trace (Parquet or CSV) and its job metadata (YAML), and validate them.

Everything that can be wrong with the input is reported as a :class:`TraceError` whose message
names the file, the column and the offending value, so the command line can print one clear line.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from trainscope.schemas.errors import TrainscopeError
from trainscope.schemas.optypes import CODE, OPTYPES

# Columns the analysis needs, with the dtype they are converted to.
REQUIRED_COLUMNS: dict[str, str] = {
    "dp_rank": "int32",
    "stage": "int32",
    "rank": "int64",
    "step": "int64",
    "optype": "str",
    "start_ts": "float64",
    "duration": "float64",
    "seq_id": "int32",
}
# Present in Megatron traces; only used to pair sends with receives, so they may be missing.
OPTIONAL_COLUMNS: dict[str, str] = {"mc": "int32", "gmc": "int32", "mb_id": "float64"}
TIME_COLUMNS = frozenset({"start_ts", "duration"})
# The integer columns' range as the store keeps them (op_traces in trainscope.schemas.whatif).
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
STORED_INT_RANGE: dict[str, tuple[int, int]] = {
    "dp_rank": _INT32, "stage": _INT32, "rank": _INT64, "step": _INT64, "seq_id": _INT32,
    "mc": _INT32, "gmc": _INT32, "mb_id": _INT32,
}
META_KEYS: tuple[str, ...] = ("dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size")


class TraceError(ValueError, TrainscopeError):
    """The trace or its metadata cannot be analysed; the message says why."""


@dataclass(frozen=True)
class JobMeta:
    dp_size: int
    pp_size: int
    tp_size: int = 1
    dsp_size: int = 1
    vpp_size: int = 1
    world_size: int = 0

    @property
    def workers(self) -> int:
        """Workers in the trace: one per (dp_rank, stage); TP/CP peers are inside each op."""
        return self.dp_size * self.pp_size

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_mapping(cls, data: Any, source: str = "metadata") -> JobMeta:
        if not isinstance(data, dict):
            kind = type(data).__name__
            raise TraceError(f"{source}: expected a mapping of job sizes, got {kind}")
        values: dict[str, int] = {}
        for key in (*META_KEYS, "world_size"):
            if key not in data:
                if key in ("dp_size", "pp_size", "world_size"):
                    raise TraceError(f"{source}: missing key {key!r}")
                continue
            raw = data[key]
            if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= _INT32[1]:
                raise TraceError(f"{source}: {key} must be a positive integer up to "
                                 f"{_INT32[1]}, got {raw!r}")
            values[key] = raw
        meta = cls(**values)
        product = meta.dp_size * meta.pp_size * meta.tp_size * meta.dsp_size
        if meta.world_size != product:
            raise TraceError(
                f"{source}: world_size {meta.world_size} does not match dp_size × pp_size × "
                f"tp_size × dsp_size = {meta.dp_size}×{meta.pp_size}×{meta.tp_size}×"
                f"{meta.dsp_size} = {product}"
            )
        return meta


def read_meta(path: str | Path) -> JobMeta:
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise TraceError(f"{path}: cannot read metadata ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise TraceError(f"{path}: not valid YAML ({_yaml_problem(exc)})") from exc
    return JobMeta.from_mapping(data, str(path))


def _yaml_problem(exc: Exception) -> str:
    """PyYAML's error on one line: its own text spans several, with a caret under the spot."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return " ".join(str(exc).split()) or type(exc).__name__


def read_table(path: str | Path) -> pd.DataFrame:
    """Read the raw table; the format is chosen by the file suffix."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix in (".parquet", ".pq"):
            return pd.read_parquet(path)
        if suffix in (".csv", ".gz"):
            return pd.read_csv(path)
    except FileNotFoundError as exc:
        raise TraceError(f"{path}: no such file") from exc
    except (OSError, ValueError) as exc:
        raise TraceError(f"{path}: cannot read trace ({exc})") from exc
    raise TraceError(f"{path}: unknown trace format {suffix!r} (use .parquet or .csv)")


def load_trace(path: str | Path, meta: JobMeta) -> pd.DataFrame:
    return validate(read_table(path), meta, str(path))


def validate(df: pd.DataFrame, meta: JobMeta, source: str = "trace", *,
             whole: bool = True) -> pd.DataFrame:
    """Check columns, types, op types and worker coordinates; return a normalised frame.

    The result has the required columns with fixed dtypes, ``optype`` replaced by an integer
    code column ``op`` and the optional columns filled with -1 where absent. ``whole``: the
    trace of the whole job, so every worker the metadata counts must be in it (a part, such as
    one rank's message on the bus, need not hold them all).
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise TraceError(f"{source}: missing column(s) {', '.join(map(repr, missing))}")
    if len(df) == 0:
        raise TraceError(f"{source}: the trace has no rows")
    out: dict[str, np.ndarray] = {}
    for name, dtype in {**REQUIRED_COLUMNS, **OPTIONAL_COLUMNS}.items():
        if name == "optype":
            continue
        if name not in df.columns:
            out[name] = np.full(len(df), -1, dtype=dtype)
            continue
        column = pd.to_numeric(df[name], errors="coerce")
        bad = column.isna()
        if name in OPTIONAL_COLUMNS:
            column = column.fillna(-1)
        elif bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            raise TraceError(
                f"{source}: column {name!r} has a missing or non-numeric value "
                f"{df[name].iloc[row]!r} (row {row})"
            )
        _check_fits(name, column, df[name], source)
        out[name] = column.to_numpy(dtype=dtype)
    codes = _optype_codes(df["optype"])
    if (codes < 0).any():
        row = int(np.flatnonzero(codes < 0)[0])
        raise TraceError(
            f"{source}: unknown optype {df['optype'].iloc[row]!r} (row {row}); expected one "
            f"of {', '.join(OPTYPES)}"
        )
    out["op"] = codes.astype(np.int8)
    _check_ranges(out, meta, source, whole)
    return pd.DataFrame(out)


def _check_fits(name: str, column: pd.Series, raw: pd.Series, source: str) -> None:
    """Times must be finite, and integers fit the store's column: a value narrowed on the way
    in would be stored as another (2**40 as dp_rank 0), and one the store refuses would fail
    the insert of every good row beside it."""
    values = column.to_numpy()
    if name in TIME_COLUMNS:
        bad = ~np.isfinite(values)
        what = "a non-finite value"
    else:
        low, high = STORED_INT_RANGE[name]
        bad = (values < low) | (values > high)
        what = f"a value outside {low}..{high}"
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise TraceError(f"{source}: column {name!r} has {what}: {raw.iloc[row]!r} (row {row})")


def _optype_codes(column: pd.Series) -> np.ndarray:
    """Our optype codes, -1 for unknown or missing names."""
    if not isinstance(column.dtype, pd.CategoricalDtype):
        column = column.astype("category")
    # Translate the few categories, not the millions of rows.
    lookup = np.array([CODE.get(str(c), -1) for c in column.cat.categories] + [-1], np.int64)
    return lookup[column.cat.codes.to_numpy()]


def _check_ranges(cols: dict[str, np.ndarray], meta: JobMeta, source: str, whole: bool) -> None:
    for name, limit, size_key in (
        ("dp_rank", meta.dp_size, "dp_size"),
        ("stage", meta.pp_size, "pp_size"),
        ("rank", meta.world_size, "world_size"),
    ):
        values = cols[name]
        bad = (values < 0) | (values >= limit)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise TraceError(
                f"{source}: {name} {int(values[row])} (row {row}) is outside 0..{limit - 1} "
                f"given {size_key} {limit} in the metadata"
            )
    if (cols["duration"] < 0).any():
        row = int(np.flatnonzero(cols["duration"] < 0)[0])
        raise TraceError(f"{source}: negative duration {cols['duration'][row]!r} (row {row})")
    if not whole:
        return
    worker_ids = np.unique(cols["stage"].astype(np.int64) * meta.dp_size + cols["dp_rank"])
    if len(worker_ids) != meta.workers:
        raise TraceError(
            f"{source}: the trace has {len(worker_ids)} workers (dp_rank, stage) but the metadata "
            f"says dp_size × pp_size = {meta.dp_size}×{meta.pp_size} = {meta.workers}"
        )


def optype_name(code: int) -> str:
    return OPTYPES[code]


__all__ = ["CODE", "JobMeta", "TraceError", "load_trace", "read_meta", "read_table", "validate"]
