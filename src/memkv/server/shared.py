"""Value memory that same-host clients can map: memfd arenas cut into slots of one size.

Why (docs/protocol.md section 13, docs/performance.md "Shared memory for same-host clients"):
over a socket every byte of a load is copied twice, both times by a CPU (into the socket by the
node, out of it by the client). A client on the same host that maps the node's value memory
copies each value once, straight into its destination (vLLM's CPU pool), and hashes the copy
while it is still in cache: the node does no per-byte work at all.

Layout. An arena is one memfd (Linux), mapped shared by the node and by clients that
received its descriptor over the same-host socket (SCM_RIGHTS, SHM_ATTACH). Every slot of an
arena has the same size, the size of the store buffers it serves (store.buffer_size_for: values
of one model are one size), so an arena needs no allocator beyond a free list. Slots are
page-aligned. An arena's memory exists only where slots were used: a fresh memfd is sparse, and a
freed slot's pages are returned to the kernel at once (MADV_REMOVE punches the hole), mapped by
clients or not, so what the store counts (allocated_bytes) is what the node holds.

Bounds: at most `max_arenas` arenas (descriptors held by the node, mappings held by each
client); a buffer that would need more comes from private memory instead, and its value is
served over the socket as before (SHM_GET answers NOT_SHARED for it).

Thread safety: `take` runs outside the store's lock (a first touch of a slot faults its pages
in), `give` under it; one lock of its own guards the free lists.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading

log = logging.getLogger("memkv.server")

ARENA_BYTES = 1 << 30  # virtual size of one arena (at least one slot)
MAX_ARENAS = 256
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a slot's pages in with one call


class Arena:
    """One memfd, mapped shared, cut into `slots` slots of `slot_size` bytes."""

    __slots__ = ("id", "fd", "slot_size", "slots", "size", "mem", "view", "_free", "_next")

    def __init__(self, arena_id: int, slot_size: int, slots: int) -> None:
        self.id = arena_id
        self.slot_size = slot_size
        self.slots = slots
        self.size = slot_size * slots
        self.fd = os.memfd_create(f"memkv-arena-{arena_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.mem = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.mem)
        self._free: list[int] = []  # offsets of slots given back
        self._next = 0  # slots [_next, slots) were never used

    def take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._next < self.slots:
            self._next += 1
            return (self._next - 1) * self.slot_size
        return None

    @property
    def full(self) -> bool:
        return not self._free and self._next == self.slots


class SharedArenas:
    """The node's shareable value memory."""

    def __init__(self, max_arenas: int = MAX_ARENAS, arena_bytes: int = ARENA_BYTES) -> None:
        self.max_arenas = max_arenas
        self.arena_bytes = arena_bytes
        self._lock = threading.Lock()
        self._arenas: dict[int, Arena] = {}
        self._open: dict[int, list[Arena]] = {}  # slot size -> arenas with a free slot
        self._populate = True  # MADV_POPULATE_WRITE until the kernel says it has none
        self.refused = 0  # buffers that came from private memory: no arena could be made
        self.quarantined = 0  # slots taken out of service (`quarantine`)

    def take(self, size: int) -> tuple[Arena, int] | None:
        """A slot of `size` bytes (a page multiple) with its pages faulted in, or None when no
        arena can be made (the bound, or the kernel refused a memfd): use private memory."""
        with self._lock:
            arenas = self._open.setdefault(size, [])
            arena = arenas[-1] if arenas else None
            if arena is None:
                arena = self._new_arena(size)
                if arena is None:
                    self.refused += 1
                    return None
                arenas.append(arena)
            offset = arena.take()
            assert offset is not None  # arenas in _open have a free slot
            if arena.full:
                arenas.pop()
        try:
            self._fault_in(arena, offset, size)
        except BaseException:
            self.give(arena, offset)
            raise
        return arena, offset

    def give(self, arena: Arena, offset: int) -> None:
        """A slot nobody uses: its pages go back to the kernel now (a client's mapping of it then
        reads zeros, which no checksum matches), the slot back to the free list."""
        try:
            arena.mem.madvise(mmap.MADV_REMOVE, offset, arena.slot_size)
        except OSError as exc:  # never seen on Linux; the memory then stays until reuse
            log.warning("MADV_REMOVE on arena %d failed: %s", arena.id, exc)
        with self._lock:
            was_full = arena.full
            arena._free.append(offset)
            if was_full:
                self._open.setdefault(arena.slot_size, []).append(arena)

    def quarantine(self, arena: Arena, offset: int) -> None:
        """A slot a client may still write into (an SHM_PUT reservation never committed: the
        client stalled or vanished mid-copy): its pages go back to the kernel, the slot itself
        never serves again, so a late write lands in no value. Costs a slot of address space."""
        try:
            arena.mem.madvise(mmap.MADV_REMOVE, offset, arena.slot_size)
        except OSError as exc:
            log.warning("MADV_REMOVE on arena %d failed: %s", arena.id, exc)
        with self._lock:
            self.quarantined += 1

    def descriptor(self, arena_id: int) -> tuple[int, int] | None:
        """(fd, size) of an arena, for SHM_ATTACH; None for an id that is not one."""
        arena = self._arenas.get(arena_id)
        return None if arena is None else (arena.fd, arena.size)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "arenas": len(self._arenas),
                "max_arenas": self.max_arenas,
                "virtual_bytes": sum(a.size for a in self._arenas.values()),
                "refused_buffers": self.refused,
                "quarantined_slots": self.quarantined,
            }

    def _new_arena(self, size: int) -> Arena | None:
        """Lock held."""
        if len(self._arenas) >= self.max_arenas:
            return None
        arena_id = len(self._arenas)  # never reused: arenas live as long as the node
        try:
            arena = Arena(arena_id, size, max(1, self.arena_bytes // size))
        except OSError as exc:
            log.warning("no shared memory arena (%s): values of %d bytes use private memory", exc, size)
            self.max_arenas = len(self._arenas)  # do not ask the kernel again for every buffer
            return None
        self._arenas[arena_id] = arena
        return arena

    def _fault_in(self, arena: Arena, offset: int, size: int) -> None:
        """Fault the slot's pages in now (as MAP_POPULATE does for private buffers), so that
        neither a PUT's receive nor a client's first copy takes page faults one by one."""
        if self._populate:
            try:
                arena.mem.madvise(MADV_POPULATE_WRITE, offset, size)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._populate = False  # before Linux 5.14
        zeros = bytes(min(size, 1 << 20))
        for off in range(offset, offset + size, len(zeros)):
            n = min(len(zeros), offset + size - off)
            arena.view[off : off + n] = zeros[:n]
