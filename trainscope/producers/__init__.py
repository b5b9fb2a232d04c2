"""Everything that creates events: in-process hooks, host agent, replay, simulated cluster."""
