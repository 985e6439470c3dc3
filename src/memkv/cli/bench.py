"""`memkv bench`: move values through the client, against the configured cluster or an embedded node."""

from __future__ import annotations

import argparse
import os
import sys

from memkv.cli.common import EXIT_FAILED, EXIT_OK, UsageError, fail, print_json
from memkv.config import ENV_AUTH_KEY, ENV_CONFIG, ENV_SERVERS, ClientConfig, env_value, format_size, parse_size
from memkv.errors import ConfigError, MemKVError


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    b = sub.add_parser("bench", help="store and load values through the client (progress bar on stderr)")
    b.add_argument("--value-size", default="16MiB", help="bytes per value, e.g. 1MiB, 16MiB, 4MB (default 16MiB)")
    b.add_argument("--values", type=int, default=32, help="values per round (default 32)")
    b.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of store-then-load; the figures printed are the median round (default 3)",
    )
    b.add_argument("--threads", type=int, default=2, help="client threads moving values in parallel (default 2)")
    b.add_argument(
        "--embedded",
        action="store_true",
        help="run against a local node started for the run (default when neither MEMKV_SERVERS nor MEMKV_CONFIG is set)",
    )
    b.add_argument(
        "--json", action="store_true", help='print the result as one JSON object on stdout ({"ok", "put_gbps", ...})'
    )
    b.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from memkv.benchmark import run_client_bench

    value_bytes = parse_size(args.value_size, "--value-size")
    for name in ("values", "rounds", "threads"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1")
    progress = not args.json
    embedded = args.embedded or not (env_value(os.environ, ENV_SERVERS) or env_value(os.environ, ENV_CONFIG))
    try:
        if embedded:
            from memkv.local import LocalNode, new_key_hex

            key = new_key_hex()
            capacity = max(256 << 20, int(value_bytes * args.values * 1.25))
            with LocalNode(key, capacity=str(capacity)) as node:
                config = ClientConfig.from_env({ENV_SERVERS: node.address, ENV_AUTH_KEY: key})
                print(
                    f"memkv bench: embedded node at {node.address} (capacity {format_size(capacity)})", file=sys.stderr
                )
                result = run_client_bench(
                    config, value_bytes, args.values, args.rounds, args.threads, progress=progress
                )
        else:
            result = run_client_bench(
                ClientConfig.from_env(), value_bytes, args.values, args.rounds, args.threads, progress=progress
            )
    except (MemKVError, RuntimeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        return fail(args, EXIT_FAILED, f"bench failed: {exc}")
    result = {"ok": True, **result}  # run_client_bench raises unless every value was stored, loaded and verified
    if args.json:
        print_json(result)
    else:
        print(
            f"values {format_size(value_bytes)} x {args.values}, {_plural(args.threads, 'thread')}, "
            f"{_plural(args.rounds, 'round')}, servers {result['servers']}"
        )
        print(
            f"put  {result['put_gbps']:.2f} GB/s median of {_plural(args.rounds, 'round')}   (best round {result['put_gbps_best']:.2f})"
        )
        print(
            f"get  {result['get_gbps']:.2f} GB/s median of {_plural(args.rounds, 'round')}   (best round {result['get_gbps_best']:.2f})"
        )
        print(f"verified byte-exact: {result['verified']}")
    return EXIT_OK


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
