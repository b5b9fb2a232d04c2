"""The single source of truth for every record: structs, wire codec, JSON Schema, DDL."""

from trainscope.schemas.codec import BadMessage, Batch, decode_batch, encode_batch
from trainscope.schemas.records import (
    CATEGORIES,
    LAYERS,
    SCHEMA_VERSION,
    ControlMessage,
    Finding,
    FindingCallPath,
    FunctionSummary,
    MetricSample,
    ProfileCallPaths,
    Record,
    SpanBatch,
    SpanEvent,
    StepRecord,
    SummaryBatch,
    Topology,
    WorkerInfo,
)

__all__ = [
    "CATEGORIES",
    "LAYERS",
    "SCHEMA_VERSION",
    "BadMessage",
    "Batch",
    "ControlMessage",
    "Finding",
    "FindingCallPath",
    "FunctionSummary",
    "MetricSample",
    "ProfileCallPaths",
    "Record",
    "SpanBatch",
    "SpanEvent",
    "StepRecord",
    "SummaryBatch",
    "Topology",
    "WorkerInfo",
    "decode_batch",
    "encode_batch",
]
