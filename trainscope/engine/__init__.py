"""The window engine and the stream job on it: windows, the embedded and bus-fed pipelines,
checkpoints, at-least-once delivery and the job's ``/metrics``."""
