"""Data path ceiling: 16 MiB values through memkv.Client vs a raw Python socket, same run.

    python bench/datapath.py [--value-size 16MiB] [--values 32] [--threads 2] [--reps 5]

The baseline is the fastest plain Python design measured on this machine
(../shared/ref/limits.md): a blocking socket per thread, `sendall(memoryview)` of a slot of a
pre-faulted pool, `recv_into` a slot of the server's pre-faulted pool, one ack byte per value.
It has no framing, no authentication, no checksums and no store: what MemKV adds costs the
difference. Both run in each repetition, interleaved, against server processes on 127.0.0.1;
the ratio is taken per repetition (the host drifts between a fast and a slow state) and the
median is printed. Results: bench/out/datapath.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from memkv.benchmark import fill_pattern, prefaulted_pool  # noqa: E402
from memkv.client.cluster import Client  # noqa: E402
from memkv.config import AuthKey, ClientConfig, format_size, parse_servers, parse_size  # noqa: E402
from memkv.local import LocalNode, new_key_hex  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
_REQ = struct.Struct(">cI")  # op b"P"/b"G", slot


# -- the raw baseline -------------------------------------------------------------------------------


def raw_server(port_file: str, value_bytes: int, slots: int) -> None:
    pool = memoryview(prefaulted_pool(value_bytes * slots))
    lsock = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(lsock.getsockname()[1]))

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hdr = bytearray(_REQ.size)
        with conn:
            while True:
                n = conn.recv_into(hdr)
                if n == 0:
                    return
                while n < len(hdr):
                    n += conn.recv_into(memoryview(hdr)[n:])
                op, slot = _REQ.unpack(hdr)
                view = pool[slot * value_bytes : (slot + 1) * value_bytes]
                if op == b"P":
                    got = 0
                    while got < value_bytes:
                        got += conn.recv_into(view[got:])
                    conn.sendall(b"k")
                else:
                    conn.sendall(view)

    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


class RawClient:
    def __init__(self, port: int, threads: int) -> None:
        self._local = threading.local()
        self.port = port

    def _sock(self) -> socket.socket:
        s = getattr(self._local, "sock", None)
        if s is None:
            s = socket.create_connection(("127.0.0.1", self.port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.sock = s
        return s

    def put(self, slot: int, view: memoryview) -> None:
        s = self._sock()
        s.sendall(_REQ.pack(b"P", slot))
        s.sendall(view)
        assert s.recv(1) == b"k"

    def get(self, slot: int, view: memoryview) -> None:
        s = self._sock()
        s.sendall(_REQ.pack(b"G", slot))
        got = 0
        while got < len(view):
            got += s.recv_into(view[got:])


# -- the run ----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--value-size", default="16MiB")
    ap.add_argument("--values", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--blocks-per-op", type=int, default=1, help="values per client batch call")
    ap.add_argument("--raw-server", nargs=2, metavar=("PORT_FILE", "SLOTS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    value_bytes = parse_size(args.value_size, "--value-size")
    if args.raw_server:
        raw_server(args.raw_server[0], value_bytes, int(args.raw_server[1]))
        return

    n = args.values
    port_file = OUT / f"raw-{os.getpid()}.port"
    OUT.mkdir(exist_ok=True)
    raw = subprocess.Popen([sys.executable, __file__, "--value-size", str(value_bytes), "--raw-server", str(port_file), str(n)])
    key = new_key_hex()
    capacity = str(int(value_bytes * n * 1.3 / args.nodes) + (64 << 20))
    nodes = [LocalNode(key, capacity=capacity) for _ in range(args.nodes)]
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline:
                raise RuntimeError("raw baseline server did not start")
            time.sleep(0.05)
        rawc = RawClient(int(port_file.read_text()), args.threads)
        config = ClientConfig(servers=parse_servers(",".join(x.address for x in nodes), "bench"),
                              auth_key=AuthKey.from_hex(key, "bench"))
        client = Client(config)
        src = memoryview(prefaulted_pool(value_bytes * n))
        dst = memoryview(prefaulted_pool(value_bytes * n))
        for i in range(n):
            fill_pattern(src[i * value_bytes : (i + 1) * value_bytes], i)
        keys = [f"bench/{i}".encode() for i in range(n)]
        slot = lambda v, i: v[i * value_bytes : (i + 1) * value_bytes]  # noqa: E731
        per_thread = [list(range(t, n, args.threads)) for t in range(args.threads)]
        bpo = args.blocks_per_op

        def batches(idx):
            return [idx[j : j + bpo] for j in range(0, len(idx), bpo)]

        ops = {
            "raw put": lambda idx: [rawc.put(i, slot(src, i)) for i in idx],
            "memkv put": lambda idx: [client.batch_put_views([(keys[i], slot(src, i)) for i in b]) for b in batches(idx)],
            "raw get": lambda idx: [rawc.get(i, slot(dst, i)) for i in idx],
            "memkv get": lambda idx: [client.batch_get_into([(keys[i], slot(dst, i)) for i in b]) for b in batches(idx)],
        }
        rates: dict[str, list[float]] = {name: [] for name in ops}
        with concurrent.futures.ThreadPoolExecutor(args.threads) as ex:
            for name, fn in ops.items():  # warm-up: connections, first-touch of server memory
                list(ex.map(fn, per_thread))
            for rep in range(args.reps):
                for name, fn in ops.items():
                    t = time.perf_counter()
                    list(ex.map(fn, per_thread))
                    rates[name].append(value_bytes * n / (time.perf_counter() - t) / 1e9)
                    if name == "memkv get":
                        assert bytes(dst[:4096]) == bytes(src[:4096]) and dst == src, "memkv get returned wrong bytes"
        client.close()
    finally:
        raw.kill()
        for x in nodes:
            x.stop()
        port_file.unlink(missing_ok=True)

    ratio = {op: [m / r for m, r in zip(rates[f"memkv {op}"], rates[f"raw {op}"])] for op in ("put", "get")}
    result = {
        "benchmark": "datapath",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "value_bytes": value_bytes, "values": n, "threads": args.threads, "nodes": args.nodes,
        "blocks_per_op": bpo, "reps": args.reps,
        "gbps": {k: v for k, v in rates.items()},
        "ratio_memkv_over_raw": ratio,
    }
    (OUT / "datapath.json").write_text(json.dumps(result, indent=2))
    print(f"{format_size(value_bytes)} values x {n}, {args.threads} threads, {args.nodes} node(s), "
          f"{bpo} per batch, {args.reps} reps -- {result['machine']}")
    print(f"{'op':<10} {'raw GB/s':>10} {'memkv GB/s':>11} {'memkv/raw':>10}   (medians; ratio per rep: min-max)")
    for op in ("put", "get"):
        r = ratio[op]
        print(f"{op:<10} {statistics.median(rates['raw ' + op]):>10.2f} {statistics.median(rates['memkv ' + op]):>11.2f} "
              f"{statistics.median(r):>10.2f}   ({min(r):.2f}-{max(r):.2f})")


if __name__ == "__main__":
    main()
