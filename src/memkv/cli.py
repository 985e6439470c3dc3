"""The `memkv` command.

    memkv serve     run a node (defaults: 127.0.0.1:9900, admin on port+1, capacity 1/4 of RAM)
    memkv keygen    print a new 64-hex-character auth key
    memkv probe     authenticated round trip to every configured server (exit 0 ok, 1 failed)
    memkv status    each server's admin status as a table (or --json)
    memkv bench     move values through the client; with no servers configured, against an
                    embedded local node on loopback
    memkv get/put/del   small key tools for debugging a namespace

Exit codes: 0 success, 1 the operation failed (a server down, a miss for `get`), 2 bad usage or
configuration.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

from memkv import __version__
from memkv.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ENV_AUTH_KEY,
    ENV_SERVERS,
    AuthKey,
    ClientConfig,
    LaneSpec,
    ServerConfig,
    default_capacity_bytes,
    default_key_path,
    format_size,
    parse_address,
    parse_size,
)
from memkv.errors import ConfigError, MemKVError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"memkv: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_FAILED


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="memkv", description="MemKV: in-memory KV-cache store for LLM inference")
    ap.add_argument("--version", action="version", version=f"memkv {__version__}")
    ap.add_argument("--log-level", default=os.environ.get("MEMKV_LOG_LEVEL", "warning"), choices=["debug", "info", "warning", "error"])
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run a node")
    s.add_argument("--listen", default=f"{DEFAULT_HOST}:{DEFAULT_PORT}", help="HOST:PORT of the data port (port 0 picks a free one)")
    s.add_argument("--admin-port", type=int, default=None, help="admin HTTP port (default: data port + 1; 0 picks a free one)")
    s.add_argument("--admin-host", default=None, help="admin HTTP address (default: the data host)")
    s.add_argument("--capacity", default=None, help="byte capacity, e.g. 512MiB, 8GiB (default: 1/4 of RAM)")
    s.add_argument("--lane", action="append", default=[], metavar="NAME:PREFIX:SHARE",
                   help="an eviction lane: keys starting with PREFIX share SHARE of the capacity (repeatable)")
    s.add_argument("--max-value-size", default="64MiB", help="largest value accepted (default 64MiB)")
    s.add_argument("--key-file", default=None, help="file holding the 64-hex auth key (MEMKV_AUTH_KEY wins when set)")
    s.add_argument("--max-connections", type=int, default=1024, help="concurrent client connections (default 1024)")
    s.add_argument("--idle-timeout", type=float, default=300.0, help="seconds an idle connection is kept (default 300)")
    s.add_argument("--io-timeout", type=float, default=30.0, help="seconds a started frame may take (default 30)")
    s.add_argument("--node-id", default="", help="name reported to clients and in status (default host:port)")
    s.set_defaults(func=cmd_serve)

    k = sub.add_parser("keygen", help="print a new auth key (64 hex characters)")
    k.set_defaults(func=cmd_keygen)

    pr = sub.add_parser("probe", help="check connectivity and auth of every configured server")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_probe)

    st = sub.add_parser("status", help="show each configured server's admin status")
    st.add_argument("--json", action="store_true")
    st.add_argument("--admin-port-offset", type=int, default=1, help="admin port = data port + this (default 1)")
    st.set_defaults(func=cmd_status)

    b = sub.add_parser("bench", help="store and load values through the client")
    b.add_argument("--value-size", default="16MiB")
    b.add_argument("--values", type=int, default=32, help="values per round (default 32)")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--embedded", action="store_true", help="run against a local node started for the run (default when MEMKV_SERVERS is unset)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)

    g = sub.add_parser("get", help="print or save one value")
    g.add_argument("key")
    g.add_argument("-o", "--output", help="write the value to this file (default: stdout)")
    g.set_defaults(func=cmd_get)
    pu = sub.add_parser("put", help="store one value from a file or stdin")
    pu.add_argument("key")
    pu.add_argument("file", help="path, or - for stdin")
    pu.set_defaults(func=cmd_put)
    d = sub.add_parser("del", help="delete keys")
    d.add_argument("keys", nargs="+")
    d.set_defaults(func=cmd_del)
    return ap


# -- serve ------------------------------------------------------------------------------------------


def _server_key(args) -> AuthKey:
    if os.environ.get(ENV_AUTH_KEY):
        return AuthKey.from_hex(os.environ[ENV_AUTH_KEY], ENV_AUTH_KEY)
    if args.key_file:
        return AuthKey.from_file(args.key_file, "--key-file")
    path = default_key_path()
    if path.exists():
        return AuthKey.from_file(path, "default key file")
    path.parent.mkdir(parents=True, exist_ok=True)
    key_hex = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key_hex + "\n")
    print(f"memkv: no auth key configured; created one in {path} (mode 0600).", flush=True)
    print(f"memkv: clients on other hosts need it: export {ENV_AUTH_KEY}=$(cat {path})", flush=True)
    return AuthKey.from_hex(key_hex, str(path))


def cmd_serve(args) -> int:
    from memkv.server.admin import AdminServer
    from memkv.server.node import Node

    host, port = parse_address(args.listen, "--listen", DEFAULT_PORT)
    capacity = parse_size(args.capacity, "--capacity") if args.capacity else default_capacity_bytes()
    config = ServerConfig(
        host=host,
        port=port,
        capacity_bytes=capacity,
        lanes=tuple(LaneSpec.parse(text) for text in args.lane),
        max_value_bytes=parse_size(args.max_value_size, "--max-value-size"),
        max_connections=args.max_connections,
        idle_timeout_s=args.idle_timeout,
        io_timeout_s=args.io_timeout,
        node_id=args.node_id,
    )
    key = _server_key(args)
    try:
        node = Node(config, key.raw)
    except OSError as exc:
        print(f"memkv: cannot listen on {args.listen}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED
    admin_port = args.admin_port if args.admin_port is not None else (node.address[1] + 1 if port else 0)
    try:
        admin = AdminServer(node, args.admin_host or host, admin_port)
    except OSError as exc:
        print(f"memkv: cannot listen on admin port {admin_port}: {exc.strerror} (use --admin-port)", file=sys.stderr)
        return EXIT_FAILED
    admin.start()

    def on_signal(signum, frame) -> None:
        threading.Thread(target=node.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ah, ap = admin.address
    print(f"memkv node listening on {_fmt(node.address[0])}:{node.address[1]} (admin {_fmt(ah)}:{ap})", flush=True)
    print(f"memkv: capacity {format_size(capacity)}, max value {format_size(config.max_value_bytes)}, "
          f"lanes {[lane.name for lane in node.store.lanes]}", flush=True)
    try:
        node.serve_forever()
    finally:
        admin.shutdown()
    print("memkv: node stopped", flush=True)
    return EXIT_OK


def _fmt(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# -- client commands ----------------------------------------------------------------------------------


def cmd_keygen(args) -> int:
    print(secrets.token_hex(32))
    return EXIT_OK


def _client():
    from memkv.client.cluster import Client

    return Client(ClientConfig.from_env())


def cmd_probe(args) -> int:
    config = ClientConfig.from_env()
    from memkv.client.cluster import Client

    results, failed = [], False
    with Client(config) as client:
        for node in client._nodes:
            try:
                rtt = node.ping()
                results.append({"server": node.name, "ok": True, "node_id": node.node_id, "rtt_ms": round(rtt * 1000, 3)})
            except MemKVError as exc:
                failed = True
                results.append({"server": node.name, "ok": False, "error": str(exc)})
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            if r["ok"]:
                print(f"ok    {r['server']}  node={r['node_id']}  rtt={r['rtt_ms']:.3f} ms")
            else:
                print(f"FAIL  {r['server']}  {r['error']}")
    return EXIT_FAILED if failed else EXIT_OK


def fetch_status(host: str, admin_port: int, timeout_s: float = 2.0) -> dict:
    url = f"http://{_fmt(host)}:{admin_port}/v1/status"
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.load(resp)


def cmd_status(args) -> int:
    config = ClientConfig.from_env()
    rows, failed = [], False
    for server in config.servers:
        try:
            s = fetch_status(server.host, server.port + args.admin_port_offset)
            lookups = s["hits"] + s["misses"]
            rows.append({
                "server": server.name, "healthy": bool(s["ready"]), "node_id": s["node_id"],
                "used_bytes": s["allocated_bytes"], "stored_bytes": s["stored_bytes"], "capacity_bytes": s["capacity_bytes"],
                "values": s["values"], "hit_ratio": (s["hits"] / lookups) if lookups else None,
                "evictions": s["evictions"], "connections": s["connections"],
            })
        except (OSError, ValueError, KeyError) as exc:
            failed = True
            rows.append({"server": server.name, "healthy": False, "error": str(getattr(exc, "reason", exc))})
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_FAILED if failed else EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title="MemKV cluster")
    for col in ("server", "health", "used / capacity", "values", "hit ratio", "evictions", "conns"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["server"], "[red]DOWN[/red]", r["error"], "", "", "", "")
            continue
        ratio = "-" if r["hit_ratio"] is None else f"{r['hit_ratio']:.1%}"
        table.add_row(r["server"], "[green]ok[/green]" if r["healthy"] else "[yellow]draining[/yellow]",
                      f"{format_size(r['used_bytes'])} / {format_size(r['capacity_bytes'])}", str(r["values"]), ratio,
                      str(r["evictions"]), str(r["connections"]))
    Console().print(table)
    return EXIT_FAILED if failed else EXIT_OK


def cmd_get(args) -> int:
    with _client() as client:
        value = client.get(args.key)
    if value is None:
        print(f"memkv: {args.key}: miss", file=sys.stderr)
        return EXIT_FAILED
    if args.output:
        with open(args.output, "wb") as f:
            f.write(value)
    else:
        sys.stdout.buffer.write(value)
    return EXIT_OK


def cmd_put(args) -> int:
    data = sys.stdin.buffer.read() if args.file == "-" else open(args.file, "rb").read()
    with _client() as client:
        try:
            client.put(args.key, data)
        except MemKVError as exc:
            print(f"memkv: put failed: {exc}", file=sys.stderr)
            return EXIT_FAILED
    print(f"stored {len(data)} bytes under {args.key}")
    return EXIT_OK


def cmd_del(args) -> int:
    with _client() as client:
        deleted = client.delete(args.keys)
    for key, ok in zip(args.keys, deleted):
        print(f"{'deleted' if ok else 'missing'}  {key}")
    return EXIT_OK if all(deleted) else EXIT_FAILED


# -- bench ----------------------------------------------------------------------------------------------


def cmd_bench(args) -> int:
    from memkv.benchmark import run_client_bench

    value_bytes = parse_size(args.value_size, "--value-size")
    embedded = args.embedded or not os.environ.get(ENV_SERVERS)
    if embedded:
        from memkv.local import LocalNode, new_key_hex

        key = new_key_hex()
        capacity = max(256 << 20, int(value_bytes * args.values * 1.25))
        with LocalNode(key, capacity=str(capacity)) as node:
            config = ClientConfig.from_env({ENV_SERVERS: node.address, ENV_AUTH_KEY: key})
            print(f"memkv bench: embedded node at {node.address} (capacity {format_size(capacity)})", file=sys.stderr)
            result = run_client_bench(config, value_bytes, args.values, args.rounds, args.threads, progress=not args.json)
    else:
        result = run_client_bench(ClientConfig.from_env(), value_bytes, args.values, args.rounds, args.threads, progress=not args.json)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"values {format_size(value_bytes)} x {args.values}, {args.threads} threads, {args.rounds} rounds, servers {result['servers']}")
        print(f"put  {result['put_gbps']:.2f} GB/s   (best round {result['put_gbps_best']:.2f})")
        print(f"get  {result['get_gbps']:.2f} GB/s   (best round {result['get_gbps_best']:.2f})")
        print(f"verified byte-exact: {result['verified']}")
    return EXIT_OK if result["verified"] else EXIT_FAILED
