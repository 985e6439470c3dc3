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
"""

from __future__ import annotations

import argparse
import concurrent.futures
import grp
import hashlib
import http.client
import json
import logging
import os
import re
import secrets
import signal
import socket
import ssl
import sys
import threading
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from memkv import __version__
from memkv.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ENV_AUTH_KEY,
    ENV_CONFIG,
    ENV_SERVERS,
    ENV_TLS_CA,
    SIZE_UNITS_HELP,
    AuthKey,
    ClientConfig,
    ClientTls,
    LaneSpec,
    ServerAddress,
    ServerConfig,
    capacity_warning,
    default_capacity_bytes,
    default_key_path,
    env_value,
    format_size,
    parse_address,
    parse_size,
)
from memkv.errors import AuthError, ConfigError, MemKVError

if TYPE_CHECKING:  # the CLI imports the client lazily: `memkv serve` never loads it
    from memkv.client.cluster import Client
    from memkv.client.node import NodeClient
    from memkv.server.node import Node

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
ENV_LOG_LEVEL = "MEMKV_LOG_LEVEL"


class UsageError(Exception):
    """A bad argument found after parsing (a key too long, an unreadable file): exit 2."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # argparse itself exits 2 on bad usage
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except ConfigError as exc:
        return _fail(args, EXIT_USAGE, f"configuration error: {exc}")
    except UsageError as exc:
        return _fail(args, EXIT_USAGE, str(exc))
    except BrokenPipeError:
        # stdout closed early (`memkv get k | head -c 10`): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_FAILED


