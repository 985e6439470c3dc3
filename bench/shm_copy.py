"""What one copy per byte would buy a same-host load: node memory mapped by the client vs the Unix socket.

Today a same-host load moves every byte twice, both times on a CPU: the node's `sendall` copies
it into the socket, the client's `recv_into` copies it out into the destination (vLLM's CPU
pool). If the node kept its values in shared memory (a memfd) that the client maps, the client
could copy each value straight from the node's buffer into the pool: one copy, no syscalls.
This measures that ceiling before anything is built, against the socket path in the same run:

  * socket: a "node" process with a thread per connection `sendall`s 16 MiB values from its
    pre-faulted memory over an abstract Unix socket per one-byte request; T client threads
    `recv_into` their slots of the destination (the data path of memkv's same-host clients,
    without framing);
  * shm: the "node" process fills a memfd it shares with the client (the mapping is made and
    pre-faulted once, as a client would at attach); T client threads copy each value from the
    mapping into its slot with one `ctypes.memmove` (the GIL is released during the copy).

  * shm-fresh (with `--fresh`): as shm, but through a mapping made anew for the repetition and
    not pre-faulted, as a client process that just started (a restarted engine) would have:
    each thread fills the page tables of its value with one madvise(MADV_POPULATE_READ) before
    the copy (Linux 5.14+; else the copy takes the page faults). What a fresh engine's first
    load of each value would cost on top of the copy.

`--verify python` also hashes every value with xxh3-128 (python-xxhash) as memkv verifies: the
socket path in 256 KiB pieces right after each receive, the shm paths per 256 KiB piece right
after its copy. `--verify compiled` uses memkv's compiled loops instead (memkv._recv_verify,
built by `pip install -e .` or carried as src/memkv/_recv_verify.abi3.so): recv_xxh3_into for
the socket, copy_xxh3 for the shm paths, each one GIL release per value. The destination is a
pinned torch tensor when torch imports (vLLM's pool is pinned), else pre-faulted anonymous
memory. The modes take turns, repetition by repetition (order reversed every other one).
Prints GB/s, CPU-seconds per GB (both processes) and each shm mode / socket.

    python3 bench/shm_copy.py [--gib 8] [--threads 8,16] [--reps 3] [--verify {none,python,compiled}]
                              [--fresh] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import socket
import statistics
import threading
import time

VALUE = 16 << 20
PIECE = 256 << 10


def _anon(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))


def _destination(size: int) -> tuple[object, int, memoryview, str]:
    """(keep-alive object, address, view, kind) of the destination buffer."""
    try:
        import torch

        t = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        t.fill_(1)
        addr = t.data_ptr()
        view = memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
        return t, addr, view, "torch pinned" if t.is_pinned() else "torch pageable"
    except ImportError:
        m = _anon(size)
        view = memoryview(m)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        return m, addr, view, "anonymous mmap"


def _hasher():
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_128


def _compiled():
    """memkv's compiled loops (csrc/recv_verify.c) as built in this checkout's src/, or None.
    Loaded from its file alone: the package's imports (blake3, ...) need not be on the host."""
    import glob
    import importlib.util

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "memkv")
    for path in glob.glob(os.path.join(here, "_recv_verify*.so")):
        spec = importlib.util.spec_from_file_location("memkv._recv_verify", path)
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return None


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_READ = 22  # Linux 5.14


def _map_fresh(fd: int, size: int) -> int:
    """A new read-only mapping of the node's memory, page tables empty (ctypes: no GIL held)."""
    addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of the node's memory failed")
    return addr


def _node(listener: socket.socket, fd: int, size: int, ready: int) -> None:
    """The node: fills the shared values, says so on `ready`, then serves them over the socket."""
    shared = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    for off in range(0, size, VALUE):
        shared[off : off + VALUE] = os.urandom(64) * (VALUE // 64)
    os.write(ready, b"1")
    view = memoryview(shared)

    def one(conn: socket.socket) -> None:
        while True:
            req = conn.recv(4)
            if len(req) < 4:
                return
            i = int.from_bytes(req, "big")
            conn.sendall(view[i * VALUE : (i + 1) * VALUE])

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=one, args=(conn,), daemon=True).start()


def run(
    mode: str, conns, shared_addr: int, dst_addr: int, dst: memoryview, values: int, threads: int, verify: str, fd: int
):
    hasher = _hasher() if verify == "python" else None
    compiled = _compiled() if verify == "compiled" else None
    digests: list[bytes] = []
    size = values * VALUE
    src_addr = _map_fresh(fd, size) if mode == "shm-fresh" else shared_addr

    def worker(t: int) -> None:
        for i in range(t, values, threads):
            slot = dst[i * VALUE : (i + 1) * VALUE]
            src = src_addr + i * VALUE
            h = hasher() if hasher else None
            if mode == "socket":
                conn = conns[t]
                conn.sendall(i.to_bytes(4, "big"))
                if compiled is not None:
                    got, err, digest = compiled.recv_xxh3_into(conn.fileno(), slot, PIECE, -1.0)
                    if got != VALUE:
                        raise OSError(err, "receive failed")
                    digests.append(digest)
                    continue
                got = 0
                while got < VALUE:
                    n = conn.recv_into(slot[got:], min(PIECE, VALUE - got) if h else VALUE - got)
                    if h:
                        h.update(slot[got : got + n])
                    got += n
            else:
                if mode == "shm-fresh":
                    _LIBC.madvise(src, VALUE, MADV_POPULATE_READ)  # fails harmlessly before Linux 5.14
                if compiled is not None:
                    source = memoryview((ctypes.c_char * VALUE).from_address(src)).cast("B")
                    digests.append(compiled.copy_xxh3(slot, source, PIECE))
                elif h:
                    for off in range(0, VALUE, PIECE):
                        ctypes.memmove(dst_addr + i * VALUE + off, src + off, PIECE)
                        h.update(slot[off : off + PIECE])
                else:
                    ctypes.memmove(dst_addr + i * VALUE, src, VALUE)
            if h:
                digests.append(h.digest())

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    t0, r0 = time.perf_counter(), os.times()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed, r1 = time.perf_counter() - t0, os.times()
    if mode == "shm-fresh":
        _LIBC.munmap(src_addr, size)
    if verify != "none" and len(digests) != values:
        raise SystemExit(f"{mode}: {len(digests)} of {values} values verified")
    return elapsed, r0, r1


