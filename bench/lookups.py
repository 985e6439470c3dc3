"""Batched `exists` latency: 64, 256, 512 and 4096 keys over 1 and 3 nodes, p50/p99.

    python bench/lookups.py [--iters 300]

Baseline measured in the same run: a 100-byte request/reply round trip on a raw Python socket
(the floor of any lookup on this machine: 14-55 us depending on vCPU placement). Half of the
keys exist. Results: bench/out/lookups.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from memkv.client.cluster import Client
from memkv.config import AuthKey, ClientConfig, parse_servers
from memkv.local import LocalNode, new_key_hex

OUT = Path(__file__).resolve().parent / "out"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def raw_round_trip_us(iters: int) -> list[float]:
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = lsock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(100):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    c = socket.create_connection(lsock.getsockname())
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = []
    msg = b"x" * 100
    for _ in range(iters):
        t = time.perf_counter()
        c.sendall(msg)
        got = 0
        while got < 100:
            got += len(c.recv(100 - got))
        out.append((time.perf_counter() - t) * 1e6)
    c.close()
    lsock.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    key = new_key_hex()
    nodes = [LocalNode(key, capacity="128MiB") for _ in range(3)]
    rows = []
    try:
        raw = raw_round_trip_us(args.iters)
        for n_nodes in (1, 3):
            config = ClientConfig(
                servers=parse_servers(",".join(x.address for x in nodes[:n_nodes]), "bench"),
                auth_key=AuthKey.from_hex(key, "bench"),
            )
            with Client(config) as client:
                stored = [f"lk/{i}".encode() for i in range(2048)]
                client.batch_put_views([(k, b"v") for k in stored])
                for n_keys in (64, 256, 512, 4096):
                    keys = [f"lk/{i}".encode() for i in range(0, 2 * n_keys, 2)]  # half exist
                    for _ in range(20):
                        client.exists(keys)  # warm-up: connections, branch caches
                    lat = []
                    for _ in range(args.iters):
                        t = time.perf_counter()
                        client.exists(keys)
                        lat.append((time.perf_counter() - t) * 1e6)
                    rows.append(
                        {
                            "nodes": n_nodes,
                            "keys": n_keys,
                            "p50_us": statistics.median(lat),
                            "p99_us": pct(lat, 0.99),
                            "p50_over_raw_rtt": statistics.median(lat) / statistics.median(raw),
                        }
                    )
    finally:
        for x in nodes:
            x.stop()
    result = {
        "benchmark": "lookups",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "raw_rtt_us": {"p50": statistics.median(raw), "p99": pct(raw, 0.99)},
        "rows": rows,
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "lookups.json").write_text(json.dumps(result, indent=2))
    print(f"batched exists, {args.iters} iterations -- {result['machine']}")
    print(f"raw 100 B round trip: p50 {result['raw_rtt_us']['p50']:.0f} us, p99 {result['raw_rtt_us']['p99']:.0f} us")
    print(f"{'nodes':>5} {'keys':>6} {'p50 us':>8} {'p99 us':>8} {'p50/raw rtt':>12}")
    for r in rows:
        print(f"{r['nodes']:>5} {r['keys']:>6} {r['p50_us']:>8.0f} {r['p99_us']:>8.0f} {r['p50_over_raw_rtt']:>12.1f}")


if __name__ == "__main__":
    main()
