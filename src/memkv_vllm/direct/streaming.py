"""Worker-side streaming for load_guarantee "leased": GPU <-> a ring of staging slots <-> MemKV.

Each worker (one per TP rank) moves its own rank's values: a load job fetches them from MemKV
into free slots of its ring, the client verifies each value (whole, exact length, checksum) and
only then are the bytes copied to the job's GPU blocks; a store job copies GPU blocks into free
slots and puts them. Two threads per direction, so the network and the copies overlap: while
chunk i is copied, chunk i+1 is fetched (or put). A job of any length streams through the ring,
which never grows: staging stays `staging_mb` whatever the prompt.

The ring. Rank r's ring is section r of every slot of the engine's staging region (staging.py):
ranks never share bytes, and the region stays pinned once. The first half of the slots serves
loads, the rest stores, so neither direction can starve the other.

Loads cannot fail (vLLM asserts success, vllm-spec-api.md 5.4): the scheduler leased every
rank's value at lookup time, so while its node lives the bytes are there and unchanged. A fetch
that fails (a connection reset, a stalled or restarting node, a checksum mismatch on the wire)
is retried with backoff until `load_retry_s` has passed since the batch's first attempt. Past
that the values that failed are deleted (a purge: a corrupt value must not fail the restarted
engine again; on its node the delete takes effect once the leases end) and the job fails loudly: `get_finished()` (or `wait()`) raises LoadFailed naming the rank,
the key, the node and its last error, and nothing of the failed chunk reaches the GPU -- an
unverified or partial value is never copied. Quarantine: a slot whose fetch failed is reused
only after the fetch returned (TCP: `batch_load_into` returns once its receiving threads have;
RDMA, where a node may still WRITE after the client gave up: `load_failure_grace_s` later).

Stores are best effort (a failed put is a future MISS: lookups lease, so a value that is not on
its node is never claimed). `wait()` of a store job stops it from copying further chunks (they
are shed and counted) and returns once no copy touches its GPU blocks; puts of chunks already
copied finish on their own.

Threading: submit/get_finished/wait/shutdown on the worker's connector thread; the four
threads below own their queues' items. `_lock` guards `_done` and the counters.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("vllm.memkv_vllm.direct")

BACKOFF_FIRST_S = 0.02
BACKOFF_MAX_S = 1.0


class LoadFailed(RuntimeError):
    """A leased load could not be served within load_retry_s: the engine must stop (vLLM has no
    way back to recomputing a chunk it committed to load)."""


class SlotRing:
    """Free staging slots of one direction; quarantined ones come back at their time."""

    def __init__(self, slots: list[int], clock: Callable[[], float] = time.monotonic) -> None:
        self._free = collections.deque(slots)
        self._late: list[tuple[float, int]] = []
        self._cond = threading.Condition()
        self._clock = clock
        self.closed = False
        self.size = len(slots)

    def take(self, most: int, timeout_s: float | None = None) -> list[int]:
        """Between 1 and `most` slots; [] when closed or after `timeout_s`."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        with self._cond:
            while True:
                self._unquarantine()
                if self.closed:
                    return []
                if self._free:
                    return [self._free.popleft() for _ in range(min(most, len(self._free)))]
                wait = 0.5 if not self._late else max(0.001, min(0.5, self._late[0][0] - self._clock()))
                if deadline is not None:
                    left = deadline - self._clock()
                    if left <= 0:
                        return []
                    wait = min(wait, left)
                self._cond.wait(wait)

    def give(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def quarantine(self, slot: int, until: float) -> None:
        with self._cond:
            self._late.append((until, slot))
            self._late.sort()

    @property
    def quarantined(self) -> int:
        with self._cond:
            return len(self._late)

    @property
    def free(self) -> int:
        with self._cond:
            return len(self._free)

    def _unquarantine(self) -> None:
        now = self._clock()
        while self._late and self._late[0][0] <= now:
            self._free.append(self._late.pop(0)[1])

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


@dataclasses.dataclass
class Chunk:
    key: bytes  # this rank's MemKV key of the chunk
    runs: list[tuple[int, int, int, int, int]]  # (tensor idx, first GPU block, blocks, page bytes, offset in section)


class Job:
    __slots__ = ("job_id", "load", "chunks", "event", "started", "error", "cancelled", "copies_done", "done",
                 "nbytes", "shed", "failed_puts")

    def __init__(self, job_id: int, load: bool, chunks: list[Chunk], event: Any, nbytes: int) -> None:
        self.job_id = job_id
        self.load = load
        self.chunks = chunks
        self.event = event  # CUDA event recorded at submit (compute before copies), or None
        self.started = time.perf_counter()
        self.error: str | None = None
        self.cancelled = False
        self.copies_done = threading.Event()  # no copy of this job touches its GPU blocks any more
        self.done = threading.Event()
        self.nbytes = nbytes
        self.shed = 0
        self.failed_puts = 0


class StreamingTransfers:
    """The four threads and two rings of one worker (see the module docstring).

    `section(slot)` is this rank's writable view of a slot; `copy(job, chunk, slot, to_staging)`
    moves one chunk between the GPU and a slot and returns once the copy is complete."""

    def __init__(self, client: Any, rank: int, section: Callable[[int], memoryview], num_slots: int,
                 copy: Callable[[Job, Chunk, int, bool], None], blocks_per_op: int, load_retry_s: float,
                 load_failure_grace_s: float, on_thread_start: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.rank = rank
        self._section = section
        self._copy = copy
        self._step = blocks_per_op
        self.load_retry_s = load_retry_s
        self._grace_s = load_failure_grace_s
        self._clock = clock
        n_load = max(1, num_slots // 2)
        self.load_ring = SlotRing(list(range(n_load)), clock)
        self.store_ring = SlotRing(list(range(n_load, num_slots)), clock)
        self._lock = threading.Lock()
        self._done: list[Job] = []
        self.retries = 0
        self.shed = 0
        self.failed_puts = 0
        self._queues: dict[str, queue.SimpleQueue[Any]] = {n: queue.SimpleQueue() for n in
                                                             ("fetch", "scatter", "gather", "put")}
        self._on_thread_start = on_thread_start
        self._threads = [threading.Thread(target=self._loop, args=(name, fn), name=f"memkv-direct-{name}", daemon=True)
                         for name, fn in (("fetch", self._fetch_job), ("scatter", self._scatter),
                                          ("gather", self._gather_job), ("put", self._put))]
        for t in self._threads:
            t.start()

    # -- connector thread ------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        self._queues["fetch" if job.load else "gather"].put(job)

    def take_done(self) -> list[Job]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def busy(self) -> bool:
        return any(not q.empty() for q in self._queues.values())

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.load_ring.close()
        self.store_ring.close()
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout_s)

    # -- threads ---------------------------------------------------------------------------------

    def _loop(self, name: str, fn: Callable[[Any], None]) -> None:
        self._on_thread_start()
        q = self._queues[name]
        while True:
            item = q.get()
            if item is None:
                return
            try:
                fn(item)
            except Exception as exc:  # a bug must fail the job loudly, never hang it
                job = item if isinstance(item, Job) else item[0]
                log.exception("MemKV direct mode: %s thread failed", name)
                job.error = job.error or f"MemKV direct mode: rank {self.rank}: internal error in {name}: {exc!r}"
                self._finish(job)

    def _finish(self, job: Job) -> None:
        if job.done.is_set():
            return
        job.copies_done.set()
        with self._lock:
            self._done.append(job)
        job.done.set()

    def _fetch_job(self, job: Job) -> None:
        chunks = job.chunks
        i = 0
        while i < len(chunks) and job.error is None:
            slots = self.load_ring.take(min(self._step, len(chunks) - i))
            if not slots:  # closed: shutting down
                job.error = f"MemKV direct mode: rank {self.rank}: worker shut down with a load in flight"
                break
            batch = chunks[i : i + len(slots)]
            slots = self._fetch(job, batch, slots)
            if job.error is not None:
                self.load_ring.give(slots)
                break
            self._queues["scatter"].put((job, batch, slots))
            i += len(batch)
        self._queues["scatter"].put((job, None, None))  # after its batches: the job's end

    def _fetch(self, job: Job, batch: list[Chunk], slots: list[int]) -> list[int]:
        """Fetch `batch` into `slots`, retrying what failed until load_retry_s; returns the slots
        used (a failed RDMA fetch's slot is quarantined and replaced). Sets job.error on failure."""
        deadline = self._clock() + self.load_retry_s
        pending = list(range(len(batch)))
        backoff = BACKOFF_FIRST_S
        attempts = 0
        while True:
            attempts += 1
            result = self.client.batch_load_into([(batch[j].key, self._section(slots[j])) for j in pending])
            failed = [j for j, ok in zip(pending, result.ok) if not ok]
            if not failed:
                return slots
            if result.may_land_late:  # a node may still WRITE into these slots
                for j in failed:
                    self.load_ring.quarantine(slots[j], self._clock() + self._grace_s)
                    more = self.load_ring.take(1, timeout_s=max(0.0, deadline - self._clock()))
                    if not more:
                        job.error = self._failure(batch[j].key, attempts, "no staging slot left out of quarantine")
                        return [s for k, s in enumerate(slots) if k not in failed]
                    slots[j] = more[0]
            left = deadline - self._clock()
            if left <= 0:
                job.error = self._failure(batch[failed[0]].key, attempts, None)
                # Purge what failed (a DELETE of a leased value takes effect when its leases end),
                # so that a corrupt value makes the restarted engine recompute, not fail again.
                # A node that is down answers False: nothing lost.
                self.client.delete([batch[j].key for j in failed])
                return [s for k, s in enumerate(slots) if not (result.may_land_late and k in failed)]
            with self._lock:
                self.retries += len(failed)
            time.sleep(min(backoff, left))
            backoff = min(2 * backoff, BACKOFF_MAX_S)
            pending = failed

    def _failure(self, key: bytes, attempts: int, cause: str | None) -> str:
        server = self.client.owner(key).name
        if cause is None:
            health = {h["server"]: h for h in self.client.health()}.get(server, {})
            cause = health.get("last_error") or "miss or checksum mismatch (value gone despite its lease, or corrupt)"
        return (f"MemKV direct mode: rank {self.rank} could not load {key!r} from server {server} within "
                f"load_retry_s={self.load_retry_s:g}s ({attempts} attempts; last error: {cause}). The chunk was "
                f"leased at lookup and vLLM cannot recompute a chunk it committed to load, so the engine stops "
                f"here rather than copy unverified bytes to the GPU (docs/direct-mode.md, 'Residual risk').")

    def _scatter(self, item: tuple[Job, list[Chunk] | None, list[int] | None]) -> None:
        job, batch, slots = item
        if batch is None:
            self._finish(job)
            return
        assert slots is not None
        try:
            if job.error is None:
                for chunk, slot in zip(batch, slots):
                    self._copy(job, chunk, slot, False)
        finally:
            self.load_ring.give(slots)

    def _gather_job(self, job: Job) -> None:
        chunks = job.chunks
        i = 0
        try:
            while i < len(chunks):
                if job.cancelled:  # wait(): its GPU blocks are about to be reused
                    job.shed += len(chunks) - i
                    break
                slots = self.store_ring.take(min(self._step, len(chunks) - i))
                if not slots:
                    job.shed += len(chunks) - i
                    break
                batch = chunks[i : i + len(slots)]
                try:
                    for chunk, slot in zip(batch, slots):
                        self._copy(job, chunk, slot, True)
                except BaseException:
                    self.store_ring.give(slots)
                    raise
                self._queues["put"].put((job, batch, slots))
                i += len(batch)
        finally:
            job.copies_done.set()
            if job.shed:
                with self._lock:
                    self.shed += job.shed
            self._queues["put"].put((job, None, None))

    def _put(self, item: tuple[Job, list[Chunk] | None, list[int] | None]) -> None:
        job, batch, slots = item
        if batch is None:
            self._finish(job)
            return
        assert slots is not None
        try:
            stored = self.client.batch_put_views([(c.key, self._section(s)) for c, s in zip(batch, slots)])
        finally:
            self.store_ring.give(slots)
        bad = len(stored) - sum(stored)
        if bad:
            job.failed_puts += bad
            with self._lock:
                self.failed_puts += bad
