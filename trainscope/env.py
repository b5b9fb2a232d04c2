"""Every environment variable trainscope reads, as documented constants.

Settings resolve in one order everywhere: an explicit argument, then the environment variable
named here, then the default. Nothing else in trainscope reads ``os.environ`` for its own
settings (the launcher variables of torchrun and friends are listed at the end, read-only).
"""

from __future__ import annotations

# -- trainscope's own settings ---------------------------------------------------------------

TRAINSCOPE_BUS = "TRAINSCOPE_BUS"
"""Where to publish: ``memory`` or ``kafka://HOST:PORT[,HOST:PORT]``. Unset: nothing leaves the
process (attach() says so once in the log)."""

TRAINSCOPE_JOB_ID = "TRAINSCOPE_JOB_ID"
"""The job's identity in every record. Default: torchrun's run id, else ``local-<pid>``."""

TRAINSCOPE_WINDOW_S = "TRAINSCOPE_WINDOW_S"
"""Length of the summary windows in seconds (aligned to the epoch). Default 15."""
DEFAULT_WINDOW_S = 15.0
"""Its default, here because every producer (live or replayed) must cut the same windows."""

TRAINSCOPE_QUEUE_SIZE = "TRAINSCOPE_QUEUE_SIZE"
"""Records the in-process sender holds before it drops (and counts) new ones. Default 10000."""

TRAINSCOPE_PROFILE_BUDGET_S = "TRAINSCOPE_PROFILE_BUDGET_S"
"""Longest wall time one on-demand profiling session may run. Default 60."""

TRAINSCOPE_PROFILE_MAX_STEPS = "TRAINSCOPE_PROFILE_MAX_STEPS"
"""Most steps one on-demand profiling session may cover, whatever was requested. Default 50."""

TRAINSCOPE_DISABLE = "TRAINSCOPE_DISABLE"
"""``1``/``true``: attach() does nothing (a kill switch that needs no code change)."""

TRAINSCOPE_OPTRACE = "TRAINSCOPE_OPTRACE"
"""``1``/``true``: also publish the per-step op trace for what-if analysis. Default off."""

TRAINSCOPE_LOG_LEVEL = "TRAINSCOPE_LOG_LEVEL"
"""Level of the ``trainscope`` logger inside training processes. Default WARNING."""

TRAINSCOPE_STORE_DIR = "TRAINSCOPE_STORE_DIR"
"""The embedded ClickHouse (chDB) store directory. Default: ``$XDG_DATA_HOME/trainscope/store``
(``~/.local/share/trainscope/store``)."""

TRAINSCOPE_CLICKHOUSE_URL = "TRAINSCOPE_CLICKHOUSE_URL"
"""A ClickHouse server to use instead of the embedded store, e.g. ``http://host:8123``."""

TRAINSCOPE_CLICKHOUSE_USER = "TRAINSCOPE_CLICKHOUSE_USER"
"""User name for the ClickHouse server. Default ``default``."""

TRAINSCOPE_CLICKHOUSE_PASSWORD = "TRAINSCOPE_CLICKHOUSE_PASSWORD"
"""Password for the ClickHouse server; only ever read from the environment."""

ALL: tuple[str, ...] = (
    TRAINSCOPE_BUS,
    TRAINSCOPE_JOB_ID,
    TRAINSCOPE_WINDOW_S,
    TRAINSCOPE_QUEUE_SIZE,
    TRAINSCOPE_PROFILE_BUDGET_S,
    TRAINSCOPE_PROFILE_MAX_STEPS,
    TRAINSCOPE_DISABLE,
    TRAINSCOPE_OPTRACE,
    TRAINSCOPE_LOG_LEVEL,
    TRAINSCOPE_STORE_DIR,
    TRAINSCOPE_CLICKHOUSE_URL,
    TRAINSCOPE_CLICKHOUSE_USER,
    TRAINSCOPE_CLICKHOUSE_PASSWORD,
)

# -- launcher variables (set by torchrun / torch.distributed.launch / SLURM wrappers) --------

RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
MASTER_ADDR = "MASTER_ADDR"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
GROUP_RANK = "GROUP_RANK"
"""torchrun: index of this node among the job's nodes."""
