"""A same-host node's value memory, mapped into this process (docs/protocol.md section 13).

A node that offers shared memory on its same-host socket keeps values of 1 MiB and more in memfd
arenas (memkv/server/shared.py). An SHM_GET tells where each value lies; the client copies it
from the mapping straight into its destination and hashes the copy piece by piece while it is
in cache (one copy per byte instead of two, no syscall per value). `copy_verified` holds the
result to the checksum the node stored: a value the node reused meanwhile fails it and is a
miss, so a stale mapping can cost a hit, never return wrong bytes.

Mappings belong to one node process (named by its same-host socket, random per process; a node
restarted on the same port keeps its node_id): a node that restarted has new arenas, and the
old mappings, which keep the dead process's memory alive, are unmapped once no copy uses them.

Pages: a mapping is made without faulting anything in (most of an arena may be holes, and a read
fault on a hole would allocate memory in the node). Filling the page tables of a value's pages
costs about 0.02 s per GiB (madvise(MADV_POPULATE_READ), Linux 5.14+), enough to make a first
copy slower than the socket (docs/performance.md, runs 49-52). So a value is copied from shared
memory only where this process filled them already, off the load path: right after it stored
the value itself (`NodeConnection.warm`, on the store thread). Every other value comes over the
socket. `warm` remembers each slot with the checksum of the value it was filled for: the node
punches a freed slot's pages out (which empties every process's page tables of it), so a slot
holding another value since is not warm any more.

Stores: an SHM_PUT reserves a slot per value and says where; the client writes the value there
itself (`write_value`: one copy, no socket, no work in the node) and commits it with SHM_COMMIT.
The write fills this process's page tables for the slot, so a value stored that way is warm.
"""

from __future__ import annotations

import ctypes
import errno
import hmac
import mmap
import os
import stat
import threading
from collections.abc import Sequence

from memkv.integrity import Checksummer
from memkv.protocol import ChecksumAlgo

try:
    from memkv._recv_verify import copy_xxh3 as _compiled_copy
except ImportError:
    _compiled_copy = None  # type: ignore[assignment]
# MEMKV_PURE_PYTHON=1 turns the compiled loop off, as for receives (memkv/sockio.py).
COMPILED_COPY = _compiled_copy is not None and os.environ.get("MEMKV_PURE_PYTHON", "") in ("", "0")

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
PAGE = mmap.PAGESIZE
# Copied and hashed in pieces this large: each piece is hashed while the copy left it in cache.
COPY_PIECE = 256 << 10


class ArenaError(OSError):
    """A descriptor the node passed cannot be mapped as the arena it announced."""


