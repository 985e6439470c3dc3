"""`memkv health`: liveness of the node this container runs (the Docker HEALTHCHECK)."""

from __future__ import annotations

import argparse
import http.client
import os
import ssl

from memkv.cli.admin import admin_get
from memkv.cli.common import EXIT_FAILED, EXIT_OK, UsageError, fail, fmt_host, print_json
from memkv.cli.proc import serve_argv
from memkv.cli.serve import add_parsers as add_serve_parser
from memkv.config import DEFAULT_PORT, ENV_TLS_CA, env_value, parse_address
from memkv.errors import ConfigError


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def _serve_args_of(pid: int) -> argparse.Namespace | None:
    """The parsed `memkv serve` arguments of process `pid` (or of one of its children when it is
    an init process), None when neither runs `memkv serve`. Parsed by the serve command's own
    parser, so the defaults are the node's."""
    found = serve_argv(pid)
    if found is None:
        return None
    candidate, argv = found
    parser = argparse.ArgumentParser(prog="memkv")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    try:
        return parser.parse_args(argv)
    except SystemExit:
        raise UsageError(f"process {candidate}: its `memkv serve` arguments do not parse") from None


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
    where = f"{'https' if ctx else 'http'}://{fmt_host(admin_host)}:{admin_port}/v1/health"
    try:
        status, _ = admin_get(admin_host, admin_port, "/v1/health", args.timeout, ctx)
    except (OSError, http.client.HTTPException) as exc:
        from memkv.errors import explain_tls

        reason = explain_tls(exc) if isinstance(exc, ssl.SSLError) else (getattr(exc, "reason", None) or exc)
        return fail(args, EXIT_FAILED, f"{where}: {reason}")
    if status != 200:
        return fail(args, EXIT_FAILED, f"{where}: HTTP {status}")
    if args.json:
        print_json({"ok": True, "url": where, "status": status})
    else:
        print(f"{where}: ok")
    return EXIT_OK
