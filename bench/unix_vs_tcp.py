"""Loopback TCP vs a Unix stream socket, the same bytes, the same Python, the same run.

A node and a client on one host talk over loopback TCP today. This measures what the kernel
charges for that against an AF_UNIX stream socket (abstract namespace) moving the same 16 MiB
values: one server process (a thread per connection, `sendall` of a pre-faulted buffer per
one-byte request, as a node's GET reply), one client process with T threads (`recv_into` a
pre-faulted slot of one pool, as the tier's load into its CPU pool). The two families take
turns, repetition by repetition (order reversed every other one): only same-run ratios mean
anything on a noisy host. Prints GB/s, CPU-seconds per GB (client and server together) and
unix/tcp per thread count; `--out` writes the JSON.

    python3 bench/unix_vs_tcp.py [--threads 2,8,16] [--values 32] [--reps 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import socket
import statistics
import sys
import threading
import time

SIZE = 16 << 20


def _pool(size: int) -> memoryview:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return memoryview(mmap.mmap(-1, size, flags=flags))


def _serve(listener: socket.socket) -> None:
    def one(conn: socket.socket) -> None:
        src = _pool(SIZE)
        while conn.recv(1):
            conn.sendall(src)

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=one, args=(conn,), daemon=True).start()


def measure(family: str, threads: int, values: int) -> dict[str, float]:
    if family == "tcp":
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        address: object = listener.getsockname()
    else:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = f"\0memkv-bench-{os.getpid()}-{time.monotonic_ns()}"
        listener.bind(address)
    listener.listen(threads)
    pid = os.fork()
    if pid == 0:
        try:
            _serve(listener)
        finally:
            os._exit(0)
    listener.close()
    pool = _pool(SIZE * threads)
    conns = []
    for _ in range(threads):
        conn = socket.socket(socket.AF_INET if family == "tcp" else socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(address)
        conns.append(conn)

    def client(i: int) -> None:
        conn, slot = conns[i], pool[i * SIZE : (i + 1) * SIZE]
        for _ in range(values):
            conn.sendall(b"g")
            got = 0
            while got < SIZE:
                n = conn.recv_into(slot[got:], SIZE - got)
                if not n:
                    raise ConnectionError("server closed")
                got += n

    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    t0, r0 = time.perf_counter(), os.times()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed, r1 = time.perf_counter() - t0, os.times()
    for conn in conns:
        conn.close()
    # The server's CPU: its whole life, which is the transfer plus a fork and an idle accept.
    os.kill(pid, 9)
    _, _, usage = os.wait4(pid, 0)
    gb = SIZE * values * threads / 1e9
    client_cpu = (r1.user - r0.user) + (r1.system - r0.system)
    return {
        "gb_s": gb / elapsed,
        "cpu_s_per_gb": (client_cpu + usage.ru_utime + usage.ru_stime) / gb,
        "client_cpu_s_per_gb": client_cpu / gb,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="2,8,16", help="client threads, comma-separated")
    ap.add_argument("--values", type=int, default=32, help="16 MiB values per thread per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args()
    result: dict[str, object] = {
        "benchmark": "unix_vs_tcp",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Linux {platform.release()}",
        "python": platform.python_version(),
        "value_bytes": SIZE,
        "values_per_thread": args.values,
        "rows": [],
    }
    print(f"# {result['machine']}, Python {result['python']}, {result['date']}")
    print(
        f"{'threads':>7} {'rep':>3} {'tcp GB/s':>9} {'unix GB/s':>9} {'unix/tcp':>8} {'tcp CPU-s/GB':>12} {'unix CPU-s/GB':>13}"
    )
    for threads in [int(t) for t in args.threads.split(",")]:
        for rep in range(args.reps):
            order = ["tcp", "unix"] if rep % 2 == 0 else ["unix", "tcp"]
            got = {family: measure(family, threads, args.values) for family in order}
            row = {"threads": threads, "rep": rep, **{f"{f}_{k}": v for f, m in got.items() for k, v in m.items()}}
            row["unix_over_tcp"] = got["unix"]["gb_s"] / got["tcp"]["gb_s"]
            result["rows"].append(row)  # type: ignore[union-attr]
            print(
                f"{threads:>7} {rep:>3} {got['tcp']['gb_s']:>9.2f} {got['unix']['gb_s']:>9.2f} {row['unix_over_tcp']:>8.2f}"
                f" {got['tcp']['cpu_s_per_gb']:>12.3f} {got['unix']['cpu_s_per_gb']:>13.3f}",
                flush=True,
            )
        ratios = [r["unix_over_tcp"] for r in result["rows"] if r["threads"] == threads]  # type: ignore[union-attr,index]
        print(f"{threads:>7} median unix/tcp {statistics.median(ratios):.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
