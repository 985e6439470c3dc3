"""The messages: value objects, one per frame kind, and the `Request` / `Reply` unions.

`reply_mismatch` is the one place a reply is held to its request; `payload_length` says how
many value bytes follow a message's meta on the wire.
"""

from __future__ import annotations

import dataclasses
import enum
import re

from memkv.errors import RemoteProtocolError
from memkv.protocol.frames import ErrorCode, ItemStatus, Limits, Opcode


@dataclasses.dataclass(frozen=True)
class PingRequest:
    pass


@dataclasses.dataclass(frozen=True)
class PingReply:
    pass


@dataclasses.dataclass(frozen=True)
class HelloOk:
    """Sent by the node after a good handshake: who it is and what it accepts.

    `local_socket`: the name of the node's same-host socket (`@` + an abstract AF_UNIX name,
    random per node process; docs/protocol.md section 2.6), or None when it serves none.
    `shared_memory`: this connection may exchange values as sealed memfds (SHM_* requests; only
    on the same-host socket, section 13). Its JSON key is `shared_values`: a client that knows
    only the earlier arena design (`shared_memory`) never sees it and stays on the socket.
    `shm_put`: with `shared_memory`, stores may go through SHM_PUT; false where the node writes
    its memfds itself (`memkv serve --shared-memory-stores node`): store over the socket (JSON
    key `shm_put`, present only when false)."""

    node_id: str
    limits: Limits
    local_socket: str | None = None
    shared_memory: bool = False
    shm_put: bool = True

    def __post_init__(self) -> None:
        if self.local_socket is not None and not is_local_socket_name(self.local_socket):
            raise RemoteProtocolError(f"HELLO_OK: bad local_socket {self.local_socket!r}", ErrorCode.MALFORMED)


# A same-host socket's advertised name: "@" then an abstract AF_UNIX name (never a filesystem
# path), short enough for sun_path (108 bytes with its leading NUL).
_LOCAL_SOCKET_NAME = re.compile(r"@[A-Za-z0-9._-]{1,100}")


def is_local_socket_name(name: object) -> bool:
    return isinstance(name, str) and _LOCAL_SOCKET_NAME.fullmatch(name) is not None


@dataclasses.dataclass(frozen=True)
class PutItem:
    key: bytes
    length: int
    algo: int
    checksum: bytes  # CHECKSUM_BYTES long


@dataclasses.dataclass(frozen=True)
class PutRequest:
    items: tuple[PutItem, ...]


@dataclasses.dataclass(frozen=True)
class GetRequest:
    keys: tuple[bytes, ...]
    expected_lengths: tuple[int, ...]  # ANY_LENGTH where the reader accepts any size


@dataclasses.dataclass(frozen=True)
class GetReplyItem:
    status: int
    length: int
    algo: int
    checksum: bytes


@dataclasses.dataclass(frozen=True)
class ExistsRequest:
    keys: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class DeleteRequest:
    keys: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class ListRequest:
    """The first `limit` stored keys (in byte order) that start with `prefix` (b"": all)."""

    prefix: bytes
    limit: int


@dataclasses.dataclass(frozen=True)
class ListReply:
    """Keys in ascending byte order, each value's length, and whether more keys matched."""

    keys: tuple[bytes, ...]
    lengths: tuple[int, ...]
    truncated: bool


@dataclasses.dataclass(frozen=True)
class StatusReply:
    """PUT, EXISTS and DELETE replies: one ItemStatus per key, in request order."""

    opcode: int
    statuses: bytes


@dataclasses.dataclass(frozen=True)
class GetReply:
    items: tuple[GetReplyItem, ...]


@dataclasses.dataclass(frozen=True)
class ErrorReply:
    code: int
    message: str


# Leases (docs/protocol.md, section 11). A lease is named by (key, token): the token is the
# holder's (a client picks one at random), so holders do not end each other's leases, and a
# LEASE of a (key, token) that is already leased renews it. Bounded by the node: its ttl cap
# (the granted ttl comes back in the reply) and its count and byte bounds (a lease beyond them
# answers MISS).

MAX_LEASE_MS = 3_600_000


@dataclasses.dataclass(frozen=True)
class LeaseRequest:
    """Lease each key's value for `ttl_ms` (capped by the node) under `token`."""

    keys: tuple[bytes, ...]
    ttl_ms: int
    token: int


@dataclasses.dataclass(frozen=True)
class LeaseReply:
    """Per key OK (leased: `lengths[i]` is the value's length) or MISS (no such value, or a
    lease beyond the node's bounds: lengths[i] 0); `ttl_ms` is the ttl the node granted."""

    statuses: bytes
    lengths: tuple[int, ...]
    ttl_ms: int


