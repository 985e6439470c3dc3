"""Values as sealed memfds (memkv/server/shm.py, memkv/client/shared.py) and the store on top.

Behaviour under test (real memfds, no node process):
* a reservation is a memfd of exactly the buffer's size, sealed against shrinking and growing:
  ftruncate and a write past its end fail; `seal` refuses while a writable shared mapping exists
  (StillMapped) and, once sealed, no descriptor or mapping writes it any more;
* the store counts every memfd in allocated_bytes from its reservation on, never reuses one for
  another value (private buffers are pooled, memfds closed), and after a fill-evict-delete cycle
  holds none; a memfd bound reached makes `begin_shared_put` answer None without evicting;
* `write_value` leaves no writable mapping (the seal then succeeds) and keeps a read-only one;
  `check_sealed` refuses a memfd without its seals or of another size than the value's buffer; `copy_verified` copies whole and verified,
  and fails a checksum of other bytes; `MappedValues` stays within its bounds and unmaps what it
  dropped once the copies reading it end, whatever other copies run;
* spares: an SHM_PUT makes its size wanted, the refill makes faulted-in memfds of it within the
  spare budget, counted once in allocated_bytes, the next SHM_PUT of the size takes one; sizes
  not asked for within SPARE_KEEP_S lose theirs; a full store evicts for a spare and frees the
  spares before refusing a store.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os

import pytest

from memkv.client import shared as client_shared
from memkv.client.shared import (
    MappedValues,
    SealError,
    check_loadable,
    check_sealed,
    copy_verified,
    map_value,
    read_verified,
    write_value,
)
from memkv.config import ConfigError, ServerConfig
from memkv.integrity import Checksummer
from memkv.memfd import unmap
from memkv.protocol import ChecksumAlgo, ItemStatus
from memkv.server.shm import (
    SEALS_OPEN,
    SPARE_KEEP_S,
    SealedBuffer,
    SharedValues,
    StillMapped,
    client_stores_on,
    node_written_memfd,
    spares_on,
)
from memkv.server.store import Store, ValueBuffer

MiB = 1 << 20
SUMS = Checksummer(b"k" * 32)


def refuses_every_write(fd: int, size: int) -> None:
    """No write through `fd`, a new shared mapping of it, or a read-write reopening of it."""
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 0)
    with pytest.raises(PermissionError):
        mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.pwrite(reopened, b"x", 0)
    finally:
        os.close(reopened)


def test_a_reservation_cannot_change_size_and_a_sealed_one_cannot_change_at_all() -> None:
    buf = SealedBuffer(2 * MiB)
    try:
        for size in (0, MiB, 4 * MiB):
            with pytest.raises(PermissionError):
                os.ftruncate(buf.fd, size)
        with pytest.raises(PermissionError):
            os.pwrite(buf.fd, b"x", 2 * MiB)  # growing by a write
        os.pwrite(buf.fd, b"abc", 0)  # its own pending value: writable until sealed
        writer = mmap.mmap(buf.fd, 2 * MiB, flags=mmap.MAP_SHARED)
        with pytest.raises(StillMapped):
            buf.seal()
        writer.close()
        buf.seal()
        assert bytes(buf.view[:3]) == b"abc"
        refuses_every_write(buf.fd, 2 * MiB)
        with pytest.raises(PermissionError):
            fcntl.fcntl(buf.fd, fcntl.F_ADD_SEALS, 0x10)  # F_SEAL_FUTURE_WRITE: refused, F_SEAL_SEAL makes them final
        assert bytes(buf.view[:3]) == b"abc"
    finally:
        buf.free()


def test_the_store_counts_memfds_never_reuses_them_and_holds_none_after_a_cycle() -> None:
    shared = SharedValues(max_values=100)
    store = Store(8 * MiB, shared=shared, pool_max_bytes=8 * MiB)
    for i in range(12):  # four fit: the rest evicts
        begin = store.begin_shared_put if i % 2 == 0 else store.begin_put
        ticket = begin(b"k%d" % i, 2 * MiB, 1, bytes(32))
        assert ticket is not None
        assert isinstance(ticket.buf, SealedBuffer) == (i % 2 == 0)
        if isinstance(ticket.buf, SealedBuffer):
            os.pwrite(ticket.buf.fd, bytes([i]) * 16, 0)
            ticket.buf.seal()
        else:
            ticket.target[:16] = bytes([i]) * 16
        assert store.commit(ticket)
        assert store.allocated_bytes <= 8 * MiB
        assert shared.bytes == 2 * MiB * shared.values <= store.allocated_bytes
    assert store.stats()["evictions"] == 8
    assert shared.pending == 0
    store.delete([b"k%d" % i for i in range(12)])
    assert shared.values == 0 and shared.bytes == 0
    assert all(isinstance(b, ValueBuffer) for bufs in store._pool.values() for b in bufs), "memfds are never pooled"


def test_past_the_memfd_bound_a_shared_reservation_is_refused_without_evicting() -> None:
    shared = SharedValues(max_values=2)
    store = Store(64 * MiB, shared=shared)
    tickets = [store.begin_shared_put(b"k%d" % i, MiB, 1, bytes(32)) for i in range(3)]
    assert tickets[2] is None and shared.refused == 1 and store.allocated_bytes == 2 * MiB
    for t in tickets[:2]:
        assert t is not None
        store.abort(t)
    assert shared.values == 0 and shared.pending == 0 and store.allocated_bytes == 0


def _store_with_spares(capacity: int, now: list[float]) -> tuple[Store, SharedValues]:
    shared = SharedValues(max_values=100)
    return Store(capacity, shared=shared, clock=lambda: now[0]), shared


def _memfd_pages(buf: SealedBuffer) -> int:
    return os.fstat(buf.fd).st_blocks * 512


def test_spares_are_made_for_the_size_asked_within_their_budget_and_counted() -> None:
    """An SHM_PUT of a size makes that size wanted: the refill makes spares of it, faulted in,
    up to capacity / SPARE_CAPACITY_DIVISOR (at most MAX_SPARE_BYTES), counted in allocated_bytes;
    the next SHM_PUT of that size takes one (no fresh memfd), byte for byte a value's memfd."""
    now = [0.0]
    store, shared = _store_with_spares(64 * MiB, now)  # budget: 4 MiB = 2 spares of 2 MiB
    assert not store.refill_spare(), "no size wanted yet"
    first = store.begin_shared_put(b"a", 2 * MiB - 100, 1, bytes(32))
    assert first is not None and shared.spares_taken == 0
    made = 0
    while store.refill_spare():
        made += 1
    assert made == 2 and shared.spares == 2 and shared.spare_bytes == 4 * MiB
    assert store.allocated_bytes == 2 * MiB + 4 * MiB
    spare = store._spares[2 * MiB][-1]
    assert _memfd_pages(spare) == 2 * MiB, "faulted in ahead"
    assert fcntl.fcntl(spare.fd, fcntl.F_GET_SEALS) & SEALS_OPEN == SEALS_OPEN, "sealed against resizing already"
    second = store.begin_shared_put(b"b", 2 * MiB - 100, 1, bytes(32))
    assert second is not None and second.buf is spare and shared.spares_taken == 1
    assert shared.spares == 1 and shared.values == 2 and store.allocated_bytes == 6 * MiB, "moved, not counted twice"
    for ticket in (first, second):
        ticket.buf.seal()
        assert store.commit(ticket)
    assert store.refill_spare() and not store.refill_spare(), "back to its budget"
    assert store.allocated_bytes == 4 * MiB + 4 * MiB <= store.capacity_bytes


