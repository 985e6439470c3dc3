"""The node's value store: byte capacity, lanes, LRU eviction, buffers faulted once and reused.

Memory. A value lives in a buffer the store owns: for values >= 1 MiB an anonymous private mmap,
its pages (2 MiB ones where the host gives them on request) made by the first PUT's receive as
it fills them; a bytearray for smaller ones; or, for a value a same-host client stored through
shared memory (SHM_PUT), a sealed memfd of its own (memkv/server/shm.py). Buffers are sized to
the value rounded up to a page. When a value is evicted or deleted its private buffer is reused
for the next value of the same size class (KV-cache values of one model are all one size), so
the hot path neither allocates nor page-faults; a bounded pool keeps freed buffers for reuse and
beyond that they are unmapped. A memfd a client wrote is never reused (its value is sealed
immutable): freed, it is closed. A PUT from a same-host client that stores over the socket into
shared memory (`begin_put(memfd=True)`, --shared-memory-stores node) gets, where the store makes a
buffer, a node-written memfd instead of private memory (memkv/server/shm.py): reused like a
private one, and SHM_GET passes it to same-host clients. (Values from other hosts stay in
private memory, whose huge pages a node's first fill needs.) `allocated_bytes`
(every buffer in existence: live, pinned-but-dead, pooled, reserved for a PUT in flight, memfds
included) never exceeds `capacity_bytes`.

Lanes. Every key belongs to one lane, chosen by the longest matching key prefix (the `default`
lane takes the rest). A lane's share is its fair part of the capacity; lanes may grow past it
while there is room. To make room the store evicts, least recently used first, from the lane
furthest over its share; when no lane is over its share, from the writer's own lane.

In flight. A buffer reserved for a PUT counts against capacity from the moment it is reserved
(it may have evicted committed values to exist), but is invisible until committed. Their total,
`inflight_bytes`, is bounded by `max_inflight_bytes`: a reservation that would exceed it waits
(up to the caller's `wait_s`) for others to commit or abort, then fails with NoSpace (reason
`inflight_limit`). Writers that stall mid-value can therefore never hold, or have evicted for
them, more than that bound of the cache.

Pins. A reader pins the entries it sends; an evicted or replaced entry that is pinned leaves
the index at once (no new reader finds it) but keeps its buffer until the last reader unpins.

Leases (LEASE / RELEASE, docs/protocol.md section 11). A lease is (key, token) with an expiry:
while a value has one, it is never evicted, a PUT of its key is refused (LEASED) and a DELETE
is deferred (LEASED: the key answers MISS to EXISTS and LEASE at once, GET still serves the
leased bytes to the lease holders, and the value goes when its last lease ends). So the bytes a
holder reads are the bytes that were leased. Bounded: ttl capped at `max_lease_s`, at most
`max_leases` leases and `max_lease_bytes` of leased buffers, and each holder (token) at most
`max_lease_share` of both, so one holder at its bound leaves the rest to others (a lease beyond a
bound answers MISS); leases expire by themselves (a heap of expiries, swept under the lock on every lease
operation, eviction and stats call) and live in memory only: a restart drops them.

Threading: every public method may be called from any connection thread; all state is guarded
by one lock, held only for O(1) metadata work (plus a bounded number of evictions); buffers are
allocated, filled, sent and freed outside the lock.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import heapq
import math
import mmap
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from memkv.config import LaneSpec
from memkv.memfd import MADV_HUGEPAGE
from memkv.protocol import ItemStatus
from memkv.server.shm import MAX_SPARE_BYTES, SPARE_CAPACITY_DIVISOR, SPARE_KEEP_S, SealedBuffer, SharedValues

PAGE = mmap.PAGESIZE
MMAP_THRESHOLD = 1 << 20
# A freed buffer may serve a value up to this much smaller (keeps reuse high for mixed sizes
# while bounding the slack that counts against capacity).
REUSE_SLACK = 1 / 16


def buffer_size_for(length: int) -> int:
    """Bytes of buffer a value of `length` bytes occupies (and counts against capacity)."""
    if length >= MMAP_THRESHOLD:
        return -(-length // PAGE) * PAGE
    return max(length, 1)


class ValueBuffer:
    """A reusable block of the node's memory: private, or (`node_written`: descriptor and mapping
    of a node-written memfd, memkv/server/shm.py) shared with same-host clients read-only. `fd`:
    that memfd's descriptor, -1 for private memory."""

    # No view kept: a memoryview is two objects the garbage collector tracks, and a full
    # collection walks every tracked object of the node with the GIL held (with a million
    # values stored, that pause was 0.5 s on the 2-vCPU VM). Views are made when used.
    __slots__ = ("size", "fd", "_mem")

    def __init__(self, size: int, node_written: tuple[int, mmap.mmap] | None = None) -> None:
        self.size = size
        self.fd = -1
        self._mem: mmap.mmap | bytearray
        if node_written is not None:
            self.fd, self._mem = node_written
        elif size >= MMAP_THRESHOLD:
            # No MAP_POPULATE: Python's mmap holds the GIL while the kernel makes every page
            # (0.4 s a GiB on the 2-vCPU VM), freezing every connection thread of the node, and
            # a populating madvise holds the process's mmap lock as long. The PUT's receive
            # makes the pages as it fills them, with neither held.
            self._mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            # Huge pages where the host allows them on request (THP "madvise", the common
            # default): the receive then makes 2 MiB pages, 512 times fewer faults; a fresh
            # 16 MiB buffer fills about 3.5x faster on the 2-vCPU VM. Before any page exists,
            # so the advice is only a flag on the mapping.
            self._mem.madvise(MADV_HUGEPAGE)
        else:
            self._mem = bytearray(size)

    @property
    def view(self) -> memoryview:
        return memoryview(self._mem)

    def close_fd(self) -> None:
        """The store is done with it: its memfd's descriptor closes now; the mapping (and the
        memfd) goes with its last view, as a private buffer's does."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


Buffer = ValueBuffer | SealedBuffer


@dataclasses.dataclass(eq=False, slots=True)
class Entry:
    key: bytes
    lane: Lane
    length: int
    algo: int
    checksum: bytes
    buf: Buffer
    pins: int = 0
    live: bool = True  # False once evicted/replaced/deleted; the buffer goes back when unpinned
    leases: dict[int, float] | None = None  # token -> expiry (monotonic s) while leased
    doomed: bool = False  # deleted while leased: removed when its last lease ends

    @property
    def value(self) -> memoryview:
        return self.buf.view[: self.length]


class Lane:
    __slots__ = ("name", "prefix", "share", "entries", "bytes", "evictions")

    def __init__(self, name: str, prefix: bytes, share: float) -> None:
        self.name = name
        self.prefix = prefix
        self.share = share
        self.entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()  # LRU first
        self.bytes = 0  # buffer bytes of live entries
        self.evictions = 0


@dataclasses.dataclass
class PutTicket:
    """A buffer reserved for a value being received; invisible until committed."""

    key: bytes
    lane: Lane
    length: int
    algo: int
    checksum: bytes
    buf: Buffer
    reserved: int = 0  # bytes counted in Store.inflight_bytes until commit / abort

    @property
    def target(self) -> memoryview:
        return self.buf.view[: self.length]


class NoSpace(Exception):
    """The value cannot fit, even after eviction (`reason` "no_space"), or the in-flight bound
    is reached (`reason` "inflight_limit")."""

    def __init__(self, message: str, reason: str = "no_space") -> None:
        super().__init__(message)
        self.reason = reason


class Leased(Exception):
    """A PUT of a key whose value is leased: the leased value stays."""


DEFAULT_MAX_LEASE_S = 300.0
DEFAULT_MAX_LEASES = 65536
DEFAULT_LEASE_FRACTION = 0.5  # of capacity: leases can never pin the whole node
DEFAULT_LEASE_SHARE = 0.5  # of the lease bounds, per holder: one holder can never take them all


class Store:
    def __init__(
        self,
        capacity_bytes: int,
        lanes: Sequence[LaneSpec] = (),
        pool_max_bytes: int | None = None,
        max_inflight_bytes: int | None = None,
        *,
        max_lease_s: float = DEFAULT_MAX_LEASE_S,
        max_leases: int = DEFAULT_MAX_LEASES,
        max_lease_bytes: int | None = None,
        max_lease_share: float = DEFAULT_LEASE_SHARE,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedValues | None = None,
    ) -> None:
        """`shared`: the bounds and counters of memfd values (SHM_PUT, `begin_shared_put`, and
        node-written memfds, `begin_put(memfd=True)`)."""
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        if not 0 < max_lease_share <= 1:
            raise ValueError("max_lease_share must be in (0, 1]")
        self.capacity_bytes = capacity_bytes
        self.max_inflight_bytes = capacity_bytes if max_inflight_bytes is None else max_inflight_bytes
        self._lock = threading.Lock()
        self._inflight_done = threading.Condition(self._lock)  # notified when a reservation ends
        self.inflight_bytes = 0  # buffers reserved for PUTs not yet committed or aborted
        share_left = max(0.0, 1.0 - sum(spec.share for spec in lanes))
        self._lanes = [Lane(spec.name, spec.prefix, spec.share) for spec in lanes]
        self._lanes.sort(key=lambda lane: len(lane.prefix), reverse=True)  # longest prefix wins
        self.default_lane = Lane("default", b"", share_left)
        self._index: dict[bytes, Entry] = {}
        self._pool: dict[int, list[ValueBuffer]] = {}
        self._pool_sizes: list[int] = []  # sorted sizes with a non-empty pool list
        self._pool_bytes = 0
        self._pool_max = capacity_bytes // 8 if pool_max_bytes is None else pool_max_bytes
        self.allocated_bytes = 0  # every buffer in existence
        self.stored_bytes = 0  # value bytes of live entries
        self.evictions = 0
        # Called with each buffer the store frees, under its lock (quick, never re-entering the
        # store): the RDMA responder deregisters buffers it registered (memkv/server/rdma.py).
        self.on_drop: Callable[[Buffer], None] | None = None
        # Called with each buffer the store creates, outside its lock, before the PUT fills it
        # (never raises): the RDMA responder registers it with NIXL there, so a later read does
        # not pay the registration (memkv/server/rdma.py).
        self.on_alloc: Callable[[Buffer], None] | None = None
        self.max_lease_s = max_lease_s
        self.max_leases = max_leases
        self.max_lease_bytes = (
            int(capacity_bytes * DEFAULT_LEASE_FRACTION) if max_lease_bytes is None else max_lease_bytes
        )
        self.max_lease_share = max_lease_share
        self.max_leases_per_holder = math.ceil(max_leases * max_lease_share)
        self.max_lease_bytes_per_holder = int(self.max_lease_bytes * max_lease_share)
        self._clock = clock
        self.shared = shared
        self._lease_heap: list[tuple[float, int, bytes, int]] = []  # (expiry, seq, key, token)
        self._lease_seq = 0
        self.leases = 0  # (key, token) pairs
        self.leased_bytes = 0  # buffer bytes of values with at least one lease
        self.lease_expirations = 0
        self.leases_refused = 0
        # token -> [leases, bytes] it holds: each holder is charged the whole buffer of every
        # value it leases, shared with other holders or not (what it would pin alone).
        self._holders: dict[int, list[int]] = {}
        # Spares: fresh memfds faulted in ahead of the same-host stores that take them
        # (`refill_spare`), counted in allocated_bytes. size -> buffers; size -> (when an SHM_PUT
        # last asked for it, the lane of that key: the lane a spare evicts from, as its store would).
        self._spares: dict[int, list[SealedBuffer]] = {}
        self._spare_wanted: dict[int, tuple[float, Lane]] = {}
        self._spare_wake = threading.Condition(self._lock)  # notified when a spare is taken
        # Buffers the store let go of while its lock was held, freed once it is released (`_locked`).
        self._released: list[tuple[Buffer, bool]] = []

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The store's lock. Memory let go of while it is held is freed after it is released:
        freeing a 16 MiB memfd takes about 4.5 ms and unmapping a 16 MiB buffer 1.5 ms (the
        2-vCPU VM), and lookups, GETs and other PUTs wait for this lock."""
        released: list[tuple[Buffer, bool]] = []
        try:
            with self._lock:
                try:
                    yield
                finally:
                    released, self._released = self._released, []
        finally:
            for buf, spare in released:
                if isinstance(buf, SealedBuffer):
                    if self.shared is not None:
                        self.shared.freed(buf, spare)
                    else:
                        buf.free()
                elif buf.fd >= 0:
                    buf.close_fd()
                    if self.shared is not None:
                        self.shared.node_written_freed(buf.size)
            released.clear()  # a ValueBuffer's mapping goes with its last reference: this list's

    # -- lanes --------------------------------------------------------------------------------

    @property
    def lanes(self) -> list[Lane]:
        return [*self._lanes, self.default_lane]

    def lane_for(self, key: bytes) -> Lane:
        for lane in self._lanes:
            if key.startswith(lane.prefix):
                return lane
        return self.default_lane

    # -- writes -------------------------------------------------------------------------------

    def begin_put(
        self, key: bytes, length: int, algo: int, checksum: bytes, wait_s: float = 0.0, memfd: bool = False
    ) -> PutTicket:
        """Reserve a buffer for a value. Raises NoSpace. Caller fills `ticket.target`, then
        calls `commit` or `abort` exactly once. Waits up to `wait_s` for the in-flight bound.
        `memfd`: a buffer made for it is a node-written memfd (where `shared` allows one)."""
        return self._begin_put(key, length, algo, checksum, wait_s, buffer_size_for(length), None, memfd=memfd)

    def begin_shared_put(
        self, key: bytes, length: int, algo: int, checksum: bytes, wait_s: float = 0.0
    ) -> PutTicket | None:
        """As `begin_put`, the buffer a new memfd (SHM_PUT: the client fills it, `SealedBuffer.seal`
        before `commit`); None when `self.shared` has none to give (a bound reached), and then
        nothing was reserved or evicted."""
        size = buffer_size_for(length)
        if self.shared is None:
            return None
        if (spare := self._take_spare(key, size)) is not None:
            try:
                return self._begin_put(key, length, algo, checksum, wait_s, size, spare, counted=True)
            except BaseException:
                self.shared.ended()
                with self._locked():
                    self._give_back(spare)
                raise
        if (sealed := self.shared.reserve(size)) is None:
            return None
        try:
            return self._begin_put(key, length, algo, checksum, wait_s, size, sealed)
        except BaseException:
            self.shared.ended()
            self.shared.freed(sealed)
            raise

    def _begin_put(
        self,
        key: bytes,
        length: int,
        algo: int,
        checksum: bytes,
        wait_s: float,
        size: int,
        sealed: SealedBuffer | None,
        counted: bool = False,
        memfd: bool = False,
    ) -> PutTicket:
        """`counted`: `sealed` is a spare, already in allocated_bytes (nothing to make room for)."""
        if size > self.capacity_bytes:
            raise NoSpace(f"value of {length} bytes exceeds the node's capacity")
        lane = self.lane_for(key)
        with self._locked():
            self._expire_leases()
            old = self._index.get(key)
            if old is not None and old.leases:
                raise Leased(f"key {key[:64]!r} is leased")
            if self.inflight_bytes + size > self.max_inflight_bytes:
                # wait_for re-checks under the lock; a bound smaller than one value lets one in.
                fits = lambda: self.inflight_bytes == 0 or self.inflight_bytes + size <= self.max_inflight_bytes  # noqa: E731
                if not self._inflight_done.wait_for(fits, timeout=wait_s):
                    raise NoSpace(
                        f"{self.inflight_bytes} bytes of PUTs in flight (bound {self.max_inflight_bytes})",
                        "inflight_limit",
                    )
            self.inflight_bytes += size
            try:
                buf = None if counted else self._reserve(key, size, lane, reuse=sealed is None)
            except BaseException:
                self._end_inflight(size)
                raise
        if sealed is not None:
            return PutTicket(key, lane, length, algo, checksum, sealed, size)
        if buf is None:
            try:
                buf = self._new_buffer(size, memfd)
            except BaseException:
                with self._locked():
                    self.allocated_bytes -= size
                    self._end_inflight(size)
                raise
            if self.on_alloc is not None:
                self.on_alloc(buf)
        return PutTicket(key, lane, length, algo, checksum, buf, size)

    def _new_buffer(self, size: int, memfd: bool) -> ValueBuffer:
        """A new buffer of `size` (lock not held): a node-written memfd where asked for and the
        memfd bound allows, else private memory."""
        shared = self.shared
        made = None
        if memfd and shared is not None and size >= MMAP_THRESHOLD:
            made = shared.node_written_memfd(size)
        return ValueBuffer(size, made)

    def _reserve(self, key: bytes, size: int, lane: Lane, reuse: bool = True) -> ValueBuffer | None:
        """A buffer of `size` (lock held), or None with `size` bytes reserved for the caller to
        allocate outside the lock (always None without `reuse`: a memfd is made anew). Raises
        NoSpace."""
        buf = self._take_pooled(size) if reuse else None
        if buf is None and self.allocated_bytes + size > self.capacity_bytes:
            self._expire_leases()
            buf = self._drop_replaced(key, size, reuse)
        if buf is None:
            buf = self._make_room(size, lane, reuse)
        if buf is None:
            self.allocated_bytes += size  # reserve now, allocate outside the lock
        return buf

    def _end_inflight(self, size: int) -> None:
        self.inflight_bytes -= size
        self._inflight_done.notify_all()

    def commit(self, ticket: PutTicket) -> bool:
        """Make the value visible. False (and the ticket aborted) when its key was leased
        meanwhile: a leased value is never replaced."""
        entry = Entry(ticket.key, ticket.lane, ticket.length, ticket.algo, ticket.checksum, ticket.buf)
        with self._locked():
            self._end_inflight(ticket.reserved)
            self._expire_leases()
            old = self._index.get(ticket.key)
            if old is not None and old.leases:
                self._give_back(ticket.buf)
                self._shared_ended(ticket)
                return False
            if old is not None:
                self._unlink(old)
            self._shared_ended(ticket)
            self._index[ticket.key] = entry
            ticket.lane.entries[ticket.key] = entry
            ticket.lane.bytes += entry.buf.size
            self.stored_bytes += entry.length
        return True

    def abort(self, ticket: PutTicket) -> None:
        """Drop a reservation: its buffer back to the pool, a memfd closed (what a client still
        maps of it is then that client's memory)."""
        with self._locked():
            self._end_inflight(ticket.reserved)
            self._give_back(ticket.buf)
            self._shared_ended(ticket)

    def _shared_ended(self, ticket: PutTicket) -> None:
        if self.shared is not None and isinstance(ticket.buf, SealedBuffer):
            self.shared.ended()

    # -- spares (memkv/server/shm.py) --------------------------------------------------------

    def _take_spare(self, key: bytes, size: int) -> SealedBuffer | None:
        """A spare of exactly `size` for an SHM_PUT of `key`, or None; either way the size is
        wanted from now on (the refill thread makes the next one)."""
        with self._locked():
            self._spare_wanted[size] = (self._clock(), self.lane_for(key))
            self._spare_wake.notify()
            spares = self._spares.get(size)
            if not spares or self.shared is None or not self.shared.take_spare(size):
                return None
            return spares.pop()

    def refill_spare(self) -> bool:
        """Make one spare if the spares of a wanted size are below their share of the spare
        budget, evicting for it as the store it stands for would; True if one was made (call
        again), False when none is wanted now (or there is no room). Drops the spares of sizes
        no SHM_PUT asked for within SPARE_KEEP_S. Called by one thread (the node's)."""
        with self._locked():
            size, lane = self._spare_to_make()
            if size is None or lane is None or self.shared is None:
                return False
            if self.allocated_bytes + size > self.capacity_bytes:
                try:
                    self._make_room(size, lane, reuse=False, for_spare=True)
                except NoSpace:
                    return False
            self.allocated_bytes += size
            shared = self.shared
        buf = shared.spare(size)  # outside the lock: faulting the pages in takes a while
        with self._locked():
            if buf is None:
                self.allocated_bytes -= size
                return False
            self._spares.setdefault(size, []).append(buf)
        return True

    def wait_for_spare_demand(self, timeout_s: float) -> None:
        with self._locked():
            self._spare_wake.wait(timeout_s)

    def _spare_to_make(self) -> tuple[int | None, Lane | None]:
        """Lock held: the size of the next spare to make (the most recently wanted first), and
        the lane it evicts from."""
        now = self._clock()
        for size, (when, _) in list(self._spare_wanted.items()):
            if now - when > SPARE_KEEP_S:
                del self._spare_wanted[size]
                for buf in self._spares.pop(size, []):
                    self._free_spare(buf)
        if not self._spare_wanted:
            return None, None
        budget = min(MAX_SPARE_BYTES, self.capacity_bytes // SPARE_CAPACITY_DIVISOR) // len(self._spare_wanted)
        for size, (_, lane) in sorted(self._spare_wanted.items(), key=lambda item: -item[1][0]):
            if (len(self._spares.get(size, ())) + 1) * size <= budget:
                return size, lane
        return None, None

    def _drop_spares(self) -> bool:
        """Lock held: free every spare (a store needs their room and nothing else can go)."""
        spares, self._spares = self._spares, {}
        for bufs in spares.values():
            for buf in bufs:
                self._free_spare(buf)
        return bool(spares)

    def _free_spare(self, buf: SealedBuffer) -> None:
        """Lock held: freed when it is released."""
        self.allocated_bytes -= buf.size
        self._released.append((buf, True))

    # -- reads --------------------------------------------------------------------------------

    def acquire(self, keys: Sequence[bytes], expected_lengths: Sequence[int], any_length: int) -> list[Entry | int]:
        """Pin the entries for a GET. Per key: a pinned Entry, or an ItemStatus (MISS,
        SIZE_MISMATCH). Call `release` with the entries when they are sent."""
        out: list[Entry | int] = []
        with self._locked():
            for key, expected in zip(keys, expected_lengths):
                entry = self._index.get(key)
                if entry is None:
                    out.append(ItemStatus.MISS)
                elif expected != any_length and entry.length != expected:
                    out.append(ItemStatus.SIZE_MISMATCH)
                else:
                    entry.pins += 1
                    entry.lane.entries.move_to_end(key)
                    out.append(entry)
        return out

    def release(self, entries: Iterable[Entry]) -> None:
        with self._locked():
            for entry in entries:
                entry.pins -= 1
                if entry.pins == 0 and not entry.live:
                    self._give_back(entry.buf)

    def exists(self, keys: Sequence[bytes]) -> bytes:
        contains = self._index.__contains__
        with self._locked():
            found = list(map(contains, keys))
            if self.leases:  # a value deleted while leased answers MISS at once
                index = self._index
                found = [f and not index[k].doomed for f, k in zip(found, keys)]
        return bytes(ItemStatus.MISS - f for f in found)  # OK = 0, MISS = 1

    def delete(self, keys: Sequence[bytes]) -> bytes:
        out = bytearray()
        with self._locked():
            self._expire_leases()
            for key in keys:
                entry = self._index.get(key)
                if entry is None or entry.doomed:
                    out.append(ItemStatus.MISS)
                elif entry.leases:
                    entry.doomed = True  # goes when its last lease ends
                    out.append(ItemStatus.LEASED)
                else:
                    self._unlink(entry)
                    out.append(ItemStatus.OK)
        return bytes(out)

    # -- leases ---------------------------------------------------------------------------------

    def lease(self, keys: Sequence[bytes], token: int, ttl_s: float) -> tuple[bytes, list[int], float]:
        """Lease (or renew) each key's value under `token` for `ttl_s` (capped at max_lease_s).
        Per key OK with the value's length, or MISS (no value, deleted, or beyond the bounds).
        Returns (statuses, lengths, granted ttl)."""
        ttl = min(ttl_s, self.max_lease_s)
        statuses = bytearray()
        lengths: list[int] = []
        with self._locked():
            now = self._clock()
            self._expire_leases(now)
            expiry = now + ttl
            for key in keys:
                entry = self._index.get(key)
                if entry is None or entry.doomed:
                    statuses.append(ItemStatus.MISS)
                    lengths.append(0)
                    continue
                held = entry.leases
                if held is None or token not in held:
                    new_bytes = 0 if held else entry.buf.size
                    mine = self._holders.get(token) or [0, 0]
                    if (
                        self.leases + 1 > self.max_leases
                        or self.leased_bytes + new_bytes > self.max_lease_bytes
                        or mine[0] + 1 > self.max_leases_per_holder
                        or mine[1] + entry.buf.size > self.max_lease_bytes_per_holder
                    ):
                        self.leases_refused += 1
                        statuses.append(ItemStatus.MISS)
                        lengths.append(0)
                        continue
                    if held is None:
                        held = entry.leases = {}
                    self.leases += 1
                    self.leased_bytes += new_bytes
                    mine[0] += 1
                    mine[1] += entry.buf.size
                    self._holders[token] = mine
                held[token] = expiry
                self._lease_seq += 1
                heapq.heappush(self._lease_heap, (expiry, self._lease_seq, key, token))
                entry.lane.entries.move_to_end(key)  # leased: recently used
                statuses.append(ItemStatus.OK)
                lengths.append(entry.length)
        return bytes(statuses), lengths, ttl

    def end_leases(self, keys: Sequence[bytes], token: int) -> bytes:
        """End the leases (key, token): OK where one ended, MISS where there was none."""
        out = bytearray()
        with self._locked():
            self._expire_leases()
            for key in keys:
                entry = self._index.get(key)
                if entry is None or not entry.leases or token not in entry.leases:
                    out.append(ItemStatus.MISS)
                    continue
                self._end_lease(entry, token)
                out.append(ItemStatus.OK)
        return bytes(out)

    def _end_lease(self, entry: Entry, token: int) -> None:
        """(lock held) Drop one lease; the last one un-pins the value (and removes a doomed one)."""
        assert entry.leases is not None
        del entry.leases[token]
        self.leases -= 1
        mine = self._holders[token]
        mine[0] -= 1
        mine[1] -= entry.buf.size
        if not mine[0]:
            del self._holders[token]
        if not entry.leases:
            entry.leases = None
            self.leased_bytes -= entry.buf.size
            if entry.doomed:
                self._unlink(entry)

    def _expire_leases(self, now: float | None = None) -> None:
        """(lock held) End every lease past its expiry. A renewed lease left a stale heap item
        behind (its expiry no longer matches): skipped."""
        heap = self._lease_heap
        if not heap:
            return
        now = self._clock() if now is None else now
        while heap and heap[0][0] <= now:
            expiry, _, key, token = heapq.heappop(heap)
            entry = self._index.get(key)
            if entry is None or not entry.leases or entry.leases.get(token) != expiry:
                continue
            self.lease_expirations += 1
            self._end_lease(entry, token)

    # -- introspection --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._locked():
            self._expire_leases()
            return {
                "leases": self.leases,
                "leased_bytes": self.leased_bytes,
                "max_leases": self.max_leases,
                "max_lease_bytes": self.max_lease_bytes,
                "max_lease_share": self.max_lease_share,
                "lease_holders": len(self._holders),
                "max_lease_s": self.max_lease_s,
                "lease_expirations": self.lease_expirations,
                "leases_refused": self.leases_refused,
                "capacity_bytes": self.capacity_bytes,
                "allocated_bytes": self.allocated_bytes,
                "stored_bytes": self.stored_bytes,
                "pooled_bytes": self._pool_bytes,
                "inflight_bytes": self.inflight_bytes,
                "max_inflight_bytes": self.max_inflight_bytes,
                "values": len(self._index),
                "evictions": self.evictions,
                "lanes": [
                    {
                        "name": lane.name,
                        "prefix": lane.prefix.decode("utf-8", "replace"),
                        "share": lane.share,
                        "share_bytes": int(lane.share * self.capacity_bytes),
                        "used_bytes": lane.bytes,
                        "values": len(lane.entries),
                        "evictions": lane.evictions,
                    }
                    for lane in self.lanes
                ],
            }

    def list_keys(self, prefix: bytes = b"", limit: int = 1000) -> tuple[list[tuple[bytes, int]], bool]:
        """The first `limit` keys in byte order that start with `prefix`, each with its value's
        length, and whether more keys matched. O(values on the node): for operators (LIST),
        never the data path."""
        with self._locked():
            # Only a C-speed snapshot under the lock: filtering and sorting a large node's keys
            # happen outside it, so a listing does not stall PUT/GET. An entry's key and length
            # never change, so reading them afterwards is safe.
            entries = [e for e in self._index.values() if not e.doomed] if self.leases else list(self._index.values())
        if prefix:
            entries = [e for e in entries if e.key.startswith(prefix)]
        first = heapq.nsmallest(limit, entries, key=operator.attrgetter("key"))
        return [(e.key, e.length) for e in first], len(entries) > limit

    # -- internals (lock held) ------------------------------------------------------------------

    def _unlink(self, entry: Entry, keep_buffer: bool = False) -> None:
        """Remove a live entry from the index; free its buffer unless a reader holds it (or the
        caller keeps it: an eviction handing the buffer straight to the next value)."""
        del self._index[entry.key]
        del entry.lane.entries[entry.key]
        entry.lane.bytes -= entry.buf.size
        self.stored_bytes -= entry.length
        entry.live = False
        if entry.pins == 0 and not keep_buffer:
            self._give_back(entry.buf)

    def _drop_replaced(self, key: bytes, size: int, reuse: bool = True) -> ValueBuffer | None:
        """A full store replacing `key`: its old value goes first, rather than an unrelated LRU
        value (both buffers cannot exist at once without exceeding capacity). Its buffer is
        handed over when it fits and no reader holds it. An abort then leaves the key a miss."""
        old = self._index.get(key)
        if old is None or old.leases:
            return None
        buf = old.buf
        reusable = (
            reuse and isinstance(buf, ValueBuffer) and old.pins == 0 and size <= buf.size <= size * (1 + REUSE_SLACK)
        )
        self._unlink(old, keep_buffer=reusable)
        return buf if reusable and isinstance(buf, ValueBuffer) else None

    def _give_back(self, buf: Buffer) -> None:
        """A buffer nobody uses: keep it for reuse while the pool has room, else free it once
        the lock is released (a memfd always: it is sealed to its value)."""
        if isinstance(buf, SealedBuffer):
            self.allocated_bytes -= buf.size
            if self.on_drop is not None:
                self.on_drop(buf)
            self._released.append((buf, False))
        elif self._pool_bytes + buf.size <= self._pool_max:
            lst = self._pool.setdefault(buf.size, [])
            if not lst:
                bisect.insort(self._pool_sizes, buf.size)
            lst.append(buf)
            self._pool_bytes += buf.size
        else:
            self.allocated_bytes -= buf.size
            if self.on_drop is not None:
                self.on_drop(buf)
            self._released.append((buf, False))

    def _take_pooled(self, size: int) -> ValueBuffer | None:
        i = bisect.bisect_left(self._pool_sizes, size)
        if i == len(self._pool_sizes) or self._pool_sizes[i] > size * (1 + REUSE_SLACK):
            return None
        found = self._pool_sizes[i]
        lst = self._pool[found]
        buf = lst.pop()
        if not lst:
            del self._pool[found]
            self._pool_sizes.pop(i)
        self._pool_bytes -= found
        return buf

    def _drop_pooled(self, need: int) -> None:
        """Free pooled buffers (largest first) until `need` more bytes fit under capacity."""
        while self._pool_sizes and self.allocated_bytes + need > self.capacity_bytes:
            size = self._pool_sizes[-1]
            lst = self._pool[size]
            dropped = lst.pop()
            if self.on_drop is not None:
                self.on_drop(dropped)
            self._released.append((dropped, False))
            if not lst:
                del self._pool[size]
                self._pool_sizes.pop()
            self._pool_bytes -= size
            self.allocated_bytes -= size

    def _make_room(self, size: int, lane: Lane, reuse: bool = True, for_spare: bool = False) -> ValueBuffer | None:
        """Evict until `size` fits. Returns a reusable evicted buffer, or None when the caller
        should allocate (space is reserved by the caller). Spares go only when no value can
        (never `for_spare`). Raises NoSpace."""
        self._drop_pooled(size)
        while self.allocated_bytes + size > self.capacity_bytes:
            victim = self._pick_victim(lane)
            if victim is None:
                if not for_spare and self._drop_spares():
                    continue
                raise NoSpace("no evictable value: every value is being read or is leased")
            victim.lane.evictions += 1
            self.evictions += 1
            pinned = victim.pins > 0
            # A victim of this size class hands its buffer over directly, however full the
            # free pool is (values larger than capacity / 8 never fit in the pool).
            buf = victim.buf
            reusable = (
                reuse and isinstance(buf, ValueBuffer) and not pinned and size <= buf.size <= size * (1 + REUSE_SLACK)
            )
            self._unlink(victim, keep_buffer=reusable)
            if reusable and isinstance(buf, ValueBuffer):
                return buf
            if not pinned:
                if reuse and (reused := self._take_pooled(size)) is not None:
                    return reused
                self._drop_pooled(size)
        return None

    def _pick_victim(self, writer: Lane) -> Entry | None:
        cap = self.capacity_bytes
        best: Lane | None = None
        best_ratio = 1.0
        for lane in self.lanes:
            if not lane.entries:
                continue
            share_bytes = lane.share * cap
            ratio = float("inf") if share_bytes <= 0 else lane.bytes / share_bytes
            if ratio > best_ratio:
                best, best_ratio = lane, ratio
        candidates = [best] if best is not None else []
        candidates += [writer, *self.lanes]
        for lane in candidates:
            for entry in lane.entries.values():
                if entry.pins == 0 and not entry.leases:
                    return entry
            # every entry of this lane is pinned or leased; try the next candidate lane
        return None
