"""Whole profiler traces: streaming ingestion, calling-context trees, analyzers with suggestions.

Everything here works on one or more Kineto/Chrome traces read into compact columns
(:mod:`trainscope.traces.reader`); it imports only the schemas, so a producer, the commands
and the stream job can all use it.
"""