def test_spares_of_a_size_no_longer_asked_for_are_freed() -> None:
    now = [0.0]
    store, shared = _store_with_spares(64 * MiB, now)
    ticket = store.begin_shared_put(b"a", 2 * MiB, 1, bytes(32))
    assert ticket is not None
    store.abort(ticket)
    while store.refill_spare():
        pass
    assert shared.spares == 2
    now[0] += SPARE_KEEP_S + 1
    assert not store.refill_spare()
    assert shared.spares == 0 and shared.spare_bytes == 0 and store.allocated_bytes == 0


def test_a_full_store_evicts_for_spares_and_gives_them_up_before_refusing_a_store() -> None:
    """Spares stand for the stores to come: a full store evicts its least recently used value
    for one, as that store would; a store that finds nothing else to evict (all leased) frees
    the spares instead of answering NoSpace."""
    now = [0.0]
    store, shared = _store_with_spares(32 * MiB, now)  # budget: 2 MiB = 1 spare
    for i in range(16):
        ticket = store.begin_put(b"v%d" % i, 2 * MiB, 1, bytes(32))
        ticket.target[:1] = b"x"
        assert store.commit(ticket)
    ticket = store.begin_shared_put(b"v0", 2 * MiB, 1, bytes(32))  # replaces v0: no eviction
    assert ticket is not None
    ticket.buf.seal()
    assert store.commit(ticket)
    evictions = store.evictions
    assert store.refill_spare() and store.evictions == evictions + 1 and shared.spares == 1
    assert store.allocated_bytes == store.capacity_bytes
    store.max_lease_bytes = store.max_lease_bytes_per_holder = store.capacity_bytes
    statuses, _, _ = store.lease([k for k in store._index], token=7, ttl_s=60)
    assert all(s == ItemStatus.OK for s in statuses), "every value leased: none can be evicted"
    ticket = store.begin_put(b"new", 2 * MiB, 1, bytes(32))
    assert shared.spares == 0, "the spare went instead"
    store.abort(ticket)


