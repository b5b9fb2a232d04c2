"""Replay producers: publish existing traces (Kineto/torch.profiler, op traces) as if live."""
