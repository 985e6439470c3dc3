"""Values same-host clients store and load through shared memory: one sealed memfd per value.

Why (docs/protocol.md section 13): over a socket every byte is copied twice, both times by a CPU.
A same-host client that writes a value into memory the node then keeps, and copies a value
out of it, copies each byte once and hashes it while it is in cache; the node does no per-byte
work at all.

Trust. Every descriptor a client gets is a memfd of exactly one value's buffer, sealed against
shrinking and growing from its creation (F_SEAL_SHRINK | F_SEAL_GROW): no client can turn a
mapping of it into SIGBUS for the node or anyone else. The client of an SHM_PUT writes into its
own reservation only; SHM_COMMIT adds F_SEAL_WRITE | F_SEAL_SEAL, which the kernel refuses
(EBUSY) while any writable shared mapping of it exists, so a committed value is immutable for
every process (no descriptor, mapping or reopening through /proc writes it any more). The node
never maps a memfd writable; it maps a committed one private and read-only, for socket GETs.

Memory. A memfd's bytes count in the store's allocated_bytes from the reservation on (the
node's capacity); a memfd closed by the node (value deleted, evicted, replaced, a reservation
dropped) is memory the node no longer holds: what a client still maps of it is the client's.
Pages are charged (memcg) to whichever process faulted them: a value's pages to its writer.

Node-written memfds (`--shared-memory-stores node`, the default where the host gives shared
memory no huge pages). A fresh memfd per store makes every value's pages anew, 4 KiB at a time
there: stores ran at a third of the socket's speed. Instead same-host clients store over the
socket, and the node receives each of their values into a buffer that is a memfd of its own
(`node_written_memfd`), reused for value after value like its private buffers. The node maps it
writable before sealing it F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE: its own mapping
still writes, and every other holder is refused any write (write, pwrite, a writable shared
mapping, mprotect, reopening /proc/self/fd/N, fallocate, ftruncate). SHM_GET passes it as it
passes a committed memfd; since it may hold another value by the time a client reads it, a
client reads it verified and takes the socket where the bytes no longer match. What a client
still holds a descriptor of shows whatever value the node put there later, until the client
closes it (docs/protocol.md section 13).

Bounds: at most `max_values` memfds (descriptors and mappings held by the node) and at most
`max_pending` reservations not yet committed, node-wide; past them SHM_PUT answers NOT_SHARED
and the client stores over the socket, and a new node-written buffer is private memory.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading

from memkv import memfd

PAGE = mmap.PAGESIZE
SEALS_OPEN = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # from creation: the size never changes
SEALS_COMMITTED = SEALS_OPEN | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL  # from SHM_COMMIT: immutable
# A node-written memfd: writable through the node's own mapping only, made before this seal.
SEALS_NODE_WRITTEN = SEALS_OPEN | memfd.F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
MAX_PENDING = 1024  # reservations not yet committed, node-wide
MAP_HEADROOM = 8192  # mappings kept for the rest of the process (vm.max_map_count)
FD_HEADROOM = 256  # descriptors kept for the rest of the process beyond connections
FDS_PER_VALUE = 2  # the memfd's, and the one Python's mmap keeps of it
# Spares (`Store.refill_spare`): fresh memfds faulted in ahead of the stores that will take
# them, at most this many bytes (and capacity / SPARE_CAPACITY_DIVISOR), split between the value
# sizes SHM_PUT asked for within SPARE_KEEP_S.
MAX_SPARE_BYTES = 256 << 20
SPARE_CAPACITY_DIVISOR = 16
SPARE_KEEP_S = 30.0
# "auto" makes spares only where the node may run on this many CPUs: faulting pages in ahead
# helps a store when another core does it; on a 2-core host it competed with the writers and
# made stores slower (docs/archive/performance-log.md, "Shared memory").
MIN_SPARE_CPUS = 4


# --shared-memory-stores "auto" lets clients write their own memfds where the host's shared memory
# mode is one of these.
THP_ON_ADVICE = ("always", "within_size", "advise", "force")


def client_stores_on(mode: str) -> bool:
    """Whether same-host clients store through SHM_PUT, for --shared-memory-stores `mode`. "auto":
    where the host makes shared memory's pages huge on advice, as a fresh memfd per value needs to
    fill at the copy's speed (memkv/memfd.py, `shmem_huge_pages`)."""
    if mode == "auto":
        return memfd.shmem_huge_pages() in THP_ON_ADVICE
    return mode == "client"


