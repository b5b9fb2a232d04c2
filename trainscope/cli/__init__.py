"""Every command of ``trainscope`` (``main`` is the entry point), the demo job and the simulated
publisher: composition over every layer below, imported lazily one command at a time."""
