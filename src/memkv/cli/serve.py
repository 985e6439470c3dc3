"""`memkv serve`: run a node (its flags, its auth key, its start lines and signals)."""

from __future__ import annotations

import argparse
import grp
import logging
import os
import secrets
import signal
import sys
import threading
from typing import TYPE_CHECKING

from memkv.cli.common import EXIT_FAILED, EXIT_OK, fmt_host
from memkv.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ENV_AUTH_KEY,
    SIZE_UNITS_HELP,
    AuthKey,
    LaneSpec,
    ServerConfig,
    capacity_warning,
    default_capacity_bytes,
    default_key_path,
    env_value,
    format_size,
    parse_address,
    parse_size,
)
from memkv.errors import ConfigError

if TYPE_CHECKING:
    from memkv.server.node import Node


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`serve` and its flags (`memkv health` parses a node's command line with them too)."""
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
    s.add_argument(
        "--shared-memory-spares",
        default="auto",
        choices=("auto", "on", "off"),
        help="fault fresh memfds in ahead of same-host stores, on a node thread (default auto: on where the node "
        "may use 4 CPUs or more; docs/operations.md, 'Same-host clients')",
    )
    s.add_argument(
        "--shared-memory-stores",
        default="auto",
        choices=("auto", "client", "node"),
        help="where same-host clients' stores of 1 MiB and more go: client = into a fresh memfd each, which the "
        "client writes (no node CPU; needs huge pages for shared memory to be fast), node = over the socket into "
        "memfds the node writes and reuses (default auto: client where the host gives shared memory huge pages "
        "on advice, else node; docs/operations.md, 'Same-host clients')",
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

    from memkv.memfd import SHMEM_THP, shmem_huge_pages
    from memkv.server.admin import AdminServer
    from memkv.server.node import Node

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
        shared_memory_spares=args.shared_memory_spares,
        shared_memory_stores=args.shared_memory_stores,
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
    print(
        f"memkv node listening on {fmt_host(node.address[0])}:{node.address[1]} (admin {fmt_host(ah)}:{ap})", flush=True
    )
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
            shared += ", stored by " + ("the clients (SHM_PUT)" if node.client_stores else "the node")
        print(f"memkv: same-host clients connect to {node.local_socket} (abstract Unix socket{shared})", flush=True)
        huge = shmem_huge_pages() if node.client_stores else "advise"
        if huge in ("never", "deny"):
            logging.getLogger("memkv.serve").warning(
                "transparent huge pages for shared memory are %r on this host: stores through shared memory run "
                "at half their speed or less; set %s to advise, or let the node write them "
                "(--shared-memory-stores auto or node; docs/operations.md, 'Same-host clients')",
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
    plain = f"; plain on {fmt_host(node.address[0])}:{node.address[1]}" if where != node.address else ""
    print(f"memkv: TLS on {fmt_host(where[0])}:{where[1]} ({mode}, TLS 1.3; admin HTTPS{plain})", flush=True)