def _child_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--gib", type=float, default=8.0, help="bytes moved per repetition (a 32k prompt of the 32B shape: 8)"
    )
    ap.add_argument("--threads", default="8", help="client threads, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--verify",
        choices=("none", "python", "compiled"),
        default="none",
        help="xxh3-128 over every value in 256 KiB pieces: python-xxhash, or memkv's compiled loops",
    )
    ap.add_argument("--fresh", action="store_true", help="also shm-fresh: a new, unfaulted mapping per repetition")
    ap.add_argument("--out")
    args = ap.parse_args()
    values = int(args.gib * (1 << 30)) // VALUE
    size = values * VALUE
    fd = os.memfd_create("memkv-bench-shm")
    os.ftruncate(fd, size)
    name = f"\0memkv-bench-shm-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen(64)
    ready_r, ready_w = os.pipe()
    node = os.fork()
    if node == 0:
        try:
            _node(listener, fd, size, ready_w)
        finally:
            os._exit(0)
    listener.close()
    if args.verify == "compiled" and _compiled() is None:
        raise SystemExit("--verify compiled: memkv._recv_verify is not built in this checkout's src/")
    if args.verify == "python" and _hasher() is None:
        raise SystemExit("--verify python: python-xxhash is not installed")
    _keep, dst_addr, dst, kind = _destination(size)  # _keep: holds the buffer alive
    if os.read(ready_r, 1) != b"1":
        raise SystemExit("the node process did not fill its values")
    # What a client would pay once per node at attach: map the node's memory, page tables filled.
    t0 = time.perf_counter()
    shared = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    map_s = time.perf_counter() - t0
    shared_addr = ctypes.addressof(ctypes.c_char.from_buffer(shared))
    result = {
        "benchmark": "shm_copy",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Linux {platform.release()}",
        "destination": kind,
        "verify": args.verify,
        "bytes": size,
        "populate_mapping_s": map_s,
        "rows": [],
    }
    print(
        f"# {result['machine']}, {time.strftime('%H:%M UTC', time.gmtime())}; {size / 2**30:.1f} GiB per rep into {kind}; "
        f"verify={args.verify}; mapping the node's memory once: {map_s:.2f} s"
    )
    modes = ["socket", "shm"] + (["shm-fresh"] if args.fresh else [])
    shm_modes = modes[1:]
    print(
        f"{'threads':>7} {'rep':>3} "
        + " ".join(f"{m + ' GB/s':>14}" for m in modes)
        + " "
        + " ".join(f"{m + '/socket':>16}" for m in shm_modes)
        + " "
        + " ".join(f"{m + ' CPU-s/GB':>18}" for m in modes)
    )
    try:
        for threads in [int(t) for t in args.threads.split(",")]:
            conns = []
            for _ in range(threads):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(name)
                conns.append(c)
            for mode in modes:  # warm: page tables, socket buffers, caches
                run(mode, conns, shared_addr, dst_addr, dst, values, threads, args.verify, fd)
            for rep in range(args.reps):
                got = {}
                for mode in modes if rep % 2 == 0 else modes[::-1]:
                    n0 = _child_cpu(node)
                    elapsed, r0, r1 = run(mode, conns, shared_addr, dst_addr, dst, values, threads, args.verify, fd)
                    cpu = (r1.user - r0.user) + (r1.system - r0.system) + _child_cpu(node) - n0
                    got[mode] = {"gb_s": size / elapsed / 1e9, "cpu_s_per_gb": cpu / (size / 1e9)}
                row = {"threads": threads, "rep": rep, **{f"{m}_{k}": v for m, d in got.items() for k, v in d.items()}}
                for m in shm_modes:
                    row[f"{m}_over_socket"] = got[m]["gb_s"] / got["socket"]["gb_s"]
                result["rows"].append(row)
                print(
                    f"{threads:>7} {rep:>3} "
                    + " ".join(f"{got[m]['gb_s']:>14.2f}" for m in modes)
                    + " "
                    + " ".join(f"{row[m + '_over_socket']:>16.2f}" for m in shm_modes)
                    + " "
                    + " ".join(f"{got[m]['cpu_s_per_gb']:>18.3f}" for m in modes),
                    flush=True,
                )
            for c in conns:
                c.close()
            for m in shm_modes:
                ratios = [r[f"{m}_over_socket"] for r in result["rows"] if r["threads"] == threads]
                print(f"{threads:>7} median {m}/socket {statistics.median(ratios):.2f}")
    finally:
        os.kill(node, 9)
        os.waitpid(node, 0)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
