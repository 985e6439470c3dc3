"""The client benchmark behind `memkv bench`: store and load values between one pre-faulted
pool of slots and the cluster, then check every loaded byte against what was stored.

It reports figures only for a run that it saw succeed: it probes every server first (a stopped
node or a wrong key raises, naming the server and why) and raises BenchFailed as soon as a value
is not stored, not loaded, or loaded with other bytes. The figures are each round's rate, the
median round and the best one."""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import time
from typing import Any

from memkv.client.cluster import Client
from memkv.config import ClientConfig


class BenchFailed(RuntimeError):
    """A value was not stored, not loaded, or loaded with other bytes: no figure is reported."""


def _why(client: Client) -> str:
    down = [f"{h['server']}: {h['last_error']}" for h in client.health() if not h["up"] and h["last_error"]]
    return f" ({'; '.join(down)})" if down else " (answered NO_SPACE: is the node big enough for the run?)"


def prefaulted_pool(n_bytes: int) -> mmap.mmap:
    """Anonymous memory faulted in once up front, as vLLM's CPU pool is."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, n_bytes, flags=flags)


def fill_pattern(view: memoryview, seed: int) -> None:
    """Distinct, cheap content per slot: a random 64 KiB block repeated, stamped with the seed."""
    block = os.urandom(min(65536, len(view)))
    for off in range(0, len(view), len(block)):
        n = min(len(block), len(view) - off)
        view[off : off + n] = block[:n]
    view[:8] = seed.to_bytes(8, "little")


def run_client_bench(
    config: ClientConfig,
    value_bytes: int,
    n_values: int,
    rounds: int,
    threads: int,
    progress: bool = True,
    key_prefix: bytes = b"bench/",
) -> dict[str, Any]:
    src = prefaulted_pool(value_bytes * n_values)
    dst = prefaulted_pool(value_bytes * n_values)
    sv, dv = memoryview(src), memoryview(dst)
    slots = [(i * value_bytes, (i + 1) * value_bytes) for i in range(n_values)]
    for i, (a, b) in enumerate(slots):
        fill_pattern(sv[a:b], i)
    keys = [key_prefix + f"{os.getpid()}/{i}".encode() for i in range(n_values)]
    per_thread = [list(range(t, n_values, threads)) for t in range(threads)]
    put_rates: list[float] = []
    get_rates: list[float] = []

    bar = None
    if progress:
        from rich.console import Console
        from rich.progress import Progress

        bar = Progress(transient=True, console=Console(stderr=True))  # stdout stays the report
        task = bar.add_task("bench", total=rounds * 2)
        bar.start()
    try:
        with Client(config) as client, concurrent.futures.ThreadPoolExecutor(threads) as pool:
            client.probe()  # a stopped node or a wrong key fails here, naming the server and why

            def put_part(idx: list[int]) -> bool:
                return all(client.batch_put_views([(keys[i], sv[slots[i][0] : slots[i][1]]) for i in idx]))

            def get_part(idx: list[int]) -> bool:
                return all(client.batch_get_into([(keys[i], dv[slots[i][0] : slots[i][1]]) for i in idx]))

            for n in range(rounds):
                t = time.perf_counter()
                ok = all(pool.map(put_part, per_thread))
                put_rates.append(value_bytes * n_values / (time.perf_counter() - t) / 1e9)
                if not ok:  # a figure for values that were not stored would be a lie
                    raise BenchFailed(f"round {n + 1}: not every value was stored{_why(client)}")
                if bar:
                    bar.advance(task)
                _zero(dv)  # so a load that wrote nothing cannot pass the comparison
                t = time.perf_counter()
                ok = all(pool.map(get_part, per_thread))
                get_rates.append(value_bytes * n_values / (time.perf_counter() - t) / 1e9)
                if not ok:
                    raise BenchFailed(f"round {n + 1}: not every value was loaded{_why(client)}")
                if sv != dv:
                    raise BenchFailed(f"round {n + 1}: the loaded bytes differ from the stored ones")
                if bar:
                    bar.advance(task)
            client.delete(keys)
            servers = [s.name for s in client.servers()]
    finally:
        if bar:
            bar.stop()
        sv.release()
        dv.release()
        src.close()
        dst.close()
    return {
        "servers": servers,
        "value_bytes": value_bytes,
        "values": n_values,
        "threads": threads,
        "put_gbps": sorted(put_rates)[len(put_rates) // 2],
        "get_gbps": sorted(get_rates)[len(get_rates) // 2],
        "put_gbps_best": max(put_rates),
        "get_gbps_best": max(get_rates),
        "verified": True,  # every round stored, loaded and compared every value, or raised
    }


def _zero(view: memoryview) -> None:
    zeros = bytes(1 << 20)
    for off in range(0, len(view), len(zeros)):
        n = min(len(zeros), len(view) - off)
        view[off : off + n] = zeros[:n]