# write_value's three ways: into a spare (pages exist: pwrite), into a fresh memfd with pwrite
# (the host's shared-memory THP mode "never"), into a fresh memfd through a mapping ("advise").
# The host's mode is the OS's answer, faked here so that every way runs on any host.
WAYS = {"spare-pwrite": (True, "never"), "fresh-pwrite": (False, "never"), "fresh-mapped": (False, "advise")}


@pytest.mark.parametrize("way", WAYS)
def test_write_value_leaves_no_writable_mapping_and_keeps_a_read_only_one(way: str, monkeypatch) -> None:
    spare, host_mode = WAYS[way]
    monkeypatch.setattr(client_shared, "shmem_huge_pages", lambda: host_mode)
    buf = SealedBuffer(2 * MiB)
    if spare:
        buf.prefault()
    try:
        value = os.urandom(2 * MiB - 100)
        checksum, kept = write_value(os.dup(buf.fd), memoryview(value), ChecksumAlgo.XXH3_128, SUMS, keep=True)
        assert checksum == SUMS.compute(value) and kept is not None
        buf.seal()  # no writable mapping is left
        target = bytearray(len(value))
        assert copy_verified(memoryview(target), kept[0], ChecksumAlgo.XXH3_128, checksum, SUMS)
        assert target == value
        unmap(*kept)
        assert check_sealed(buf.fd, len(value)) == 2 * MiB
        for length in (2 * MiB + 1, MiB, 0):  # a memfd is exactly the value's buffer: no larger mapping
            with pytest.raises(SealError):
                check_sealed(buf.fd, length)
    finally:
        buf.free()