def _fail(args: argparse.Namespace, code: int, message: str) -> int:
    print(f"memkv: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        _print_json({"ok": False, "error": message, "exit_code": code})
    return code


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False), flush=True)


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

    s = sub.add_parser("serve", help="run a node")
    s.add_argument(
        "--listen",
        default=f"{DEFAULT_HOST}:{DEFAULT_PORT}",
        help="HOST:PORT of the data port (port 0 picks a free one)",
    )
    s.add_argument(
        "--admin-port", type=int, default=None, help="admin HTTP port (default: data port + 1; 0 picks a free one)"
    )
    s.add_argument("--admin-host", default=None, help="admin HTTP address (default: the data host)")
    s.add_argument(
        "--capacity",
        default=None,
        help=f"byte capacity, e.g. 512MiB, 8GiB; units: {SIZE_UNITS_HELP} "
        "(default: 1/4 of RAM, or of the cgroup memory limit when lower)",
    )
    s.add_argument(
        "--lane",
        action="append",
        default=[],
        metavar="NAME:PREFIX:SHARE",
        help="an eviction lane: keys starting with PREFIX share SHARE of the capacity (repeatable)",
    )
    s.add_argument(
        "--max-value-size", default="64MiB", help="largest value accepted, a size as for --capacity (default 64MiB)"
    )
    s.add_argument("--key-file", default=None, help="file holding the 64-hex auth key (MEMKV_AUTH_KEY wins when set)")
    s.add_argument("--max-connections", type=int, default=1024, help="concurrent client connections (default 1024)")
    s.add_argument("--idle-timeout", type=float, default=300.0, help="seconds an idle connection is kept (default 300)")
    s.add_argument("--io-timeout", type=float, default=30.0, help="seconds a started frame may take (default 30)")
    s.add_argument("--node-id", default="", help="name reported to clients and in status (default host:port)")
    s.add_argument(
        "--max-lease-ttl", type=float, default=300.0, help="seconds a lease (LEASE) may last, at most (default 300)"
    )
    s.add_argument("--max-leases", type=int, default=65536, help="leases held at once, at most (default 65536)")
    s.add_argument(
        "--max-lease-bytes", default=None, help="bytes of values leased at once, at most (default: half the capacity)"
    )
    s.add_argument(
        "--max-lease-share",
        type=float,
        default=0.5,
        help="fraction of --max-leases and --max-lease-bytes one holder (client) may take (default 0.5)",
    )
    s.add_argument(
        "--no-local-socket",
        dest="local_socket",
        action="store_false",
        help="serve same-host clients over TCP too (default: also over an abstract Unix socket, named to them in the "
        "handshake; docs/operations.md, 'Same-host clients')",
    )
    s.add_argument(
        "--no-shared-memory",
        dest="shared_memory",
        action="store_false",
        help="keep values in private memory (default: values of 1 MiB and more in memory that clients on the "
        "same-host socket map and copy from; docs/operations.md, 'Same-host clients')",
    )
    s.add_argument(
        "--shared-memory-group",
        default=None,
        metavar="GROUP",
        help="also offer shared memory to same-host clients in this group (name or gid; default: only to "
        "processes of the node's own uid; docs/operations.md, 'Same-host clients')",
    )
    t = s.add_argument_group("TLS (docs/operations.md, 'Encryption in transit'); SIGHUP re-reads the files")
    t.add_argument("--tls-cert", default=None, metavar="FILE", help="PEM certificate (chain) of the node: turns TLS on")
    t.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    t.add_argument(
        "--tls-ca",
        default=None,
        metavar="FILE",
        help="PEM CA: clients must present a certificate it signed (mutual TLS)",
    )
    t.add_argument(
        "--tls-listen",
        default=None,
        metavar="HOST:PORT",
        help="serve TLS on this second port and keep --listen plain (default: --listen itself is TLS-only)",
    )
    s.set_defaults(func=cmd_serve)

    k = sub.add_parser("keygen", help="print a new auth key (64 hex characters)")
    k.add_argument("--json", action="store_true", help='print {"auth_key": ...}')
    k.set_defaults(func=cmd_keygen)

    pr = sub.add_parser("probe", help="authenticated round trip to every configured server")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_probe)

    st = sub.add_parser("status", help="show each configured server's admin status")
    st.add_argument("--json", action="store_true")
    st.add_argument("--lanes", action="store_true", help="also show each node's eviction lanes")
    st.add_argument("--admin-port-offset", type=int, default=1, help="admin port = data port + this (default 1)")
    st.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each node's admin port (default 2)")
    st.set_defaults(func=cmd_status)

    he = sub.add_parser(
        "health",
        help="liveness of the local node (Docker HEALTHCHECK): its admin /v1/health, HTTPS when it has TLS",
        description="Find the node's admin port and TLS settings in the `memkv serve` command line of "
        "process --pid (default 1: the container's entrypoint; with an init process as PID 1, its "
        "children are searched), then GET /v1/health. Over HTTPS the node's certificate is verified "
        "against MEMKV_TLS_CA when set, else against the node's own --tls-cert file; the host name "
        "is not checked (the request goes to this host's loopback). Exit 0 when the node answers 200.",
    )
    he.add_argument("--pid", type=int, default=1, help="process running `memkv serve` (default 1)")
    he.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer (default 2)")
    he.add_argument("--json", action="store_true")
    he.set_defaults(func=cmd_health)

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

    g = sub.add_parser("get", help="print or save one value (exit 1 on a miss)")
    g.add_argument("key")
    g.add_argument("-o", "--output", help="write the value to this file (default: stdout)")
    g.add_argument(
        "--json",
        action="store_true",
        help="print the value's metadata as JSON (the value itself only goes to --output)",
    )
    g.set_defaults(func=cmd_get)
    pu = sub.add_parser("put", help="store one value from a file or stdin")
    pu.add_argument("key")
    pu.add_argument("file", help="path, or - for stdin")
    pu.add_argument("--json", action="store_true")
    pu.set_defaults(func=cmd_put)
    d = sub.add_parser("del", help="delete keys (exit 1 unless every key was deleted)")
    d.add_argument("keys", nargs="+")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_del)
    ls = sub.add_parser(
        "ls", help="list stored keys under a prefix, in byte order (exit 1 when none, or a server fails)"
    )
    ls.add_argument("prefix", nargs="?", default="", help="list keys starting with this (default: every key)")
    ls.add_argument("--limit", type=int, default=1000, help="list at most this many keys (1..4096, default 1000)")
    ls.add_argument("--json", action="store_true", help="print the keys, their sizes and servers as JSON")
    ls.set_defaults(func=cmd_ls)
    return ap


# -- serve ------------------------------------------------------------------------------------------


def _group_id(name: str | None) -> int | None:
    """--shared-memory-group: a group name or a numeric gid."""
    if name is None:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"--shared-memory-group: no group named {name!r}") from None


