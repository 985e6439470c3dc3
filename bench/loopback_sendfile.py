"""Would a node's GET reply cost less CPU sent with os.sendfile from a memfd than with sendall?

Issue 16 item 4 asks for 16 MiB GETs at 0.9x a raw socket on a 2-core machine where both ends
are CPU-bound, so every CPU-second per GB counts. Raw and MemKV both pay two kernel copies per
byte (sender's buffer -> socket, socket -> receiver's buffer); sendfile from a page-cache
(memfd) buffer would, in principle, hand the pages to the socket without the first one. This
measures it on loopback, the path the data-path benchmark uses: one sender process, one
receiving process (recv_into a reused buffer), a one-byte ack per value as a GET's reply
cycle, the two modes alternating. Prints GB/s and CPU-seconds per GB (both processes).

    python3 bench/loopback_sendfile.py [--values 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import time

SIZE = 16 << 20


def _receiver(port: int, values: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    view = memoryview(bytearray(SIZE))
    for _ in range(values):
        got = 0
        while got < SIZE:
            n = sock.recv_into(view[got:], SIZE - got)
            if not n:
                os._exit(1)
            got += n
        sock.sendall(b"k")
    os._exit(0)


def measure(mode: str, values: int) -> dict[str, float]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    pid = os.fork()
    if pid == 0:
        _receiver(listener.getsockname()[1], values)
    conn, _ = listener.accept()
    fd = os.memfd_create("memkv-bench-value")
    os.ftruncate(fd, SIZE)
    value = mmap.mmap(fd, SIZE)
    value.write(os.urandom(4096) * (SIZE // 4096))  # pre-faulted, as a store buffer is
    view = memoryview(value)
    t0, r0 = time.perf_counter(), os.times()
    for _ in range(values):
        if mode == "sendall":
            conn.sendall(view)
        else:
            sent = 0
            while sent < SIZE:
                sent += os.sendfile(conn.fileno(), fd, sent, SIZE - sent)
        if conn.recv(1) != b"k":
            raise SystemExit("receiver went away")
    _, status = os.waitpid(pid, 0)  # children's CPU is in os.times() only after the wait
    t1, r1 = time.perf_counter(), os.times()
    if status != 0:
        raise SystemExit(f"receiver failed ({status})")
    view.release()
    value.close()
    os.close(fd)
    conn.close()
    listener.close()
    cpu = sum(b - a for a, b in zip(r0[:4], r1[:4], strict=True))
    gb = SIZE * values / 1e9
    return {"gb_s": gb / (t1 - t0), "cpu_s_per_gb": cpu / gb}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--values", type=int, default=64, help="16 MiB values per measurement (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating sendall/sendfile rounds (default 3)")
    args = ap.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"sendall": [], "sendfile": []}
    for _ in range(args.rounds):
        for mode in rows:
            rows[mode].append(measure(mode, args.values))
    out = {"loadavg": os.getloadavg(), "values": args.values}
    for mode, runs in rows.items():
        out[mode] = {k: statistics.median(r[k] for r in runs) for k in ("gb_s", "cpu_s_per_gb")}
    out["sendfile_over_sendall"] = {
        "speed": out["sendfile"]["gb_s"] / out["sendall"]["gb_s"],
        "cpu_per_gb": out["sendfile"]["cpu_s_per_gb"] / out["sendall"]["cpu_s_per_gb"],
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