def test_a_memfd_without_its_seals_is_refused() -> None:
    fd = os.memfd_create("not-sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, MiB)
        with pytest.raises(SealError) as info:
            check_sealed(fd, MiB)
        assert info.value.errno == errno.EPERM
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(SealError):
            check_sealed(fd, MiB)  # readers need F_SEAL_WRITE too
        check_sealed(fd, MiB, client_shared.SEALS_OPEN)  # what a writer needs
    finally:
        os.close(fd)


@pytest.mark.parametrize("way", WAYS)
def test_write_value_into_a_memfd_sealed_against_writing_is_refused_as_a_seal_error(way: str, monkeypatch) -> None:
    """A node that passes a committed memfd for a store: the write fails as a mapping would, with
    SealError (the caller turns shared memory off for that node process), never another error."""
    spare, host_mode = WAYS[way]
    monkeypatch.setattr(client_shared, "shmem_huge_pages", lambda: host_mode)
    buf = SealedBuffer(MiB)
    try:
        if spare:
            buf.prefault()
        buf.seal()
        with pytest.raises(SealError):
            write_value(os.dup(buf.fd), memoryview(os.urandom(MiB)), ChecksumAlgo.XXH3_128, SUMS, keep=False)
    finally:
        buf.free()


def _sealed_value(monkeypatch, compiled: bool) -> tuple[SealedBuffer, bytes]:
    """A committed 4 MiB memfd value, with the compiled copy loop on or off."""
    if compiled and not client_shared.COMPILED_COPY:
        pytest.skip("the compiled copy loop is not built here")
    monkeypatch.setattr(client_shared, "COMPILED_COPY", compiled)
    buf = SealedBuffer(4 * MiB)
    value = os.urandom(4 * MiB - 123)
    os.pwrite(buf.fd, value, 0)
    buf.seal()
    return buf, value


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("algo", [ChecksumAlgo.XXH3_128, ChecksumAlgo.BLAKE3_KEYED])
def test_copy_verified_copies_out_of_a_read_only_mapping(monkeypatch, compiled: bool, algo: ChecksumAlgo) -> None:
    buf, value = _sealed_value(monkeypatch, compiled)
    addr = map_value(buf.fd, buf.size)
    try:
        checksum = SUMS.compute(value, algo)
        target = bytearray(len(value))
        assert copy_verified(memoryview(target), addr, algo, checksum, SUMS)
        assert target == value
        other = SUMS.compute(value[::-1], algo)
        assert not copy_verified(memoryview(bytearray(len(value))), addr, algo, other, SUMS)
    finally:
        unmap(addr, buf.size)
        buf.free()


def _value_mappings() -> int:
    with open("/proc/self/maps") as f:
        return f.read().count("memkv-value")


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("algo", [ChecksumAlgo.XXH3_128, ChecksumAlgo.BLAKE3_KEYED])
def test_read_verified_reads_a_memfd_without_mapping_it(monkeypatch, compiled: bool, algo: ChecksumAlgo) -> None:
    """A passed memfd is read (pread) into the target, hashed as it lands: byte-exact and
    verified; another checksum fails; a memfd shorter than the target fails, nothing raised."""
    buf, value = _sealed_value(monkeypatch, compiled)
    try:
        maps_before = _value_mappings()
        checksum = SUMS.compute(value, algo)
        target = bytearray(len(value))
        assert read_verified(memoryview(target), buf.fd, algo, checksum, SUMS)
        assert target == value
        assert _value_mappings() == maps_before, "no mapping made"
        other = SUMS.compute(value[::-1], algo)
        assert not read_verified(memoryview(bytearray(len(value))), buf.fd, algo, other, SUMS)
        longer = bytearray(buf.size + MiB)
        assert not read_verified(memoryview(longer), buf.fd, algo, SUMS.compute(bytes(longer), algo), SUMS)
    finally:
        buf.free()


def _mapped(buf: SealedBuffer) -> bool:
    """Whether this process maps `buf`'s memfd other than through the buffer's own view."""
    inode = os.fstat(buf.fd).st_ino
    with open("/proc/self/maps") as f:
        rows = [line.split() for line in f]
    return sum(len(row) > 4 and int(row[4]) == inode for row in rows) > (1 if buf.view.nbytes else 0)


def test_mapped_values_stay_within_their_bounds_and_unmap_after_the_last_copy() -> None:
    values = MappedValues("test", max_values=2, max_bytes=3 * MiB)
    bufs = [SealedBuffer(MiB) for _ in range(4)]
    try:
        addrs = []
        for i, b in enumerate(bufs):
            b.seal()
            addrs.append(map_value(b.fd, MiB))
            values.add(b"k%d" % i, addrs[-1], MiB, MiB, bytes(32))
        assert values.has([b"k0", b"k1", b"k2", b"k3"]) == [False, False, True, True]
        assert not _mapped(bufs[0]) and not _mapped(bufs[1]), "pushed out of the LRU: unmapped at once"
        found = values.find(b"k2")
        assert found is not None and found.addr == addrs[2]
        values.forget(b"k2")
        assert values.find(b"k2") is None
        assert bytes((ctypes.c_char * 16).from_address(found.addr)) == bytes(16), "still mapped while a copy runs"
        values.done(found)
        assert not _mapped(bufs[2]), "unmapped by the last copy"
        values.retire()
        assert values.mapped == 0 and values.retired and not _mapped(bufs[3])
    finally:
        for b in bufs:
            b.free()


def test_a_copy_in_progress_keeps_only_its_own_mapping() -> None:
    """A process whose copies never all end at once (two threads loading back to back) must
    still unmap what it drops: one running copy holds its one mapping, not every later drop."""
    values = MappedValues("test", max_values=1, max_bytes=8 * MiB)
    bufs = [SealedBuffer(MiB) for _ in range(6)]
    try:
        addrs = []
        for b in bufs:
            b.seal()
            addrs.append(map_value(b.fd, MiB))
        values.add(b"held", addrs[0], MiB, MiB, bytes(32))
        held = values.find(b"held")  # a copy that outlives every drop below
        assert held is not None
        for i in range(1, 6):
            values.add(b"k%d" % i, addrs[i], MiB, MiB, bytes(32))  # max_values=1: the previous one goes
        assert [_mapped(b) for b in bufs] == [True, False, False, False, False, True]
        values.done(held)
        assert not _mapped(bufs[0])
    finally:
        values.retire()
        for b in bufs:
            b.free()


def test_the_spares_mode_is_checked_and_auto_follows_the_cpus_the_node_may_use(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="--shared-memory-spares: expected one of auto, on, off, got 'yes'"):
        ServerConfig(capacity_bytes=1 << 30, shared_memory_spares="yes")
    assert spares_on("on") and not spares_on("off")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    assert not spares_on("auto"), "2 CPUs: the writers need them"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert spares_on("auto")


def test_the_stores_mode_is_checked_and_auto_follows_the_hosts_huge_pages(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="--shared-memory-stores: expected one of auto, client, node, got 'both'"):
        ServerConfig(capacity_bytes=1 << 30, shared_memory_stores="both")
    assert client_stores_on("client") and not client_stores_on("node")
    for mode, clients_write in (("advise", True), ("within_size", True), ("always", True), ("never", False)):
        monkeypatch.setattr("memkv.memfd.shmem_huge_pages", lambda mode=mode: mode)
        assert client_stores_on("auto") is clients_write, mode
    monkeypatch.setattr("memkv.memfd.shmem_huge_pages", lambda: None)
    assert not client_stores_on("auto"), "unknown: the way that is never slow"


def test_a_node_written_memfd_is_written_by_its_first_mapping_only() -> None:
    fd, mem = node_written_memfd(2 * MiB)
    try:
        mem[:3] = b"abc"  # the node's own mapping, made before the seal
        for size in (0, MiB, 4 * MiB):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        refuses_every_write(fd, 2 * MiB)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # F_SEAL_SEAL: final
        mem[3:6] = b"def"  # still the node's to reuse
        assert os.pread(fd, 6, 0) == b"abcdef"
        assert check_loadable(fd, 2 * MiB) is True, "a client tells it from a committed memfd"
    finally:
        mem.close()
        os.close(fd)
    committed = SealedBuffer(MiB)
    try:
        committed.seal()
        assert check_loadable(committed.fd, MiB) is False
    finally:
        committed.free()
    reservation = SealedBuffer(MiB)  # sealed against resizing only: not loadable
    try:
        with pytest.raises(SealError, match="needs 0xe or 0x16"):
            check_loadable(reservation.fd, MiB)
    finally:
        reservation.free()


def test_a_store_of_node_written_memfds_reuses_them_and_counts_them() -> None:
    shared = SharedValues(max_values=100)
    store = Store(8 * MiB, shared=shared, pool_max_bytes=4 * MiB)
    fds = set()
    for i in range(12):  # four fit: the rest evict and take the evicted value's memfd
        ticket = store.begin_put(b"k%d" % i, 2 * MiB, 1, bytes(32), memfd=True)
        assert ticket.buf.fd >= 0
        fds.add(os.fstat(ticket.buf.fd).st_ino)
        ticket.target[:16] = bytes([i]) * 16
        assert store.commit(ticket)
        assert shared.node_written_bytes == 2 * MiB * shared.node_written <= store.allocated_bytes <= 8 * MiB
    assert len(fds) == 4 and shared.node_written == 4, "made once, then reused"
    store.delete([b"k%d" % i for i in range(12)])
    assert shared.node_written == 2 and store.stats()["pooled_bytes"] == 4 * MiB, "the pool keeps two"
    store.begin_put(b"big", 8 * MiB, 1, bytes(32), memfd=True)  # needs every byte: the pooled memfds go
    assert shared.node_written == 1 and shared.node_written_bytes == 8 * MiB


def test_past_the_memfd_bound_a_node_written_buffer_is_private_memory() -> None:
    shared = SharedValues(max_values=1)
    store = Store(8 * MiB, shared=shared)
    first, second = (store.begin_put(b"k%d" % i, 2 * MiB, 1, bytes(32), memfd=True) for i in range(2))
    assert first.buf.fd >= 0 and second.buf.fd == -1
    assert store.begin_put(b"private", 2 * MiB, 1, bytes(32)).buf.fd == -1, "not asked for: private memory"
    assert store.begin_shared_put(b"s", MiB, 1, bytes(32)) is None, "the bound counts node-written ones"
    small = store.begin_put(b"small", MiB - 1, 1, bytes(32), memfd=True)
    assert small.buf.fd == -1, "below 1 MiB: private memory"
