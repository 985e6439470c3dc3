"""Node memory: RSS against stored bytes while filling a node to capacity, per value size.

    python bench/memory.py [--capacity 2GiB] [--sizes 1MiB,4MiB,16MiB,64MiB]

For each value size a fresh node is started and filled with 1.5x its capacity (so it evicts);
RSS (VmRSS of the node process) is sampled after every batch. The baseline is the same node's
RSS before the first value (the interpreter and its libraries). Target: RSS <= 1.05 x stored
bytes + 64 MiB. Results: bench/out/memory.json (+ memory.png when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from memkv.benchmark import fill_pattern, prefaulted_pool
from memkv.client.cluster import Client
from memkv.config import AuthKey, ClientConfig, format_size, parse_servers, parse_size
from memkv.local import LocalNode, new_key_hex

OUT = Path(__file__).resolve().parent / "out"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def status(node: LocalNode) -> dict:
    with urllib.request.urlopen(node.admin_url + "/v1/status", timeout=5) as r:
        return json.load(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", default="2GiB")
    ap.add_argument("--sizes", default="1MiB,4MiB,16MiB,64MiB")
    args = ap.parse_args()
    capacity = parse_size(args.capacity, "--capacity")
    key = new_key_hex()
    rows = []
    for size_text in args.sizes.split(","):
        value_bytes = parse_size(size_text, "--sizes")
        node = LocalNode(key, capacity=str(capacity))
        try:
            config = ClientConfig(servers=parse_servers(node.address, "bench"), auth_key=AuthKey.from_hex(key, "bench"))
            base_rss = rss_bytes(node.pid)
            n_values = int(capacity * 1.5 // value_bytes)
            batch = max(1, (256 << 20) // value_bytes)
            src = memoryview(prefaulted_pool(value_bytes * batch))
            for i in range(batch):
                fill_pattern(src[i * value_bytes : (i + 1) * value_bytes], i)
            samples = []
            with Client(config) as client:
                for start in range(0, n_values, batch):
                    items = [
                        (f"m/{start + j}".encode(), src[j * value_bytes : (j + 1) * value_bytes])
                        for j in range(min(batch, n_values - start))
                    ]
                    client.batch_put_views(items)
                    s = status(node)
                    samples.append(
                        {
                            "stored": s["stored_bytes"],
                            "allocated": s["allocated_bytes"],
                            "rss": rss_bytes(node.pid),
                            "evictions": s["evictions"],
                        }
                    )
            peak = max(samples, key=lambda x: x["rss"])
            worst = max(samples, key=lambda x: (x["rss"] - base_rss) / max(1, x["stored"]))
            rows.append(
                {
                    "value_bytes": value_bytes,
                    "capacity_bytes": capacity,
                    "baseline_rss": base_rss,
                    "peak_rss": peak["rss"],
                    "stored_at_peak": peak["stored"],
                    "final": samples[-1],
                    "samples": samples,
                    "rss_over_stored_final": (samples[-1]["rss"] - base_rss) / samples[-1]["stored"],
                    "target_ok": all(x["rss"] <= 1.05 * x["stored"] + (64 << 20) + base_rss for x in samples),
                    "worst_ratio": (worst["rss"] - base_rss) / max(1, worst["stored"]),
                }
            )
        finally:
            node.stop()
    result = {
        "benchmark": "memory",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "rows": rows,
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "memory.json").write_text(json.dumps(result, indent=2))
    print(f"node RSS vs stored bytes, capacity {format_size(capacity)} -- {result['machine']}")
    print(
        f"{'value':>7} {'base RSS':>9} {'final stored':>13} {'final RSS':>10} {'(RSS-base)/stored':>18} {'<=1.05x+64MiB':>14}"
    )
    for r in rows:
        f = r["final"]
        print(
            f"{format_size(r['value_bytes']):>7} {format_size(r['baseline_rss']):>9} {format_size(f['stored']):>13} "
            f"{format_size(f['rss']):>10} {r['rss_over_stored_final']:>18.3f} {r['target_ok']!s:>14}"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for r in rows:
            ax.plot(
                [x["stored"] / 2**30 for x in r["samples"]],
                [(x["rss"] - r["baseline_rss"]) / 2**30 for x in r["samples"]],
                marker=".",
                label=format_size(r["value_bytes"]),
            )
        lim = capacity / 2**30
        ax.plot([0, lim], [0, lim * 1.05], "k--", label="1.05 x stored")
        ax.set_xlabel("stored GiB")
        ax.set_ylabel("node RSS above baseline, GiB")
        ax.set_title("memkv node memory while filling to capacity")
        ax.legend()
        fig.tight_layout()
        fig.savefig(OUT / "memory.png", dpi=110)
    except ImportError:
        print("(matplotlib not installed: no plot)")


if __name__ == "__main__":
    main()