def node_written_memfd(size: int) -> tuple[int, mmap.mmap]:
    """A memfd of `size` bytes that only the returned mapping (shared, writable) can write: the
    descriptor (for SHM_GET) and the mapping. Raises OSError."""
    fd = os.memfd_create("memkv-value", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS_OPEN)
        mem = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mem.madvise(memfd.MADV_HUGEPAGE)  # where the host allows it: before any page exists
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS_NODE_WRITTEN)
    except BaseException:
        os.close(fd)
        raise
    return fd, mem


def spares_on(mode: str) -> bool:
    """Whether the node keeps spares, for --shared-memory-spares `mode` (auto, on, off)."""
    if mode == "auto":
        return len(os.sched_getaffinity(0)) >= MIN_SPARE_CPUS
    return mode == "on"


class StillMapped(OSError):
    """SHM_COMMIT of a memfd that some process still maps writable (or sealed against sealing)."""


class SealedBuffer:
    """A store buffer that is a memfd of `size` bytes (ValueBuffer's interface: size, view, fd).
    `view` exists once committed: a private read-only mapping."""

    __slots__ = ("size", "fd", "view", "_mem")

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create("memkv-value", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS_OPEN)
        except BaseException:
            os.close(self.fd)
            raise
        self._mem: mmap.mmap | None = None
        self.view = memoryview(b"")

    def seal(self) -> None:
        """Make the value immutable and map it for the node's reads. Raises StillMapped when a
        writable shared mapping of it exists (EBUSY) or the writer sealed it against sealing."""
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS_COMMITTED)
        except OSError as exc:
            if exc.errno in (errno.EBUSY, errno.EPERM):
                raise StillMapped(exc.errno, "the memfd is still mapped writable (or sealed by the writer)") from None
            raise
        if fcntl.fcntl(self.fd, fcntl.F_GET_SEALS) & SEALS_COMMITTED != SEALS_COMMITTED:
            raise StillMapped(errno.EPERM, "the memfd lacks its seals")
        # Private and read-only: no mapping the node holds can write, and none blocks the seals.
        # (Python's mmap holds a second descriptor of the memfd: FDS_PER_VALUE.)
        self._mem = mmap.mmap(self.fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        self.view = memoryview(self._mem)

    def prefault(self) -> None:
        """Fault every page in now (huge pages where the host allows), so that the client's copy
        into it writes into memory that exists (`SharedValues.spare`). Only ever done before any
        client has seen the memfd; the node's writable mapping is gone after."""
        addr = memfd.map_fd(self.fd, self.size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED)
        try:
            memfd.fault_in(addr, self.size)
        finally:
            memfd.unmap(addr, self.size)

    def free(self) -> None:
        """The store is done with it: the memfd closes now, or, while a socket GET still sends
        from it, with that GET's last view (CPython frees the mapping with its last reference)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        mem, self._mem = self._mem, None
        self.view = memoryview(b"")
        if mem is not None:
            try:
                mem.close()  # unmaps and closes its own descriptor
            except BufferError:  # exported: goes with the last view
                pass


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # the kernel's default


class SharedValues:
    """The node's memfd values: their bounds and counters. Thread-safe."""

    def __init__(self, max_values: int | None = None, max_pending: int = MAX_PENDING) -> None:
        self.max_values = max(0, _max_map_count() - MAP_HEADROOM) if max_values is None else max_values
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self.values = 0  # memfds of values: reserved, committed, not yet freed
        self.bytes = 0  # their buffer bytes (part of the store's allocated_bytes)
        self.spares = 0  # memfds faulted in for stores to come (`spare`)
        self.spare_bytes = 0  # their buffer bytes (part of the store's allocated_bytes too)
        self.pending = 0  # reservations not yet committed or dropped
        self.refused = 0  # SHM_PUT items answered NOT_SHARED: a bound reached
        self.commits_refused = 0  # SHM_COMMIT items refused: still mapped writable
        self.reclaimed = 0  # reservations dropped uncommitted (timeout, connection end)
        self.spares_taken = 0  # SHM_PUT items given a spare (faulted in ahead: no page faults for the client)
        self.node_written = 0  # node-written memfds (`node_written_memfd`): values, pooled or reserved
        self.node_written_bytes = 0  # their buffer bytes (part of the store's allocated_bytes)

    def _at_bound(self) -> bool:
        """(lock held) Whether the node holds as many memfds as it may: values, spares, its own."""
        return self.values + self.spares + self.node_written >= self.max_values

    def fit_fd_limit(self, fd_soft_limit: int, connections: int) -> None:
        """Keep the memfds the node holds under RLIMIT_NOFILE, beside `connections` sockets."""
        self.max_values = max(0, min(self.max_values, (fd_soft_limit - connections - FD_HEADROOM) // FDS_PER_VALUE))

    def reserve(self, size: int) -> SealedBuffer | None:
        """A new memfd of `size` bytes, or None past a bound (or when the kernel refuses one)."""
        with self._lock:
            if self._at_bound() or self.pending >= self.max_pending:
                self.refused += 1
                return None
            self.values += 1
            self.pending += 1
            self.bytes += size
        try:
            return SealedBuffer(size)
        except OSError:
            with self._lock:
                self.values -= 1
                self.pending -= 1
                self.bytes -= size
                self.refused += 1
            return None

    def spare(self, size: int) -> SealedBuffer | None:
        """A new memfd of `size` bytes, faulted in, for a later `take_spare`; None past the memfd
        bound (or when the kernel refuses one)."""
        with self._lock:
            if self._at_bound():
                return None
            self.spares += 1
            self.spare_bytes += size
        try:
            buf = SealedBuffer(size)
        except OSError:
            with self._lock:
                self.spares -= 1
                self.spare_bytes -= size
            return None
        buf.prefault()
        return buf

    def node_written_memfd(self, size: int) -> tuple[int, mmap.mmap] | None:
        """A node-written memfd of `size` bytes (`node_written_memfd`), or None past the memfd
        bound (or when the kernel refuses one): the caller's buffer is private memory then."""
        with self._lock:
            if self._at_bound():
                return None
            self.node_written += 1
            self.node_written_bytes += size
        try:
            return node_written_memfd(size)
        except OSError:
            self.node_written_freed(size)
            return None

    def node_written_freed(self, size: int) -> None:
        with self._lock:
            self.node_written -= 1
            self.node_written_bytes -= size

    def take_spare(self, size: int) -> bool:
        """A spare of `size` bytes becomes a reservation: False past the pending bound (then it
        stays a spare)."""
        with self._lock:
            if self.pending >= self.max_pending:
                self.refused += 1
                return False
            self.pending += 1
            self.spares_taken += 1
            self.spares -= 1
            self.spare_bytes -= size
            self.values += 1
            self.bytes += size
            return True

    def ended(self) -> None:
        """A reservation was committed or dropped."""
        with self._lock:
            self.pending -= 1

    def reclaimed_reservations(self, n: int) -> None:
        """`n` reservations dropped because their SHM_COMMIT never came."""
        with self._lock:
            self.reclaimed += n

    def freed(self, buf: SealedBuffer, spare: bool = False) -> None:
        buf.free()
        with self._lock:
            if spare:
                self.spares -= 1
                self.spare_bytes -= buf.size
            else:
                self.values -= 1
                self.bytes -= buf.size

    def refused_commit(self) -> None:
        with self._lock:
            self.commits_refused += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "values": self.values,
                "bytes": self.bytes,
                "spares": self.spares,
                "spare_bytes": self.spare_bytes,
                "max_values": self.max_values,
                "pending": self.pending,
                "max_pending": self.max_pending,
                "refused_puts": self.refused,
                "refused_commits": self.commits_refused,
                "reclaimed_reservations": self.reclaimed,
                "spares_taken": self.spares_taken,
                "node_written": self.node_written,
                "node_written_bytes": self.node_written_bytes,
            }
