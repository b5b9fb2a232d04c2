"""The in-process PyTorch producer: ``trainscope.attach()`` and ``trainscope.step()``.

Always on and cheap: step times, forward/backward/optimizer time of the top-level model,
data-loader waits, GC pauses and collectives, condensed per window into function summaries.
On demand (a control message): torch.profiler for a few steps on one rank, summarised per
function with call paths. Nothing here blocks or raises into the training loop.
"""

from trainscope.producers.torch.api import attach, current, step

__all__ = ["attach", "current", "step"]
