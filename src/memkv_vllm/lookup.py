"""Batched asynchronous `exists` probes with a deadline, owned by the tier.

vLLM's AsyncLookupManager has no deadline in any release and changed its internals in 0.28, 0.30
and 0.33, so the tier runs its own (same shape, no vLLM dependency):

* `lookup(key, req_id)` answers from a per-key verdict cache: True (HIT), False (MISS) or None
  (probe pending: RETRY). A key seen for the first time joins this step's batch.
* `flush()` (from the tier's on_schedule_end) hands the step's batch to the worker: one
  `exists` round per step for all requests. Batches that queued while the worker was busy are
  merged into its next round, so a slow round never leaves a growing backlog of rounds.
* Deadline: a key still unanswered `deadline_s` after it was first looked up answers False
  (MISS, counted as `timeout`) from then on; its late answer is dropped. This holds on every
  vLLM release, patched or not: a stalled node can delay a request by at most the deadline
  plus one step, never stall the engine.
* Verdicts live while some request that asked for the key is unfinished (`cleanup(req_id)`
  from on_request_finished); `mark_miss(keys)` forces False after a failed load so the same
  promotion is not retried in a loop.

Threading: lookup/flush/cleanup/mark_miss/pending/shutdown are called by the scheduler (0.33:
under the manager lock, possibly from different threads, never concurrently). Ownership:
`_state`, `_req_keys`, `_batch` belong to the scheduler side; the worker thread
`memkv-lookup` only reads `_requests` and writes `_results` (both SimpleQueues).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Iterable

log = logging.getLogger("vllm.memkv_vllm.lookup")


class _KeyState:
    __slots__ = ("generation", "result", "first_seen", "req_ids", "timed_out")

    def __init__(self, generation: int, now: float) -> None:
        self.generation = generation
        self.result: bool | None = None
        self.first_seen = now
        self.req_ids: set[str] = set()
        self.timed_out = False


class LookupService:
    def __init__(self, probe: Callable[[list[bytes]], list[bool]], deadline_s: float | None,
                 on_timeout: Callable[[int], None] = lambda n: None, clock: Callable[[], float] = time.monotonic) -> None:
        self._probe = probe
        self._deadline_s = deadline_s
        self._on_timeout = on_timeout
        self._clock = clock
        self._state: dict[bytes, _KeyState] = {}
        self._req_keys: dict[str, set[bytes]] = {}
        self._batch: list[tuple[bytes, int]] = []
        self._generation = 0
        self._requests: queue.SimpleQueue[list[tuple[bytes, int]] | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[list[tuple[bytes, int, bool]]] = queue.SimpleQueue()
        self.rounds = 0  # exists rounds run by the worker (for tests and logs)
        self._thread = threading.Thread(target=self._worker, name="memkv-lookup", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------------------------
    # Scheduler side
    # ---------------------------------------------------------------------------------------------

    def lookup(self, key: bytes, req_id: str) -> bool | None:
        self._drain()
        now = self._clock()
        state = self._state.get(key)
        if state is None:
            state = _KeyState(self._generation, now)
            self._generation += 1
            self._state[key] = state
            self._batch.append((key, state.generation))
        if req_id not in state.req_ids:
            state.req_ids.add(req_id)
            self._req_keys.setdefault(req_id, set()).add(key)
        if state.result is None and self._deadline_s is not None and now - state.first_seen >= self._deadline_s:
            state.result = False
            state.timed_out = True
            self._on_timeout(1)
            log.warning("memkv lookup unanswered after %.1fs: answering MISS (lookup_timeout_s)", now - state.first_seen)
        return state.result

    def was_timeout(self, key: bytes) -> bool:
        state = self._state.get(key)
        return state is not None and state.timed_out

    def flush(self) -> None:
        self._drain()
        if self._batch:
            self._requests.put(self._batch)
            self._batch = []

    def pending(self) -> bool:
        """True while some verdict is still unknown (keeps the engine stepping)."""
        return any(s.result is None for s in self._state.values())

    def cleanup(self, req_id: str) -> None:
        for key in self._req_keys.pop(req_id, ()):
            state = self._state.get(key)
            if state is None:
                continue
            state.req_ids.discard(req_id)
            if not state.req_ids:
                del self._state[key]  # a late answer for this generation is dropped in _drain

    def mark_miss(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            state = self._state.get(key)
            if state is not None:
                state.result = False

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._requests.put(None)
        self._thread.join(timeout_s)  # a probe stuck on a dead node must not hang shutdown
        if self._thread.is_alive():
            log.warning("memkv lookup thread still busy at shutdown; abandoning it (daemon)")

    def _drain(self) -> None:
        while True:
            try:
                results = self._results.get_nowait()
            except queue.Empty:
                return
            for key, generation, hit in results:
                state = self._state.get(key)
                if state is None or state.generation != generation or state.result is not None:
                    continue  # request finished, key re-probed since, timed out, or marked missed
                state.result = hit

    # ---------------------------------------------------------------------------------------------
    # Worker side
    # ---------------------------------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            batch = self._requests.get()
            if batch is None:
                return
            stop = False
            while True:  # merge rounds that queued up behind a slow one
                try:
                    more = self._requests.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch += more
            keys = [key for key, _ in batch]
            try:
                hits = list(self._probe(keys))
                if len(hits) != len(keys):
                    raise RuntimeError(f"probe answered {len(hits)} of {len(keys)} keys")
            except Exception as exc:  # the probe must never kill the worker: answer misses
                log.warning("memkv lookup of %d keys failed: %s", len(keys), exc)
                hits = [False] * len(keys)
            self.rounds += 1
            self._results.put([(key, gen, bool(hit)) for (key, gen), hit in zip(batch, hits)])
            if stop:
                return
