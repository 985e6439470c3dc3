"""A same-host node's values as sealed memfds, written and read by this process (docs/protocol.md
section 13).

Stores: an SHM_PUT passes a memfd per value, of exactly the value's buffer size, sealed against
shrinking and growing. `write_value` maps it shared and writable, copies the value in and hashes
the copy piece by piece while it is in cache (one pass over the bytes, no socket, no work in the
node), maps it again private and read-only for later loads, then unmaps the writable mapping
and closes the descriptor: the node seals it against writing at SHM_COMMIT, which the kernel
refuses while a writable shared mapping exists.

Loads: an SHM_GET passes a value's memfd; `check_sealed` refuses one that is not sealed against
shrinking, growing and writing (a node not to be trusted, or another process's doing), `map_value`
maps it private and read-only, `copy_verified` copies and verifies it. A committed memfd never
changes: what a mapping holds is what was committed, even after the node dropped the value.

Mappings kept (`MappedValues`): filling a mapping's page tables costs about 0.02 s per GiB, enough
to make a load noticeably slower. So the read-only mappings of values this process stored stay
(a bounded LRU, per node process) and their loads ask the node for the value's status and
checksum only; a value the node no longer has (MISS) or holds anew (another checksum) loses its
mapping. Others are mapped for one load (MAP_POPULATE) and unmapped after.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import hmac
import mmap
import os
import stat
import threading

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
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in for writing with one call
# Transparent huge pages for the value's memfd where the host allows them for shared memory
# (/sys/kernel/mm/transparent_hugepage/shmem_enabled "advise", "within_size" or "always"): a
# fresh memfd per value needs its page tables filled for every store, about 1 us per 4 KiB page
# on a VM, which made a 16 MiB store 3-4x slower than the copy itself; 2 MiB pages make that
# 512 times fewer. Ignored where the host says "never" (docs/operations.md, "Same-host clients").
MADV_HUGEPAGE = 14
PAGE = mmap.PAGESIZE
# Copied and hashed in pieces this large: each piece is hashed while the copy left it in cache.
COPY_PIECE = 256 << 10
SEALS_NEEDED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
SEALS_OPEN = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
# Mappings of stored values kept, per node process: far below vm.max_map_count (65530 by default).
# A kept mapping of a value the node has dropped keeps its pages alive (charged to this process)
# until the next load of that key or the LRU drops it: the byte bound caps that memory.
MAX_MAPPED_VALUES = 1024
MAX_MAPPED_BYTES = 2 << 30


class SealError(OSError):
    """A descriptor the node passed is not a memfd of the announced value, sealed as it must be."""


def check_sealed(fd: int, length: int, seals: int = SEALS_NEEDED) -> int:
    """The size of the memfd `fd` when it is the buffer of a `length`-byte value (the length
    rounded up to a page) and carries `seals`; else SealError."""
    try:
        info = os.fstat(fd)
        have = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise SealError(exc.errno or errno.EINVAL, f"not a sealable memfd: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode) or not 0 < length <= info.st_size < length + PAGE:
        raise SealError(errno.EINVAL, f"a memfd of {info.st_size} bytes for a {length}-byte value")
    if have & seals != seals:
        raise SealError(errno.EPERM, f"a memfd without its seals (has 0x{have:x}, needs 0x{seals:x})")
    return info.st_size


def _mmap(fd: int, size: int, prot: int, flags: int) -> int:
    addr = _LIBC.mmap(None, size, prot, flags, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise SealError(err, f"mmap of a {size}-byte memfd failed: {os.strerror(err)}")
    return int(addr)


def map_value(fd: int, size: int) -> int:
    """Map `size` bytes of `fd` private and read-only, page tables filled: the address."""
    return _mmap(fd, size, mmap.PROT_READ, mmap.MAP_PRIVATE | MAP_POPULATE)


def unmap(addr: int, size: int) -> None:
    _LIBC.munmap(addr, size)


def write_value(
    fd: int, value: memoryview, algo: int, checksummer: Checksummer, keep: bool
) -> tuple[bytes, tuple[int, int] | None]:
    """Write `value` into the memfd `fd` an SHM_PUT passed (closed here in every case), hashing
    the copy as it goes: (the checksum of the bytes written, what SHM_COMMIT declares; with
    `keep`, (address, size) of a private read-only mapping of them, else None). No writable
    mapping is left: the node's seal needs that. Raises SealError for a descriptor that is not
    the memfd announced, ValueError for an unknown `algo`."""
    length = len(value)
    try:
        size = check_sealed(fd, length, SEALS_OPEN)
        addr = _mmap(fd, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED)
        try:
            _LIBC.madvise(addr, size, MADV_HUGEPAGE)  # before the pages exist: they are made huge
            _LIBC.madvise(addr, size, MADV_POPULATE_WRITE)  # an error: the copy faults them in
            target = memoryview((ctypes.c_char * length).from_address(addr)).cast("B")
            checksum = copy_hashed(target, value.cast("B"), algo, checksummer)
            if checksum is None:
                raise ValueError(f"unknown checksum algorithm {algo}")
            kept = (map_value(fd, size), size) if keep else None
        finally:
            unmap(addr, size)
        return checksum, kept
    finally:
        os.close(fd)


class MappedValues:
    """Read-only mappings of values this process stored on one node process, by key: a bounded
    LRU (MAX_MAPPED_VALUES, MAX_MAPPED_BYTES). Thread-safe; a mapping in use by a copy is unmapped
    only after it (`use` / `unuse`)."""

    def __init__(self, process: str, max_values: int = MAX_MAPPED_VALUES, max_bytes: int = MAX_MAPPED_BYTES) -> None:
        self.process = process  # the node process's same-host socket name
        self.max_values = max_values
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # key -> (address, size, length, checksum)
        self._maps: collections.OrderedDict[bytes, tuple[int, int, int, bytes]] = collections.OrderedDict()
        self._bytes = 0
        self._users = 0
        self._doomed: list[tuple[int, int]] = []  # unmapped once no copy runs
        self._retired = False
        self.refused: str | None = None  # why this node process's memfds cannot be used here (then: socket)

    def add(self, key: bytes, addr: int, size: int, length: int, checksum: bytes) -> None:
        with self._lock:
            old = self._maps.pop(key, None)
            if old is not None:
                self._drop(old)
            if self._retired or self.max_values <= 0 or size > self.max_bytes:
                self._doomed.append((addr, size))
            else:
                self._maps[key] = (addr, size, length, checksum)
                self._bytes += size
                while len(self._maps) > self.max_values or self._bytes > self.max_bytes:
                    self._drop(self._maps.popitem(last=False)[1])
        self._collect()

    def find(self, key: bytes) -> tuple[int, int, bytes] | None:
        """(address, length, checksum) of `key`'s mapping (the caller holds `use`), or None."""
        with self._lock:
            found = self._maps.get(key)
            if found is None:
                return None
            self._maps.move_to_end(key)
            return found[0], found[2], found[3]

    def has(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._maps for k in keys]

    def forget(self, key: bytes) -> None:
        """The node no longer has (or has another) value of `key`: its mapping goes."""
        with self._lock:
            old = self._maps.pop(key, None)
            if old is not None:
                self._drop(old)
        self._collect()

    def _drop(self, entry: tuple[int, int, int, bytes]) -> None:
        """Lock held."""
        self._bytes -= entry[1]
        self._doomed.append((entry[0], entry[1]))

    def use(self) -> bool:
        """Count a copy in progress; False once retired."""
        with self._lock:
            if self._retired:
                return False
            self._users += 1
            return True

    def unuse(self) -> None:
        with self._lock:
            self._users -= 1
        self._collect()

    def retire(self) -> None:
        """The node process is gone or replaced: every mapping goes once the last copy ends."""
        with self._lock:
            self._retired = True
            for entry in self._maps.values():
                self._drop(entry)
            self._maps.clear()
        self._collect()

    def refuse(self, reason: str) -> None:
        """A memfd of this node process cannot be used here: its values come over the socket."""
        self.refused = reason
        self.retire()

    def _collect(self) -> None:
        with self._lock:
            if self._users or not self._doomed:
                return
            doomed, self._doomed = self._doomed, []
        for addr, size in doomed:
            unmap(addr, size)

    @property
    def mapped(self) -> int:
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
    (`write_value`) both copy so."""
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
