"""Direct mode on CPU through vLLM's real OffloadingConnector (both sides), 2 local nodes.

    .nox/conformance-0-33-0/bin/python bench/direct_cpu.py [--chunks 32] [--chunk-tokens 2048] [--tp 1,2]

Run with a Python that has vLLM (any nox conformance venv). Per TP size and repetition: an
engine (tests/conformance/direct_harness.py: scheduler connector + one worker connector per
rank, CPU tensors for the GPU) prefills one prompt of `--chunks` chunks and waits until every
put is done (store: request arrival -> idle); it is shut down; a restarted engine asks for the
same prompt (load: request arrival -> every rank's blocks loaded, i.e. exists probe, prefetch
into staging, and the workers' copies; every loaded byte is then checked, outside the timing). Results:
bench/out/direct_cpu.json. The simulated model (hashing each block's bytes) is part of the
store figure; compare store figures between configurations, not with a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from memkv.local import LocalNode, new_key_hex  # noqa: E402
from tests.conformance import direct_harness as dh  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def one(tp: int, chunks: int, chunk_tokens: int, staging_mb: int) -> dict:
    g = dh.Geometry(world_size=tp, block_size=chunk_tokens,
                    num_gpu_blocks=2 * (chunks * chunk_tokens // 16) + 64)
    config = dh.direct_config(staging_mb=staging_mb, block_size=chunk_tokens)
    tag = uuid.uuid4().hex
    tokens = chunks * chunk_tokens + 1
    with dh.DirectEngine(g, config, token_budget=8192, step_sleep_s=0.0005) as engine:
        t = time.perf_counter()
        engine.run(tag, tokens, timeout_s=600)
        store_s = time.perf_counter() - t
        region = engine.manager.layout.region_bytes
    with dh.DirectEngine(g, config, token_budget=8192, step_sleep_s=0.0005, check_loads=False) as restarted:
        req = restarted.add_request(tag, tokens)
        t = time.perf_counter()
        restarted.run_until(lambda: req.matched_tokens is not None and req.status.name != "WAITING_FOR_REMOTE_KVS",
                            timeout_s=600)
        load_s = time.perf_counter() - t
        steps = restarted.step_count
        restarted.check_loaded(req)  # byte for byte, outside the timing
        restarted.run_until(lambda: req.is_finished(), timeout_s=600)
        matched = req.matched_tokens
    nbytes = chunks * tp * g.value_bytes
    return {"tp": tp, "chunks": chunks, "value_bytes": g.value_bytes, "prompt_bytes": nbytes, "store_s": store_s,
            "load_s": load_s, "load_steps": steps, "matched_tokens": matched, "staging_bytes": region,
            "load_gib_s": nbytes / load_s / 2**30}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=2048)  # 1 MiB per rank per chunk in the harness shape
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--staging-mb", type=int, default=128)
    args = ap.parse_args()
    key = new_key_hex()
    nodes = [LocalNode(key, capacity="2GiB") for _ in range(2)]
    os.environ.update({"MEMKV_SERVERS": ",".join(n.address for n in nodes), "MEMKV_AUTH_KEY": key,
                       "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")})
    os.environ.pop("MEMKV_CONFIG", None)
    results = []
    try:
        for tp in [int(x) for x in args.tp.split(",")]:
            runs = [one(tp, args.chunks, args.chunk_tokens, args.staging_mb) for _ in range(args.reps)]
            assert all(r["matched_tokens"] == args.chunks * args.chunk_tokens for r in runs), runs
            row = {"tp": tp, "prompt_mib": runs[0]["prompt_bytes"] >> 20, "staging_mib": runs[0]["staging_bytes"] >> 20,
                   "store_s_median": statistics.median(r["store_s"] for r in runs),
                   "load_s_median": statistics.median(r["load_s"] for r in runs),
                   "load_gib_s_median": statistics.median(r["load_gib_s"] for r in runs), "runs": runs}
            results.append(row)
            print(f"TP={tp}: prompt {row['prompt_mib']} MiB, staging {row['staging_mib']} MiB: store "
                  f"{row['store_s_median']:.2f} s, load (restarted engine) {row['load_s_median']:.3f} s = "
                  f"{row['load_gib_s_median']:.2f} GiB/s", flush=True)
    finally:
        for n in nodes:
            n.stop()
    OUT.mkdir(exist_ok=True)
    import vllm

    with open(OUT / "direct_cpu.json", "w") as f:
        json.dump({"host": {"cpus": os.cpu_count(), "python": platform.python_version(), "vllm": vllm.__version__,
                            "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                   "args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
