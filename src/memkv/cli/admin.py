"""The client of a node's admin HTTP port (plain HTTP, or HTTPS with the client's TLS settings)."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.error
import urllib.request
from typing import Any

from memkv.cli.common import fmt_host
from memkv.config import ClientTls


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
            with urllib.request.urlopen(f"http://{fmt_host(host)}:{admin_port}{path}", timeout=timeout_s) as resp:
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
