"""Stream processing: the bus, the window engine and the stream jobs."""
