"""The node's shareable value memory (memkv/server/shared.py) and the store on top of it.

Behaviour under test (real memfds, no node process):
* a slot is page-aligned, faulted in when taken, and its pages go back to the kernel when it is
  given back (the memfd's allocated blocks drop), mapped elsewhere or not; the slot is reused;
* at most `max_arenas` arenas exist: a buffer beyond that comes from private memory and the
  store still keeps the value whole;
* the store's accounting holds with arenas: after a fill-evict-delete cycle the memory the
  arenas hold is what the store counts as allocated, never more;
* `copy_verified` (memkv/client/shared.py) copies a value out of a read-only mapping of the
  memfd whole and verified, and fails a checksum of other bytes.
"""

from __future__ import annotations

import mmap
import os

import pytest

from memkv.client import shared as client_shared
from memkv.client.shared import NodeMemory, copy_verified
from memkv.integrity import Checksummer
from memkv.protocol import ChecksumAlgo
from memkv.server.shared import SharedArenas
from memkv.server.store import Store

MiB = 1 << 20


def held_bytes(arenas: SharedArenas) -> int:
    return sum(os.fstat(a.fd).st_blocks * 512 for a in arenas._arenas.values())


def test_a_slot_is_faulted_in_when_taken_and_returned_to_the_kernel_when_given_back() -> None:
    arenas = SharedArenas(arena_bytes=8 * MiB)
    arena, offset = arenas.take(2 * MiB)
    assert offset % mmap.PAGESIZE == 0
    assert held_bytes(arenas) >= 2 * MiB
    arena.view[offset : offset + 4] = b"abcd"
    outside = mmap.mmap(arena.fd, arena.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)  # as a client maps it
    try:
        assert outside[offset : offset + 4] == b"abcd"
        arenas.give(arena, offset)
        assert held_bytes(arenas) == 0
        assert outside[offset : offset + 4] == bytes(4), "a client's mapping of a freed slot reads zeros"
    finally:
        outside.close()
    again = arenas.take(2 * MiB)
    assert again == (arena, offset), "the freed slot is reused first"


def test_beyond_max_arenas_buffers_come_from_private_memory_and_values_stay_whole() -> None:
    arenas = SharedArenas(max_arenas=1, arena_bytes=2 * MiB)
    store = Store(64 * MiB, shared=arenas)
    values = {b"a": os.urandom(MiB), b"b": os.urandom(MiB), b"c": os.urandom(3 * MiB)}
    for key, value in values.items():
        ticket = store.begin_put(key, len(value), 1, bytes(32))
        ticket.target[:] = value
        assert store.commit(ticket)
    found = store.acquire(list(values), [len(v) for v in values.values()], 0xFFFFFFFF)
    try:
        placed = {e.key: e.buf.arena is not None for e in found}
        assert placed == {b"a": True, b"b": True, b"c": False}  # one 2 MiB arena of two 1 MiB slots
        assert all(bytes(e.value) == values[e.key] for e in found)
    finally:
        store.release(found)
    assert arenas.stats()["refused_buffers"] == 1


def test_the_store_counts_what_the_arenas_hold_through_evictions_and_deletes() -> None:
    arenas = SharedArenas(arena_bytes=16 * MiB)
    store = Store(8 * MiB, shared=arenas, pool_max_bytes=0)  # freed buffers go back at once
    for i in range(12):  # four fit: the rest evicts
        ticket = store.begin_put(b"k%d" % i, 2 * MiB, 1, bytes(32))
        ticket.target[:] = bytes([i]) * (2 * MiB)
        assert store.commit(ticket)
        assert held_bytes(arenas) <= store.allocated_bytes
    assert store.stats()["evictions"] == 8
    store.delete([b"k%d" % i for i in range(12)])
    assert store.allocated_bytes == 0 and held_bytes(arenas) == 0


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("algo", [ChecksumAlgo.XXH3_128, ChecksumAlgo.BLAKE3_KEYED])
def test_copy_verified_copies_out_of_a_read_only_mapping(monkeypatch, compiled: bool, algo: ChecksumAlgo) -> None:
    if compiled and not client_shared.COMPILED_COPY:
        pytest.skip("the compiled copy loop is not built here")
    monkeypatch.setattr(client_shared, "COMPILED_COPY", compiled)
    checksummer = Checksummer(b"k" * 32)
    arenas = SharedArenas(arena_bytes=8 * MiB)
    arena, offset = arenas.take(4 * MiB)
    value = os.urandom(4 * MiB - 123)
    arena.view[offset : offset + len(value)] = value
    memory = NodeMemory("test")
    memory.add(arena.id, os.dup(arena.fd), arena.size)
    checksum = checksummer.compute(value, algo)
    try:
        source = memory.source(arena.id, offset, len(value), checksum)
        assert source is not None and source[1] is False, "cold until warmed"
        assert memory.warmed([b"k", b"other"]) == [False, False]
        assert memory.warm(b"k", arena.id, offset, len(value), checksum)
        assert memory.warmed([b"k", b"other"]) == [True, False]
        address, warm = memory.source(arena.id, offset, len(value), checksum)
        assert warm and address == source[0]
        target = bytearray(len(value))
        assert copy_verified(memoryview(target), address, algo, checksum, checksummer)
        assert target == value
        other = checksummer.compute(value[::-1], algo)
        assert memory.source(arena.id, offset, len(value), other) == (address, False), "warm for one value only"
        assert not copy_verified(memoryview(bytearray(len(value))), address, algo, other, checksummer)
        assert memory.source(arena.id, arena.size - 10, 20, checksum) is None, "a range past the arena is refused"
        assert memory.source(arena.id + 1, 0, 10, checksum) is None
        assert not memory.warm(b"k", arena.id, arena.size - 10, 20, checksum)
    finally:
        memory.retire()
    assert memory.arenas == 0


def mapped_bytes(address: int) -> int:
    """Bytes of the mapping at `address` that have page table entries in this process (smaps Rss)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            rss = next(x for x in lines[i + 1 :] if x.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_warming_fills_the_page_tables_and_a_freed_slot_empties_them() -> None:
    """Why a warmed slot stays warm for one value only: the node's hole punch of a freed slot
    (SharedArenas.give) also drops every client's page table entries for it."""
    arenas = SharedArenas(arena_bytes=8 * MiB)
    arena, offset = arenas.take(4 * MiB)
    memory = NodeMemory("test")
    memory.add(arena.id, os.dup(arena.fd), arena.size)
    try:
        address = memory._maps[arena.id][0]
        assert mapped_bytes(address) == 0, "mapping faults nothing in"
        assert memory.warm(b"k", arena.id, offset, 4 * MiB, b"c" * 16)
        assert mapped_bytes(address) == 4 * MiB
        arenas.give(arena, offset)
        assert mapped_bytes(address) == 0
    finally:
        memory.retire()


def test_a_descriptor_that_is_not_the_announced_arena_is_refused() -> None:
    memory = NodeMemory("test")
    fd = os.memfd_create("other")
    os.ftruncate(fd, MiB)
    with pytest.raises(client_shared.ArenaError, match="not a 2097152-byte memory file"):
        memory.add(0, fd, 2 * MiB)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by add, refused or not
    assert memory.arenas == 0
