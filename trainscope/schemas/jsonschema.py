"""JSON Schema for non-Python consumers of the bus."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from trainscope.schemas.codec import Batch
from trainscope.schemas.records import RECORD_TYPES


def export(directory: Path) -> list[Path]:
    """Write one ``<Record>.schema.json`` per record kind plus ``Batch.schema.json``."""
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} exists and is not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for struct in (*RECORD_TYPES, Batch):
        schema = msgspec.json.schema(struct)
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["title"] = struct.__name__
        path = directory / f"{struct.__name__}.schema.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
