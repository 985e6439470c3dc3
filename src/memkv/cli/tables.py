"""The tables `memkv status` prints (rich), and how their sizes, ratios and durations read."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from memkv.config import format_size


def print_status(rows: list[dict[str, Any]], totals: dict[str, Any], lanes: bool) -> None:
    """The cluster table (one row per server, totals in the footer), then with `lanes` each node's lanes."""
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
    if lanes:
        lane_table = Table(title="lanes")
        for col in ("server", "lane", "prefix", "used / share", "values", "evictions"):
            lane_table.add_column(col)
        for r in rows:
            for lane in r.get("lanes", []):
                lane_table.add_row(
                    r["server"],
                    lane["name"],
                    repr(lane.get("prefix", "")),
                    f"{format_size(lane['used_bytes'])} / {format_size(lane['share_bytes'])}",
                    str(lane["values"]),
                    str(lane["evictions"]),
                )
        console.print(lane_table)


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
