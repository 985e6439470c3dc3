"""`memkv probe` and `memkv status`: the configured cluster as an operator sees it."""

from __future__ import annotations

import argparse
import concurrent.futures
import ssl
import sys
import urllib.error
from typing import TYPE_CHECKING, Any

from memkv.cli.admin import fetch_status
from memkv.cli.common import EXIT_FAILED, EXIT_OK, fmt_host, print_json
from memkv.config import ClientConfig, ClientTls, ServerAddress
from memkv.errors import AuthError, MemKVError

if TYPE_CHECKING:  # the client is imported when a command runs
    from memkv.client.node import NodeClient


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pr = sub.add_parser("probe", help="authenticated round trip to every configured server")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_probe)

    st = sub.add_parser("status", help="show each configured server's admin status")
    st.add_argument("--json", action="store_true")
    st.add_argument("--lanes", action="store_true", help="also show each node's eviction lanes")
    st.add_argument("--admin-port-offset", type=int, default=1, help="admin port = data port + this (default 1)")
    st.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each node's admin port (default 2)")
    st.set_defaults(func=cmd_status)


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
        print_json({"ok": ok, "servers": results})
    else:
        for r in results:
            if r["ok"]:
                print(f"ok    {r['server']}  node={r['node_id']}  rtt={r['rtt_ms']:.3f} ms  via={r['via']}")
            else:
                print(f"FAIL  {r['server']}  {r['error']}")
    return EXIT_OK if ok else EXIT_FAILED


def _status_row(
    server: ServerAddress, offset: int, timeout_s: float, node: NodeClient | None = None, tls: ClientTls | None = None
) -> dict[str, Any]:
    """One server's admin status, then (with `node`, its NodeClient) an authenticated PING on
    its data port: the admin port takes no key, so only the ping shows that ours is right."""
    row: dict[str, Any] = {"server": server.name, "admin": f"{fmt_host(server.host)}:{server.port + offset}"}
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
                "shm_bytes": _memfd_bytes(s.get("shared_memory") or {}),
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
        print_json({"ok": ok, "servers": rows, "cluster": totals})
        return EXIT_OK if ok else EXIT_FAILED
    from memkv.cli.tables import print_status  # rich only for the human-readable table

    print_status(rows, totals, args.lanes)
    for r in rows:
        if r["health"] != "ok":
            print(
                f"memkv: {r['server']}: {r.get('error') or r.get('data_error') or 'not ready (shutting down)'}",
                file=sys.stderr,
            )
    return EXIT_OK if ok else EXIT_FAILED


def _memfd_bytes(shared: dict[str, int]) -> int:
    """Of a node's allocated_bytes, those in memfds: values clients wrote (and their pending
    reservations), spares, and the node's own reused buffers (node-written memfds)."""
    return sum(shared.get(k, 0) for k in ("bytes", "spare_bytes", "node_written_bytes"))
