"""Worker-side streaming for load_guarantee "leased": GPU <-> a ring of staging slots <-> MemKV.

Each worker (one per TP rank) moves its own rank's values: a load job fetches them from MemKV
into free slots of its ring, the client verifies each value (whole, exact length, checksum) and
only then are the bytes copied to the job's GPU blocks; a store job copies GPU blocks into free
slots and puts them. A job of any length streams through the ring, which never grows: staging
stays `staging_mb` whatever the prompt.

Threads, per direction (so the network and the copies overlap, and several requests are on the
network at once):

  loads   one dispatcher ("fetch"): takes free load slots, up to `load_batch` chunks at a time,
          and hands (chunks, slots) to the fetch pool; `n_fetch` fetch threads: one
          `batch_load_into` each, retried as below; one copy thread ("scatter"): takes every
          fetched batch that is ready, queues all their GPU copies at once and waits for them
          once (CUDA: one event on the side stream); one "copied" thread waits for each batch
          in turn and gives its slots back, so the next ready batch is queued meanwhile (at
          most SCATTER_IN_FLIGHT batches queued).
  stores  one copy thread ("gather"): takes up to `blocks_per_op` free store slots, copies that
          many chunks out of the GPU (one wait), hands them in batches of `store_batch` to
          `n_put` put threads (`batch_put_views` each, at `store_nice`: memkv_vllm/priority.py),
          which give the slots back.

While chunks i.. are copied, chunks i+1.. are fetched (or put) by the other threads. A job
completes only when every batch of it is done (loads: copied to the GPU; stores: put returned)
and its dispatcher is past its last chunk; jobs complete in any order (vLLM consumes
`get_finished` per job id, every release). `n_fetch` and `n_put` are the `n_read_threads` and
`n_write_threads` keys, capped at the slots of their half of the ring (a thread beyond that
could never hold a slot); a batch is sized so that half of a direction's slots can be on the
network while the other half is copied: `max(1, min(blocks_per_op, slots // (2 * threads)))`.

The ring. Rank r's ring is section r of every slot of the engine's staging region (staging.py):
ranks never share bytes, and the region stays pinned once. The first half of the slots serves
loads, the rest stores, so neither direction can starve the other.

Loads are meant not to fail (before vLLM 0.34 vLLM asserts success, vllm-spec-api.md 5.4): the
scheduler leased every rank's value at lookup time, so while its node lives the bytes are there
and unchanged. A fetch
that fails (a connection reset, a stalled or restarting node, a checksum mismatch on the wire)
is retried with backoff until `load_retry_s` has passed since the batch's first attempt. Past
that the values that failed are deleted (a purge: a corrupt value must not fail the restarted
engine again; on its node the delete takes effect once the leases end) and the job fails
(job.error names the rank, the key, the node and its last error; the worker reports it as a
failed job on vLLM 0.34+, raises LoadFailed with it before), and nothing of the failed chunk reaches the GPU -- an unverified or partial
value is never copied, and once a job has failed no later batch of it is copied either.
Quarantine: a slot whose fetch failed is reused only after the fetch returned (TCP:
`batch_load_into` returns once its receiving threads have; RDMA, where a node may still WRITE
after the client gave up: `load_failure_grace_s` later; a fetch that raised: the same grace).

Stores are best effort (a failed put is a future MISS: lookups lease, so a value that is not on
its node is never claimed). `wait()` of a store job stops it from copying further chunks (they
are shed and counted) and returns once no copy touches its GPU blocks; puts of chunks already
copied finish on their own.

Threading: submit/get_finished/wait/shutdown on the worker's connector thread; each pool thread
owns the items it took from its queue (their slots until it gives them back or passes them on).
`_lock` guards `_done`, every job's `pending` and the counters.
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

from memkv_vllm import priority

log = logging.getLogger("vllm.memkv_vllm.direct")
# Per-job stage times at DEBUG, outside vLLM's logger tree so that enabling them (bench/gpu/direct.py
# --timing adds a handler) does not turn on vLLM's own debug output.
timing = logging.getLogger("memkv_vllm.direct.timing")

BACKOFF_FIRST_S = 0.02
BACKOFF_MAX_S = 1.0


class LoadFailed(RuntimeError):
    """A leased load could not be served within load_retry_s, on a vLLM release (< 0.34) that has
    no way back to recomputing a chunk it committed to load: the engine must stop."""


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
    runs: Any  # copies.RunArray: (tensor idx, first GPU block, blocks, page bytes, offset in section) rows


class Job:
    __slots__ = (
        "job_id",
        "load",
        "chunks",
        "event",
        "started",
        "error",
        "cancelled",
        "copies_done",
        "done",
        "nbytes",
        "shed",
        "failed_puts",
        "pending",
        "net_s",
        "copy_s",
        "slot_wait_s",
        "first_at",
    )

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
        self.pending = 1  # batches in flight, +1 while its dispatcher (loads) / gather (stores) runs
        # Stage times for the timing log: thread-seconds on the network and in copies, seconds
        # waiting for a free slot, and when the first chunk was copied (loads) or put (stores).
        self.net_s = 0.0
        self.copy_s = 0.0
        self.slot_wait_s = 0.0
        self.first_at = 0.0


# copy(items, to_staging): every (job, chunk, slot) of `items` between its GPU blocks and its slot;
# returns None once all of them are complete, or a function that waits for them (CUDA: queued on
# the side stream, one wait).
CopyBatch = Callable[[list[tuple[Job, Chunk, int]], bool], "Callable[[], None] | None"]

# Load batches whose copies are queued and not yet waited for. Two keep the GPU's copy engine busy
# while the scatter thread waits for the GIL, builds the next batch's pieces and queues it: with
# one, every batch paid that time with the copy engine idle (a 32k load on an H200 copied 8 GiB
# in 0.39-0.45 s in the engine against 0.19 s alone; with two and 1 GiB of staging the load took
# 0.39 / 0.52 s against 0.55 / 0.66 s, run 81).
SCATTER_IN_FLIGHT = 2


def batch_size(blocks_per_op: int, slots: int, threads: int) -> int:
    """Chunks per fetch (put): half of a direction's slots on the network, `threads` at once."""
    return max(1, min(blocks_per_op, slots // (2 * threads)))


class StreamingTransfers:
    """The threads and two rings of one worker (see the module docstring).

    `section(slot)` is this rank's writable view of a slot; `copy(items, to_staging)` moves a
    batch of chunks between the GPU and their slots: it returns None once every copy is complete,
    or a function that waits for them (the copies are queued: CUDA)."""

    def __init__(
        self,
        client: Any,
        rank: int,
        section: Callable[[int], memoryview],
        num_slots: int,
        copy: CopyBatch,
        blocks_per_op: int,
        load_retry_s: float,
        load_failure_grace_s: float,
        on_thread_start: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        fetch_threads: int = 1,
        put_threads: int = 1,
        put_nice: int = 0,
    ) -> None:
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
        self.n_fetch = max(1, min(fetch_threads, self.load_ring.size))
        self.n_put = max(1, min(put_threads, max(1, self.store_ring.size)))
        self.load_batch = batch_size(blocks_per_op, self.load_ring.size, self.n_fetch)
        self.store_batch = batch_size(blocks_per_op, self.store_ring.size, self.n_put)
        self._lock = threading.Lock()
        self._done: list[Job] = []
        self.retries = 0
        self.shed = 0
        self.failed_puts = 0
        self.copy_waits = 0  # copy batches waited for (one synchronize each), both directions
        self._queues: dict[str, queue.SimpleQueue[Any]] = {
            n: queue.SimpleQueue() for n in ("dispatch", "fetch", "scatter", "copied", "gather", "put")
        }
        self._on_thread_start = on_thread_start
        self._put_nice = put_nice
        self._in_flight = threading.BoundedSemaphore(SCATTER_IN_FLIGHT)  # load batches queued, not waited for
        plan = [
            ("dispatch", self._dispatch_job, 1),
            ("fetch", self._fetch_batch, self.n_fetch),
            ("scatter", None, 1),
            ("copied", self._copied, 1),
            ("gather", self._gather_job, 1),
            ("put", self._put, self.n_put),
        ]
        self._threads: list[tuple[str, threading.Thread]] = []
        for name, fn, n in plan:
            for k in range(n):
                target = self._scatter_loop if fn is None else self._loop
                args = () if fn is None else (name, fn)
                self._threads.append(
                    (name, threading.Thread(target=target, args=args, daemon=True, name=f"memkv-direct-{name}-{k}"))
                )
        for _, t in self._threads:
            t.start()

    # -- connector thread ------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        self._queues["dispatch" if job.load else "gather"].put(job)

    def take_done(self) -> list[Job]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def busy(self) -> bool:
        return any(not q.empty() for q in self._queues.values())

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.load_ring.close()
        self.store_ring.close()
        for name, _ in self._threads:
            if name != "copied":  # the scatter thread ends it, after the batches it queued
                self._queues[name].put(None)
        deadline = time.monotonic() + timeout_s  # one bound for all the threads, not one each
        for _, t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # -- threads ---------------------------------------------------------------------------------

    def _loop(self, name: str, fn: Callable[[Any], None]) -> None:
        self._on_thread_start()
        if name == "put":  # background work: yields the CPU to loads and the engine
            priority.lower_this_thread(self._put_nice)
        q = self._queues[name]
        while True:
            item = q.get()
            if item is None:
                return
            try:
                fn(item)  # settles what it took: slots given back or passed on, job.pending
            except Exception:  # the job already failed (_internal_error); keep the thread alive
                log.exception("MemKV direct mode: %s thread failed", name)

    def _internal_error(self, job: Job, where: str, exc: BaseException) -> None:
        """A bug must fail the job loudly, never hang it: set before the job is settled."""
        job.error = job.error or f"MemKV direct mode: rank {self.rank}: internal error in {where}: {exc!r}"

    def _settle(self, job: Job) -> None:
        """One batch of `job` (or its dispatcher) is done; the last one completes the job."""
        with self._lock:
            job.pending -= 1
            last = job.pending == 0
        if last:
            job.copies_done.set()
            with self._lock:
                self._done.append(job)
            job.done.set()
            if timing.isEnabledFor(logging.DEBUG):
                took = time.perf_counter() - job.started
                timing.debug(
                    "rank %d %s job %d: %d chunk(s), %.0f MiB in %.3f s (%.2f GB/s); first chunk after "
                    "%.3f s; network %.3f thread-s (%d thread(s)), copies %.3f s, slot waits %.3f s%s",
                    self.rank,
                    "load" if job.load else "store",
                    job.job_id,
                    len(job.chunks),
                    job.nbytes / 2**20,
                    took,
                    job.nbytes / max(took, 1e-9) / 1e9,
                    (job.first_at - job.started) if job.first_at else -1.0,
                    job.net_s,
                    self.n_fetch if job.load else self.n_put,
                    job.copy_s,
                    job.slot_wait_s,
                    f"; error: {job.error}" if job.error else "",
                )

    def _hand(self, name: str, job: Job, batch: list[Chunk], slots: list[int]) -> None:
        with self._lock:
            job.pending += 1
        self._queues[name].put((job, batch, slots))

    # loads: dispatch -> fetch (n_fetch threads) -> scatter

    def _dispatch_job(self, job: Job) -> None:
        chunks = job.chunks
        i = 0
        try:
            while i < len(chunks) and job.error is None:
                t0 = time.perf_counter()
                slots = self.load_ring.take(min(self.load_batch, len(chunks) - i))
                job.slot_wait_s += time.perf_counter() - t0
                if not slots:  # closed: shutting down
                    job.error = f"MemKV direct mode: rank {self.rank}: worker shut down with a load in flight"
                    break
                batch = chunks[i : i + len(slots)]
                self._hand("fetch", job, batch, slots)
                i += len(batch)
        except Exception as exc:
            self._internal_error(job, "dispatch", exc)
            raise
        finally:
            self._settle(job)

    def _fetch_batch(self, item: tuple[Job, list[Chunk], list[int]]) -> None:
        job, batch, slots = item
        if job.error is not None:  # an earlier batch failed: the job is over, fetch nothing more
            self.load_ring.give(slots)
            self._settle(job)
            return
        try:
            keep = self._fetch(job, batch, slots)
        except BaseException as exc:
            # The fetch raised (a bug, or the client closed under it): whatever it may still
            # write, its slots come back only after the grace.
            until = self._clock() + self._grace_s
            for s in slots:
                if s >= 0:
                    self.load_ring.quarantine(s, until)
            self._internal_error(job, "fetch", exc)
            self._settle(job)
            raise
        if job.error is not None:
            self.load_ring.give(keep)
            self._settle(job)
            return
        self._queues["scatter"].put((job, batch, keep))  # job.pending passes on with the item

    def _fetch(self, job: Job, batch: list[Chunk], slots: list[int]) -> list[int]:
        """Fetch `batch` into `slots`, retrying what failed until load_retry_s; returns the slots
        used (a failed RDMA fetch's slot is quarantined and replaced). Sets job.error on failure."""
        deadline = self._clock() + self.load_retry_s
        pending = list(range(len(batch)))
        backoff = BACKOFF_FIRST_S
        attempts = 0
        while True:
            attempts += 1
            t0 = time.perf_counter()
            result = self.client.batch_load_into([(batch[j].key, self._section(slots[j])) for j in pending])
            with self._lock:
                job.net_s += time.perf_counter() - t0
            failed = [j for j, ok in zip(pending, result.ok) if not ok]
            if not failed:
                return slots
            if result.may_land_late:  # a node may still WRITE into these slots: each retry takes another
                until = self._clock() + self._grace_s
                for j in failed:
                    self.load_ring.quarantine(slots[j], until)
                    slots[j] = -1
                for j in failed:
                    wait_s = 0.0 if job.error is not None else max(0.0, deadline - self._clock())
                    more = self.load_ring.take(1, timeout_s=wait_s)
                    if not more:
                        job.error = job.error or self._failure(
                            batch[j].key, attempts, "no staging slot left out of quarantine"
                        )
                        return [s for s in slots if s >= 0]
                    slots[j] = more[0]
            left = deadline - self._clock()
            if left <= 0 or job.error is not None:  # out of time, or another batch of the job failed
                if job.error is None:
                    job.error = self._failure(batch[failed[0]].key, attempts, None)
                    # Purge what failed (a DELETE of a leased value takes effect when its leases
                    # end), so that a corrupt value makes the restarted engine recompute, not fail
                    # again. A node that is down answers False: nothing lost.
                    self.client.delete([batch[j].key for j in failed])
                return slots  # over RDMA the failed ones were quarantined and replaced above
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
        return (
            f"MemKV direct mode: rank {self.rank} could not load {key!r} from server {server} within "
            f"load_retry_s={self.load_retry_s:g}s ({attempts} attempts; last error: {cause}). The chunk was "
            f"leased at lookup and vLLM cannot recompute a chunk it committed to load, so the engine stops "
            f"here rather than copy unverified bytes to the GPU (docs/direct-mode.md, 'Residual risk')."
        )

    def _scatter_loop(self) -> None:
        """Copies every fetched batch that is ready in one go (one wait), so a ring of
        single-chunk fetches does not cost one synchronize per chunk. The wait is the "copied"
        thread's: this one queues the next ready batch meanwhile, up to SCATTER_IN_FLIGHT."""
        self._on_thread_start()
        q = self._queues["scatter"]
        while True:
            items = [q.get()]
            # Bounded: every item holds at least one load slot.
            while items[-1] is not None and len(items) <= self.load_ring.size:
                try:
                    items.append(q.get_nowait())
                except queue.Empty:
                    break
            stop = items[-1] is None
            ready = [item for item in items if item is not None]
            if ready:
                self._in_flight.acquire()
                self._start_scatter(ready)
            if stop:
                self._queues["copied"].put(None)  # after every batch this thread queued
                return

    def _start_scatter(self, items: list[tuple[Job, list[Chunk], list[int]]]) -> None:
        """Queues the copies of `items` (the chunks of jobs that have not failed) and hands
        them to the "copied" thread, which waits for them."""
        todo = [(job, c, s) for job, batch, slots in items if job.error is None for c, s in zip(batch, slots)]
        t0 = time.perf_counter()
        try:
            wait = self._copy(todo, False) if todo else None
        except Exception as exc:  # a bug must fail the jobs loudly, never hang them
            self._scatter_failed(items, exc)
            self._in_flight.release()
            return
        self._queues["copied"].put((items, wait, t0))

    def _copied(self, batch: tuple[list[tuple[Job, list[Chunk], list[int]]], Any, float]) -> None:
        """Waits for the copies of a batch, then gives its slots back and settles its jobs."""
        items, wait, t0 = batch
        try:
            try:
                if wait is not None:
                    wait()
            except Exception as exc:
                self._scatter_failed(items, exc)
                return
            now = time.perf_counter()
            copied = {id(job): job for job, _, _ in items if job.error is None}
            with self._lock:
                if copied:
                    self.copy_waits += 1
                for job in copied.values():
                    job.copy_s += now - t0
                    job.first_at = job.first_at or now
            for job, _, slots in items:
                self.load_ring.give(slots)
                self._settle(job)
        finally:
            self._in_flight.release()

    def _scatter_failed(self, items: list[tuple[Job, list[Chunk], list[int]]], exc: Exception) -> None:
        log.exception("MemKV direct mode: scatter thread failed")
        for job, _, slots in items:
            job.error = job.error or f"MemKV direct mode: rank {self.rank}: internal error in scatter: {exc!r}"
            self.load_ring.give(slots)
            self._settle(job)

    # stores: gather -> put (n_put threads)

    def _gather_job(self, job: Job) -> None:
        chunks = job.chunks
        i = 0
        try:
            while i < len(chunks):
                if job.cancelled:  # wait(): its GPU blocks are about to be reused
                    job.shed += len(chunks) - i
                    break
                t0 = time.perf_counter()
                slots = self.store_ring.take(min(self._step, len(chunks) - i))
                t1 = time.perf_counter()
                job.slot_wait_s += t1 - t0
                if not slots:
                    job.shed += len(chunks) - i
                    break
                batch = chunks[i : i + len(slots)]
                try:
                    wait = self._copy([(job, c, s) for c, s in zip(batch, slots)], True)
                    if wait is not None:
                        wait()
                except BaseException:
                    self.store_ring.give(slots)
                    raise
                job.copy_s += time.perf_counter() - t1
                with self._lock:
                    self.copy_waits += 1
                sb = self.store_batch
                for lo in range(0, len(batch), sb):
                    self._hand("put", job, batch[lo : lo + sb], slots[lo : lo + sb])
                i += len(batch)
        except Exception as exc:
            self._internal_error(job, "gather", exc)
            raise
        finally:
            job.copies_done.set()
            if job.shed:
                with self._lock:
                    self.shed += job.shed
            self._settle(job)

    def _put(self, item: tuple[Job, list[Chunk], list[int]]) -> None:
        job, batch, slots = item
        t0 = time.perf_counter()
        try:
            stored = self.client.batch_put_views([(c.key, self._section(s)) for c, s in zip(batch, slots)])
        except Exception:
            stored = [False] * len(batch)
            log.exception("MemKV direct mode: a put failed")
        finally:
            self.store_ring.give(slots)
        now = time.perf_counter()
        with self._lock:
            job.net_s += now - t0
            job.first_at = job.first_at or now
        bad = len(stored) - sum(stored)
        if bad:
            with self._lock:
                job.failed_puts += bad
                self.failed_puts += bad
        self._settle(job)
