"""The GIL for the integrations' threads while vLLM's scheduler steps back to back.

A scheduler with nothing for the GPU in its own process (TP > 1, or every request waiting on
MemKV) steps in pure Python and keeps the GIL; CPython hands it to a waiting thread only after
its switch interval (5 ms by default), so the lookup and transfer threads, which need it
between every two syscalls, crawled: on an H200 TP=2 engine a 512-key exists round took 1.4-5 s
instead of 6 ms. The step hooks must not wait (vLLM calls them on its scheduler loop), so while
a lookup or load is in flight they lower the switch interval instead: a thread that needs the
GIL gets it within `step_yield_ms`, and only for as long as it runs Python; the scheduler loses
no time while those threads wait on the network.

The interval is one setting per process: `SwitchInterval`s of every manager in the process
lower it together (the smallest wish wins, never above what it was) and the last one to let go
puts back the interval found before the first, unless someone else changed it meanwhile.
"""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()
_wanted: dict[int, float] = {}  # id(SwitchInterval) -> interval it asks for, while it holds
_saved: float | None = None  # the interval before the first holder lowered it
_ours: float | None = None  # the interval the holders set last


def _apply() -> None:
    """Set the interval for the current holders (under _lock)."""
    global _saved, _ours
    if _wanted:
        if _saved is None:
            _saved = sys.getswitchinterval()
        target = min(min(_wanted.values()), _saved)
        if _ours is None or sys.getswitchinterval() == _ours:
            sys.setswitchinterval(target)
            _ours = sys.getswitchinterval()
    elif _saved is not None:
        if sys.getswitchinterval() == _ours:  # not changed by someone else since
            sys.setswitchinterval(_saved)
        _saved = _ours = None


class SwitchInterval:
    """`hold(True)` while this manager's threads wait for work in flight, `hold(False)` once
    none is (called every step: O(1) unless it changes). `interval_s` 0 never holds."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.held = False

    def hold(self, on: bool) -> None:
        on = on and self.interval_s > 0
        if on == self.held:
            return
        self.held = on
        with _lock:
            if on:
                _wanted[id(self)] = self.interval_s
            else:
                _wanted.pop(id(self), None)
            _apply()

    def close(self) -> None:
        self.hold(False)
