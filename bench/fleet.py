"""Many engines, many nodes: K client processes against M nodes, against raw sockets, same run.

    python3 bench/fleet.py [--clients 1,2,4] [--nodes 1,2,4] [--topology remote,colocated[,loopback]]
                           [--values 64] [--value-mib 16] [--threads 8] [--blocks-per-op 8]
                           [--reps 2] [--lookups N [--storer-nice N]] [--cpu-split N]
                           [--out FILE] [--plot FILE]

Each client process has the tier's read/write shape: `--threads` threads, each task a batch of
`--blocks-per-op` values of `--value-mib` MiB (batch_put_views / batch_get_into), over `--values`
values of its own. For every topology and every M: M real `memkv serve` nodes, and M raw servers
(bench/datapath.py's: one request header, then the bytes, into a pre-faulted pool) in the same
places; then for every K, K client processes, started together, PUT all their values and GET them
back, once through MemKV and once through the raw servers (same bytes, same processes, same
placement count; the order alternates repetition by repetition).

Stores at steady state. A cell first stores every value once through each (reported apart as the
cell's first PUT round: with K = 1 into empty nodes, whose every buffer's pages are made and
zeroed as the receive fills them, while the raw servers receive into memory faulted before
timing), then once more through MemKV untimed. The measured PUTs then replace values whose freed
buffers the node reuses, as a node that has filled up does (an evicted value's buffer goes to the
next value of its size): both sides receive into memory made before. Shared-memory stores
(co-located) make a new memfd every time, whatever the round.

Topologies:
  remote     every node (and its raw server) on another host: a network namespace of its own
             behind a veth pair (tests/netns.py; needs root and iproute2). TCP only, as a node
             on another machine is reached. Raw baseline: TCP to the same address.
  colocated  nodes on 127.0.0.1; the client's defaults (same-host socket, shared memory).
             Raw baseline: the same-host kernel path, an abstract Unix socket.
  loopback   nodes on 127.0.0.1 reached over TCP only (the clients' local_socket off, as
             MEMKV_LOCAL_SOCKET=off): a remote node's path where namespaces cannot be made (a
             host without iproute2). Raw baseline: TCP to the same address.

Per cell (topology, K, M, op): aggregate GB/s (all bytes of the phase over the wall time from the
common start to the last client's end), the ratio to raw, per-client spread (max/min of each
client's own GB/s), p99 of one batch, and the servers' CPU-seconds per GB (user + system of the
node or raw-server processes over the phase). Targets (issue 43): aggregate >= 0.8 x raw at every
K x M, max/min <= 1.5, node CPU per GB flat as K grows. Every phase is bounded in bytes; a client
that fails a value exits non-zero and the cell is reported as failed.

`--lookups N` adds, per cell with K >= 2: one engine's batched lookups (client 0: N lookups of 64
keys, 20 ms apart) alone, then while the other K-1 clients store all their values again and again
(bounded in time and rounds): p50/p99 alone and under the storm, and the storm's worst lookup
against the tier's default lookup_timeout_s. Target: p99 <= 5 x alone, never past the timeout.
Where a lookup's time goes, alone and under the storm: the nodes' own handling of it (their
`memkv_node_request_seconds{op="exists"}`: mean, and the bucket bound under which 99% fall), the
probe's threads waiting for a CPU (schedstat's run-queue time, p99 per lookup), the nodes'
threads waiting for a CPU (mean number at any moment) and how busy the host's CPUs were.

Two ways to tell the host's CPUs from the node's own code as the cause:
  --cpu-split N     nodes and raw servers on CPUs 0..N-1, clients on the rest, as if each were on
                    hosts of its own (throughput cells too).
  --storer-nice N   the storing clients' threads at nice N during the storm. By default the
                    tier's `store_nice` (10), as its store threads run (memkv_vllm/priority.py);
                    0 measures stores at the probe's and the nodes' priority.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT))  # tests/netns.py
sys.path.insert(2, str(ROOT / "bench"))

from datapath import RawClient, start_raw  # noqa: E402

from memkv.benchmark import fill_pattern, prefaulted_pool  # noqa: E402
from memkv.client.cluster import Client  # noqa: E402
from memkv.config import AuthKey, ClientConfig, parse_servers  # noqa: E402
from memkv.local import LocalNode, new_key_hex  # noqa: E402
from memkv.memfd import shmem_huge_pages  # noqa: E402
from memkv_vllm.config import TierSettings  # noqa: E402

MiB = 1 << 20
PHASE_TIMEOUT_S = 300.0
LOOKUP_BATCH = 64  # keys per lookup: a 4k-token prompt's blocks at 64 tokens a block
LOOKUP_GAP_S = 0.02
MAX_STORM_ROUNDS = 1000
TOPOLOGIES = ("remote", "colocated", "loopback")  # the module docstring says what each is
LOOKUP_TIMEOUT_S = 5.0  # the tier's default lookup_timeout_s (memkv_vllm/config.py)


# -- one client process ---------------------------------------------------------------------------


def worker(spec: dict) -> None:
    """Runs in a client process: prepares, says "ready", then runs each phase named on stdin and
    prints its figures as one JSON line."""
    value_bytes, n, threads, bpo, me = spec["value_bytes"], spec["values"], spec["threads"], spec["bpo"], spec["me"]
    src = memoryview(prefaulted_pool(value_bytes * n))
    dst = memoryview(prefaulted_pool(value_bytes * n))
    for i in range(n):
        fill_pattern(src[i * value_bytes : (i + 1) * value_bytes], me * n + i)
    client = Client(
        ClientConfig(
            servers=parse_servers(",".join(spec["servers"]), "fleet"),
            auth_key=AuthKey.from_hex(spec["key"], "fleet"),
            pool_size=max(8, threads),
            local_socket=not spec["tcp_only"],
        )
    )
    raws = [RawClient(port, unix_name=unix, host=host) for host, port, unix in spec["raw"]]
    keys = [f"fleet/{me}/{i}".encode() for i in range(n)]
    slot_of = [(me * n + i) // len(raws) for i in range(n)]  # value i's raw server: (me * n + i) % M
    per_thread = [list(range(t, n, threads)) for t in range(threads)]

    def view(v: memoryview, i: int) -> memoryview:
        return v[i * value_bytes : (i + 1) * value_bytes]

    def run(op: str, idx: list[int], latencies: list[float], failures: list[int]) -> None:
        for j in range(0, len(idx), bpo):
            batch = idx[j : j + bpo]
            start = time.perf_counter()
            if op == "memkv put":
                ok = client.batch_put_views([(keys[i], view(src, i)) for i in batch])
            elif op == "memkv get":
                ok = client.batch_get_into([(keys[i], view(dst, i)) for i in batch])
            else:
                for i in batch:
                    raw = raws[(me * n + i) % len(raws)]
                    (raw.put if op == "raw put" else raw.get)(slot_of[i], view(src if op == "raw put" else dst, i))
                ok = [True] * len(batch)
            latencies.append(time.perf_counter() - start)
            failures.extend(i for i, good in zip(batch, ok) if not good)

    print("ready", flush=True)
    for line in sys.stdin:
        op = line.strip()
        if not op:
            break
        if op.startswith("lookups "):  # N batched lookups of the tier's shape, LOOKUP_GAP_S apart
            latencies, waits = [], []
            for _ in range(int(op.split()[1])):
                waited = runq_seconds([os.getpid()])
                start = time.monotonic()
                client.exists(keys[:LOOKUP_BATCH])
                latencies.append(time.monotonic() - start)
                waits.append(runq_seconds([os.getpid()]) - waited)
                time.sleep(LOOKUP_GAP_S)
            print(json.dumps({"op": "lookups", "latencies": latencies, "runq": waits}), flush=True)
            continue
        if op.startswith("storm "):  # store every value again and again for S seconds (bounded)
            stored, began = 0, time.monotonic()
            until = began + float(op.split()[1])
            for _ in range(MAX_STORM_ROUNDS):
                if time.monotonic() >= until:
                    break
                failures = []
                pool = [threading.Thread(target=run, args=("memkv put", idx, [], failures)) for idx in per_thread]
                for t in pool:
                    t.start()
                for t in pool:
                    t.join()
                stored += n - len(failures)
            seconds = time.monotonic() - began
            print(json.dumps({"op": "storm", "stored": stored, "seconds": seconds}), flush=True)
            continue
        latencies: list[float] = []
        failures: list[int] = []
        if op.endswith("get"):  # a GET that moved nothing must not pass on the last one's bytes
            ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(dst)), 0, len(dst))
        pool = [threading.Thread(target=run, args=(op, idx, latencies, failures)) for idx in per_thread]
        start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        end = time.monotonic()
        if op.endswith("get") and not failures:  # every byte checked, outside the timed window
            failures = [i for i in range(n) if view(dst, i).tobytes() != view(src, i).tobytes()]
        print(json.dumps({"op": op, "bytes": value_bytes * n, "start": start, "end": end, "latencies": latencies,
                          "failures": len(failures)}), flush=True)  # fmt: skip
    client.close()


# -- the parent: places, cells, figures --------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def runq_seconds(pids: list[int]) -> float:
    """Seconds the threads of `pids` have spent runnable but waiting for a CPU (schedstat's second
    field): where a lookup's time goes when the host has more runnable threads than CPUs."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError):  # a thread that ended meanwhile
                pass
    return total / 1e9


