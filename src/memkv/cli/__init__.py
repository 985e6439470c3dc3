r"""The `memkv` command: run a node, and look at a cluster as an operator.

    memkv serve     run a node (defaults: 127.0.0.1:9900, admin on port+1, capacity 1/4 of RAM or
                    of the container's memory limit)
    memkv keygen    print a new 64-hex-character auth key
    memkv probe     authenticated round trip to every configured server
    memkv status    each server's admin status as a table: stored / allocated / capacity, values,
                    hit ratio, evictions, health (and per lane with --lanes); an authenticated
                    PING on each data port checks the key too (the admin port takes none)
    memkv health    liveness of the node this container runs (the Docker HEALTHCHECK): GET
                    /v1/health on its admin port, found from the node's own command line, over
                    HTTPS when the node has a certificate
    memkv bench     move values through the client, with a progress bar on stderr; with no
                    servers configured, against an embedded local node on loopback
    memkv get/put/del/ls   small key tools for debugging a namespace

Client commands read the cluster from the `MEMKV_*` variables or `MEMKV_CONFIG` (see
docs/configuration.md), exactly as the vLLM tier does.

`memkv ls` uses the authenticated LIST request (docs/protocol.md); the admin port
(unauthenticated) never serves key names, which reveal models and prompt-content hashes.

Keys on the command line: keys are bytes. `ls` prints printable ASCII (but space and the
backslash) as is and every other byte as `\xNN`, a backslash as `\\`; every key argument
(`get`, `put`, `del`, the `ls` prefix) accepts the same escapes, so a printed key can be passed
back as it is. A backslash in a key must therefore be written `\\`.

Exit codes, the same for every command:
    0  success
    1  the operation failed: a server down or not ready, a miss for `get`, a key not deleted,
       a value not stored, no key listed by `ls` or a server that did not answer it, a
       benchmark that did not verify
    2  bad usage or configuration: an unknown flag, a bad MEMKV_* value, a key over 480 bytes,
       a bad escape in a key, an unreadable input file

`--json` (every client command) prints one JSON object on stdout with an "ok" field, also
when the command fails; human-readable messages go to stderr. Secrets are never printed
(except by `keygen`, whose job it is).

One module per command group: serve, keygen, status (`probe` and `status`), health, bench,
keys (`get`, `put`, `del`, `ls`, and how keys are written); beside them admin (the client of a
node's admin HTTP port), proc (a node's command line read from /proc), tables (what `status`
prints) and common (exit codes, errors, --json output). This module builds the parser and runs
the command.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from memkv import __version__
from memkv.cli import bench, health, keygen, keys, serve, status
from memkv.cli.common import EXIT_FAILED, EXIT_USAGE, UsageError, fail
from memkv.errors import ConfigError

ENV_LOG_LEVEL = "MEMKV_LOG_LEVEL"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # argparse itself exits 2 on bad usage
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except ConfigError as exc:
        return fail(args, EXIT_USAGE, f"configuration error: {exc}")
    except UsageError as exc:
        return fail(args, EXIT_USAGE, str(exc))
    except BrokenPipeError:
        # stdout closed early (`memkv get k | head -c 10`): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_FAILED


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="memkv",
        description="MemKV: in-memory KV-cache store for LLM inference",
        epilog="exit codes: 0 success, 1 operation failed, 2 bad usage or configuration",
    )
    ap.add_argument("--version", action="version", version=f"memkv {__version__}")
    ap.add_argument(
        "--log-level",
        default=os.environ.get(ENV_LOG_LEVEL, "warning"),
        choices=["debug", "info", "warning", "error"],
        help=f"log level (default: ${ENV_LOG_LEVEL} or warning)",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    serve.add_parsers(sub)
    keygen.add_parsers(sub)
    status.add_parsers(sub)  # probe, status
    health.add_parsers(sub)
    bench.add_parsers(sub)
    keys.add_parsers(sub)  # get, put, del, ls
    return ap
