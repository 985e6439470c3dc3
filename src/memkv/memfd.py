"""Mapping memfds through libc (ctypes): the node's spares and the client's copies.

Through ctypes rather than Python's `mmap` so that each call releases the GIL (a page-faulting
madvise of a 16 MiB value takes milliseconds; under the GIL it would stall every connection
thread of the node, every load thread of an engine) and the address is known without exporting
a buffer.
"""

from __future__ import annotations

import ctypes
import mmap
import os

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in for writing with one call
# Transparent huge pages for a value's memfd where the host allows them for shared memory
# (/sys/kernel/mm/transparent_hugepage/shmem_enabled "advise", "within_size" or "always"): a
# fresh memfd per value needs its pages made and its page tables filled for every store, about
# 1 us per 4 KiB page on a VM; 2 MiB pages make that 512 times fewer. Ignored where the host says
# "never" (docs/operations.md, "Same-host clients"). The node's private value buffers ask for them
# too (memkv/server/store.py, ValueBuffer), where /sys/kernel/mm/transparent_hugepage/enabled allows.
MADV_HUGEPAGE = 14
# Linux 5.1, not in Python's fcntl: no write through any descriptor or new mapping, while writable
# mappings made before it still write (memkv/server/shm.py, node-written memfds).
F_SEAL_FUTURE_WRITE = 0x0010


SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shmem_huge_pages() -> str | None:
    """The host's transparent-huge-page mode for shared memory (the bracketed word of SHMEM_THP),
    or None where it cannot be read. Stores into memfds need "advise" (or "within_size",
    "always") to run at the copy's speed: memkv/client/shared.py, `write_value`."""
    try:
        with open(SHMEM_THP) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def map_fd(fd: int, size: int, prot: int, flags: int) -> int:
    """mmap `size` bytes of `fd` at an address the kernel picks (2 MiB-aligned for a large
    memfd where huge pages are allowed): the address. Raises OSError."""
    addr = _LIBC.mmap(None, size, prot, flags, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a {size}-byte memfd failed: {os.strerror(err)}")
    return int(addr)


def unmap(addr: int, size: int) -> None:
    _LIBC.munmap(addr, size)


def madvise(addr: int, size: int, advice: int) -> bool:
    """Whether the kernel took the advice (an old kernel refuses MADV_POPULATE_WRITE)."""
    return bool(_LIBC.madvise(addr, size, advice) == 0)


def fault_in(addr: int, size: int) -> None:
    """Make the pages of a fresh shared writable mapping exist now, huge where allowed. Where the
    kernel cannot (before 5.14), the first writes fault them in instead."""
    madvise(addr, size, MADV_HUGEPAGE)  # before the pages exist: they are made huge
    madvise(addr, size, MADV_POPULATE_WRITE)