def pin(pid: int, cpus: set[int] | None) -> None:
    """Every thread of `pid` (threads it makes later inherit it) onto `cpus`; None: leave it."""
    if cpus is None:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def host_cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU of the host, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return sum(ticks) - idle, sum(ticks)


def exists_histogram(nodes: list) -> tuple[float, float, dict[float, float]]:
    """The nodes' `memkv_node_request_seconds{op="exists"}` summed over nodes: (count, sum,
    cumulative count per bucket bound), read from their admin ports."""
    from prometheus_client.parser import text_string_to_metric_families

    count = total = 0.0
    buckets: dict[float, float] = {}
    for node in nodes:
        with urllib.request.urlopen(node.admin_url + "/v1/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name != "memkv_node_request_seconds":
                continue
            for sample in family.samples:
                if sample.labels.get("op") != "exists":
                    continue
                if sample.name.endswith("_count"):
                    count += sample.value
                elif sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + sample.value
    return count, total, buckets


class Places:
    """M nodes and M raw servers, on other hosts (remote) or on this one (colocated, loopback)."""

    def __init__(
        self,
        topology: str,
        m: int,
        key: str,
        capacity_bytes: int,
        value_bytes: int,
        slots: int,
        cpus: set[int] | None = None,
        node_args: Sequence[str] = (),
    ) -> None:
        self.topology = topology
        self.hosts: list = []
        self.nodes: list[LocalNode] = []
        self.raws: list[tuple[subprocess.Popen, str, int, str | None]] = []
        try:
            for _ in range(m):
                if topology == "remote":
                    from tests.netns import NetnsHost

                    host = NetnsHost()
                    self.hosts.append(host)
                    self.nodes.append(host.start_node(key, capacity=str(capacity_bytes), extra_args=node_args))
                    proc, port, _unix = start_raw(value_bytes, slots, host=host.node_ip, launcher=host.launcher)
                    self.raws.append((proc, host.node_ip, port, None))
                else:
                    extra = ["--admin-port", "0", *node_args]
                    self.nodes.append(LocalNode(key, capacity=str(capacity_bytes), extra_args=extra))
                    proc, port, unix = start_raw(value_bytes, slots)
                    self.raws.append((proc, "127.0.0.1", port, None if topology == "loopback" else unix))
            for pid in [n.pid for n in self.nodes] + [proc.pid for proc, *_ in self.raws]:
                pin(pid, cpus)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        for proc, *_ in self.raws:
            proc.kill()
            proc.wait(10)
        for host in self.hosts:
            host.close()


def run_cell(places: Places, k: int, args: argparse.Namespace, key: str, reps: int) -> dict:
    value_bytes = args.value_mib * MiB
    procs = []
    for me in range(k):
        spec = {
            "value_bytes": value_bytes, "values": args.values, "threads": args.threads, "bpo": args.blocks_per_op,
            "me": me, "key": key, "servers": [n.address for n in places.nodes],
            "raw": [(host, port, unix) for _, host, port, unix in places.raws],
            "tcp_only": places.topology == "loopback",
        }  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready", "a client did not start"
            pin(p.pid, args.client_cpus)
        node_pids = [n.pid for n in places.nodes]
        raw_pids = [proc.pid for proc, *_ in places.raws]

        def phase(name: str) -> dict:
            pids = node_pids if name.startswith("memkv") else raw_pids
            cpu0 = cpu_seconds(pids)
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(name + "\n")
                p.stdin.flush()
            results = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
            cpu = cpu_seconds(pids) - cpu0  # the servers idle while clients check bytes
            wall = max(r["end"] for r in results) - min(r["start"] for r in results)
            moved = sum(r["bytes"] for r in results)
            latencies = sorted(x for r in results for x in r["latencies"])
            per_client = [r["bytes"] / (r["end"] - r["start"]) / 1e9 for r in results]
            return {
                "gbps": moved / wall / 1e9,
                "spread": max(per_client) / min(per_client),
                "p99_batch_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                "server_cpu_s_per_gb": cpu / (moved / 1e9),
                "failures": sum(r["failures"] for r in results),
            }

        cell: dict[str, list[dict]] = {}
        # Every value's first store: the node makes the pages of each buffer as it receives into
        # it, while the raw servers receive into memory faulted before timing. Reported apart.
        for system in ("memkv", "raw"):
            cell[f"first {system} put"] = [phase(f"{system} put")]
        # Then each value's buffer is replaced once, untimed, so that the measured stores reuse
        # freed buffers as a node does at steady state (full: an evicted value's buffer goes to
        # the next value of its size). Shared-memory stores make a new memfd every time.
        phase("memkv put")
        for rep in range(reps):
            systems = ["memkv", "raw"] if rep % 2 == 0 else ["raw", "memkv"]
            for op in ("put", "get"):
                for system in systems:
                    cell.setdefault(f"{system} {op}", []).append(phase(f"{system} {op}"))
        if args.lookups and k >= 2:
            cell["lookups"] = [storm(procs, args.lookups, places.nodes, value_bytes, args.storer_nice)]
        return cell
    finally:
        for p in procs:
            try:
                assert p.stdin is not None
                p.stdin.write("\n")
                p.stdin.close()
                p.wait(PHASE_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()


def storm(procs: list[subprocess.Popen], probes: int, nodes: list, value_bytes: int, storer_nice: int = 0) -> dict:
    """One engine's lookups (client 0) alone, then while the other K-1 store at full speed; with
    where a lookup's time goes: the node's own handling (its request histogram), the probe's and
    the nodes' threads waiting for a CPU, and how busy the host's CPUs were."""

    def ask(p: subprocess.Popen, line: str) -> None:
        assert p.stdin is not None
        p.stdin.write(line + "\n")
        p.stdin.flush()

    def answer(p: subprocess.Popen) -> dict:
        assert p.stdout is not None
        return json.loads(p.stdout.readline())

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    node_pids = [n.pid for n in nodes]

    def lookups(storers: list[subprocess.Popen]) -> dict:
        cpu0, hist0, runq0, t0 = host_cpu_ticks(), exists_histogram(nodes), runq_seconds(node_pids), time.monotonic()
        for p in storers:  # long enough to cover the probe's run; bounded by MAX_STORM_ROUNDS too
            ask(p, f"storm {probes * LOOKUP_GAP_S * 3 + 5:.1f}")
        ask(probe, f"lookups {probes}")
        got = answer(probe)
        cpu1, hist1, runq1, t1 = host_cpu_ticks(), exists_histogram(nodes), runq_seconds(node_pids), time.monotonic()
        storms = [answer(p) for p in storers]
        stored = sum(x["stored"] for x in storms)
        count = hist1[0] - hist0[0]
        in_node = {le: hist1[2][le] - hist0[2].get(le, 0.0) for le in sorted(hist1[2])}
        return {
            "p50_s": pct(got["latencies"], 0.5),
            "p99_s": pct(got["latencies"], 0.99),
            "max_s": max(got["latencies"]),
            "probe_runq_p99_s": pct(got["runq"], 0.99),
            "probe_runq_mean_s": statistics.mean(got["runq"]),
            "node_mean_s": (hist1[1] - hist0[1]) / count if count else 0.0,
            # the smallest bucket bound under which 99% of the nodes' EXISTS were served
            "node_p99_le_s": next((le for le, n in in_node.items() if n >= 0.99 * count), float("inf")),
            "node_threads_waiting": (runq1 - runq0) / (t1 - t0),  # mean node threads runnable without a CPU
            "host_cpu_busy": (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]),
            "stored": stored,
            # the storers' aggregate: what the stores lost to the probe's priority
            "stored_gbps": stored * value_bytes / max(x["seconds"] for x in storms) / 1e9 if storms else 0.0,
        }

    probe, storers = procs[0], procs[1:]
    for p in storers if storer_nice else []:  # as a client whose store threads yield the CPU would
        for task in Path(f"/proc/{p.pid}/task").iterdir():
            os.setpriority(os.PRIO_PROCESS, int(task.name), storer_nice)
    alone = lookups([])
    during = lookups(storers)
    return {"alone_p50_s": alone["p50_s"], "alone_p99_s": alone["p99_s"], "storm_p50_s": during["p50_s"],
            "storm_p99_s": during["p99_s"], "storm_max_s": during["max_s"], "stored_during": during["stored"],
            "alone": alone, "storm": during}  # fmt: skip


def summarize(cell: dict) -> dict:
    out = {}
    for op in ("put", "get"):
        m, r = cell[f"memkv {op}"], cell[f"raw {op}"]
        med = {name: statistics.median(x[name] for x in m) for name in ("gbps", "spread", "p99_batch_s")}
        out[op] = {
            "memkv_gbps": med["gbps"],
            "raw_gbps": statistics.median(x["gbps"] for x in r),
            "ratio": statistics.median(a["gbps"] / b["gbps"] for a, b in zip(m, r)),
            "spread": med["spread"],
            "p99_batch_s": med["p99_batch_s"],
            "node_cpu_s_per_gb": statistics.median(x["server_cpu_s_per_gb"] for x in m),
            "raw_cpu_s_per_gb": statistics.median(x["server_cpu_s_per_gb"] for x in r),
            "failures": sum(x["failures"] for x in m + r),
            "per_rep": {"memkv_gbps": [x["gbps"] for x in m], "raw_gbps": [x["gbps"] for x in r]},
        }
    first_m, first_r = cell["first memkv put"][0], cell["first raw put"][0]
    out["first_put"] = {
        "memkv_gbps": first_m["gbps"],
        "raw_gbps": first_r["gbps"],
        "ratio": first_m["gbps"] / first_r["gbps"],
        "node_cpu_s_per_gb": first_m["server_cpu_s_per_gb"],
        "failures": first_m["failures"] + first_r["failures"],
    }
    if "lookups" in cell:
        out["lookups"] = cell["lookups"][0]
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topologies = sorted({r["topology"] for r in rows})
    fig, axes = plt.subplots(len(topologies), 2, figsize=(10, 3.6 * len(topologies)), squeeze=False)
    for row_axes, topology in zip(axes, topologies):
        for ax, op in zip(row_axes, ("put", "get")):
            for m in sorted({r["nodes"] for r in rows}):
                cells = sorted(
                    (r for r in rows if r["topology"] == topology and r["nodes"] == m), key=lambda r: r["clients"]
                )
                ks = [r["clients"] for r in cells]
                (line,) = ax.plot(ks, [r[op]["memkv_gbps"] for r in cells], marker="o", label=f"memkv, {m} nodes")
                ax.plot(ks, [r[op]["raw_gbps"] for r in cells], ls="--", color=line.get_color(), label=f"raw, {m}")
                if op == "put" and all("first_put" in r for r in cells):
                    first = [r["first_put"]["memkv_gbps"] for r in cells]
                    ax.plot(ks, first, ls=":", marker="x", color=line.get_color(), label=f"memkv first round, {m}")
            ax.set_title(f"{topology}: {op}")
            ax.set_xlabel("client processes")
            ax.set_ylabel("aggregate GB/s")
            ax.set_xticks(sorted({r["clients"] for r in rows}))
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,2,4", help="K values, comma-separated")
    ap.add_argument("--nodes", default="1,2,4", help="M values, comma-separated")
    ap.add_argument("--topology", default="remote,colocated", help=f"{', '.join(TOPOLOGIES)} (comma-separated)")
    ap.add_argument("--values", type=int, default=64, help="values per client")
    ap.add_argument("--value-mib", type=int, default=16)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--blocks-per-op", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "fleet.json")
    ap.add_argument("--plot", type=Path, help="write a PNG of aggregate GB/s per topology and op")
    ap.add_argument(
        "--lookups",
        type=int,
        default=0,
        metavar="N",
        help="per cell with K >= 2: N batched lookups of client 0 alone, then while the other K-1 store",
    )
    ap.add_argument(
        "--cpu-split",
        type=int,
        metavar="N",
        help="nodes and raw servers on CPUs 0..N-1, clients on the rest: as if on hosts of their own",
    )
    ap.add_argument(
        "--storer-nice",
        type=int,
        default=TierSettings.store_nice,
        metavar="N",
        help="--lookups: the storing clients' threads at nice N, as the tier's store threads run "
        f"(its store_nice, default {TierSettings.store_nice}); 0: at the probe's and the nodes' own",
    )
    ap.add_argument(
        "--node-args",
        default="",
        help="more `memkv serve` flags for the MemKV nodes, one string (e.g. '--shared-memory-stores client')",
    )
    ap.add_argument("--replot", type=Path, metavar="JSON", help="only draw --plot from an earlier run's JSON")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.replot:
        plot(json.loads(args.replot.read_text())["rows"], args.plot or args.replot.with_suffix(".png"))
        return
    unknown = set(args.topology.split(",")) - set(TOPOLOGIES)
    if unknown:
        ap.error(f"--topology: unknown {', '.join(sorted(unknown))} ({', '.join(TOPOLOGIES)})")
    args.client_cpus = node_cpus = None
    if args.cpu_split is not None:
        cpus = sorted(os.sched_getaffinity(0))
        if not 0 < args.cpu_split < len(cpus):
            ap.error(f"--cpu-split: {args.cpu_split} leaves no CPU to nodes or clients (this host has {len(cpus)})")
        node_cpus, args.client_cpus = set(cpus[: args.cpu_split]), set(cpus[args.cpu_split :])
    ks = [int(x) for x in args.clients.split(",")]
    ms = [int(x) for x in args.nodes.split(",")]
    value_bytes = args.value_mib * MiB
    key = new_key_hex()
    rows = []
    print(f"{'topology':<10} {'K':>2} {'M':>2} {'op':<4} {'memkv GB/s':>10} {'raw GB/s':>9} {'ratio':>6} "
          f"{'max/min':>7} {'p99 batch':>9} {'node cpu-s/GB':>13} {'raw cpu-s/GB':>12}")  # fmt: skip
    for topology in args.topology.split(","):
        for m in ms:
            total_values = max(ks) * args.values
            capacity = int(total_values * value_bytes * 1.3 / m) + (256 << 20)
            places = Places(
                topology, m, key, capacity, value_bytes, -(-total_values // m), node_cpus, shlex.split(args.node_args)
            )
            try:
                for k in ks:
                    summary = summarize(run_cell(places, k, args, key, args.reps))
                    rows.append({"topology": topology, "clients": k, "nodes": m, **summary})
                    for op in ("put", "get"):
                        s = summary[op]
                        print(f"{topology:<10} {k:>2} {m:>2} {op:<4} {s['memkv_gbps']:>10.2f} {s['raw_gbps']:>9.2f} "
                              f"{s['ratio']:>6.2f} {s['spread']:>7.2f} {s['p99_batch_s']:>9.3f} "
                              f"{s['node_cpu_s_per_gb']:>13.3f} {s['raw_cpu_s_per_gb']:>12.3f}"
                              + (f"  FAILED {s['failures']} values" if s["failures"] else ""), flush=True)  # fmt: skip
                    f = summary["first_put"]
                    print(f"{topology:<10} {k:>2} {m:>2} the cell's first PUT round: {f['memkv_gbps']:.2f} GB/s against "
                          f"raw {f['raw_gbps']:.2f} ({f['ratio']:.2f}), node {f['node_cpu_s_per_gb']:.3f} CPU-s/GB"
                          + (f"  FAILED {f['failures']} values" if f["failures"] else ""), flush=True)  # fmt: skip
                    if "lookups" in summary:
                        x = summary["lookups"]
                        print(f"{topology:<10} {k:>2} {m:>2} lookups of {LOOKUP_BATCH} keys: alone p50/p99 "
                              f"{1e3 * x['alone_p50_s']:.1f}/{1e3 * x['alone_p99_s']:.1f} ms; while {k - 1} store: "
                              f"{1e3 * x['storm_p50_s']:.1f}/{1e3 * x['storm_p99_s']:.1f} ms "
                              f"(p99 {x['storm_p99_s'] / x['alone_p99_s']:.1f}x, max {x['storm_max_s']:.2f} s "
                              f"of lookup_timeout_s {LOOKUP_TIMEOUT_S:g})", flush=True)  # fmt: skip
                        a, d = x["alone"], x["storm"]
                        print(f"{topology:<10} {k:>2} {m:>2}   where it goes, alone / storm: in the nodes mean "
                              f"{1e3 * a['node_mean_s']:.2f}/{1e3 * d['node_mean_s']:.2f} ms (p99 <= "
                              f"{1e3 * a['node_p99_le_s']:g}/{1e3 * d['node_p99_le_s']:g} ms); probe waiting for a "
                              f"CPU p99 {1e3 * a['probe_runq_p99_s']:.2f}/{1e3 * d['probe_runq_p99_s']:.2f} ms; node "
                              f"threads waiting for a CPU {a['node_threads_waiting']:.2f}/"
                              f"{d['node_threads_waiting']:.2f}; host CPUs busy {100 * a['host_cpu_busy']:.0f}/"
                              f"{100 * d['host_cpu_busy']:.0f}%; the {k - 1} stored {d['stored_gbps']:.2f} GB/s "
                              f"at nice {args.storer_nice}", flush=True)  # fmt: skip
            finally:
                places.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.node()} ({os.cpu_count()} CPUs)", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "shmem_enabled": shmem_huge_pages(),
            "args": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "plot", "client_cpus")}}  # fmt: skip
    args.out.write_text(json.dumps({"meta": {**meta, "args": {k: str(v) for k, v in meta["args"].items()}},
                                    "rows": rows}, indent=1))  # fmt: skip
    if args.plot:
        plot(rows, args.plot)
    if any(r[op]["failures"] for r in rows for op in ("put", "get")):
        sys.exit(1)


if __name__ == "__main__":
    main()
