"""Values as sealed memfds (memkv/server/shared.py, memkv/client/shared.py) and the store on top.

Behaviour under test (real memfds, no node process):
* a reservation is a memfd of exactly the buffer's size, sealed against shrinking and growing:
  ftruncate and a write past its end fail; `seal` refuses while a writable shared mapping exists
  (StillMapped) and, once sealed, no descriptor or mapping writes it any more;
* the store counts every memfd in allocated_bytes from its reservation on, never reuses one for
  another value (private buffers are pooled, memfds closed), and after a fill-evict-delete cycle
  holds none; a memfd bound reached makes `begin_shared_put` answer None without evicting;
* `write_value` leaves no writable mapping (the seal then succeeds) and keeps a read-only one;
  `check_sealed` refuses a memfd without its seals or of another size than the value's buffer; `copy_verified` copies whole and verified,
  and fails a checksum of other bytes; `MappedValues` stays within its bounds.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os

import pytest

from memkv.client import shared as client_shared
from memkv.client.shared import MappedValues, SealError, check_sealed, copy_verified, map_value, unmap, write_value
from memkv.integrity import Checksummer
from memkv.protocol import ChecksumAlgo
from memkv.server.shared import SealedBuffer, SharedValues, StillMapped
from memkv.server.store import Store, ValueBuffer

MiB = 1 << 20
SUMS = Checksummer(b"k" * 32)


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
        with pytest.raises(PermissionError):
            os.pwrite(buf.fd, b"x", 0)
        with pytest.raises(PermissionError):
            mmap.mmap(buf.fd, 2 * MiB, flags=mmap.MAP_SHARED)
        reopened = os.open(f"/proc/self/fd/{buf.fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(reopened, b"x", 0)
        finally:
            os.close(reopened)
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


def test_write_value_leaves_no_writable_mapping_and_keeps_a_read_only_one() -> None:
    buf = SealedBuffer(2 * MiB)
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


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("algo", [ChecksumAlgo.XXH3_128, ChecksumAlgo.BLAKE3_KEYED])
def test_copy_verified_copies_out_of_a_read_only_mapping(monkeypatch, compiled: bool, algo: ChecksumAlgo) -> None:
    if compiled and not client_shared.COMPILED_COPY:
        pytest.skip("the compiled copy loop is not built here")
    monkeypatch.setattr(client_shared, "COMPILED_COPY", compiled)
    buf = SealedBuffer(4 * MiB)
    value = os.urandom(4 * MiB - 123)
    os.pwrite(buf.fd, value, 0)
    buf.seal()
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


def test_mapped_values_stay_within_their_bounds_and_unmap_after_the_last_copy() -> None:
    values = MappedValues("test", max_values=2, max_bytes=3 * MiB)
    bufs = [SealedBuffer(MiB) for _ in range(4)]
    try:
        for i, b in enumerate(bufs):
            b.seal()
            values.add(b"k%d" % i, map_value(b.fd, MiB), MiB, MiB, bytes(32))
        assert values.has([b"k0", b"k1", b"k2", b"k3"]) == [False, False, True, True]
        assert values.use()
        found = values.find(b"k2")
        values.forget(b"k2")
        assert values.find(b"k2") is None and found is not None
        assert bytes((ctypes.c_char * 16).from_address(found[0])) == bytes(16), "still mapped while a copy runs"
        values.unuse()
        values.retire()
        assert values.mapped == 0 and not values.use()
    finally:
        for b in bufs:
            b.free()