@dataclasses.dataclass(frozen=True)
class ReleaseRequest:
    """End the leases (key, token); the reply is a StatusReply: OK where one ended, else MISS."""

    keys: tuple[bytes, ...]
    token: int


# RDMA control messages (docs/protocol.md, section 10). They are ordinary frames on an
# authenticated connection, MACed and sequenced like every other: the RDMA metadata is only
# ever exchanged after the handshake. The value bytes of an RDMA_GET move by RDMA WRITE into
# the client's registered pool (memkv.transport), never in the frame's payload.

MAX_RDMA_METADATA_BYTES = 64 << 10  # a NIXL agent's metadata with one registered region: ~300 B
MAX_RDMA_WINDOW_MS = 3_600_000


class RdmaBackend(enum.IntEnum):
    NIXL_UCX = 1  # NIXL agent metadata, UCX backend


class RdmaAttachStatus(enum.IntEnum):
    OK = 0  # the node loaded the metadata; info = the node's agent name
    UNAVAILABLE = 1  # the node has no RDMA (NIXL not installed, or MEMKV_TRANSPORT=tcp on the node)
    REJECTED = 2  # the node could not use the metadata (unknown backend, NIXL refused it)


@dataclasses.dataclass(frozen=True)
class RdmaAttachRequest:
    """The client's RDMA metadata: lets the node WRITE into the client's registered pool from
    this connection, until the connection closes."""

    backend: int
    metadata: bytes


@dataclasses.dataclass(frozen=True)
class RdmaAttachReply:
    status: int
    info: str  # OK: the node's agent name (the sender of its notifications); else the reason


@dataclasses.dataclass(frozen=True)
class RdmaGetRequest:
    """WRITE each key's value into the client's pool at `addresses[i]` (exactly `lengths[i]`
    bytes: full-length-or-miss, as GET), then notify `token`."""

    keys: tuple[bytes, ...]
    lengths: tuple[int, ...]
    addresses: tuple[int, ...]  # absolute addresses inside the client's registered region
    window_ms: int  # the node starts no write later than this after receiving the request
    token: int  # u64; the node's notification message is the 8 bytes of `token`


@dataclasses.dataclass(frozen=True)
class RdmaGetReply:
    """One item per key, as GetReply, but no payload: OK means the node's WRITE completed."""

    items: tuple[GetReplyItem, ...]


# --------------------------------------------------------------------------------------------
# Shared memory (docs/protocol.md section 13): on the same-host socket only. A value stored by
# SHM_PUT lives in a memfd of its own, sealed against shrinking and growing from its creation and
# against writing once committed; descriptors travel with the reply frame (SCM_RIGHTS). The
# client copies and verifies each value itself; a committed memfd never changes, so nothing is
# pinned while a client copies.
# --------------------------------------------------------------------------------------------

SHM_MIN_VALUE = 1 << 20  # values this large and larger may live in memfds; smaller ones never
MAX_SHM_FDS = 250  # descriptors per reply frame (the kernel passes at most 253 a message)


@dataclasses.dataclass(frozen=True)
class ShmGetRequest:
    """SHM_GET: per key, whether to pass the value's memfd (`want[i]` 1) or only its status and
    checksum (0: the client still maps that value, e.g. one it stored itself)."""

    keys: tuple[bytes, ...]
    expected_lengths: tuple[int, ...]  # as GET: exactly this length or a miss (ANY_LENGTH: any)
    want: bytes = b""  # one flag per key; empty: 1 for every key

    def __post_init__(self) -> None:
        if not self.want:
            object.__setattr__(self, "want", bytes([1]) * len(self.keys))


@dataclasses.dataclass(frozen=True)
class ShmPutRequest:
    """SHM_PUT: a PUT's items without their values. The node creates a memfd per item and passes
    it (ShmGetReply, opcode SHM_PUT); the client writes each value there, unmaps it, then sends
    SHM_COMMIT as the connection's very next frame. The items' algo must be a known one; their
    checksum fields are not used (SHM_COMMIT brings the checksums); MemKV's client sends zeros."""

    items: tuple[PutItem, ...]


