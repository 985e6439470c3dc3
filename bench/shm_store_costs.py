"""Where a same-host store's time goes: the parts of an SHM_PUT against a raw Unix socket, same run.

    python3 bench/shm_store_costs.py [--values 24] [--reps 3] [--size-mib 16]

An SHM_PUT puts each value into a memfd of its own, which the node seals at commit (docs/protocol.md,
section 9): a value's pages are new pages, never reused, because a sealed memfd cannot be written
again. A raw socket (and the shared arenas MemKV used before it) moves the bytes into memory that
is reused store after store. This times, per value, in one process and one thread each, with no
node and no protocol (so the parts add up to what a store costs, not what `bench/datapath.py`
measures end to end):

  raw-unix      `sendall` of the value on a Unix socket pair, received into one reused buffer by a
                second thread (the raw baseline of bench/datapath.py): two copies, no new page
  allocate      the node's part for a fresh memfd: memfd_create, ftruncate, seals, every page
                faulted in for writing (MADV_POPULATE_WRITE): what a spare costs the node's spare
                thread (memkv serve --shared-memory-spares), off the store's path but on the host
  write spare   the client's part with a spare (`client.shared.write_value` into an allocated
                memfd): map, fill page tables, copy + xxh3, unmap, keep a read-only mapping
  write fresh   the client's part without a spare: the same into a memfd whose pages do not exist
                yet (the kernel allocates and zeroes each page in the copy's page faults)
  pwrite spare  the client's part with a spare and no mapping at all: each 256 KiB piece copied
                into a small buffer, hashed there and written with pwrite into the spare's pages
  copy reused   the copy + xxh3 alone, into one mapping reused value after value (its pages and
                page tables exist): the floor, what a store costs where memory is reused

Prints per part the median milliseconds per value and GB/s, and each part's time against
raw-unix's (raw / part: above 1 is faster than the raw socket); writes bench/out/shm_store_costs.json.
A host that reports freed memory to its hypervisor (virtio-balloon free page reporting: freed
pages come back cold) pays more for every new page; the JSON names the host's shared-memory THP mode.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import mmap
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from memkv.client.shared import SEALS_OPEN, copy_hashed, pwrite_hashed, write_value  # noqa: E402
from memkv.integrity import Checksummer  # noqa: E402
from memkv.memfd import MADV_POPULATE_WRITE, fault_in, madvise, map_fd, unmap  # noqa: E402
from memkv.protocol import ChecksumAlgo  # noqa: E402

PAGE = mmap.PAGESIZE


def new_memfd(size: int) -> int:
    """A value memfd as the node makes one: sized, sealed against shrink and grow."""
    fd = os.memfd_create("memkv-bench", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS_OPEN)
    return fd


def allocate(size: int) -> int:
    """A spare as the node makes one: a new memfd with every page faulted in for writing (huge
    pages where the host allows them for shared memory)."""
    fd = new_memfd(size)
    addr = map_fd(fd, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED)
    try:
        fault_in(addr, size)
    finally:
        unmap(addr, size)
    return fd


def time_raw_unix(value: memoryview, n: int) -> list[float]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sink = memoryview(bytearray(len(value)))
    times: list[float] = []

    def receive() -> None:
        for _ in range(n):
            got = 0
            while got < len(sink):
                got += b.recv_into(sink[got:])

    rx = threading.Thread(target=receive, daemon=True)
    rx.start()
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            a.sendall(value)
            times.append(time.perf_counter() - t0)
        rx.join(60)
    finally:
        a.close()
        b.close()
    return times


def time_allocate(size: int, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fd = allocate(size)
        times.append(time.perf_counter() - t0)
        os.close(fd)
    return times


def time_write(value: memoryview, n: int, spare: bool, checksummer: Checksummer) -> list[float]:
    size = -(-len(value) // PAGE) * PAGE
    fds = [allocate(size) if spare else new_memfd(size) for _ in range(n)]  # made before the clock runs
    times = []
    for fd in fds:  # write_value closes fd
        t0 = time.perf_counter()
        _, kept = write_value(fd, value, ChecksumAlgo.XXH3_128, checksummer, keep=True)
        times.append(time.perf_counter() - t0)
        if kept is not None:
            unmap(*kept)
    return times


def time_pwrite(value: memoryview, n: int, spare: bool, checksummer: Checksummer) -> list[float]:
    """The client's part with no mapping: each piece copied into a small buffer, hashed there,
    written with pwrite; into a spare the kernel copies into existing pages, into a fresh memfd
    it allocates each page as the write reaches it (shared memory skips zeroing a page that a
    write fills whole)."""
    size = -(-len(value) // PAGE) * PAGE
    fds = [allocate(size) if spare else new_memfd(size) for _ in range(n)]
    times = []
    for fd in fds:
        t0 = time.perf_counter()
        pwrite_hashed(fd, value, ChecksumAlgo.XXH3_128, checksummer)  # what write_value runs
        times.append(time.perf_counter() - t0)
        os.close(fd)
    return times


def time_copy_reused(value: memoryview, n: int, checksummer: Checksummer) -> list[float]:
    size = -(-len(value) // PAGE) * PAGE
    fd = allocate(size)
    addr = map_fd(fd, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED)
    try:
        madvise(addr, size, MADV_POPULATE_WRITE)
        target = memoryview((ctypes.c_char * len(value)).from_address(addr)).cast("B")
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            copy_hashed(target, value, ChecksumAlgo.XXH3_128, checksummer)
            times.append(time.perf_counter() - t0)
        target.release()
    finally:
        unmap(addr, size)
        os.close(fd)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=24, help="values per part per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "shm_store_costs.json"))
    args = ap.parse_args()
    size = args.size_mib << 20
    value = memoryview(os.urandom(size))
    checksummer = Checksummer(os.urandom(32))
    parts = {
        "raw-unix": lambda: time_raw_unix(value, args.values),
        "allocate": lambda: time_allocate(size, args.values),
        "write spare": lambda: time_write(value, args.values, True, checksummer),
        "write fresh": lambda: time_write(value, args.values, False, checksummer),
        "pwrite spare": lambda: time_pwrite(value, args.values, True, checksummer),
        "pwrite fresh": lambda: time_pwrite(value, args.values, False, checksummer),
        "copy reused": lambda: time_copy_reused(value, args.values, checksummer),
    }
    times: dict[str, list[float]] = {name: [] for name in parts}
    ratios: dict[str, list[float]] = {name: [] for name in parts if name != "raw-unix"}
    for rep in range(args.reps):
        order = list(parts) if rep % 2 == 0 else list(reversed(parts))  # alternate: drift cancels
        rep_median = {}
        for name in order:
            got = parts[name]()
            times[name] += got
            rep_median[name] = statistics.median(got)
        for name in ratios:
            ratios[name].append(rep_median["raw-unix"] / rep_median[name])
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
    except OSError:
        thp = "unknown"
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(
        f"{args.size_mib} MiB values, {args.values} per part x {args.reps} reps, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}, shmem THP {thp}, commit {commit.stdout.strip()}"
    )
    print("| part | ms per value | GB/s | raw-unix / part (per-rep medians) |")
    print("|---|---:|---:|---:|")
    summary = {}
    for name in parts:
        ms = statistics.median(times[name]) * 1e3
        gbps = size / (ms / 1e3) / 1e9
        span = ratios.get(name)
        text = "1" if span is None else f"{min(span):.2f}-{max(span):.2f}"
        summary[name] = {"median_ms": ms, "gb_per_s": gbps, "raw_over_part": span}
        print(f"| {name} | {ms:.2f} | {gbps:.2f} | {text} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "shmem_thp": thp,
                "commit": commit.stdout.strip(),
                "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                "load_avg": os.getloadavg(),
                "times_s": times,
                "summary": summary,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
