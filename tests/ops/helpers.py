"""Helpers for the operator-facing tests: real nodes with production port layout, a clean
environment for the `memkv` command, and the one way to wait (a deadline-bounded poll)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from memkv.local import LocalNode
from tests.conftest import poll_until  # noqa: F401  (re-exported: one implementation)

REPO = Path(__file__).resolve().parents[2]


def _free_port_pair() -> int:
    """A port P on 127.0.0.1 with P and P+1 both free right now (bounded search)."""
    for _ in range(100):
        a, b = socket.socket(), socket.socket()
        try:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
        finally:
            a.close()
            b.close()
    raise RuntimeError("no free pair of adjacent ports on 127.0.0.1")


def start_node_with_adjacent_admin(
    key_hex: str, capacity: str = "64MiB", extra_args=(), attempts: int = 5
) -> LocalNode:
    """A node listening on P with its admin port on P+1, as `memkv serve` lays them out in
    production. Another process may take a port between the search and the bind: then try
    again with a new pair (bounded)."""
    last: Exception | None = None
    for _ in range(attempts):
        port = _free_port_pair()
        try:
            node = LocalNode(key_hex, capacity=capacity, port=port, extra_args=list(extra_args), ready_timeout_s=30.0)
        except RuntimeError as exc:
            last = exc
            continue
        assert node.admin_port == node.port + 1, node.output
        return node
    raise RuntimeError(f"could not start a node with an adjacent admin port: {last}")


class Nodes:
    """Starts nodes on demand and stops every one of them in `stop_all`."""

    def __init__(self, key_hex: str) -> None:
        self.key_hex = key_hex
        self.started: list[LocalNode] = []

    def __call__(self, count: int = 1, capacity: str = "64MiB", extra_args=()) -> list[LocalNode]:
        nodes = []
        for _ in range(count):
            node = start_node_with_adjacent_admin(self.key_hex, capacity, extra_args)
            self.started.append(node)
            nodes.append(node)
        return nodes

    def stop_all(self) -> None:
        for node in reversed(self.started):
            try:
                node.stop(timeout_s=10.0)
            except Exception:  # keep stopping the others
                node.kill()


def clean_env(tmp_dir: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without any MEMKV_* variable, with a private XDG_CONFIG_HOME
    (so no default key file of the machine is picked up), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMKV_")}
    env.update({"XDG_CONFIG_HOME": str(tmp_dir / "xdg"), "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def as_json(proc) -> dict:
    """The `--json` document a CLI run printed: one object with a boolean `ok`."""
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"not JSON on stdout (exit {proc.returncode}):\n{proc.stdout!r}\n{proc.stderr!r}")
    assert isinstance(doc, dict) and isinstance(doc.get("ok"), bool), doc
    return doc
