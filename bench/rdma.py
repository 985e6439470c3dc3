"""RDMA transport rows next to the TCP path: loads and the store direction, same run, same node.

    python bench/rdma.py [--value-size 16MiB] [--values 32] [--threads 2] [--blocks-per-op 8] [--reps 5] [--ucx tcp,cma]

Needs NIXL (`pip install --no-deps nixl-cu12==1.5.1 numpy`). No NIC here: NIXL runs over UCX on
loopback (UCX_NET_DEVICES=lo) with each of the two transports CI uses:
  * tcp -- `UCX_TLS=tcp`: the WRITE is emulated over a TCP socket, landed by the target's
    progress thread (the client's, for a load);
  * cma -- `UCX_TLS=cma,tcp,self`: the initiator copies with process_vm_writev (one-sided, as
    RDMA is; same host only), UCX's active messages (notifications) over tcp.
Per UCX transport, one `memkv serve` node and, interleaved in every repetition:
  * `tcp get`   -- Client(transport=tcp).batch_get_into: MemKV's TCP path (the baseline);
  * `rdma get`  -- Client(transport=rdma) with the destination pool registered: RDMA_GET, the
                   node WRITEs into the pool, the client waits for the notification and verifies
                   each checksum (the same xxh3 the TCP path verifies);
  * `tcp put`   -- Client.batch_put_views: the store path (always TCP);
  * `write put` -- the store direction the issue asks to measure: a client-initiated WRITE of
                   the same slots into node-registered memory (a helper process standing in for
                   the node), transfer only -- no allocate/commit round trip, no checksum: an
                   upper bound for "stores by client WRITE".
Ratios are per repetition against the TCP row of the same direction, median (min-max). CPU is
the client's plus the node's (or helper's) user+system seconds per GB moved.
Results: bench/out/rdma.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
# The node (`python -m memkv serve`) runs this tree's code too, not whatever the venv installed.
os.environ["PYTHONPATH"] = os.pathsep.join([sys.path[0], *filter(None, [os.environ.get("PYTHONPATH")])])

from memkv import nixl_adapter
from memkv.benchmark import fill_pattern, prefaulted_pool
from memkv.client.cluster import Client
from memkv.config import AuthKey, ClientConfig, format_size, parse_servers, parse_size
from memkv.local import LocalNode, new_key_hex

OUT = Path(__file__).resolve().parent / "out"
UCX = {"tcp": "tcp", "cma": "cma,tcp,self"}
OPS = ("tcp get", "rdma get", "tcp put", "write put")
BASELINE = {"rdma get": "tcp get", "write put": "tcp put"}


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def store_target(conn, n_bytes: int) -> None:
    """Helper process: node-side memory for the store-direction WRITE (registered, exported)."""
    agent = nixl_adapter.NixlAgent("node")
    mem = prefaulted_pool(n_bytes)
    addr = nixl_adapter.buffer_address(memoryview(mem))
    agent.register(addr, n_bytes)
    conn.send((agent.metadata(), addr))
    conn.recv()  # until the bench is done; the progress thread lands tcp-emulated writes meanwhile
    agent.close()


def run_ucx(name: str, args, value_bytes: int) -> dict:
    os.environ.update(
        {
            "UCX_TLS": UCX[name],
            "UCX_NET_DEVICES": "lo",
            "MEMKV_NIXL_PROGRESS_DELAY_US": str(args.pthr_delay_us),
            "NIXL_LOG_LEVEL": "WARN",
        }
    )
    n = args.values
    key = new_key_hex()
    node = LocalNode(key, capacity=str(int(value_bytes * n * 1.3) + (64 << 20)))
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    helper = ctx.Process(target=store_target, args=(child, value_bytes * n), daemon=True)
    helper.start()
    try:
        servers = parse_servers(node.address, "bench")
        auth = AuthKey.from_hex(key, "bench")
        tcp = Client(ClientConfig(servers=servers, auth_key=auth, transport="tcp"))
        rdma = Client(ClientConfig(servers=servers, auth_key=auth, transport="rdma"))
        src = memoryview(prefaulted_pool(value_bytes * n))
        dst_tcp = memoryview(prefaulted_pool(value_bytes * n))
        dst_rdma = memoryview(prefaulted_pool(value_bytes * n))
        for i in range(n):
            fill_pattern(src[i * value_bytes : (i + 1) * value_bytes], i)
        t = time.perf_counter()
        assert rdma.register_pool(dst_rdma), "RDMA did not come up"
        attach_ms = (time.perf_counter() - t) * 1000  # registration + first attach (the node builds its agent)
        register_ms = rdma._transport.register_ms
        # the store-direction initiator: its own agent with the source pool registered
        md, target = parent.recv()
        writer = nixl_adapter.NixlAgent("client")
        writer.register(nixl_adapter.buffer_address(src), len(src))
        peer = writer.add_peer(md)
        src_addr = nixl_adapter.buffer_address(src)

        keys = [f"bench/{i}".encode() for i in range(n)]
        slot = lambda v, i: v[i * value_bytes : (i + 1) * value_bytes]  # noqa: E731
        per_thread = [list(range(t, n, args.threads)) for t in range(args.threads)]
        bpo = args.blocks_per_op

        def batches(idx):
            return [idx[j : j + bpo] for j in range(0, len(idx), bpo)]

        def write_put(idx):
            for b in batches(idx):
                w = writer.write(
                    [(src_addr + i * value_bytes, value_bytes) for i in b],
                    [(target + i * value_bytes, value_bytes) for i in b],
                    peer,
                    b"",
                )
                while w.state() == "PROC":
                    time.sleep(20e-6)
                assert w.state() == "DONE"
                w.release()

        def checked(results):
            for r in results:
                assert all(r), "a load failed"

        ops = {
            "tcp get": lambda idx: checked(
                tcp.batch_get_into([(keys[i], slot(dst_tcp, i)) for i in b]) for b in batches(idx)
            ),
            "rdma get": lambda idx: checked(
                rdma.batch_get_into([(keys[i], slot(dst_rdma, i)) for i in b]) for b in batches(idx)
            ),
            "tcp put": lambda idx: checked(
                tcp.batch_put_views([(keys[i], slot(src, i)) for i in b]) for b in batches(idx)
            ),
            "write put": write_put,
        }
        ops["tcp put"](list(range(n)))  # the values the loads read
        rates: dict[str, list[float]] = {op: [] for op in OPS}
        cpu: dict[str, list[float]] = {op: [] for op in OPS}
        with concurrent.futures.ThreadPoolExecutor(args.threads) as ex:
            for op in OPS:  # warm-up: connections, attach, registrations, first touch
                list(ex.map(ops[op], per_thread))
            for _ in range(args.reps):
                for op in OPS:
                    other = helper.pid if op == "write put" else node.pid
                    c0, o0 = self_cpu_s(), proc_cpu_s(other)
                    t = time.perf_counter()
                    list(ex.map(ops[op], per_thread))
                    dt = time.perf_counter() - t
                    gb = value_bytes * n / 1e9
                    rates[op].append(gb / dt)
                    cpu[op].append((self_cpu_s() - c0 + proc_cpu_s(other) - o0) / gb)
        assert dst_rdma == src and dst_tcp == src, "a load returned wrong bytes"
        writer.close()
        tcp.close()
        rdma.close()
    finally:
        parent.send("done")
        helper.join(10)
        node.stop()
    ratio = {op: [a / b for a, b in zip(rates[op], rates[BASELINE[op]])] for op in BASELINE}
    return {
        "ucx_tls": UCX[name],
        "register_ms": register_ms,
        "register_and_attach_ms": attach_ms,
        "gbps": rates,
        "cpu_s_per_gb": cpu,
        "ratio_vs_tcp": ratio,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--value-size", default="16MiB")
    ap.add_argument("--values", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--blocks-per-op", type=int, default=8, help="values per batch call (the tier's default)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ucx", default="tcp,cma", help="UCX transports to run: tcp, cma or both")
    ap.add_argument(
        "--pthr-delay-us", type=int, default=100, help="NIXL progress-thread delay (MEMKV_NIXL_PROGRESS_DELAY_US)"
    )
    args = ap.parse_args()
    ok, why = nixl_adapter.nixl_available()
    if not ok:
        sys.exit(f"bench/rdma.py needs NIXL: {why}")
    value_bytes = parse_size(args.value_size, "--value-size")
    runs = {name: run_ucx(name, args, value_bytes) for name in args.ucx.split(",")}
    result = {
        "benchmark": "rdma",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}, no RDMA NIC",
        "nixl": why,
        "value_bytes": value_bytes,
        "values": args.values,
        "threads": args.threads,
        "blocks_per_op": args.blocks_per_op,
        "reps": args.reps,
        "pthr_delay_us": args.pthr_delay_us,
        "runs": runs,
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "rdma.json").write_text(json.dumps(result, indent=2))
    print(
        f"{format_size(value_bytes)} values x {args.values}, {args.threads} threads, {args.blocks_per_op} per batch, "
        f"{args.reps} reps, {why}, progress delay {args.pthr_delay_us} us -- {result['machine']}"
    )
    print(f"{'UCX_TLS':<14} {'op':<10} {'GB/s':>6} {'vs TCP':>7} {'(min-max)':>12} {'cpu s/GB':>9}   (medians)")
    for run in runs.values():
        for op in OPS:
            r = run["ratio_vs_tcp"].get(op)
            rel = f"{statistics.median(r):>7.2f} {f'({min(r):.2f}-{max(r):.2f})':>12}" if r else f"{'1.00':>7} {'':>12}"
            print(
                f"{run['ucx_tls']:<14} {op:<10} {statistics.median(run['gbps'][op]):>6.2f} {rel} "
                f"{statistics.median(run['cpu_s_per_gb'][op]):>9.2f}"
            )
        print(
            f"{run['ucx_tls']:<14} registering the {format_size(value_bytes * args.values)} pool: {run['register_ms']:.1f} ms; "
            f"with the first attach (the node starts its agent): {run['register_and_attach_ms']:.0f} ms"
        )


if __name__ == "__main__":
    main()
