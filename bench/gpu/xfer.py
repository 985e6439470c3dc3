#!/usr/bin/env python3
"""MemKV -> pinned host memory transfer on the GPU host, outside vLLM: what the tier's data path
can do in one process, with and without a GIL-holding "engine loop" thread beside it.

It explains the MemKV->pool stage of bench/gpu/ttft.py's promotion breakdown. Starts --nodes
`memkv serve` nodes on loopback, stores --values values of --value-mib MiB from a pinned
buffer (torch pin_memory, like vLLM's CPU pool; a pre-faulted mmap without torch), then reads
them back the way the tier's load path does: a job cut into tasks of `blocks_per_op` keys, run
on `threads` threads, each task one `Client.batch_get_into` (checksum verified per value).

Variants (--variants, comma separated): THREADSxBLOCKS_PER_OP[:flag...] with flags
  busy       a Python thread spinning beside the transfer (vLLM's engine loop holds the GIL the
             same way while a promotion is in flight: in-process it steps the scheduler in a loop)
  noverify   receive without hashing (monkeypatched, to price the xxh3 verification)
  si<ms>     sys.setswitchinterval(<ms> / 1000) for that variant
  c<MiB>     receive/verify chunk of the client (patched; the client's default is 16 MiB)
--transport rdma: loads over MemKV's RDMA transport (NIXL/UCX; on a host without a NIC set
UCX_TLS=cma,tcp,self: the node writes into the pinned buffer with process_vm_writev); the pinned
buffer is registered with Client.register_pool like the tier's CPU pool. The TCP-only flags
(noverify, c<MiB>) do not apply then.
Also times one host->GPU copy of the whole buffer (pinned, non_blocking): the pool->GPU ceiling.

Usage: PYTHONPATH=src:... python3 bench/gpu/xfer.py --out-dir $OUT
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import mmap
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ttft import host_info, log, node_counters, start_nodes, stop_nodes


def alloc(nbytes: int, how: str = "torch"):
    """The destination buffer: `torch` pinned (vLLM's CPU pool; a pre-faulted mmap without torch),
    or an anonymous mmap with 4 KiB pages (`mmap`) or transparent huge pages (`thp`): over UCX cma
    the node pins the destination's pages for each write, so their size may price the write."""
    if how == "torch":
        try:
            import torch

            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return t, memoryview(t.numpy()), "torch pinned"
        except Exception as exc:
            log(f"pinned alloc failed ({exc!r}); using a pre-faulted mmap")
            how = "mmap"
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE if how == "thp" else mmap.MADV_NOHUGEPAGE)
    view = memoryview(m)
    zeros = bytes(1 << 21)
    for off in range(0, nbytes, len(zeros)):  # fault every page in now, not during the timed reads
        n = min(len(zeros), nbytes - off)
        view[off : off + n] = zeros[:n]
    return m, view, f"mmap ({how}; AnonHugePages {anon_huge_kib()} KiB)"


