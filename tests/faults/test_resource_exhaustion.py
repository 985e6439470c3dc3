"""Floods of idle connections cannot end a node or lock its ports: descriptors and the admin port.

Behaviour under test:
* a node started under a low `ulimit -n` (soft and hard 256, set in the child before it starts)
  caps `--max-connections` to what the limit allows, with a WARNING naming the numbers, and a
  flood of idle connections to both ports larger than the limit is refused and counted
  (`memkv_node_connections_refused_total{reason="max_connections"}`) instead of ending the node;
  once the flood ends it serves byte-exact again;
* a node whose descriptors run out while it runs (its RLIMIT_NOFILE cut with prlimit to a few
  above what it holds) keeps its accept loop: accept()'s EMFILE sheds the newest connection,
  is counted (`reason="fd_limit"`), and once the flood ends the node serves again (it used to
  exit: `serve_forever` re-raised the OSError); a shed peer gets a SERVER_BUSY refusal at once;
* the admin port is bounded: during a flood of idle HTTP connections the node holds at most
  its admin cap of them (threads bounded), /v1/health and the data port keep answering, the
  shed connections are counted (`memkv_node_admin_connections_refused_total{reason}`), and the
  idle ones left are closed within the admin port's per-connection deadline.

Every flood is bounded by a connection count; every wait is a deadline-bounded poll.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket

import pytest

from memkv import protocol as p
from memkv.server.admin import ADMIN_TIMEOUT_S
from memkv.server.node import ADMIN_FDS, ADMIN_MAX_CONNECTIONS, PROCESS_FDS
from tests.faults.nodeops import admin_get, metric_value, metrics_of, open_fds, status_of, thread_count

pytestmark = pytest.mark.faults

LOW_NOFILE = 256
FLOOD = 300  # more connections than LOW_NOFILE descriptors


def low_nofile() -> None:  # runs in the child, before exec: `ulimit -n 256` for soft and hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_NOFILE, LOW_NOFILE))


@contextlib.contextmanager
def idle_connections(host: str, port: int, count: int):
    """Up to `count` idle TCP connections to host:port (a refused or reset one is skipped); all
    closed on exit."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            try:
                socks.append(socket.create_connection((host, port), timeout=2.0))
            except OSError:
                continue
        yield socks
    finally:
        for s in socks:
            s.close()


def shed_by_node(sock: socket.socket) -> bool:
    """Whether the node refused (a SERVER_BUSY ServerHello) or closed `sock`, looked at without
    waiting or consuming a byte. A connection the node accepted gets nothing until its hello."""
    sock.setblocking(False)
    try:
        data = sock.recv(p.SERVER_HELLO.size, socket.MSG_PEEK)
        return data == b"" or data.startswith(p.SERVER_HELLO_MAGIC)
    except BlockingIOError:  # open, nothing to read
        return False
    except OSError:  # reset
        return True


def serves(node, make_client, tag: str) -> bool:
    assert node.proc.poll() is None, f"the node exited:\n{''.join(node.output)[-3000:]}"
    client = make_client([node])
    value = os.urandom(256 << 10)
    client.put(f"flood/{tag}", value)
    return client.get(f"flood/{tag}") == value


