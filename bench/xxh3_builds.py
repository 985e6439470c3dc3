"""Two builds of memkv's compiled loops (memkv._recv_verify) side by side, in one run.

For a change to the build itself (compiler flags, where xxHash comes from, how the vector width
is chosen): each build's `copy_xxh3` (copy a 16 MiB value in 256 KiB pieces, hashing each piece
of the copy while it is in cache: the same-host load's loop) and `xxh3_128_digest` (one 256 KiB
piece, in cache: the receive loop's hashing), alternating build by build, repetition by
repetition. Prints GB/s per build (median of the repetitions) and each build / the first.

    python3 bench/xxh3_builds.py --build A.so --build B.so [--reps 9] [--out FILE]

Make a build of another checkout with `python3 setup.py build_ext --build-lib DIR` in it; the .so
lands in DIR/memkv/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

MiB = 1 << 20
PIECE = 256 << 10


def load(path: str):
    spec = importlib.util.spec_from_file_location("memkv._recv_verify", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gbps(fn, nbytes: int, rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return nbytes * rounds / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="append", required=True, help="path of a _recv_verify*.so (twice or more)")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    builds = [(path, load(path)) for path in args.build]
    source = memoryview(bytearray(os.urandom(16 * MiB)))
    target = memoryview(bytearray(16 * MiB))
    piece = bytes(source[:PIECE])
    results: dict[str, dict[str, list[float]]] = {path: {"copy_xxh3": [], "digest": []} for path, _ in builds}
    for rep in range(args.reps):
        order = builds if rep % 2 == 0 else builds[::-1]
        for path, module in order:
            results[path]["copy_xxh3"].append(gbps(lambda m=module: m.copy_xxh3(target, source, PIECE), 16 * MiB, 8))
            results[path]["digest"].append(gbps(lambda m=module: m.xxh3_128_digest(piece), PIECE, 400))
    first = args.build[0]
    print(f"{'build':<60} {'variant':>8} {'copy_xxh3 GB/s':>15} {'ratio':>6} {'digest GB/s':>12} {'ratio':>6}")
    summary = {}
    for path, module in builds:
        med = {k: statistics.median(v) for k, v in results[path].items()}
        base = {k: statistics.median(v) for k, v in results[first].items()}
        summary[path] = {
            "variant": getattr(module, "XXH3_VARIANT", "dispatch"),
            "median_gbps": med,
            "ratio_to_first": {k: med[k] / base[k] for k in med},
            "runs_gbps": results[path],
        }
        print(
            f"{path[-60:]:<60} {summary[path]['variant']:>8} {med['copy_xxh3']:>15.2f} "
            f"{med['copy_xxh3'] / base['copy_xxh3']:>6.3f} {med['digest']:>12.2f} {med['digest'] / base['digest']:>6.3f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"reps": args.reps, "builds": summary, "when": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)


if __name__ == "__main__":
    main()
