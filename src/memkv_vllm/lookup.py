"""Batched asynchronous `exists` probes with a deadline, owned by the tier.

vLLM's AsyncLookupManager has no deadline in any release and changed its internals in 0.28, 0.30
and 0.33, so the tier runs its own (same shape, no vLLM dependency):

* `lookup(key, req_id)` answers from a per-key verdict cache: True (HIT), False (MISS) or None
  (probe pending: RETRY). A key seen for the first time joins this step's batch.
* `flush()` (from the tier's on_schedule_end) hands the step's batch to the worker, which sends
  it at once through a `Prober` (the client's EXISTS pipeline, `Client.exists_stream()`): one
  `exists` round per step for all requests. Answers are taken per node as they arrive, so a node
  that is stopped or black-holed holds only the keys it owns: the other nodes' keys resolve
  (HIT/MISS) at once, in this round and in every later one, while its own stay pending (RETRY).
  The pipeline sends a node's later keys when its outstanding replies are in, merged, so a
  silent node never leaves a growing backlog of requests.
* Deadline: a key still unanswered `deadline_s` after it was first looked up answers False
  (MISS, counted as `timeout`) from then on; its late answer is dropped. This holds on every
  vLLM release, patched or not: a stalled node can delay a request by at most the deadline
  plus one step, never stall the engine, and only requests with blocks on that node wait.
* Verdicts live while some request that asked for the key is unfinished (`cleanup(req_id)`
  from on_request_finished); `mark_miss(keys)` forces False after a failed load so the same
  promotion is not retried in a loop.

Threading: lookup/flush/cleanup/mark_miss/pending/shutdown are called by the scheduler (0.33:
under the manager lock, possibly from different threads, never concurrently). Ownership:
`_state`, `_req_keys`, `_batch` belong to the scheduler side; the worker thread `memkv-lookup`
owns the prober (submit/poll/close) and `_open_rounds`, reads `_requests` and writes `_results`
(both SimpleQueues). The scheduler side touches the prober only through `wake()`. Nothing on
the scheduler side waits: the worker blocks in `Prober.poll`, woken by `flush`/`shutdown`.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

log = logging.getLogger("vllm.memkv_vllm.lookup")

OnAnswer = Callable[[list[int], list[bool]], None]


class Prober(Protocol):
    """What the lookup worker drives (memkv.client.pipeline.StatusPipeline for EXISTS).

    `submit` sends without waiting; every key of it is then answered exactly once through
    `on_answer(indices, hits)`, called on the owner thread inside submit, poll or close (with
    False for a failed node, and for everything outstanding at close). `poll` waits for
    answers or `wake()`; `wake` is the only method called from another thread."""

    def submit(self, keys: list[bytes], on_answer: OnAnswer) -> None: ...

    def poll(self, timeout_s: float | None = None) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


class Unreachable:
    """A prober for when none can be opened: every key answers False (MISS) at once."""

    def __init__(self) -> None:
        self._woken = threading.Event()

    def submit(self, keys: list[bytes], on_answer: OnAnswer) -> None:
        on_answer(list(range(len(keys))), [False] * len(keys))

    def poll(self, timeout_s: float | None = None) -> None:
        self._woken.wait(timeout_s)
        self._woken.clear()

    def wake(self) -> None:
        self._woken.set()

    def close(self) -> None:
        self._woken.set()


class _Round:
    """One submitted batch: (key, generation) pairs and the indices still unanswered."""

    __slots__ = ("batch", "left")

    def __init__(self, batch: list[tuple[bytes, int]]) -> None:
        self.batch = batch
        self.left = set(range(len(batch)))


class _KeyState:
    __slots__ = ("generation", "result", "first_seen", "req_ids", "timed_out")

    def __init__(self, generation: int, now: float) -> None:
        self.generation = generation
        self.result: bool | None = None
        self.first_seen = now
        self.req_ids: set[str] = set()
        self.timed_out = False


class LookupService:
    """See the module docstring. `open_prober` is called once at construction (and again only
    after a prober failed); `store_keys` maps a batch of lookup keys to the keys probed."""

    def __init__(
        self,
        open_prober: Callable[[], Prober],
        deadline_s: float | None,
        on_timeout: Callable[[int], None] = lambda n: None,
        clock: Callable[[], float] = time.monotonic,
        store_keys: Callable[[list[bytes]], list[bytes]] = list,
    ) -> None:
        self._open_prober = open_prober
        self._prober: Prober = open_prober()
        self._store_keys = store_keys
        self._open_rounds: set[_Round] = set()  # worker-owned: submitted, not fully answered
        self._deadline_s = deadline_s
        self._on_timeout = on_timeout
        self._clock = clock
        self._state: dict[bytes, _KeyState] = {}
        self._req_keys: dict[str, set[bytes]] = {}
        self._batch: list[tuple[bytes, int]] = []
        self._outstanding = 0  # keys flushed to the worker and not yet drained (scheduler side)
        self._generation = 0
        self._requests: queue.SimpleQueue[list[tuple[bytes, int]] | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[list[tuple[bytes, int, bool]]] = queue.SimpleQueue()
        self.rounds = 0  # exists rounds fully answered (for tests and logs)
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
            log.warning(
                "memkv lookup unanswered after %.1fs: answering MISS (lookup_timeout_s)", now - state.first_seen
            )
        return state.result

    def was_timeout(self, key: bytes) -> bool:
        state = self._state.get(key)
        return state is not None and state.timed_out

    def flush(self) -> None:
        self._drain()
        if self._batch:
            self._outstanding += len(self._batch)
            self._requests.put(self._batch)
            self._batch = []
            self._prober.wake()

    def probing(self) -> bool:
        """True while keys handed to the worker are unanswered (O(1), called every step)."""
        return self._outstanding > 0

    def pending(self) -> bool:
        """True while some verdict is still unknown (keeps the engine stepping)."""
        return any(s.result is None for s in self._state.values())

    def cleanup(self, req_id: str) -> list[bytes]:
        """Forget `req_id`'s keys; returns those whose verdict was True and is now dropped
        (direct mode releases the leases such verdicts stand for)."""
        dropped = []
        for key in self._req_keys.pop(req_id, ()):
            state = self._state.get(key)
            if state is None:
                continue
            state.req_ids.discard(req_id)
            if not state.req_ids:
                del self._state[key]  # a late answer for this generation is dropped in _drain
                if state.result:
                    dropped.append(key)
        return dropped

    def forget(self, keys: Iterable[bytes], only_misses: bool = False) -> None:
        """Drop the verdicts of `keys` (with `only_misses`, only False ones): the next lookup
        probes again. A late answer of a forgotten probe is dropped in _drain."""
        for key in keys:
            state = self._state.get(key)
            if state is not None and (not only_misses or state.result is False):
                del self._state[key]

    def mark_miss(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            state = self._state.get(key)
            if state is not None:
                state.result = False

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._requests.put(None)
        self._prober.wake()
        self._thread.join(timeout_s)  # a probe stuck on a dead node must not hang shutdown
        if self._thread.is_alive():
            log.warning("memkv lookup thread still busy at shutdown; abandoning it (daemon)")

    def _drain(self) -> None:
        while True:
            try:
                results = self._results.get_nowait()
            except queue.Empty:
                return
            self._outstanding -= len(results)  # the prober answers every key exactly once
            for key, generation, hit in results:
                state = self._state.get(key)
                if state is None or state.generation != generation or state.result is not None:
                    continue  # request finished, key re-probed since, timed out, or marked missed
                state.result = hit

    # ---------------------------------------------------------------------------------------------
    # Worker side
    # ---------------------------------------------------------------------------------------------

    def _worker(self) -> None:
        try:
            while True:
                batch, stop = self._take_requests()
                if stop:
                    return
                if batch:
                    self._submit(batch)
                try:
                    self._prober.poll(None)  # until answers arrive, a reply is overdue, or wake()
                except Exception as exc:  # a prober bug must never kill the worker: misses, new prober
                    self._replace_prober(exc)
        finally:
            try:
                self._prober.close()  # answers what is outstanding False; gives connections back
            except Exception as exc:
                log.warning("memkv lookup: closing the prober failed: %s", exc)

    def _take_requests(self) -> tuple[list[tuple[bytes, int]], bool]:
        """Every batch queued since the last look, merged; True when shutdown was asked."""
        batch: list[tuple[bytes, int]] = []
        while True:
            try:
                more = self._requests.get_nowait()
            except queue.Empty:
                return batch, False
            if more is None:
                return batch, True
            batch += more

    def _submit(self, batch: list[tuple[bytes, int]]) -> None:
        rnd = _Round(batch)
        self._open_rounds.add(rnd)
        keys = [key for key, _ in batch]
        try:
            self._prober.submit(self._store_keys(keys), functools.partial(self._answered, rnd))
        except Exception as exc:  # the parts already sent may still answer; the rest are misses
            log.warning("memkv lookup of %d keys failed: %s", len(keys), exc)
            self._answered(rnd, sorted(rnd.left), [False] * len(rnd.left))

    def _answered(self, rnd: _Round, indices: list[int], hits: list[bool]) -> None:
        """A prober callback (worker thread): post the answers of keys not answered yet."""
        out = []
        for i, hit in zip(indices, hits):
            if i in rnd.left:
                rnd.left.discard(i)
                key, gen = rnd.batch[i]
                out.append((key, gen, bool(hit)))
        if out:
            self._results.put(out)
        if not rnd.left and rnd in self._open_rounds:
            self._open_rounds.discard(rnd)
            self.rounds += 1

    def _replace_prober(self, exc: Exception) -> None:
        keys = sum(len(r.left) for r in self._open_rounds)
        log.warning("memkv lookup prober failed (%s): %d pending keys answer MISS; opening a new one", exc, keys)
        for rnd in list(self._open_rounds):
            self._answered(rnd, sorted(rnd.left), [False] * len(rnd.left))
        old = self._prober
        try:
            self._prober = self._open_prober()
        except Exception as open_exc:
            log.error("memkv lookup: cannot open a prober (%s): every lookup answers MISS", open_exc)
            self._prober = Unreachable()
        try:
            old.close()
        except Exception:
            pass
        _backoff.wait(0.1)  # a prober that fails at once every time must not spin this thread


_backoff = threading.Event()  # never set: wait() is a bounded pause
