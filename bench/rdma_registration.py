"""What a node pays to register one store buffer with NIXL, on this host's UCX transports.

The node registers each store buffer of 1 MiB or more as the PUT that makes it (a node started
with MEMKV_TRANSPORT=rdma), or on the buffer's first RDMA read (buffers made before NIXL came up):
this prints the cost per buffer, so a reader can see what a read would pay if registration were
still on the read path. Buffers are the store's own (`ValueBuffer`: anonymous mmap, pre-faulted).
Run with the UCX settings of the host, e.g. on a GPU host
`UCX_TLS=cma,tcp,self,cuda_copy UCX_NET_DEVICES=lo python3 bench/rdma_registration.py`.
Prints one JSON line per size; --out writes them all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from memkv.config import parse_size
from memkv.nixl_adapter import NixlAgent, buffer_address
from memkv.server.store import ValueBuffer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1MiB,16MiB", help="buffer sizes, comma-separated")
    ap.add_argument("--count", type=int, default=64, help="buffers per size")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    agent = NixlAgent("node")
    rows = []
    for size in [parse_size(s, "--sizes") for s in args.sizes.split(",")]:
        bufs = [ValueBuffer(size) for _ in range(args.count)]
        each = []
        regs = []
        for b in bufs:
            t = time.perf_counter()
            regs.append(agent.register(buffer_address(b.view), size))
            each.append(time.perf_counter() - t)
        t = time.perf_counter()
        for r in regs:
            agent.deregister(r)
        dereg = (time.perf_counter() - t) / len(regs)
        row = {
            "size": size,
            "count": args.count,
            "register_us_median": round(statistics.median(each) * 1e6, 1),
            "register_us_max": round(max(each) * 1e6, 1),
            "deregister_us_mean": round(dereg * 1e6, 1),
            "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"host": os.uname().nodename, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                       "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
