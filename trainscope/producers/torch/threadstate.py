"""Our callbacks on torch's own threads keep the Python thread state they run in.

A future's callback (``Future.then``, ``add_done_callback``) runs on the thread that completes
the future: for gloo a worker thread of its own, for NCCL its watchdog. Such a thread has no
Python thread state; pybind gives it a temporary one for the call and frees it on return.
torch's Python tracer (the profiler's ``with_stack``, which the on-demand profile needs for
call paths) registers itself in every thread state alive when it starts and swaps back into
each when it stops: a temporary one freed in between is a dangling pointer, and the training
process dies of SIGSEGV. Seen with torch 2.13 on CPython 3.11, a 4-rank gloo DDP job profiled
3 steps in every 5: with a Python DDP comm hook (ours, or torch's own ``allreduce_hook``)
6 of 7 runs crashed within seconds; with the callback's thread state kept, none of 14 did.

torch's autograd engine does the same for its device threads (it creates their thread state
once and keeps it); this does it for the threads our callbacks land on. It costs one thread
state per such thread, for the life of the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

# A flag per Python thread state, not per thread id: ids are reused once a thread exits (a
# process group destroyed and another created), and a set of ids would then take a new
# backend thread for one already kept and leave its temporary state to be freed.
_kept = threading.local()


def keep_thread_state() -> None:
    """Keep the calling thread's Python thread state for the rest of the process.

    One more ``PyGILState_Ensure`` that is never released: the thread's count never drops to
    zero, so the state is not freed when the callback returns. Cheap after the first call on a
    thread state (an attribute of a thread-local).
    """
    if getattr(_kept, "done", False):
        return
    _kept.done = True
    with contextlib.suppress(AttributeError):  # not CPython: no such thread states
        ctypes.pythonapi.PyGILState_Ensure()
