"""`memkv serve` whose RDMA writes start late: a node stuck between a load request and its write.

    LATE_NODE_DELAY_S=2.5 [LATE_NODE_IGNORE_WINDOW=1] python tests/rdma/late_node.py serve --listen 127.0.0.1:0 ...

The fault is injected at the responder's one seam, `RdmaResponder._write`: it sleeps
LATE_NODE_DELAY_S before posting. A well-behaved node then finds its window closed and writes
nothing. With LATE_NODE_IGNORE_WINDOW=1 it writes anyway and lets the write complete: what a
write stuck in a NIC queue, or a node frozen after its window check, would do. Everything
else is the real node. With LATE_NODE_ON_TIME=n the node's first n writes are not delayed (a
fault in the middle of a pipeline of RDMA_GETs). With LATE_NODE_PRE_RDMA=1 the node does not know the RDMA opcodes at all
(a node that predates them: UNKNOWN_OPCODE, then it closes the connection).
"""

from __future__ import annotations

import itertools
import os
import sys
import time

from memkv import cli
from memkv.server.rdma import RdmaResponder

DELAY_S = float(os.environ.get("LATE_NODE_DELAY_S", "0"))
IGNORE_WINDOW = os.environ.get("LATE_NODE_IGNORE_WINDOW") == "1"
ON_TIME = itertools.count(int(os.environ.get("LATE_NODE_ON_TIME", "0")), -1)  # counts down per write
_write = RdmaResponder._write


def late_write(self, peer, entries, addresses, token, deadline):
    if next(ON_TIME) > 0:
        return _write(self, peer, entries, addresses, token, deadline)
    time.sleep(DELAY_S)
    if IGNORE_WINDOW:
        deadline = time.monotonic() + 30.0
    return _write(self, peer, entries, addresses, token, deadline)


RdmaResponder._write = late_write

if os.environ.get("LATE_NODE_PRE_RDMA") == "1":
    from memkv import protocol as p
    from memkv.server import node as server_node

    for op in (p.Opcode.RDMA_ATTACH, p.Opcode.RDMA_GET):
        server_node._HANDLERS.pop(op, None)

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