def _server_key(args: argparse.Namespace) -> AuthKey:
    if env_value(os.environ, ENV_AUTH_KEY) is not None:
        return AuthKey.from_hex(os.environ[ENV_AUTH_KEY], ENV_AUTH_KEY)
    if args.key_file:
        return AuthKey.from_file(args.key_file, "--key-file")
    path = default_key_path()
    if path.exists():
        return AuthKey.from_file(path, "default key file")
    key_hex = secrets.token_hex(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        # A hardened service (read-only or missing home) cannot keep a generated key: say what to set.
        raise ConfigError(
            f"no auth key configured ({ENV_AUTH_KEY} or --key-file) and none can be created at {path}: "
            f"{exc.strerror}; create one with `memkv keygen`"
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(key_hex + "\n")
    print(f"memkv: no auth key configured; created one in {path} (mode 0600).", flush=True)
    print(f"memkv: clients on other hosts need it: export {ENV_AUTH_KEY}=$(cat {path})", flush=True)
    return AuthKey.from_hex(key_hex, str(path))


def cmd_serve(args: argparse.Namespace) -> int:
    import faulthandler

    from memkv.server.admin import AdminServer
    from memkv.server.node import Node
    from memkv.server.shared import SHMEM_THP, shmem_huge_pages

    # A crash in native code (NIXL/UCX, the compiled receive loop) then leaves every thread's
    # Python stack on stderr, where `kubectl logs` finds it, instead of a bare exit code -11.
    faulthandler.enable()
    host, port = parse_address(args.listen, "--listen", DEFAULT_PORT)
    capacity = parse_size(args.capacity, "--capacity") if args.capacity else default_capacity_bytes()
    if warning := capacity_warning(capacity):
        logging.getLogger("memkv.serve").warning("%s", warning)
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
        max_lease_s=args.max_lease_ttl,
        max_leases=args.max_leases,
        max_lease_bytes=parse_size(args.max_lease_bytes, "--max-lease-bytes") if args.max_lease_bytes else None,
        max_lease_share=args.max_lease_share,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        tls_listen=parse_address(args.tls_listen, "--tls-listen") if args.tls_listen else None,
        local_socket=args.local_socket,
        shared_memory=args.shared_memory,
        shared_memory_group=_group_id(args.shared_memory_group),
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

    def on_signal(signum: int, frame: object) -> None:
        threading.Thread(target=node.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _serve_tls_lines(node)
    ah, ap = admin.address
    print(f"memkv node listening on {_fmt(node.address[0])}:{node.address[1]} (admin {_fmt(ah)}:{ap})", flush=True)
    print(
        f"memkv: capacity {format_size(capacity)}, max value {format_size(config.max_value_bytes)}, "
        f"lanes {[lane.name for lane in node.store.lanes]}",
        flush=True,
    )
    if node.local_socket:
        shared = ""
        if node.shared is not None:
            group = config.shared_memory_group
            shared = ", values of 1 MiB and more as sealed memfds for clients of uid " + str(os.geteuid())
            shared += f" or group {group}" if group is not None else ""
        print(f"memkv: same-host clients connect to {node.local_socket} (abstract Unix socket{shared})", flush=True)
        huge = shmem_huge_pages() if node.shared is not None else "advise"
        if huge in ("never", "deny"):
            logging.getLogger("memkv.serve").warning(
                "transparent huge pages for shared memory are %r on this host: stores through shared memory run "
                "at a third of their speed or less; set %s to advise (docs/operations.md, 'Same-host clients')",
                huge,
                SHMEM_THP,
            )
    try:
        node.serve_forever()
    finally:
        admin.shutdown()
    print("memkv: node stopped", flush=True)
    return EXIT_OK


def _serve_tls_lines(node: Node) -> None:
    """With TLS: SIGHUP re-reads the certificate files (cert-manager rotates them in place),
    and a line says where TLS is served (memkv.local parses it)."""
    tls, where = node.tls, node.tls_address
    if tls is None or where is None:
        return

    def on_hup(signum: int, frame: object) -> None:
        threading.Thread(target=tls.reload, name="memkv-tls-reload", daemon=True).start()

    signal.signal(signal.SIGHUP, on_hup)
    mode = "mutual TLS" if tls.mutual else "TLS"
    plain = f"; plain on {_fmt(node.address[0])}:{node.address[1]}" if where != node.address else ""
    print(f"memkv: TLS on {_fmt(where[0])}:{where[1]} ({mode}, TLS 1.3; admin HTTPS{plain})", flush=True)


def _fmt(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# -- client commands ----------------------------------------------------------------------------------


def cmd_keygen(args: argparse.Namespace) -> int:
    key_hex = secrets.token_hex(32)
    if args.json:
        _print_json({"ok": True, "auth_key": key_hex})
    else:
        print(key_hex)
    return EXIT_OK


def _client() -> Client:
    from memkv.client.cluster import Client

    return Client(ClientConfig.from_env())


_PLAIN_KEY_BYTES = frozenset(range(0x21, 0x7F)) - {0x5C}  # printable ASCII but space and backslash


def format_key(key: bytes) -> str:
    r"""A key as the CLI prints it: printable ASCII as is, a backslash as `\\`, every other
    byte (space, control, non-ASCII) as `\xNN`. One whitespace-free token that cannot
    drive the terminal, and `parse_key` turns it back into the same bytes."""
    if all(b in _PLAIN_KEY_BYTES for b in key):
        return key.decode("ascii")
    return "".join(chr(b) if b in _PLAIN_KEY_BYTES else "\\\\" if b == 0x5C else f"\\x{b:02x}" for b in key)


def parse_key(text: str) -> bytes:
    r"""A key argument as bytes: `\\` and `\xNN` are unescaped (what `format_key` writes),
    anything else is taken as typed (UTF-8; os.fsencode keeps the raw bytes of an argument
    that is not valid UTF-8). Raises UsageError on any other backslash sequence."""
    raw = os.fsencode(text)
    if b"\\" not in raw:
        return raw
    out = bytearray()
    i = 0
    while i < len(raw):
        b = raw[i]
        if b != 0x5C:
            out.append(b)
            i += 1
        elif raw[i + 1 : i + 2] == b"\\":
            out.append(0x5C)
            i += 2
        elif raw[i + 1 : i + 2] == b"x" and re.fullmatch(rb"[0-9a-fA-F]{2}", raw[i + 2 : i + 4]):
            out.append(int(raw[i + 2 : i + 4], 16))
            i += 4
        else:
            bad = raw[i : i + (4 if raw[i + 1 : i + 2] == b"x" else 2)].decode("utf-8", "backslashreplace")
            raise UsageError(f'bad escape "{bad}" in key "{text}": write a backslash as \\\\ and a byte as \\xNN')
    return bytes(out)


def _key_arg(text: str) -> bytes:
    from memkv.protocol import DEFAULT_MAX_KEY_BYTES

    key = parse_key(text)
    if not 0 < len(key) <= DEFAULT_MAX_KEY_BYTES:
        raise UsageError(f"a key must be 1..{DEFAULT_MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def _failure(server: str, exc: MemKVError) -> str:
    """What went wrong with `server`, worded by who is at fault: a node that answered but does
    not share our key is not unreachable."""
    if isinstance(exc, AuthError):
        return f"authentication failed on server {server}: {exc}"
    return f"server {server} unreachable: {exc}"


def _unreachable(client: Client, server: str) -> str | None:
    """Why `server` is marked down after a failed call, or None when it answered."""
    for h in client.health():
        if h["server"] == server and not h["up"]:
            return h["last_error"] or "unreachable"
    return None


def cmd_probe(args: argparse.Namespace) -> int:
    config = ClientConfig.from_env()
    from memkv.client.cluster import Client

    results = []
    with Client(config) as client:
        for node in client._nodes:  # every server, in the configured order, ignoring down marks
            try:
                rtt = node.ping()
                results.append(
                    {
                        "server": node.name,
                        "ok": True,
                        "node_id": node.node_id,
                        "rtt_ms": round(rtt * 1000, 3),
                        "max_value_bytes": node.limits.max_value_bytes if node.limits else None,
                        # the node's same-host socket (docs/operations.md "Same-host clients"), with
                        # its shared memory (MEMKV_SHARED_MEMORY=on and the node offers it), or TCP
                        "via": "shm" if node.shared else "local" if node.local else "tcp",
                    }
                )
            except MemKVError as exc:
                results.append({"server": node.name, "ok": False, "error": str(exc)})
    ok = all(r["ok"] for r in results)
    if args.json:
        _print_json({"ok": ok, "servers": results})
    else:
        for r in results:
            if r["ok"]:
                print(f"ok    {r['server']}  node={r['node_id']}  rtt={r['rtt_ms']:.3f} ms  via={r['via']}")
            else:
                print(f"FAIL  {r['server']}  {r['error']}")
    return EXIT_OK if ok else EXIT_FAILED


# -- status -----------------------------------------------------------------------------------------


def fetch_status(host: str, admin_port: int, timeout_s: float = 2.0, tls: ClientTls | None = None) -> dict[str, Any]:
    """GET /v1/status; over HTTPS when the client has TLS settings (the node's certificate is
    verified against MEMKV_TLS_CA, its name against MEMKV_TLS_SERVER_NAME or `host`)."""
    ctx = None
    if tls is not None:
        from memkv.tls import client_context

        ctx = client_context(tls)
    status, body = admin_get(host, admin_port, "/v1/status", timeout_s, ctx, tls.server_name if tls else None)
    if status != 200:
        raise urllib.error.URLError(f"HTTP {status}")
    doc: dict[str, Any] = json.loads(body)
    return doc


def admin_get(
    host: str, admin_port: int, path: str, timeout_s: float, ctx: ssl.SSLContext | None, server_name: str | None = None
) -> tuple[int, bytes]:
    """(HTTP status, body) of GET `path` on an admin port: plain HTTP, or HTTPS through `ctx`
    (the certificate checked against `server_name` or `host` when `ctx` checks host names)."""
    if ctx is None:
        try:
            with urllib.request.urlopen(f"http://{_fmt(host)}:{admin_port}{path}", timeout=timeout_s) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
    sock = socket.create_connection((host, admin_port), timeout=timeout_s)
    try:
        wrapped = ctx.wrap_socket(sock, server_hostname=server_name or host)
    except BaseException:
        sock.close()
        raise
    conn = http.client.HTTPConnection(host, admin_port, timeout=timeout_s)
    conn.sock = wrapped  # http.client sends on a socket already set instead of connecting
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# -- health -----------------------------------------------------------------------------------------

# How many children of an init process (`docker run --init`: PID 1 is tini) are searched.
_HEALTH_MAX_CHILDREN = 16


def _serve_args_of(pid: int) -> argparse.Namespace | None:
    """The parsed `memkv serve` arguments of process `pid` (or of one of its children when it is
    an init process), None when neither runs `memkv serve`. Parsed by the serve command's own
    parser, so the defaults are the node's."""
    candidates = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            candidates += [int(c) for c in f.read().split()[:_HEALTH_MAX_CHILDREN]]
    except OSError:
        pass
    for candidate in candidates:
        try:
            with open(f"/proc/{candidate}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        # `memkv serve ...` (the console script) or `python -m memkv serve ...`
        for i, word in enumerate(argv[:-1]):
            if word == "serve" and (argv[i - 1].endswith("memkv") if i else False):
                try:
                    return _parser().parse_args(argv[i:])
                except SystemExit:
                    raise UsageError(f"process {candidate}: its `memkv serve` arguments do not parse") from None
    return None


def cmd_health(args: argparse.Namespace) -> int:
    serve = _serve_args_of(args.pid)
    if serve is None:
        raise UsageError(f"process {args.pid} is not `memkv serve` (nor is any of its children): pass --pid")
    host, port = parse_address(serve.listen, "--listen", DEFAULT_PORT)
    admin_port = serve.admin_port if serve.admin_port is not None else (port + 1 if port else 0)
    if not admin_port:
        raise UsageError("the node's admin port is picked at random (port 0): start it with --admin-port")
    admin_host = serve.admin_host or host
    admin_host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(admin_host, admin_host)
    ctx = None
    if serve.tls_cert:
        ca = env_value(os.environ, ENV_TLS_CA)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False  # loopback to our own node; the trust anchor below decides
        if ca is None:  # the node's own certificate is the one trust anchor
            ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        try:
            ctx.load_verify_locations(cafile=ca or serve.tls_cert)
        except (OSError, ssl.SSLError) as exc:
            which = f"{ENV_TLS_CA} {ca}" if ca else f"the node's --tls-cert {serve.tls_cert}"
            raise ConfigError(f"{which}: cannot be used to verify the admin port: {exc}") from None
    where = f"{'https' if ctx else 'http'}://{_fmt(admin_host)}:{admin_port}/v1/health"
    try:
        status, _ = admin_get(admin_host, admin_port, "/v1/health", args.timeout, ctx)
    except (OSError, http.client.HTTPException) as exc:
        from memkv.errors import explain_tls

        reason = explain_tls(exc) if isinstance(exc, ssl.SSLError) else (getattr(exc, "reason", None) or exc)
        return _fail(args, EXIT_FAILED, f"{where}: {reason}")
    if status != 200:
        return _fail(args, EXIT_FAILED, f"{where}: HTTP {status}")
    if args.json:
        _print_json({"ok": True, "url": where, "status": status})
    else:
        print(f"{where}: ok")
    return EXIT_OK


def _status_row(
    server: ServerAddress, offset: int, timeout_s: float, node: NodeClient | None = None, tls: ClientTls | None = None
) -> dict[str, Any]:
    """One server's admin status, then (with `node`, its NodeClient) an authenticated PING on
    its data port: the admin port takes no key, so only the ping shows that ours is right."""
    row: dict[str, Any] = {"server": server.name, "admin": f"{_fmt(server.host)}:{server.port + offset}"}
    try:
        s = fetch_status(server.host, server.port + offset, timeout_s, tls)
        hits, misses = int(s["hits"]), int(s["misses"])
        row.update(
            {
                "health": "ok" if s["ready"] else "draining",
                "node_id": s["node_id"],
                "version": s.get("version"),
                "uptime_s": s.get("uptime_s"),
                "used_bytes": s["allocated_bytes"],  # kept for scripts written before allocated_bytes
                "allocated_bytes": s["allocated_bytes"],
                "stored_bytes": s["stored_bytes"],
                "capacity_bytes": s["capacity_bytes"],
                "used_ratio": s["allocated_bytes"] / s["capacity_bytes"] if s["capacity_bytes"] else None,
                "values": s["values"],
                "shm_bytes": (s.get("shared_memory") or {}).get("bytes", 0),  # of allocated_bytes, in memfds
                "hits": hits,
                "misses": misses,
                "hit_ratio": hits / (hits + misses) if hits + misses else None,
                "evictions": s["evictions"],
                "connections": s["connections"],
                "max_value_bytes": s.get("max_value_bytes"),
                "lanes": [
                    {
                        k: lane[k]
                        for k in ("name", "prefix", "share", "share_bytes", "used_bytes", "values", "evictions")
                        if k in lane
                    }
                    for lane in s.get("lanes", [])
                ],
            }
        )
    except urllib.error.URLError as exc:
        row.update({"health": "down", "error": f"admin port {row['admin']}: {getattr(exc, 'reason', exc)}"})
    except ssl.SSLError as exc:
        from memkv.tls import explain

        row.update({"health": "down", "error": f"admin port {row['admin']} (HTTPS): {explain(exc)}"})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        row.update({"health": "down", "error": f"admin port {row['admin']}: bad answer ({type(exc).__name__}: {exc})"})
    if "error" in row or node is None:
        row["auth"] = "not checked"
        return row
    try:
        node.ping()
        row["auth"] = "ok"
    except AuthError as exc:
        row.update(
            {
                "health": "auth failed",
                "auth": "failed",
                "data_error": f"data port {server.name}: authentication failed: {exc}",
            }
        )
    except MemKVError as exc:
        row.update({"health": "down", "auth": "not checked", "data_error": f"data port {server.name}: {exc}"})
    return row


def _cluster_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    up = [r for r in rows if "error" not in r]
    hits, misses = sum(r["hits"] for r in up), sum(r["misses"] for r in up)
    capacity = sum(r["capacity_bytes"] for r in up)
    used = sum(r["used_bytes"] for r in up)
    return {
        "servers": len(rows),
        "healthy": sum(1 for r in rows if r["health"] == "ok"),
        "used_bytes": used,
        "allocated_bytes": used,
        "stored_bytes": sum(r["stored_bytes"] for r in up),
        "shm_bytes": sum(r.get("shm_bytes", 0) for r in up),
        "capacity_bytes": capacity,
        "used_ratio": used / capacity if capacity else None,
        "values": sum(r["values"] for r in up),
        "hits": hits,
        "misses": misses,
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
        "evictions": sum(r["evictions"] for r in up),
        "connections": sum(r["connections"] for r in up),
    }


def cmd_status(args: argparse.Namespace) -> int:
    config = ClientConfig.from_env()
    servers = list(config.servers)
    from memkv.client.cluster import Client

    with Client(config) as client, concurrent.futures.ThreadPoolExecutor(min(16, len(servers))) as pool:
        nodes = {n.name: n for n in client._nodes}  # a dead node costs one timeout, not N
        rows = list(
            pool.map(
                lambda s: _status_row(s, args.admin_port_offset, args.timeout, nodes.get(s.name), config.tls), servers
            )
        )
    totals = _cluster_totals(rows)
    ok = totals["healthy"] == len(rows)
    if args.json:
        _print_json({"ok": ok, "servers": rows, "cluster": totals})
        return EXIT_OK if ok else EXIT_FAILED
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title="MemKV cluster", show_footer=len(rows) > 1)
    cols = (
        "server",
        "node",
        "health",
        "stored / allocated / capacity",
        "values",
        "hit ratio",
        "evictions",
        "conns",
        "uptime",
    )
    footer = (
        "total",
        "",
        f"{totals['healthy']}/{totals['servers']} ok",
        _used(totals),
        str(totals["values"]),
        _ratio(totals["hit_ratio"]),
        str(totals["evictions"]),
        str(totals["connections"]),
        "",
    )
    for col, foot in zip(cols, footer):
        table.add_column(
            col, footer=foot, justify="right" if col in ("values", "evictions", "conns", "uptime") else "left"
        )
    for r in rows:
        if "error" in r:
            table.add_row(r["server"], "", "[red]DOWN[/red]", r["error"], "", "", "", "", "")
            continue
        health = {
            "ok": "[green]ok[/green]",
            "draining": "[yellow]draining[/yellow]",
            "auth failed": "[red]AUTH FAILED[/red]",
        }.get(r["health"], "[red]DOWN[/red]")
        table.add_row(
            r["server"],
            str(r["node_id"]),
            health,
            _used(r),
            str(r["values"]),
            _ratio(r["hit_ratio"]),
            str(r["evictions"]),
            str(r["connections"]),
            _duration(r.get("uptime_s")),
        )
    console.print(table)
    if args.lanes:
        lanes = Table(title="lanes")
        for col in ("server", "lane", "prefix", "used / share", "values", "evictions"):
            lanes.add_column(col)
        for r in rows:
            for lane in r.get("lanes", []):
                lanes.add_row(
                    r["server"],
                    lane["name"],
                    repr(lane.get("prefix", "")),
                    f"{format_size(lane['used_bytes'])} / {format_size(lane['share_bytes'])}",
                    str(lane["values"]),
                    str(lane["evictions"]),
                )
        console.print(lanes)
    for r in rows:
        if r["health"] != "ok":
            print(
                f"memkv: {r['server']}: {r.get('error') or r.get('data_error') or 'not ready (shutting down)'}",
                file=sys.stderr,
            )
    return EXIT_OK if ok else EXIT_FAILED


def _used(r: dict[str, Any]) -> str:
    """Stored value bytes, then the buffer bytes allocated for them (stored values rounded up to
    pages, buffers pooled for reuse, PUTs in flight), out of the capacity."""
    pct = f" ({r['used_ratio']:.0%} allocated)" if r.get("used_ratio") is not None else ""
    shm = f", {format_size(r['shm_bytes'])} in memfds" if r.get("shm_bytes") else ""
    return (
        f"{format_size(r['stored_bytes'])} / {format_size(r['used_bytes'])} / {format_size(r['capacity_bytes'])}"
        f"{pct}{shm}"
    )


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


# -- get / put / del --------------------------------------------------------------------------------


def cmd_get(args: argparse.Namespace) -> int:
    key = _key_arg(args.key)
    present = down = None
    with _client() as client:
        server = client.owner(key).name
        value = client.get(key)
        if value is None:  # a miss reads like an unreachable node: ask the owner directly
            try:
                present = client.exists_on(server, [key])[0]
            except MemKVError as exc:
                down = _failure(server, exc)
    doc = {"ok": value is not None, "key": args.key, "server": server, "found": value is not None}
    if down:
        doc["error"] = down
    elif present:
        doc["error"] = "stored but not loaded (it failed its checksum, or changed while being read)"
    elif value is None:
        doc["error"] = "miss"
    else:
        doc.update({"bytes": len(value), "sha256": hashlib.sha256(value).hexdigest(), "output": args.output})
        if args.output:
            try:
                with open(args.output, "wb") as f:
                    f.write(value)
            except OSError as exc:
                raise UsageError(f"cannot write {args.output}: {exc.strerror}") from None
        elif not args.json:
            sys.stdout.buffer.write(value)
            sys.stdout.buffer.flush()
    if value is None:
        print(f"memkv: {args.key}: {doc['error']}", file=sys.stderr)
    if args.json:
        _print_json(doc)
    return EXIT_OK if value is not None else EXIT_FAILED


def cmd_put(args: argparse.Namespace) -> int:
    key = _key_arg(args.key)
    try:
        if args.file == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(args.file, "rb") as f:
                data = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {args.file}: {exc.strerror}") from None
    if not data:
        raise UsageError("refusing to store an empty value")
    with _client() as client:
        server = client.owner(key).name
        try:
            client.put(key, data)
            error = None
        except MemKVError as exc:
            error = _failure(server, exc) if isinstance(exc, AuthError) else str(exc)
    doc = {"ok": error is None, "key": args.key, "server": server, "bytes": len(data)}
    if error:
        doc["error"] = error
        print(f"memkv: put failed: {error}", file=sys.stderr)
    if args.json:
        _print_json(doc)
    elif not error:
        print(f"stored {len(data)} bytes under {args.key} on {server}")
    return EXIT_OK if error is None else EXIT_FAILED


def cmd_del(args: argparse.Namespace) -> int:
    keys = [_key_arg(k) for k in args.keys]
    with _client() as client:
        deleted = client.delete(keys)
        results = []
        for text, key, ok in zip(args.keys, keys, deleted):
            server = client.owner(key).name
            down = None if ok else _unreachable(client, server)
            result = "deleted" if ok else ("unreachable" if down else "missing")
            entry = {"key": text, "server": server, "result": result}
            if down:
                entry["error"] = down
            results.append(entry)
    ok = all(deleted)
    if args.json:
        _print_json({"ok": ok, "keys": results})
    else:
        for r in results:
            print(f"{r['result']:<11}  {r['key']}" + (f"  ({r['server']}: {r['error']})" if "error" in r else ""))
    return EXIT_OK if ok else EXIT_FAILED


def cmd_ls(args: argparse.Namespace) -> int:
    from memkv.protocol import DEFAULT_MAX_KEY_BYTES, Limits

    prefix = parse_key(args.prefix)
    if len(prefix) > DEFAULT_MAX_KEY_BYTES:
        raise UsageError(f"a key prefix must be 0..{DEFAULT_MAX_KEY_BYTES} bytes, got {len(prefix)}")
    most = Limits().max_list_keys
    if not 1 <= args.limit <= most:
        raise UsageError(f"--limit must be 1..{most}, got {args.limit}")
    with _client() as client:
        servers = [s.name for s in client.servers()]
        listing = client.list_keys(prefix, args.limit)
    shown = format_key(prefix)
    errors = [f"server {name} did not answer: {why}" for name, why in listing.failed.items()]
    if not listing.keys and not errors:
        errors.append(f'no keys start with "{shown}"' if prefix else "no keys stored")
    if args.json:
        listed = {name: 0 for name in servers}
        for e in listing.keys:
            listed[e.server] = listed.get(e.server, 0) + 1
        doc = {
            "ok": not errors,
            "prefix": shown,
            "limit": args.limit,
            "count": len(listing.keys),
            "truncated": listing.truncated,
            "keys": [{"key": format_key(e.key), "bytes": e.length, "server": e.server} for e in listing.keys],
            "servers": [
                {"server": name, "ok": False, "error": listing.failed[name]}
                if name in listing.failed
                else {"server": name, "ok": True, "listed": listed.get(name, 0)}
                for name in servers
            ],
        }
        if errors:
            doc["error"] = "; ".join(errors)
        _print_json(doc)
    else:
        names = [format_key(e.key) for e in listing.keys]
        width = max(map(len, names), default=0)
        for name, e in zip(names, listing.keys):
            print(f"{name:<{width}}  {e.length:>10}  {e.server}")
        sys.stdout.flush()
    if listing.truncated:
        print(
            f"memkv: listing stops at --limit {args.limit}: more keys match (narrow the prefix or raise --limit)",
            file=sys.stderr,
        )
    for error in errors:
        print(
            f"memkv: {error}" + ("; its keys are missing from this listing" if "did not answer" in error else ""),
            file=sys.stderr,
        )
    return EXIT_FAILED if errors else EXIT_OK


# -- bench ----------------------------------------------------------------------------------------------


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
        return _fail(args, EXIT_FAILED, f"bench failed: {exc}")
    result = {"ok": True, **result}  # run_client_bench raises unless every value was stored, loaded and verified
    if args.json:
        _print_json(result)
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
