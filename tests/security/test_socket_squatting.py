"""A same-host socket name taken by another process while its node was away.

Behaviour under test, against real `memkv serve` processes, a real squatter process running as
another Unix user (uid 65534, set in the child: the tests run as root) and a long-lived client:
the node is SIGKILLed, the squatter binds the abstract name the node had named (anyone can:
abstract names have no owner or permissions), accepts every connection and never answers; the
node comes back on the same port under a new name. Claims:

* every operation after the node is back succeeds: the client gives the silent socket one short
  deadline, goes to TCP for that call, learns the node's new socket there and moves to it;
* the node is never marked down for it (TCP works), and the squatter's name is not kept;
* the same with the client's pooled connections still open from before the kill (the issue's
  case): at most the call that finds its pooled connection dead fails, the rest succeed.

Counts successes, not times. Every wait is a process wait, a pipe read with a timeout or a
bounded poll; the squatter exits when its stdin closes or after 120 s.
"""

from __future__ import annotations

import select
import subprocess
import sys

import pytest

from tests.conftest import poll_until
from tests.faults.nodeops import start_again, status_of

pytestmark = pytest.mark.integration

OPERATIONS = 13

# Binds the abstract name (retrying while the dying node still holds it), says "bound", then
# accepts and holds every connection without a byte; prints "accepted" per connection.
# It drops to uid/gid 65534 first thing (the interpreter itself may not be readable by that user).
_SQUATTER = r"""
import os, socket, sys, time, select
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
assert os.getuid() == 65534
name = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
deadline = time.monotonic() + 10
while True:
    try:
        s.bind("\0" + name)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        select.select([], [], [], 0.01)
s.listen(64)
print("bound", flush=True)
held = []
end = time.monotonic() + 120
while time.monotonic() < end:
    ready, _, _ = select.select([s, sys.stdin], [], [], 0.2)
    if sys.stdin in ready and not sys.stdin.readline():
        break
    if s in ready:
        held.append(s.accept()[0])
        print("accepted", flush=True)
"""


class Squatter:
    """A process of uid 65534 holding the abstract name `name` (given with its "@")."""

    def __init__(self, name: str) -> None:
        assert name.startswith("@")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SQUATTER, name[1:]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        self.accepted = 0
        assert self._line(10.0) == "bound", "the squatter could not bind the name"

    def _line(self, timeout_s: float) -> str | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline().strip() if ready else None

    def count_accepted(self) -> int:
        while self._line(0.0) == "accepted":
            self.accepted += 1
        return self.accepted

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _operations(client, tag: str) -> int:
    """OPERATIONS calls (a store, then a load of it, alternately): how many succeeded."""
    ok = 0
    for i in range(OPERATIONS):
        key, value = f"{tag}/{i // 2}", f"{tag}-{i // 2}".encode() * 100
        if i % 2 == 0:
            ok += client.batch_put_views([(key, value)]) == [True]
        else:
            ok += client.get(key) == value
    return ok


def _squat_and_restart(start_node, node):
    """SIGKILL `node`, squat its socket name as another user, start it again on its port."""
    old = status_of(node)["local_socket"]
    node.kill()
    squatter = Squatter(old)
    fresh = start_again(node, capacity="64MiB")
    start_node.nodes.append(fresh)
    new = status_of(fresh)["local_socket"]
    assert new is not None and new != old
    return squatter, old, new


@pytest.fixture
def squatters():
    started: list[Squatter] = []
    yield started
    for squatter in started:
        squatter.stop()


def test_a_squatted_socket_name_costs_one_short_deadline_then_the_client_uses_the_new_one(
    start_node, make_client, squatters
):
    node = start_node(capacity="64MiB", extra_args=["--admin-port", "0"])
    # A long timeout and a long down mark: on a client that waited on the squatter for an io
    # timeout and then marked the node down, every later call of this test would fail fast.
    client = make_client([node], io_timeout_s=5.0, connect_timeout_s=1.0, down_for_s=60.0)
    assert client.batch_put_views([("warm", b"w" * 100)]) == [True]
    nc = client._nodes[0]
    assert nc.local
    for conn in nc._idle:  # the connections closed while the node was away (idle, or used by others)
        conn.close()
    nc._idle.clear()
    squatter, _, new = _squat_and_restart(start_node, node)
    squatters.append(squatter)

    succeeded = _operations(client, "squat")

    # The squatter accepts on its own time: its count is polled (the client's wait is over).
    poll_until(lambda: squatter.count_accepted() >= 1, 10.0, what="the client's connection to reach the squatter")
    assert succeeded == OPERATIONS, f"{succeeded} of {OPERATIONS} operations succeeded after the node came back"
    assert [h["up"] for h in client.health()] == [True] and nc.failures == 0
    assert nc.local and nc._local is not None and nc._local[0] == new, "the client moved to the node's new socket"
    assert squatter.count_accepted() == 1, "the squatted name was tried once, then forgotten"


def test_a_long_lived_client_with_pooled_connections_recovers_past_a_squatter(start_node, make_client, squatters):
    node = start_node(capacity="64MiB", extra_args=["--admin-port", "0"])
    client = make_client([node], io_timeout_s=5.0, connect_timeout_s=1.0, down_for_s=0.2, pool_size=4)
    assert client.batch_put_views([(f"warm/{i}", b"w" * 100) for i in range(8)]) == [True] * 8
    nc = client._nodes[0]
    assert nc.local and nc._idle
    squatter, old, new = _squat_and_restart(start_node, node)
    squatters.append(squatter)

    # The first call finds its pooled connection dead (the node it went to is gone): a failure
    # of a connection, which marks the node down for down_for_s like any other.
    client.batch_put_views([("first", b"f" * 100)])
    poll_until(lambda: all(h["up"] for h in client.health()), 5.0, what="the down mark to expire")
    succeeded = _operations(client, "pooled")
    assert succeeded == OPERATIONS, f"{succeeded} of {OPERATIONS} operations succeeded after the node came back"
    assert nc.local and nc._local is not None and nc._local[0] == new
    assert old not in {c.local_name for c in nc._idle}
