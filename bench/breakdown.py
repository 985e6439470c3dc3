"""Where the time of one value goes: the cost of each piece of the data path, per value size.

    python bench/breakdown.py [--sizes 1MiB,4MiB,16MiB,64MiB]

Measured in one process, each piece alone (medians of repeated runs), for values taken from a
pre-faulted pool larger than the CPU caches:
  socket   loopback transfer of the value (sendall -> recv_into MSG_WAITALL, other thread)
  memcpy   one copy of the value (what the kernel does twice per transfer)
  xxh3     the default checksum (xxh3-128), once per value on each side
  blake3   the keyed BLAKE3 option (integrity: blake3)
  frame    encode + verify one request frame (HMAC-SHA256 over header + meta), per batch
  fault    first touch of fresh memory (what a node without buffer reuse would pay per PUT)
Prints microseconds per value and the share of a PUT/GET each piece represents, writes
bench/out/breakdown.json and breakdown.png (stacked bars).
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from memkv import protocol as p
from memkv.benchmark import fill_pattern, prefaulted_pool
from memkv.config import format_size, parse_size
from memkv.integrity import Checksummer
from memkv.protocol import ChecksumAlgo

OUT = Path(__file__).resolve().parent / "out"
POOL_BYTES = 512 << 20


def timed(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def socket_pair():
    lsock = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(lsock.getsockname())
    server, _ = lsock.accept()
    lsock.close()
    return client, server


def measure(value_bytes: int, reps: int) -> dict:
    n = max(1, POOL_BYTES // value_bytes)
    src = memoryview(prefaulted_pool(n * value_bytes))
    dst = memoryview(prefaulted_pool(n * value_bytes))
    for i in range(n):
        fill_pattern(src[i * value_bytes : (i + 1) * value_bytes], i)
    vals = [src[i * value_bytes : (i + 1) * value_bytes] for i in range(n)]
    outs = [dst[i * value_bytes : (i + 1) * value_bytes] for i in range(n)]
    key = os.urandom(32)
    cs_x = Checksummer(key, ChecksumAlgo.XXH3_128)
    cs_b = Checksummer(key, ChecksumAlgo.BLAKE3_KEYED)

    def per_value(fn) -> float:
        return timed(lambda: [fn(i) for i in range(n)], reps) / n * 1e6

    def copy(i):
        outs[i][:] = vals[i]

    tx, rx = socket_pair()

    def receiver():
        for _ in range(reps * n):
            got = 0
            view = outs[0]
            while got < value_bytes:
                got += rx.recv_into(view[got:], value_bytes - got, socket.MSG_WAITALL)

    th = threading.Thread(target=receiver, daemon=True)
    th.start()
    sock_us = timed(lambda: [tx.sendall(v) for v in vals], reps) / n * 1e6
    th.join(60)
    tx.close()
    rx.close()

    codec_a = p.FrameCodec(b"a" * 32, b"b" * 32, p.Limits(max_payload_bytes=1 << 31))
    codec_b = p.FrameCodec(b"b" * 32, b"a" * 32, p.Limits(max_payload_bytes=1 << 31))
    item = p.PutItem(b"model_0123456789ab/b16777216/0/" + b"f" * 64, value_bytes, 1, bytes(32))

    def frame():
        data = codec_a.encode(p.PutRequest((item,)))
        header = codec_b.parse_header(data[: p.FRAME_PREFIX_BYTES])
        codec_b.open(header, data[: p.FRAME_PREFIX_BYTES], data[p.FRAME_PREFIX_BYTES :])

    frame_us = timed(lambda: [frame() for _ in range(200)], 3) / 200 * 1e6

    def fault():
        m = mmap.mmap(-1, value_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mv = memoryview(m)
        mv[:] = vals[0]
        mv.release()
        m.close()

    fault_us = timed(fault, reps) * 1e6
    return {
        "value_bytes": value_bytes,
        "us": {
            "socket": sock_us,
            "memcpy": per_value(copy),
            "xxh3": per_value(lambda i: cs_x.compute(vals[i])),
            "blake3": per_value(lambda i: cs_b.compute(vals[i])),
            "frame": frame_us,
            "fault+copy": fault_us,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1MiB,4MiB,16MiB,64MiB")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rows = [measure(parse_size(s, "--sizes"), args.reps) for s in args.sizes.split(",")]
    result = {
        "benchmark": "breakdown",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "rows": rows,
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "breakdown.json").write_text(json.dumps(result, indent=2))
    names = list(rows[0]["us"])
    print(f"microseconds per value -- {result['machine']}")
    print(f"{'value':>7} " + " ".join(f"{n:>11}" for n in names) + f" {'xxh3/socket':>12}")
    for r in rows:
        u = r["us"]
        print(
            f"{format_size(r['value_bytes']):>7} "
            + " ".join(f"{u[n]:>11.0f}" for n in names)
            + f" {u['xxh3'] / u['socket']:>12.2f}"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [format_size(r["value_bytes"]) for r in rows]
        # A GET's CPU path as shipped: socket transfer + one xxh3 verify + one frame each way.
        bottom = [0.0] * len(rows)
        for piece, color in (("socket", "#4c72b0"), ("xxh3", "#dd8452"), ("frame", "#55a868")):
            per_mib = [r["us"][piece] * (2 if piece == "frame" else 1) / (r["value_bytes"] / 2**20) for r in rows]
            ax.bar(labels, per_mib, bottom=bottom, color=color, label=piece if piece != "frame" else "2 frames (HMAC)")
            bottom = [b + v for b, v in zip(bottom, per_mib)]
        ax.set_ylabel("microseconds per MiB")
        ax.set_title("Where a GET's time goes (loopback, one thread)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(OUT / "breakdown.png", dpi=110)
    except ImportError:
        print("(matplotlib not installed: no plot)")


if __name__ == "__main__":
    main()
