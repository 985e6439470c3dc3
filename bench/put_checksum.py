"""Where a TCP store's time goes beyond the raw socket's: the client's checksum pass, same run.

    python3 bench/put_checksum.py [--threads 8] [--values 32] [--value-mib 16] [--batch 8] [--reps 5] [--out FILE]

A PUT's frame carries each value's checksum (xxh3-128) ahead of the value's bytes (docs/protocol.md),
so the client hashes a whole value before it sends the first byte: one pass that reads the value from
memory, then the kernel's copy into the socket reads it from memory again. A load hashes each piece
as it lands, while it is in cache. This times, over loopback TCP into a receiver process that
reads into one reused buffer per connection (no node, no protocol), `--threads` sender threads of
one process each moving `--values` values of their own (a pool larger than the caches, as the
tier's CPU pool is) in batches of `--batch` (the tier's blocks_per_op), the variants interleaved
repetition by repetition:

  raw               `sendall` of each value of a batch: the raw design's store
  hash, then send   xxh3-128 of each value of the batch, one after the other, then `sendall` of each:
                    what the client does today (a batch's frame carries every checksum)
  hash in parallel  the batch's values hashed at once on a pool of hashing threads (one per CPU, at
                    most 8), then sent: the same frame, its checksums made on idle cores
  hash each piece   per value, xxh3-128 updated with each 256 KiB piece just before that piece is
                    sent: what a checksum sent after the value (a trailer) would allow

Prints per variant the median GB/s and its ratio to raw in the same repetition; writes
bench/out/put_checksum.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from memkv.benchmark import fill_pattern, prefaulted_pool  # noqa: E402

MiB = 1 << 20
PIECE = 256 << 10  # the piece the compiled receive loop hashes while it is in cache
VARIANTS = ("raw", "hash, then send", "hash in parallel", "hash each piece")
HASHERS = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))
RECV_TIMEOUT_S = 60.0


def receiver(port_file: str, threads: int, value_bytes: int) -> None:
    """Accepts `threads` connections and reads each into one reused buffer until the peer closes."""
    lst = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(lst.getsockname()[1]))

    def drain(conn: socket.socket) -> None:
        buf = memoryview(prefaulted_pool(value_bytes))
        conn.settimeout(RECV_TIMEOUT_S)
        with conn:
            while conn.recv_into(buf):
                pass

    pool = []
    for _ in range(threads):
        conn, _ = lst.accept()
        t = threading.Thread(target=drain, args=(conn,), daemon=True)
        t.start()
        pool.append(t)
    for t in pool:
        t.join()


def send(variant: str, sock: socket.socket, batch: list[memoryview]) -> None:
    if variant == "hash, then send":
        for value in batch:
            xxhash.xxh3_128_digest(value)
    elif variant == "hash in parallel":
        list(HASHERS.map(xxhash.xxh3_128_digest, batch))
    if variant != "hash each piece":
        for value in batch:
            sock.sendall(value)
        return
    for value in batch:
        hasher = xxhash.xxh3_128()
        for off in range(0, len(value), PIECE):
            piece = value[off : off + PIECE]
            hasher.update(piece)
            sock.sendall(piece)
        hasher.digest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--values", type=int, default=32, help="values per thread (each thread's own)")
    ap.add_argument("--value-mib", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="values per batch (the tier's blocks_per_op)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "put_checksum.json")
    ap.add_argument("--receiver", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receiver:
        receiver(args.receiver[0], int(args.receiver[1]), int(args.receiver[2]))
        return
    if min(args.threads, args.values, args.value_mib, args.batch, args.reps) < 1:
        ap.error("--threads, --values, --value-mib, --batch and --reps must be at least 1")
    value_bytes = args.value_mib * MiB
    n = args.threads * args.values
    pool = memoryview(prefaulted_pool(value_bytes * n))
    for i in range(n):
        fill_pattern(pool[i * value_bytes : (i + 1) * value_bytes], i)
    port_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"put_checksum.{os.getpid()}.port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--receiver", str(port_file), str(args.threads), str(value_bytes)]
    )
    try:
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text()):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the receiver did not start")
            time.sleep(0.05)
        port = int(port_file.read_text())
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(args.threads)]
        for s in socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def block(variant: str) -> float:
            def one(t: int) -> None:
                mine = range(t, n, args.threads)
                for j in range(0, len(mine), args.batch):
                    batch = [pool[i * value_bytes : (i + 1) * value_bytes] for i in mine[j : j + args.batch]]
                    send(variant, socks[t], batch)

            threads = [threading.Thread(target=one, args=(t,)) for t in range(args.threads)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return n * value_bytes / (time.perf_counter() - start) / 1e9

        for v in VARIANTS:  # warm-up: connections, the receiver's buffers, the pool in the page tables
            block(v)
        reps: list[dict[str, float]] = []
        for r in range(args.reps):
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
            reps.append({v: block(v) for v in order})
        for s in socks:
            s.close()
        proc.wait(RECV_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        port_file.unlink(missing_ok=True)
    print(
        f"{args.threads} thread(s), {n} values of {args.value_mib} MiB in batches of {args.batch}, "
        f"{args.reps} repetitions, {os.cpu_count()} CPUs"
    )
    print(f"{'variant':<17} {'GB/s':>6} {'vs raw (median, min-max)':>26}")
    summary = {}
    for v in VARIANTS:
        gbps = statistics.median(r[v] for r in reps)
        ratios = [r[v] / r["raw"] for r in reps]
        summary[v] = {"gbps": gbps, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                      "ratio_max": max(ratios)}  # fmt: skip
        print(f"{v:<17} {gbps:>6.2f} {statistics.median(ratios):>12.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.node()} ({os.cpu_count()} CPUs)", "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "args": {k: v for k, v in vars(args).items() if k not in ("out", "receiver")}}  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "reps": reps, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
