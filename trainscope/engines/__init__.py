"""The same stream job on other engines: Faust (``faust``) and the PyFlink windowing tier
(``flink``, which runs in an environment of its own)."""