@dataclasses.dataclass(frozen=True)
class ShmCommitRequest:
    """SHM_COMMIT: one flag per memfd the preceding SHM_PUT passed (its OK items, in order): 1 the
    client wrote the value (seal it and store it), 0 it did not (drop it); and per flag the
    checksum of the bytes written (by the SHM_PUT item's algo; zeros for flag 0). Reply:
    StatusReply, one status per flag: OK stored, LEASED (leased meanwhile: the leased value
    stays), STILL_MAPPED (a writable mapping of the memfd exists: not stored), MISS (0)."""

    written: bytes
    checksums: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class ShmGetReply:
    """SHM_GET and SHM_PUT replies: as a GET reply's items, no payload; `passed[i]` 1 when item
    i's memfd rides on this frame (SCM_RIGHTS, in item order; only OK items, at most MAX_SHM_FDS)."""

    items: tuple[GetReplyItem, ...]
    passed: bytes
    opcode: int = Opcode.SHM_GET


# Every message a client sends, and every message a node sends (ERROR included).
Request = (
    PingRequest
    | PutRequest
    | GetRequest
    | ExistsRequest
    | DeleteRequest
    | ListRequest
    | LeaseRequest
    | ReleaseRequest
    | RdmaAttachRequest
    | RdmaGetRequest
    | ShmGetRequest
    | ShmPutRequest
    | ShmCommitRequest
)
Reply = (
    PingReply
    | HelloOk
    | StatusReply
    | GetReply
    | ListReply
    | LeaseReply
    | ErrorReply
    | RdmaAttachReply
    | RdmaGetReply
    | ShmGetReply
)
Message = Request | Reply


def reply_mismatch(request: Request, reply: Message) -> str | None:
    """Why `reply` cannot answer `request` (None when it can): its kind, its opcode, one status or
    item per key or value asked, a LIST within the prefix and limit asked, memfds passed only
    with OK items. The one place a client holds a reply to its request (an ErrorReply is the
    caller's to raise before). Payloads and descriptors are checked where they are read."""
    expected: tuple[type, int | None, int | None]  # reply type, opcode (StatusReply, ShmGetReply), count
    if isinstance(request, PingRequest):
        expected = (PingReply, None, None)
    elif isinstance(request, (ExistsRequest, DeleteRequest, ReleaseRequest)):
        op = {ExistsRequest: Opcode.EXISTS, DeleteRequest: Opcode.DELETE, ReleaseRequest: Opcode.RELEASE}
        expected = (StatusReply, op[type(request)], len(request.keys))
    elif isinstance(request, PutRequest):
        expected = (StatusReply, Opcode.PUT, len(request.items))
    elif isinstance(request, ShmCommitRequest):
        expected = (StatusReply, Opcode.SHM_COMMIT, len(request.written))
    elif isinstance(request, LeaseRequest):
        expected = (LeaseReply, None, len(request.keys))
    elif isinstance(request, GetRequest):
        expected = (GetReply, None, len(request.keys))
    elif isinstance(request, ShmGetRequest):
        expected = (ShmGetReply, Opcode.SHM_GET, len(request.keys))
    elif isinstance(request, ShmPutRequest):
        expected = (ShmGetReply, Opcode.SHM_PUT, len(request.items))
    elif isinstance(request, RdmaAttachRequest):
        expected = (RdmaAttachReply, None, None)
    elif isinstance(request, RdmaGetRequest):
        expected = (RdmaGetReply, None, len(request.keys))
    else:  # ListRequest
        if not isinstance(reply, ListReply):
            return f"ListRequest answered with {type(reply).__name__}"
        if len(reply.keys) > request.limit or not all(k.startswith(request.prefix) for k in reply.keys):
            return "LIST reply holds more keys than asked or a key outside the prefix"
        return None
    kind, opcode, count = expected
    name = type(request).__name__
    if not isinstance(reply, kind) or (opcode is not None and getattr(reply, "opcode", None) != opcode):
        return f"{name} answered with {type(reply).__name__}"
    if count is not None:
        got = len(reply.statuses) if isinstance(reply, (StatusReply, LeaseReply)) else len(getattr(reply, "items", ()))
        if got != count or (isinstance(reply, LeaseReply) and len(reply.lengths) != count):
            return f"{name} reply has {got} item(s) for {count} asked"
    if isinstance(reply, ShmGetReply) and (
        len(reply.passed) != len(reply.items)
        or any(passed and item.status != ItemStatus.OK for item, passed in zip(reply.items, reply.passed))
    ):
        return f"{name} reply passes a memfd with an item that is not OK"
    return None


def payload_length(msg: Message) -> int:
    """Bytes of values that follow this message's meta on the wire."""
    if isinstance(msg, PutRequest):
        return sum(item.length for item in msg.items)
    if isinstance(msg, GetReply):
        return sum(item.length for item in msg.items if item.status == ItemStatus.OK)
    return 0