def test_node_under_a_low_fd_limit_caps_max_connections_warns_and_survives_a_flood(
    start_node, make_client, wait_until, figures
):
    node = start_node(capacity="64MiB", extra_args=["--max-value-size", "16MiB"], preexec_fn=low_nofile)
    capped = LOW_NOFILE - PROCESS_FDS - ADMIN_FDS
    log = "".join(node.output)
    assert f"RLIMIT_NOFILE is {LOW_NOFILE} (hard {LOW_NOFILE}): --max-connections 1024 capped to {capped}" in log, log
    assert status_of(node)["max_connections"] == capped
    before = metric_value(metrics_of(node), "memkv_node_connections_refused_total", reason="max_connections")
    with (
        idle_connections(node.host, node.admin_port, FLOOD // 2),
        idle_connections(node.host, node.port, FLOOD) as data,
    ):
        assert len(data) > capped
        wait_until(
            lambda: (
                metric_value(metrics_of(node), "memkv_node_connections_refused_total", reason="max_connections")
                >= before + len(data) - capped
            ),
            10.0,
            what="the connections over the cap to be refused and counted",
        )
        assert node.proc.poll() is None
        peak_fds = open_fds(node.pid)
    assert peak_fds <= LOW_NOFILE
    wait_until(lambda: status_of(node)["connections"] == 0, 10.0, what="the flood's connections to close")
    assert serves(node, make_client, "low-limit")
    assert admin_get(node, "/v1/health")[0] == 200
    figures(
        nofile=LOW_NOFILE, max_connections_capped_to=capped, flood_connections=FLOOD + FLOOD // 2, peak_fds=peak_fds
    )


def test_accept_out_of_descriptors_sheds_counts_and_keeps_serving(start_node, make_client, wait_until, figures):
    node = start_node(capacity="64MiB", extra_args=["--max-value-size", "16MiB"])
    assert serves(node, make_client, "before")
    baseline = status_of(node)["connections"]  # the client's pooled connection
    headroom = 8
    limit = open_fds(node.pid) + headroom
    resource.prlimit(node.pid, resource.RLIMIT_NOFILE, (limit, limit))  # descriptors run out mid-run
    with idle_connections(node.host, node.port, 4 * headroom) as flood:
        # Out of descriptors, the admin port cannot accept a scrape either: the shedding shows
        # on the flood's side, as connections the node closed at once.
        wait_until(lambda: sum(map(shed_by_node, flood)) >= 1, 10.0, what="the node to shed connections on EMFILE")
        assert node.proc.poll() is None, f"the node exited on EMFILE:\n{''.join(node.output)[-3000:]}"
        opened, shed_seen = len(flood), sum(map(shed_by_node, flood))
    # The flood is gone: its descriptors come back and the node accepts again under the same limit.
    wait_until(lambda: status_of(node)["connections"] == baseline, 15.0, what="the flood's connections to close")
    assert serves(node, make_client, "after")
    shed = metric_value(metrics_of(node), "memkv_node_connections_refused_total", reason="fd_limit")
    assert shed >= shed_seen
    assert "Traceback" not in "".join(node.output)
    figures(nofile_limit=limit, flood_connections=opened, shed_on_emfile=shed, shed_seen_by_the_flood=shed_seen)


def test_admin_flood_is_capped_while_health_and_the_data_port_answer(start_node, make_client, wait_until, figures):
    node = start_node(capacity="64MiB", extra_args=["--max-value-size", "16MiB"])
    baseline_threads = thread_count(node.pid)
    flood = FLOOD
    with idle_connections(node.host, node.admin_port, flood) as socks:
        opened = len(socks)
        # At the cap every new connection sheds the oldest idle one, so a health check gets in.
        code, body = admin_get(node, "/v1/health")
        assert code == 200 and b"ok" in body
        assert serves(node, make_client, "admin-flood")
        metrics = metrics_of(node)
        held = metric_value(metrics, "memkv_node_admin_connections")
        shed = metric_value(metrics, "memkv_node_admin_connections_refused_total", reason="idle_shed")
        threads = thread_count(node.pid)
        assert held <= ADMIN_MAX_CONNECTIONS
        assert shed >= opened - 2 * ADMIN_MAX_CONNECTIONS
        # one thread per admin connection, including those shed and closing; a few per data connection
        assert threads <= baseline_threads + 2 * ADMIN_MAX_CONNECTIONS + 8, (
            f"{threads} threads for {opened} idle admin connections"
        )
        # The idle connections left are closed at the per-connection deadline, the flood still open.
        wait_until(
            lambda: metric_value(metrics_of(node), "memkv_node_admin_connections") <= 1,
            ADMIN_TIMEOUT_S + 5.0,
            interval_s=0.25,
            what="the idle admin connections to be closed at their deadline",
        )
        timed_out = metric_value(metrics_of(node), "memkv_node_admin_connections_refused_total", reason="timeout")
        assert timed_out >= 1
    assert admin_get(node, "/v1/health")[0] == 200
    figures(
        admin_flood=opened,
        admin_held=held,
        admin_shed=shed,
        admin_timed_out=timed_out,
        node_threads=threads,
        baseline_threads=baseline_threads,
    )
