"""Every environment variable trainscope reads, as documented constants.

Settings resolve in one order everywhere: an explicit argument, then the environment variable
named here, then the default. Nothing else in trainscope reads ``os.environ`` for its own
settings (the launcher variables of torchrun and friends are listed at the end, read-only).
"""

from __future__ import annotations

# -- trainscope's own settings ---------------------------------------------------------------

TRAINSCOPE_BUS = "TRAINSCOPE_BUS"
"""Where to publish: ``memory`` or ``kafka://HOST:PORT[,HOST:PORT][?settings]`` (TLS/SASL
settings: see the ``TRAINSCOPE_KAFKA_*`` variables below). Unset: nothing leaves the
process (attach() says so once in the log)."""

TRAINSCOPE_JOB_ID = "TRAINSCOPE_JOB_ID"
"""The job's identity in every record. Default: torchrun's run id, else ``local-<pid>``."""

TRAINSCOPE_WINDOW_S = "TRAINSCOPE_WINDOW_S"
"""Length of the summary windows in seconds (aligned to the epoch). Default 15."""
DEFAULT_WINDOW_S = 15.0
"""Its default, here because every producer (live or replayed) must cut the same windows."""

TRAINSCOPE_WIRE = "TRAINSCOPE_WIRE"
"""How producers encode bus messages: ``msgpack`` (default) or ``json`` (the form the PyFlink
job reads; see trainscope.schemas.json_wire). Consumers read both. Read by the wire codec
itself (trainscope.schemas.codec), the one place every producer encodes through."""

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

TRAINSCOPE_STORE_READ_TOKEN = "TRAINSCOPE_STORE_READ_TOKEN"
"""A token the owner of an embedded store requires of every reader of its read endpoint (see
trainscope.store.live), and that readers of a store owned by another process send (as
ClickHouse's password or the ``X-ClickHouse-Key`` header). Unset: no token, loopback only."""

TRAINSCOPE_STORE_READ_BIND = "TRAINSCOPE_STORE_READ_BIND"
"""Address the owner's read endpoint listens on. Default ``127.0.0.1``; the port is free-picked
and written into the store directory (``trainscope-endpoint.json``). ``off``: no endpoint."""

# -- Kafka security: TLS and SASL for every Kafka client (settings in the kafka:// URL's query
# win over these). Secrets (the two passwords) come only from here or from a file. -----------

TRAINSCOPE_KAFKA_SECURITY_PROTOCOL = "TRAINSCOPE_KAFKA_SECURITY_PROTOCOL"
"""``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT`` or ``SASL_SSL``. Default: ``SSL`` when a CA or
client certificate is given, ``SASL_SSL`` when a SASL mechanism is given, else ``PLAINTEXT``."""

TRAINSCOPE_KAFKA_SSL_CAFILE = "TRAINSCOPE_KAFKA_SSL_CAFILE"
"""PEM file of the CA(s) that signed the brokers' certificates. Default: the system's CAs."""

TRAINSCOPE_KAFKA_SSL_CERTFILE = "TRAINSCOPE_KAFKA_SSL_CERTFILE"
"""PEM client certificate, for brokers that authenticate clients by certificate (mTLS)."""

TRAINSCOPE_KAFKA_SSL_KEYFILE = "TRAINSCOPE_KAFKA_SSL_KEYFILE"
"""PEM private key of the client certificate (if not in the certificate file)."""

TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD = "TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD"
"""Password of an encrypted client key. Secret: never accepted in a URL, never printed."""

TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD_FILE = "TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD_FILE"
"""A file holding that password (e.g. a mounted secret); used when the variable above is unset."""

TRAINSCOPE_KAFKA_SSL_CHECK_HOSTNAME = "TRAINSCOPE_KAFKA_SSL_CHECK_HOSTNAME"
"""``false`` to accept a broker certificate whose name does not match the address. Default true."""

TRAINSCOPE_KAFKA_SASL_MECHANISM = "TRAINSCOPE_KAFKA_SASL_MECHANISM"
"""``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512``."""

TRAINSCOPE_KAFKA_SASL_USERNAME = "TRAINSCOPE_KAFKA_SASL_USERNAME"
"""SASL user name."""

TRAINSCOPE_KAFKA_SASL_PASSWORD = "TRAINSCOPE_KAFKA_SASL_PASSWORD"
"""SASL password. Secret: never accepted in a URL, never printed."""

TRAINSCOPE_KAFKA_SASL_PASSWORD_FILE = "TRAINSCOPE_KAFKA_SASL_PASSWORD_FILE"
"""A file holding the SASL password; used when the variable above is unset."""

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
    TRAINSCOPE_KAFKA_SECURITY_PROTOCOL,
    TRAINSCOPE_KAFKA_SSL_CAFILE,
    TRAINSCOPE_KAFKA_SSL_CERTFILE,
    TRAINSCOPE_KAFKA_SSL_KEYFILE,
    TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD,
    TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD_FILE,
    TRAINSCOPE_KAFKA_SSL_CHECK_HOSTNAME,
    TRAINSCOPE_KAFKA_SASL_MECHANISM,
    TRAINSCOPE_KAFKA_SASL_USERNAME,
    TRAINSCOPE_KAFKA_SASL_PASSWORD,
    TRAINSCOPE_KAFKA_SASL_PASSWORD_FILE,
)

# -- launcher variables (set by torchrun / torch.distributed.launch / SLURM wrappers) --------

RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
MASTER_ADDR = "MASTER_ADDR"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
GROUP_RANK = "GROUP_RANK"
"""torchrun: index of this node among the job's nodes."""