class NodeMemory:
    """The arenas of one node process mapped into this one. Thread-safe."""

    def __init__(self, process: str) -> None:
        self.process = process  # the node process's same-host socket name
        self._lock = threading.Lock()
        self._maps: dict[int, tuple[int, int]] = {}  # arena id -> (address, size)
        # Slots whose page tables this process filled (`warm`), each with the key and checksum of
        # the value it was filled for, and the other way round; both at most one entry per slot.
        self._warm: dict[tuple[int, int], tuple[bytes, bytes]] = {}
        self._warm_keys: dict[bytes, tuple[int, int]] = {}
        self._users = 0
        self._retired = False
        self.refused: str | None = None  # why this process's arenas cannot be mapped here (then: socket)

    def missing(self, arenas: set[int]) -> list[int]:
        with self._lock:
            return sorted(a for a in arenas if a not in self._maps)

    def add(self, arena: int, fd: int, size: int) -> None:
        """Map `fd` (closed here in every case) as arena `arena` of `size` bytes (writable: SHM_PUT
        writes values into it; a load copies only from slots it asked for)."""
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size or size <= 0:
                raise ArenaError(
                    errno.EINVAL, f"arena {arena}: the descriptor is not a {size}-byte memory file (got {info.st_size})"
                )
            with self._lock:
                if arena in self._maps or self._retired:
                    return
                addr = _LIBC.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
                if addr is None or addr == _MAP_FAILED:
                    err = ctypes.get_errno()
                    raise ArenaError(err, f"arena {arena}: mmap failed: {os.strerror(err)}")
                self._maps[arena] = (addr, size)
        finally:
            os.close(fd)

    def _address(self, arena: int, offset: int, length: int) -> int | None:
        """Lock held."""
        found = self._maps.get(arena)
        if found is None or offset < 0 or length <= 0 or offset + length > found[1]:
            return None
        return found[0] + offset

    def warm(self, key: bytes, arena: int, offset: int, length: int, checksum: bytes) -> bool:
        """Fill this process's page tables for the `length` bytes at `offset` of `arena`, which hold
        `key`'s value, whose checksum is `checksum` (the caller holds `use`). False when the range
        is not inside a mapped arena (a node not to be trusted). Costs about 0.02 s per GiB: call
        it off the load path. A kernel without MADV_POPULATE_READ (before 5.14) leaves it cold."""
        with self._lock:
            addr = self._address(arena, offset, length)
            if addr is None:
                return False
        start = addr - addr % PAGE
        if _LIBC.madvise(start, addr + length - start, MADV_POPULATE_READ) == 0:
            self._mark_warm(key, (arena, offset), checksum)
        return True

    def _mark_warm(self, key: bytes, slot: tuple[int, int], checksum: bytes) -> None:
        with self._lock:
            before = self._warm.get(slot)
            if before is not None:
                self._warm_keys.pop(before[0], None)
            moved = self._warm_keys.get(key)
            if moved is not None:
                del self._warm[moved]  # the key's value was replaced: its old slot was freed
            self._warm[slot] = (key, checksum)
            self._warm_keys[key] = slot

    def write_value(self, arena: int, offset: int, value: memoryview, algo: int, checksummer: Checksummer) -> bytes:
        """Copy `value` into the slot an SHM_PUT reserved at `offset` of `arena` (the caller holds
        `use`), hashing the copy as it goes (`copy_hashed`): returns the checksum of the bytes
        now in the slot, what SHM_COMMIT declares. Raises ValueError when that range is not
        inside a mapped arena (a node not to be trusted) or `algo` is unknown. The slot's page
        tables are filled first in one call (MADV_POPULATE_WRITE, Linux 5.14+; else the copy
        faults them in page by page). `committed` marks the slot warm once the node stored it."""
        length = len(value)
        with self._lock:
            addr = self._address(arena, offset, length)
        if addr is None:
            raise ValueError(f"arena {arena}, offset {offset}, {length} bytes: not inside a mapped arena")
        start = addr - addr % PAGE
        _LIBC.madvise(start, addr + length - start, MADV_POPULATE_WRITE)  # an error: the copy faults
        target = memoryview((ctypes.c_char * length).from_address(addr)).cast("B")
        checksum = copy_hashed(target, value.cast("B"), algo, checksummer)
        if checksum is None:
            raise ValueError(f"unknown checksum algorithm {algo}")
        return checksum

    def committed(self, key: bytes, arena: int, offset: int, checksum: bytes) -> None:
        """The node stored `key`'s value (of `checksum`) in the slot this process wrote: warm."""
        self._mark_warm(key, (arena, offset), checksum)

    def warmed(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: whether this process warmed a slot for its value (which may since be gone)."""
        with self._lock:
            return [k in self._warm_keys for k in keys]

    def source(self, arena: int, offset: int, length: int, checksum: bytes) -> tuple[int, bool] | None:
        """(address of `length` bytes at `offset` of `arena`, whether this process warmed that slot
        for the value of `checksum`: only then is a copy from it faster than the socket); None when
        the arena is not mapped or the range does not lie inside it (a node not to be trusted)."""
        with self._lock:
            addr = self._address(arena, offset, length)
            if addr is None:
                return None
            found = self._warm.get((arena, offset))
            return addr, found is not None and found[1] == checksum

    def use(self) -> bool:
        """Count a copy in progress; False once retired (its mappings go)."""
        with self._lock:
            if self._retired:
                return False
            self._users += 1
            return True

    def unuse(self) -> None:
        with self._lock:
            self._users -= 1
            done = self._retired and self._users == 0
        if done:
            self._unmap()

    def retire(self) -> None:
        """The node process is gone or replaced: unmap once the last copy ends."""
        with self._lock:
            if self._retired:
                return
            self._retired = True
            done = self._users == 0
        if done:
            self._unmap()

    def refuse(self, reason: str) -> None:
        """An arena of this node process cannot be mapped here (a bad descriptor, mmap refused):
        its values come over the socket from now on."""
        self.refused = reason
        self.retire()

    def _unmap(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
            self._warm.clear()
            self._warm_keys.clear()
        for addr, size in maps.values():
            _LIBC.munmap(addr, size)

    @property
    def arenas(self) -> int:
        return len(self._maps)


def copy_verified(target: memoryview, source_addr: int, algo: int, checksum: bytes, checksummer: Checksummer) -> bool:
    """Copy len(target) bytes from `source_addr` into `target`, hashing the copy; True when it
    matches `checksum` (an unknown algo: False, a miss)."""
    source = memoryview((ctypes.c_char * len(target)).from_address(source_addr)).cast("B")
    got = copy_hashed(target, source, algo, checksummer)
    return got is not None and hmac.compare_digest(got, checksum)


def copy_hashed(target: memoryview, source: memoryview, algo: int, checksummer: Checksummer) -> bytes | None:
    """Copy `source` into `target` (same length, bytes), hashing each piece of the copy right
    after it is written, while it is in cache: the checksum of the bytes in `target` (None for an
    unknown algo), whatever `source` does meanwhile. The compiled loop does all of it in one GIL
    release (a busy engine makes every re-acquire cost up to its switch interval); the Python one
    copies each piece with ctypes.memmove (no GIL; a read-only source by slice assignment) and
    hashes it with python-xxhash or blake3. Loads (`copy_verified`) and SHM_PUT stores
    (`NodeMemory.write_value`) both copy so."""
    length = len(target)
    if algo == ChecksumAlgo.XXH3_128 and COMPILED_COPY:
        assert _compiled_copy is not None
        return Checksummer.padded(_compiled_copy(target, source, COPY_PIECE, False))
    try:
        hasher = checksummer.hasher(algo)
    except ValueError:
        return None
    target_addr = ctypes.addressof(ctypes.c_char.from_buffer(target))
    source_addr = None if source.readonly else ctypes.addressof(ctypes.c_char.from_buffer(source))
    for off in range(0, length, COPY_PIECE):
        n = min(COPY_PIECE, length - off)
        if source_addr is None:
            target[off : off + n] = source[off : off + n]
        else:
            ctypes.memmove(target_addr + off, source_addr + off, n)
        hasher.update(target[off : off + n])
    return checksummer.finish(hasher)