def anon_huge_kib() -> int:
    """This process's AnonHugePages (whether THP took), from /proc/self/smaps_rollup."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--values", type=int, default=512)
    ap.add_argument("--value-mib", type=int, default=16)
    ap.add_argument("--pool-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--variants",
        default="16x4,16x4:noverify,16x4:c4,16x4:busy,16x4:busy:noverify,16x4:busy:c4,"
        "16x4:busy:c16,16x4:busy:si0.5,16x1:busy,32x4:busy:c4",
    )
    ap.add_argument("--transport", default="tcp", choices=["tcp", "rdma"], help="MEMKV_TRANSPORT of client and nodes")
    ap.add_argument(
        "--alloc",
        default="torch",
        choices=["torch", "mmap", "thp"],
        help="destination buffer: torch pinned (vLLM's pool), mmap with 4 KiB pages, or THP",
    )
    ap.add_argument("--tag", default="", help="output name: xfer-<transport>[-<tag>].json (several runs in one call)")
    ap.add_argument("--state-dir", default="/tmp/xfer-state")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "bench/out"))
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    vb = args.value_mib << 20
    total = vb * args.values
    result = {
        "host": host_info(),
        "args": vars(args),
        "variants": [],
        "env": {
            k: os.environ.get(k)
            for k in ("UCX_TLS", "UCX_NET_DEVICES", "MEMKV_NIXL_SYNC", "MEMKV_NIXL_WORKERS", "MEMKV_RDMA_PIPELINE_MB")
        },
    }

    os.environ["MEMKV_TRANSPORT"] = args.transport  # nodes inherit it
    capacity = max((total // args.nodes) * 3 // 2, 4 * vb)
    state = start_nodes(args.nodes, f"{capacity >> 20}MiB", f"{args.value_mib}MiB", args.state_dir, [])
    try:
        cfg = os.path.join(args.state_dir, "client.yaml")
        with open(cfg, "w") as f:
            f.write(f"pool_size: {args.pool_size}\nio_timeout_s: 30\n")
        os.environ.update(
            MEMKV_SERVERS=",".join(n["address"] for n in state["nodes"]), MEMKV_AUTH_KEY=state["key"], MEMKV_CONFIG=cfg
        )
        from memkv.client.cluster import Client
        from memkv.sockio import recv_exactly_into
        from memkv.transport import stream as streammod

        client = Client.from_env()
        t = time.perf_counter()
        owner, buf, kind = alloc(total, args.alloc)
        result["buffer"] = kind
        rows = [buf[i * vb : (i + 1) * vb] for i in range(args.values)]
        rows[0][:] = os.urandom(vb)
        for i in range(1, args.values):
            rows[i][:] = rows[0]
            rows[i][:8] = i.to_bytes(8, "little")
        result["alloc_fill_s"] = time.perf_counter() - t
        if args.transport == "rdma":
            t = time.perf_counter()
            registered = client.register_pool(buf)
            result["rdma"] = {
                "registered": registered,
                "has_rdma": client.has_rdma(),
                "register_s": time.perf_counter() - t,
                "UCX_TLS": os.environ.get("UCX_TLS"),
            }
            log(f"rdma: pool registered={registered} has_rdma={client.has_rdma()} UCX_TLS={os.environ.get('UCX_TLS')}")
        keys = [f"xfer/{i}".encode() for i in range(args.values)]

        def chunks(bpo):
            return [list(range(lo, min(lo + bpo, args.values))) for lo in range(0, args.values, bpo)]

        t = time.perf_counter()
        with cf.ThreadPoolExecutor(16) as ex:
            ok = sum(
                sum(r) for r in ex.map(lambda ch: client.batch_put_views([(keys[i], rows[i]) for i in ch]), chunks(4))
            )
        dt = time.perf_counter() - t
        result["put"] = {"seconds": dt, "gbps": total / dt / 1e9, "stored": ok}
        log(f"put {ok}/{args.values} values: {total / dt / 1e9:.1f} GB/s ({kind} buffer)")

        # Host -> GPU ceiling for the same bytes (what vLLM's pool -> GPU stage moves).
        try:
            import torch

            if owner is not None and torch.cuda.is_available():
                dst = torch.empty(total, dtype=torch.uint8, device="cuda")
                for _rep in range(2):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    dst.copy_(owner, non_blocking=True)
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t
                    result.setdefault("h2d", []).append({"seconds": dt, "gbps": total / dt / 1e9})
                    log(f"host->GPU copy of {total >> 30} GiB: {total / dt / 1e9:.1f} GB/s")
                del dst
        except Exception as exc:
            result["h2d_error"] = repr(exc)

        orig_recv = streammod.SocketStream._recv_verified
        default_chunk = streammod._VERIFY_CHUNK

        def recv_noverify(self, view, *args, **kwargs):  # the client's signature may grow (deadline)
            with self.conn.io("read"):
                recv_exactly_into(self.conn.sock, view)
            return True

        for spec in filter(None, args.variants.split(",")):
            head, *flags = spec.split(":")
            threads, bpo = (int(x) for x in head.split("x"))
            si = next((float(f[2:]) for f in flags if f.startswith("si")), None)
            streammod.SocketStream._recv_verified = recv_noverify if "noverify" in flags else orig_recv
            chunk = next((int(f[1:]) for f in flags if f.startswith("c") and f[1:].isdigit()), None)
            streammod._VERIFY_CHUNK = (chunk << 20) if chunk else default_chunk
            sys.setswitchinterval((si or 5.0) / 1000)
            stop = threading.Event()
            spins = [0]

            def spin(stop=stop, spins=spins):  # bound now: run and joined within this iteration
                n = 0
                while not stop.is_set():
                    for _ in range(200):
                        n += 1
                spins[0] = n

            busy = threading.Thread(target=spin, daemon=True) if "busy" in flags else None
            if busy:
                busy.start()
            times = []
            admin = [n["admin"] for n in state["nodes"]]
            with cf.ThreadPoolExecutor(threads) as ex:
                list(ex.map(lambda i: None, range(threads)))  # threads up before timing
                # CPU seconds of the nodes and of this (client) process over the timed reps: where
                # the cores go per GiB moved (issue 16 item 2: RDMA over cma moves the copy to the node)
                node_cpu0, client_cpu0 = node_counters(admin)["cpu_s"], time.process_time()
                for _rep in range(args.reps):
                    t = time.perf_counter()
                    res = list(ex.map(lambda ch: client.batch_get_into([(keys[i], rows[i]) for i in ch]), chunks(bpo)))
                    dt = time.perf_counter() - t
                    got = sum(sum(r) for r in res)
                    if got != args.values:
                        log(f"{spec}: only {got}/{args.values} values loaded")
                    times.append(dt)
                node_cpu, client_cpu = node_counters(admin)["cpu_s"] - node_cpu0, time.process_time() - client_cpu0
            stop.set()
            if busy:
                busy.join()
            streammod.SocketStream._recv_verified = orig_recv
            streammod._VERIFY_CHUNK = default_chunk
            sys.setswitchinterval(0.005)
            best = min(times)
            rec = {
                "variant": spec,
                "threads": threads,
                "blocks_per_op": bpo,
                "flags": flags,
                "seconds": times,
                "gbps_best": total / best / 1e9,
                "gbps_median": total / statistics.median(times) / 1e9,
                "node_cpu_s_per_gib": node_cpu / (args.reps * total / 2**30),
                "client_cpu_s_per_gib": client_cpu / (args.reps * total / 2**30),
            }
            result["variants"].append(rec)
            log(
                f"{spec:<24} {total >> 30} GiB in "
                + " / ".join(f"{x:.3f}" for x in times)
                + f" s  -> {rec['gbps_median']:.1f} GB/s (median); CPU s/GiB nodes {rec['node_cpu_s_per_gib']:.3f}"
                + f" client {rec['client_cpu_s_per_gib']:.3f}"
            )
        client.close()
    finally:
        stop_nodes(state)
        with open(
            os.path.join(args.out_dir, f"xfer-{args.transport}{'-' + args.tag if args.tag else ''}.json"), "w"
        ) as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
