"""Lookup latency on a node that is absorbing a burst of 16 MiB PUTs, against the same node idle.

    python bench/lookups_under_puts.py [--probes 40] [--put-threads 16] [--rounds 3]

One real `memkv serve` node on loopback. A probe in its own process (an idle client, as another
engine would be) times, every 50 ms: EXISTS on its pooled connection, and connect + handshake +
EXISTS on a new client. Baseline in the same run: the same probe while the node is idle. Then
the probe again while this process PUTs `--rounds` x 64 values of 16 MiB from `--put-threads`
threads (the cascade of a 32k prompt's stores into one node). Prints p50 / p99 / max and the
burst / idle ratio; bounded by the probe count and the rounds. Results: bench/out/lookups_under_puts.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from memkv.client.cluster import Client  # noqa: E402
from memkv.config import AuthKey, ClientConfig, parse_servers  # noqa: E402
from memkv.local import LocalNode, new_key_hex  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
VALUE = 16 << 20
VALUES = 64

PROBE = """
import json, sys, time
from memkv.client.cluster import Client
from memkv.config import AuthKey, ClientConfig, parse_servers
address, key, probes = sys.argv[1], sys.argv[2], int(sys.argv[3])
def config():
    return ClientConfig(servers=parse_servers(address, "bench"), auth_key=AuthKey.from_hex(key, "bench"))
pooled, fresh = [], []
with Client(config()) as client:
    client.exists([b"probe"])
    print("ready", flush=True)
    for _ in range(probes):
        t = time.perf_counter(); client.exists([b"probe"]); pooled.append(time.perf_counter() - t)
        t = time.perf_counter()
        with Client(config()) as other:
            other.exists([b"probe"])
        fresh.append(time.perf_counter() - t)
        time.sleep(0.05)
print(json.dumps({"pooled_s": pooled, "fresh_s": fresh}), flush=True)
"""


def probe(address: str, key: str, probes: int, during=None) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", PROBE, address, key, str(probes)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    extra = during() if during else None
    out, _ = proc.communicate(timeout=300)
    result = json.loads(out.strip().splitlines()[-1])
    if extra is not None:
        result["burst"] = extra
    return result


def summary(xs: list[float]) -> dict:
    s = sorted(xs)
    return {
        "p50_ms": 1e3 * statistics.median(s),
        "p99_ms": 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))],
        "max_ms": 1e3 * s[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probes", type=int, default=40)
    ap.add_argument("--put-threads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    key = new_key_hex()
    node = LocalNode(key, capacity=f"{VALUES * VALUE * 3 // 2 >> 20}MiB")
    try:
        config = ClientConfig(
            servers=parse_servers(node.address, "bench"),
            auth_key=AuthKey.from_hex(key, "bench"),
            pool_size=args.put_threads,
            io_timeout_s=30.0,
        )
        buf = mmap.mmap(-1, VALUES * VALUE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        rows = [memoryview(buf)[i * VALUE : (i + 1) * VALUE] for i in range(VALUES)]
        keys = [f"burst/{i}".encode() for i in range(VALUES)]
        with Client(config) as writer:
            writer.probe()

            def burst() -> dict:
                t, stored = time.perf_counter(), 0
                groups = [list(range(lo, lo + 4)) for lo in range(0, VALUES, 4)]
                with cf.ThreadPoolExecutor(args.put_threads) as ex:
                    for _ in range(args.rounds):
                        for ok in ex.map(lambda g: writer.batch_put_views([(keys[i], rows[i]) for i in g]), groups):
                            stored += sum(ok)
                dt = time.perf_counter() - t
                return {"seconds": dt, "stored": stored, "of": args.rounds * VALUES, "gbps": stored * VALUE / dt / 1e9}

            idle = probe(node.address, key, args.probes)
            busy = probe(node.address, key, args.probes, during=burst)
    finally:
        node.stop()
    result = {
        "benchmark": "lookups_under_puts",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "args": vars(args),
        "idle": idle,
        "busy": busy,
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "lookups_under_puts.json").write_text(json.dumps(result, indent=1))
    b = busy["burst"]
    print(f"lookups on a node absorbing 16 MiB PUTs -- {result['machine']} -- {result['date']}")
    print(
        f"burst: {b['stored']}/{b['of']} values stored in {b['seconds']:.2f} s ({b['gbps']:.2f} GB/s), "
        f"{args.put_threads} threads; {args.probes} probe samples each, idle and while the burst ran"
    )
    print(f"{'':36} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}   busy/idle: p50, max")
    for what, name in (("pooled_s", "EXISTS, pooled connection"), ("fresh_s", "connect + handshake + EXISTS")):
        i, u = summary(idle[what]), summary(busy[what])
        print(f"{name + ', idle':36} {i['p50_ms']:8.2f} {i['p99_ms']:8.2f} {i['max_ms']:8.2f}")
        print(
            f"{name + ', busy':36} {u['p50_ms']:8.2f} {u['p99_ms']:8.2f} {u['max_ms']:8.2f}"
            f"   {u['p50_ms'] / i['p50_ms']:.1f}x, {u['max_ms'] / i['max_ms']:.0f}x"
        )


if __name__ == "__main__":
    main()
