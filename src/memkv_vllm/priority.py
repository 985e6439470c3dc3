"""Store threads yield the CPU: the integrations' store (cascade, put) threads run at a higher
nice than the engine's other threads.

A store is background work: nothing waits for it. A lookup or a load is on a request's path to
its first token, and the engine's own threads (the scheduler loop, the model runner) are on
every token's. Where the host's CPUs are all busy, which a store storm from this and the other
engines of a host makes them, the kernel's scheduler shares them by weight: at nice 10 a store
thread weighs about a tenth of a nice-0 thread, so the threads that serve requests get a CPU
first, and the stores take what is left (all of it on an idle host). Measured with
`bench/fleet.py --storer-nice` (docs/performance.md, "Lookups while other engines store").

Linux gives each thread its own nice (setpriority(2) on a thread id). An unprivileged process
may raise a nice, never lower it again, so a thread at a raised nice runs store work only
(transfers.py). The nice counts among the threads of one scheduling group: with autogroup, those
of one session; under a cgroup's CPU controller, those of one cgroup (a container).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("vllm.memkv_vllm.priority")

MAX_NICE = 19
_warned = False


def current_nice() -> int | None:
    """This thread's nice; None where the platform has no per-thread nice."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return None


def lower_this_thread(by: int) -> int | None:
    """Raise the calling thread's nice by `by` (at most to 19); its new nice, or None where that
    cannot be done (then it says so once, at WARNING, and the thread runs on as it was)."""
    global _warned
    now = current_nice()
    if by <= 0 or now is None:
        return now
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(MAX_NICE, now + by))
    except OSError as exc:
        if not _warned:
            _warned = True
            log.warning("MemKV: store threads run at the engine's CPU priority: raising their nice failed (%s)", exc)
        return now
    return current_nice()
