"""Helpers for the what-if tests: generate a trace and analyse it in one call."""

from __future__ import annotations

import pytest

from trainscope.schemas.optrace import JobMeta, validate
from trainscope.whatif.analysis import WhatIf, analyse
from trainscope.whatif.generate import JobSpec, generate
from trainscope.whatif.layout import Layout, build_layout


def _layout_of(spec: JobSpec) -> Layout:
    df, meta_dict = generate(spec)
    meta = JobMeta.from_mapping(meta_dict)
    return build_layout(validate(df, meta), meta)


def _analyse_spec(spec: JobSpec) -> WhatIf:
    return analyse(_layout_of(spec))


@pytest.fixture
def layout_of():
    """Function: generated trace of a job spec → validated layout."""
    return _layout_of


@pytest.fixture
def analyse_spec():
    """Function: generated trace of a job spec → analysis result."""
    return _analyse_spec


@pytest.fixture
def trace_files(tmp_path):
    """Factory: write a generated trace (parquet or csv) and its YAML; return both paths."""
    from trainscope.whatif.generate import write

    def make(spec: JobSpec, suffix: str = ".parquet", df=None, meta=None):
        gen_df, gen_meta = generate(spec)
        trace = tmp_path / f"trace{suffix}"
        meta_path = tmp_path / "meta.yaml"
        write(gen_df if df is None else df(gen_df), meta or gen_meta, trace, meta_path)
        return trace, meta_path

    return make
