"""A same-host node's values as sealed memfds, written and read by this process (docs/protocol.md
section 13). The SHM_GET / SHM_PUT exchanges that pass them are memkv/transport/shm.py.

Stores: an SHM_PUT passes a memfd per value, of exactly the value's buffer size, sealed against
shrinking and growing. `write_value` copies the value in and hashes it piece by piece while it
is in cache (one pass over the bytes, no socket, no work in the node): with pwrite, or, where
the host gives shared memory huge pages on advice only, into a memfd with no pages yet through
a shared writable mapping advised for them, faulted in with one call and unmapped after. It
maps the memfd again private and read-only for later loads and closes the descriptor: the node
seals it against writing at SHM_COMMIT, which the kernel refuses while a writable shared
mapping exists.

Loads: an SHM_GET passes a value's memfd; `check_sealed` refuses one that is not sealed against
shrinking, growing and writing (a node not to be trusted, or another process's doing), and
`read_verified` reads it into the target (pread, hashed piece by piece as it lands). A committed
memfd never changes: what is read is what was committed, even after the node dropped the value.
Reading rather than mapping: a mapping per load takes this process's address-space lock twice
and fills page tables, and a vLLM engine's loader threads serialized on it (a restarted engine
promoted 32k tokens 1.8x slower than over the socket).

Mappings kept (`MappedValues`): the read-only mappings of values this process stored stay (a
bounded LRU, per node process, made while the store had the value in cache), and their loads
ask the node for the value's status and checksum only and copy from the mapping
(`copy_verified`); a value the node no longer has (MISS) or holds anew (another checksum) loses
its mapping.
Spares (memkv/server/shm.py) make the memfd of a store exist before the store: then only the
copy is the writer's.
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
from collections.abc import Sequence

from memkv.integrity import Checksummer
from memkv.memfd import F_SEAL_FUTURE_WRITE, MAP_POPULATE, fault_in, map_fd, shmem_huge_pages, unmap
from memkv.protocol import ChecksumAlgo

try:
    from memkv._recv_verify import copy_xxh3 as _compiled_copy
    from memkv._recv_verify import read_xxh3 as _compiled_read
    from memkv._recv_verify import write_xxh3 as _compiled_write
except ImportError:
    _compiled_copy = None  # type: ignore[assignment]
    _compiled_read = None  # type: ignore[assignment]
    _compiled_write = None  # type: ignore[assignment]
# MEMKV_PURE_PYTHON=1 turns the compiled loop off, as for receives (memkv/sockio.py).
COMPILED_COPY = _compiled_copy is not None and os.environ.get("MEMKV_PURE_PYTHON", "") in ("", "0")

PAGE = mmap.PAGESIZE
# Copied and hashed in pieces this large: each piece is hashed while the copy left it in cache.
COPY_PIECE = 256 << 10
SEALS_NEEDED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
SEALS_OPEN = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
# A memfd the node writes and reuses (`memkv serve --shared-memory-stores node`): nobody else can
# write it, but it may hold another value by the time it is read.
SEALS_NODE_WRITTEN = SEALS_OPEN | F_SEAL_FUTURE_WRITE
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
    return _sealed(fd, length, (seals,))[0]


def check_loadable(fd: int, length: int) -> bool:
    """Whether the memfd an SHM_GET passed for a `length`-byte value is node-written (it may hold
    another value by now: a failed check means "GET it") rather than committed (immutable: a
    failed check is an integrity failure). SealError when it is neither, sealed as it must be."""
    return _sealed(fd, length, (SEALS_NEEDED, SEALS_NODE_WRITTEN))[1] == SEALS_NODE_WRITTEN


def _sealed(fd: int, length: int, accepted: Sequence[int]) -> tuple[int, int]:
    """(size, the first of `accepted` seal sets `fd` carries); SealError where none."""
    try:
        info = os.fstat(fd)
        have = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise SealError(exc.errno or errno.EINVAL, f"not a sealable memfd: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode) or not 0 < length <= info.st_size < length + PAGE:
        raise SealError(errno.EINVAL, f"a memfd of {info.st_size} bytes for a {length}-byte value")
    for seals in accepted:
        if have & seals == seals:
            return info.st_size, seals
    needs = " or ".join(f"0x{seals:x}" for seals in accepted)
    raise SealError(errno.EPERM, f"a memfd without its seals (has 0x{have:x}, needs {needs})")


def _mmap(fd: int, size: int, prot: int, flags: int) -> int:
    try:
        return map_fd(fd, size, prot, flags)
    except OSError as exc:
        raise SealError(exc.errno or errno.EINVAL, exc.strerror or "mmap failed") from None


def map_value(fd: int, size: int) -> int:
    """Map `size` bytes of `fd` private and read-only, page tables filled: the address."""
    return _mmap(fd, size, mmap.PROT_READ, mmap.MAP_PRIVATE | MAP_POPULATE)


def write_value(
    fd: int, value: memoryview, algo: int, checksummer: Checksummer, keep: bool
) -> tuple[bytes, tuple[int, int] | None]:
    """Write `value` into the memfd `fd` an SHM_PUT passed (closed here in every case), hashing
    the copy as it goes: (the checksum of the bytes written, what SHM_COMMIT declares; with
    `keep`, (address, size) of a private read-only mapping of them, its page tables filled now:
    a load then copies with no fault, else None). No writable mapping is left: the node's seal
    needs that. Raises SealError for a descriptor that is not the memfd announced, ValueError for
    an unknown `algo`.

    How, by measurement (bench/shm_store_costs.py): with pwrite (no page tables to fill, nothing
    to unmap; into a memfd with no pages yet the kernel makes each page as the write fills it,
    without zeroing it first: half the time of a mapping where pages are 4 KiB), except into a
    memfd with no pages yet on a host whose THP for shared memory is "advise": there through a
    mapping advised for huge pages, which makes them 2 MiB (pwrite cannot ask for that)."""
    length = len(value)
    try:
        size = check_sealed(fd, length, SEALS_OPEN)
        # The host's mode is read per store (a few us against milliseconds of copy): an operator
        # who sets "advise" gets huge pages from the next store on, no restart.
        if os.fstat(fd).st_blocks * 512 >= size or shmem_huge_pages() != "advise":
            try:
                checksum = pwrite_hashed(fd, value.cast("B"), algo, checksummer)
            except OSError as exc:  # as a mapping refused: not the writable memfd announced
                raise SealError(exc.errno or errno.EINVAL, exc.strerror or "pwrite failed") from None
        else:
            addr = _mmap(fd, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED)
            try:
                fault_in(addr, size)
                target = memoryview((ctypes.c_char * length).from_address(addr)).cast("B")
                checksum = copy_hashed(target, value.cast("B"), algo, checksummer)
            finally:
                unmap(addr, size)
        if checksum is None:
            raise ValueError(f"unknown checksum algorithm {algo}")
        return checksum, ((map_value(fd, size), size) if keep else None)
    finally:
        os.close(fd)


def pwrite_hashed(fd: int, source: memoryview, algo: int, checksummer: Checksummer) -> bytes | None:
    """Write `source` at offset 0 of `fd` piece by piece, each piece copied into a small buffer
    first and hashed there: the checksum of the bytes written, whatever `source` does meanwhile
    (None for an unknown algo). The compiled loop does it in one GIL release (a store thread of a
    busy engine, or of a process with many, would otherwise wait for the GIL at every piece)."""
    if algo == ChecksumAlgo.XXH3_128 and COMPILED_COPY:
        assert _compiled_write is not None
        return Checksummer.padded(_compiled_write(fd, source, COPY_PIECE))
    try:
        hasher = checksummer.hasher(algo)
    except ValueError:
        return None
    piece = memoryview(bytearray(min(COPY_PIECE, len(source))))
    for off in range(0, len(source), COPY_PIECE):
        part = piece[: min(COPY_PIECE, len(source) - off)]
        part[:] = source[off : off + len(part)]
        hasher.update(part)
        done = 0
        while done < len(part):
            done += os.pwrite(fd, part[done:], off + done)
    return checksummer.finish(hasher)


class Mapping:
    """A read-only mapping of one stored value; unmapped once dropped and no copy reads it."""

    __slots__ = ("addr", "size", "length", "checksum", "readers", "dropped")

    def __init__(self, addr: int, size: int, length: int, checksum: bytes) -> None:
        self.addr, self.size, self.length, self.checksum = addr, size, length, checksum
        self.readers = 0  # copies reading it now (`MappedValues.find` .. `done`)
        self.dropped = False


class MappedValues:
    """Read-only mappings of values this process stored on one node process, by key: a bounded
    LRU (MAX_MAPPED_VALUES, MAX_MAPPED_BYTES). Thread-safe. A mapping dropped (pushed out of the
    LRU, forgotten, retired) is unmapped at once, or by the last copy reading it (`find` pins it,
    `done` unpins it): copies from other mappings never keep it, so what dropped values hold
    beyond the bounds is at most what the running copies read, however busy the process."""

    def __init__(self, process: str, max_values: int = MAX_MAPPED_VALUES, max_bytes: int = MAX_MAPPED_BYTES) -> None:
        self.process = process  # the node process's same-host socket name
        self.max_values = max_values
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._maps: collections.OrderedDict[bytes, Mapping] = collections.OrderedDict()
        self._bytes = 0  # of the mappings in _maps
        self.retired = False  # the node process is gone or replaced: nothing is kept any more
        self.refused: str | None = None  # why this node process's memfds cannot be used here (then: socket)

    def add(self, key: bytes, addr: int, size: int, length: int, checksum: bytes) -> None:
        new = Mapping(addr, size, length, checksum)
        with self._lock:
            dropped = [self._pop(key)]
            if self.retired or self.max_values <= 0 or size > self.max_bytes:
                dropped.append(new)
            else:
                self._maps[key] = new
                self._bytes += size
                while len(self._maps) > self.max_values or self._bytes > self.max_bytes:
                    dropped.append(self._pop(next(iter(self._maps))))
            gone = self._drop(dropped)
        _unmap_all(gone)

    def find(self, key: bytes) -> Mapping | None:
        """`key`'s mapping, pinned for the caller's copy (`done` when it ended), or None."""
        with self._lock:
            found = self._maps.get(key)
            if found is None:
                return None
            self._maps.move_to_end(key)
            found.readers += 1
            return found

    def done(self, mapping: Mapping) -> None:
        """A copy from `mapping` (`find`) ended: unmapped now if it was dropped meanwhile."""
        with self._lock:
            mapping.readers -= 1
            gone = [mapping] if mapping.dropped and mapping.readers == 0 else []
        _unmap_all(gone)

    def has(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._maps for k in keys]

    def forget(self, key: bytes) -> None:
        """The node no longer has (or has another) value of `key`: its mapping goes."""
        with self._lock:
            gone = self._drop([self._pop(key)])
        _unmap_all(gone)

    def retire(self) -> None:
        """The node process is gone or replaced: every mapping goes (a pinned one after its copy)."""
        with self._lock:
            self.retired = True
            dropped = list(self._maps.values())
            self._maps.clear()
            self._bytes = 0
            gone = self._drop(dropped)
        _unmap_all(gone)

    def refuse(self, reason: str) -> None:
        """A memfd of this node process cannot be used here: its values come over the socket."""
        self.refused = reason
        self.retire()

    def _pop(self, key: bytes) -> Mapping | None:
        """Lock held."""
        mapping = self._maps.pop(key, None)
        if mapping is not None:
            self._bytes -= mapping.size
        return mapping

    @staticmethod
    def _drop(mappings: Sequence[Mapping | None]) -> list[Mapping]:
        """Lock held: mark `mappings` (out of the LRU) dropped; those no copy reads, to unmap
        outside the lock."""
        gone = []
        for mapping in mappings:
            if mapping is not None:
                mapping.dropped = True
                if mapping.readers == 0:
                    gone.append(mapping)
        return gone

    @property
    def mapped(self) -> int:
        return len(self._maps)


def _unmap_all(mappings: list[Mapping]) -> None:
    for mapping in mappings:
        unmap(mapping.addr, mapping.size)


def copy_verified(target: memoryview, source_addr: int, algo: int, checksum: bytes, checksummer: Checksummer) -> bool:
    """Copy len(target) bytes from `source_addr` into `target`, hashing the copy; True when it
    matches `checksum` (an unknown algo: False, a miss)."""
    source = memoryview((ctypes.c_char * len(target)).from_address(source_addr)).cast("B")
    got = copy_hashed(target, source, algo, checksummer)
    return got is not None and hmac.compare_digest(got, checksum)


def read_verified(target: memoryview, fd: int, algo: int, checksum: bytes, checksummer: Checksummer) -> bool:
    """Read the first len(target) bytes of the memfd `fd` into `target` (pread: no mapping, so
    no lock of this process's address space, which loader threads mapping and unmapping values
    serialize on), hashing each piece as it lands; True when they match `checksum` (an unknown
    algo or a short file: False). The compiled loop does it in one GIL release."""
    if algo == ChecksumAlgo.XXH3_128 and COMPILED_COPY:
        assert _compiled_read is not None
        digest = _compiled_read(fd, target, COPY_PIECE)
        got = None if digest is None else Checksummer.padded(digest)
    else:
        try:
            hasher = checksummer.hasher(algo)
        except ValueError:
            return False
        off = 0
        while off < len(target):
            n = os.preadv(fd, [target[off : off + COPY_PIECE]], off)
            if n <= 0:
                return False
            hasher.update(target[off : off + n])
            off += n
        got = checksummer.finish(hasher)
    return got is not None and hmac.compare_digest(got, checksum)


def copy_hashed(target: memoryview, source: memoryview, algo: int, checksummer: Checksummer) -> bytes | None:
    """Copy `source` into `target` (same length, bytes), hashing each piece of the copy right
    after it is written, while it is in cache: the checksum of the bytes in `target` (None for an
    unknown algo), whatever `source` does meanwhile. The compiled loop does all of it in one GIL
    release (a busy engine makes every re-acquire cost up to its switch interval); the Python one
    copies each piece with ctypes.memmove (no GIL; a read-only source by slice assignment) and
    hashes it with python-xxhash or blake3. Loads from a kept mapping (`copy_verified`) and
    SHM_PUT stores into a fresh memfd (`write_value`) both copy so."""
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
