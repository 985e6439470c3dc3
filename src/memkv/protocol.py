"""MemKV wire protocol, version 1: a sans-I/O codec.

Bytes in, messages out; messages in, bytes out. Nothing here opens a socket, starts a thread or
reads a clock, so every path can be tested with plain bytes. `docs/protocol.md` is the
normative description; this module is its implementation and the two must agree.

Theory of operation
-------------------
1. Handshake (fixed-size, unMACed messages; both sides prove they hold the 32-byte auth key):

       client -> ClientHello  b"MKVH" | version u8 | 3 zero bytes | client_nonce[32]
       server -> ServerHello  b"MKVS" | version u8 | status u8 | min u8 | max u8 | server_nonce[32] | server_proof[32]
       client -> ClientAuth   b"MKVA" | client_proof[32]
       server -> a MACed HELLO_OK frame (seq 1) carrying the node's limits, or AuthReject b"MKVX" | code u16

   transcript = version | client_nonce | server_nonce, and
   proof_role = HMAC-SHA256(auth_key, "memkv/1 <role> proof" | transcript). Both nonces are
   fresh, so a recorded handshake never verifies again. The per-direction frame keys are
   HMAC-SHA256(auth_key, "memkv/1 c2s|s2c" | transcript): a frame of one connection (or one
   direction) never verifies on another.

2. Frames. A 28-byte header, a 32-byte MAC, `meta_len` bytes of metadata (keys, lengths,
   checksums), then `payload_len` bytes of values back to back:

       magic b"MK" | version u8 | opcode u8 | flags u16 | status u16 | seq u64 | meta_len u32 | payload_len u64

   MAC = HMAC-SHA256(direction key, header | meta). It covers everything but the value bytes;
   each value's checksum travels in the meta, so the MAC covers the checksums and the
   checksums cover the values (a MAC over 16 MiB would cap the data path at SHA-256 speed).
   `seq` counts frames per direction from 1 and must be exactly the next number (no replay,
   no reordering, no dropping). One request is outstanding per connection; a reply's opcode
   is the request's | 0x80.

Bounds are enforced here (`Limits`) before any payload is read, so a peer cannot make the
other side allocate or wait for more than the limits allow. Each bound has one check
function, used with LocalProtocolError before sending and RemoteProtocolError on receipt.

Layout of this module: the message value objects (`Request` and `Reply` are the complete
unions, RDMA control frames included), the bound checks, then the codec as two tables:
`_ENCODERS` (message type -> its encoder) and `_DECODERS` (opcode -> its decoder), then the
frame header and MAC (`FrameCodec`), then the handshake.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import itertools
import json
import re
import struct
from collections.abc import Callable, Sequence
from typing import Any

from memkv.errors import AuthError, LocalProtocolError, RemoteProtocolError

PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1

HELLO_MAGIC = b"MKVH"
SERVER_HELLO_MAGIC = b"MKVS"
AUTH_MAGIC = b"MKVA"
REJECT_MAGIC = b"MKVX"
FRAME_MAGIC = b"MK"

NONCE_BYTES = 32
KEY_BYTES = 32  # the shared auth key: 32 bytes, 64 hex chars in configuration
MAC_BYTES = 32
CHECKSUM_BYTES = 32  # fixed field; xxh3-128 uses the first 16 bytes, the rest is zero

CLIENT_HELLO = struct.Struct(">4sB3x32s")  # 40 bytes
SERVER_HELLO = struct.Struct(">4sBBBB32s32s")  # 72 bytes
CLIENT_AUTH = struct.Struct(">4s32s")  # 36 bytes
AUTH_REJECT = struct.Struct(">4sH")  # 6 bytes
FRAME_HEADER = struct.Struct(">2sBBHHQIQ")  # 28 bytes
FRAME_PREFIX_BYTES = FRAME_HEADER.size + MAC_BYTES  # 60: read this much, then meta_len

_COUNT = struct.Struct(">I")
_LIST_HEAD = struct.Struct(">IH")  # LIST: limit u32 | prefix_len u16

# Defaults for `Limits`. Keys: 480 bytes is what the spec promises users. Batches: 4096 keys
# covers a lookup of a 256k-token prompt in 64-token blocks in one round trip. Meta: every
# field of a 4096-item batch fits with room. Payload: a batch of 8 x 64 MiB values fits twice.
DEFAULT_MAX_KEY_BYTES = 480
DEFAULT_MAX_VALUE_BYTES = 64 << 20
DEFAULT_MAX_BATCH = 4096
DEFAULT_MAX_META_BYTES = 4 << 20
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
ANY_LENGTH = 0xFFFFFFFF  # GET: accept a value of any length
_LIST_REQUEST_FIXED = 6  # LIST meta: limit u32 | prefix_len u16, then the prefix
_LIST_REPLY_FIXED = 5  # LIST reply meta: count u32 ... truncated u8


class Opcode(enum.IntEnum):
    HELLO_OK = 0x02  # server -> client, first frame after a good handshake
    PING = 0x01
    PUT = 0x10
    GET = 0x11
    EXISTS = 0x12
    DELETE = 0x13
    LIST = 0x14  # operators only (`memkv ls`): the stored keys under a prefix
    LEASE = 0x15  # keep values from eviction, deletion and overwrite for a while (section 11)
    RELEASE = 0x16  # end leases early
    RDMA_ATTACH = 0x20  # client -> node: the client's RDMA metadata (section 10 of docs/protocol.md)
    RDMA_GET = 0x21  # client -> node: WRITE these values into these slots of the client's pool
    # 0x30-0x34: the shared-arena messages of earlier nodes (SHM_ATTACH, SHM_PLACE...), retired.
    SHM_GET = 0x35  # same-host socket: these values' sealed memfds (section 13)
    SHM_PUT = 0x36  # same-host socket: a memfd per value to write; the client writes them itself
    SHM_COMMIT = 0x37  # the next frame after an SHM_PUT: seal the memfds written, store the values
    ERROR = 0x7F  # server -> client; the connection closes after it
    REPLY = 0x80  # or-ed into the request opcode


class ErrorCode(enum.IntEnum):
    """Frame- and connection-level errors (ERROR frames, AuthReject, ServerHello status)."""

    OK = 0
    BAD_MAGIC = 1
    UNSUPPORTED_VERSION = 2
    AUTH_FAILED = 3
    BAD_MAC = 4
    BAD_SEQUENCE = 5
    UNKNOWN_OPCODE = 6
    FRAME_TOO_LARGE = 7
    MALFORMED = 8
    KEY_TOO_LONG = 9
    VALUE_TOO_LARGE = 10
    BATCH_TOO_LARGE = 11
    SERVER_BUSY = 12
    SHUTTING_DOWN = 13
    INTERNAL = 14
    TLS_REQUIRED = 15  # ServerHello status: a plain hello reached a TLS-only port


class ItemStatus(enum.IntEnum):
    """Per-key outcome inside a batch reply."""

    OK = 0  # stored / found / deleted
    MISS = 1  # no such key
    SIZE_MISMATCH = 2  # GET: stored length differs from the expected length (treated as a miss)
    NO_SPACE = 3  # PUT: cannot fit even after eviction (value larger than its lane, all pinned)
    TRANSFER_FAILED = 4  # RDMA_GET: the node's WRITE failed or did not complete within the window
    LEASED = 5  # PUT / DELETE of a leased key: the leased value stays (DELETE: removed when its leases end)
    NOT_SHARED = 6  # SHM_GET / SHM_PUT: not in shared memory (private memory, a bound reached): use the socket
    STILL_MAPPED = 7  # SHM_COMMIT: the memfd is still mapped writable somewhere: not stored


class ChecksumAlgo(enum.IntEnum):
    XXH3_128 = 1  # default: detects corruption at memory speed
    BLAKE3_KEYED = 2  # keyed with a key derived from the auth key: detects tampering too


# --------------------------------------------------------------------------------------------
# Limits
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds a node enforces and announces in HELLO_OK; clients check them before sending."""

    max_key_bytes: int = DEFAULT_MAX_KEY_BYTES
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    max_batch: int = DEFAULT_MAX_BATCH
    max_meta_bytes: int = DEFAULT_MAX_META_BYTES
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES

    def __post_init__(self) -> None:
        if not 1 <= self.max_key_bytes <= 0xFFFF:
            raise ValueError(f"max_key_bytes must be in 1..65535, got {self.max_key_bytes}")
        if not 1 <= self.max_value_bytes < ANY_LENGTH:
            raise ValueError(f"max_value_bytes must be in 1..{ANY_LENGTH - 1}, got {self.max_value_bytes}")
        if self.max_batch < 1 or self.max_meta_bytes < 64 or self.max_payload_bytes < self.max_value_bytes:
            raise ValueError(f"inconsistent limits: {self}")

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @property
    def max_list_keys(self) -> int:
        """Most keys one LIST reply may carry: `max_batch`, or fewer where `max_meta_bytes`
        could not hold that many keys of `max_key_bytes` (each costs u16 + key + u32 of meta,
        plus count u32 and truncated u8 once)."""
        return min(self.max_batch, (self.max_meta_bytes - _LIST_REPLY_FIXED) // (self.max_key_bytes + 6))


# --------------------------------------------------------------------------------------------
# Messages: value objects, validated when constructed
# --------------------------------------------------------------------------------------------


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
    only the earlier arena design (`shared_memory`) never sees it and stays on the socket."""

    node_id: str
    limits: Limits
    local_socket: str | None = None
    shared_memory: bool = False

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
_LEASE_TAIL = struct.Struct(">IQ")  # ttl_ms u32 | token u64
_TOKEN = struct.Struct(">Q")


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
_RDMA_GET_TAIL = struct.Struct(">IQ")  # window_ms u32 | token u64


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


def payload_length(msg: Message) -> int:
    """Bytes of values that follow this message's meta on the wire."""
    if isinstance(msg, PutRequest):
        return sum(item.length for item in msg.items)
    if isinstance(msg, GetReply):
        return sum(item.length for item in msg.items if item.status == ItemStatus.OK)
    return 0


# --------------------------------------------------------------------------------------------
# Bounds. Each is checked by exactly one function, used on both sides: with LocalProtocolError
# before sending, with RemoteProtocolError on receipt (and there before anything is parsed
# that the bound protects).
# --------------------------------------------------------------------------------------------

_ErrorClass = type[LocalProtocolError] | type[RemoteProtocolError]


def _check_batch(n: int, limits: Limits, err: _ErrorClass) -> None:
    """The one max_batch check: a batch of `n` keys."""
    if n > limits.max_batch:
        raise err(f"batch of {n} keys exceeds max_batch {limits.max_batch}", ErrorCode.BATCH_TOO_LARGE)


def _check_keys(keys: Sequence[bytes], limits: Limits, err: _ErrorClass) -> None:
    _check_batch(len(keys), limits, err)
    if not keys:
        return
    lengths = list(map(len, keys))  # C-speed scan: this runs for every batch on both sides
    shortest, longest = min(lengths), max(lengths)
    if shortest == 0 or longest > limits.max_key_bytes:
        bad = longest if longest > limits.max_key_bytes else shortest
        raise err(f"key of {bad} bytes: keys must be 1..{limits.max_key_bytes} bytes", ErrorCode.KEY_TOO_LONG)


def _check_value_length(length: int, limits: Limits, err: _ErrorClass) -> None:
    if length > limits.max_value_bytes:
        raise err(
            f"value of {length} bytes exceeds max_value_bytes {limits.max_value_bytes}", ErrorCode.VALUE_TOO_LARGE
        )


def _check_list_request(prefix: bytes, limit: int, limits: Limits, err: _ErrorClass) -> None:
    if len(prefix) > limits.max_key_bytes:
        raise err(f"LIST prefix of {len(prefix)} bytes: must be 0..{limits.max_key_bytes}", ErrorCode.KEY_TOO_LONG)
    if limit < 1:
        raise err(f"LIST limit {limit}: must be at least 1", ErrorCode.MALFORMED)
    if limit > limits.max_list_keys:
        raise err(f"LIST limit {limit} exceeds max_list_keys {limits.max_list_keys}", ErrorCode.BATCH_TOO_LARGE)


def _check_list_reply_count(n: int, limits: Limits, err: _ErrorClass) -> None:
    if n > limits.max_list_keys:
        raise err(f"LIST reply of {n} keys exceeds max_list_keys {limits.max_list_keys}", ErrorCode.BATCH_TOO_LARGE)


def _check_rdma_metadata(size: int, err: _ErrorClass) -> None:
    if not 1 <= size <= MAX_RDMA_METADATA_BYTES:
        raise err(f"RDMA metadata of {size} bytes: must be 1..{MAX_RDMA_METADATA_BYTES}", ErrorCode.FRAME_TOO_LARGE)


def _check_flags(flags: bytes, n: int, what: str, err: _ErrorClass) -> None:
    if len(flags) != n or any(f > 1 for f in flags):
        raise err(f"{what}: one flag (0 or 1) per item, {n} items", ErrorCode.MALFORMED)


def _check_lease_ttl(ttl_ms: int, err: _ErrorClass) -> None:
    if not 1 <= ttl_ms <= MAX_LEASE_MS:
        raise err(f"lease ttl of {ttl_ms} ms: must be 1..{MAX_LEASE_MS}", ErrorCode.MALFORMED)


def _check_token(token: int, err: _ErrorClass) -> None:
    if not 0 <= token < 1 << 64:
        raise err(f"lease token {token}: must fit u64", ErrorCode.MALFORMED)


def _check_rdma_window(window_ms: int, err: _ErrorClass) -> None:
    if not 1 <= window_ms <= MAX_RDMA_WINDOW_MS:
        raise err(f"RDMA_GET window of {window_ms} ms: must be 1..{MAX_RDMA_WINDOW_MS}", ErrorCode.MALFORMED)


# Checks of outgoing messages beyond their keys (`validate_outgoing`), by message type.


def _validate_put(msg: PutRequest | ShmPutRequest, limits: Limits) -> None:
    for it in msg.items:
        _check_value_length(it.length, limits, LocalProtocolError)
        if len(it.checksum) != CHECKSUM_BYTES:
            raise LocalProtocolError(f"checksum must be {CHECKSUM_BYTES} bytes", ErrorCode.MALFORMED)
    _check_keys([it.key for it in msg.items], limits, LocalProtocolError)


def _validate_keys(
    msg: GetRequest | ExistsRequest | DeleteRequest | RdmaGetRequest | ShmGetRequest, limits: Limits
) -> None:
    _check_keys(msg.keys, limits, LocalProtocolError)


def _validate_lease(msg: LeaseRequest, limits: Limits) -> None:
    _check_keys(msg.keys, limits, LocalProtocolError)
    _check_lease_ttl(msg.ttl_ms, LocalProtocolError)
    _check_token(msg.token, LocalProtocolError)


def _validate_release(msg: ReleaseRequest, limits: Limits) -> None:
    _check_keys(msg.keys, limits, LocalProtocolError)
    _check_token(msg.token, LocalProtocolError)


def _validate_lease_reply(msg: LeaseReply, limits: Limits) -> None:
    _check_batch(len(msg.statuses), limits, LocalProtocolError)
    if len(msg.lengths) != len(msg.statuses):
        raise LocalProtocolError("a LEASE reply needs one length per status", ErrorCode.MALFORMED)
    _check_lease_ttl(msg.ttl_ms, LocalProtocolError)


def _validate_list(msg: ListRequest, limits: Limits) -> None:
    _check_list_request(msg.prefix, msg.limit, limits, LocalProtocolError)


def _validate_list_reply(msg: ListReply, limits: Limits) -> None:
    _check_list_reply_count(len(msg.keys), limits, LocalProtocolError)
    _check_keys(msg.keys, limits, LocalProtocolError)


_VALIDATORS: dict[type, Callable[[Any, Limits], None]] = {
    PutRequest: _validate_put,
    GetRequest: _validate_keys,
    ExistsRequest: _validate_keys,
    DeleteRequest: _validate_keys,
    RdmaGetRequest: _validate_keys,
    ShmGetRequest: _validate_keys,
    ShmPutRequest: _validate_put,
    ShmCommitRequest: lambda msg, limits: _check_batch(len(msg.written), limits, LocalProtocolError),
    ListRequest: _validate_list,
    ListReply: _validate_list_reply,
    LeaseRequest: _validate_lease,
    ReleaseRequest: _validate_release,
    LeaseReply: _validate_lease_reply,
}


def validate_outgoing(msg: Message, limits: Limits) -> None:
    """Raise LocalProtocolError when `msg` would break `limits` (checked before sending)."""
    check = _VALIDATORS.get(type(msg))
    if check is not None:
        check(msg, limits)
    if payload_length(msg) > limits.max_payload_bytes:
        raise LocalProtocolError(
            f"batch payload of {payload_length(msg)} bytes exceeds max_payload_bytes {limits.max_payload_bytes}",
            ErrorCode.FRAME_TOO_LARGE,
        )


# --------------------------------------------------------------------------------------------
# Meta encoding. Keys travel as one array of u16 lengths plus the concatenated key bytes, so
# a 4096-key batch is parsed with one struct call and a slice per key. One encoder per message
# type and one decoder per opcode, in the two tables below; the layouts are in docs/protocol.md.
# --------------------------------------------------------------------------------------------


def _pack_keys(keys: Sequence[bytes]) -> bytes:
    n = len(keys)
    return _COUNT.pack(n) + struct.pack(f">{n}H", *map(len, keys)) + b"".join(keys)


def _pack_items(items: Sequence[GetReplyItem]) -> bytes:
    n = len(items)
    parts = [
        _COUNT.pack(n),
        bytes(it.status for it in items),
        struct.pack(f">{n}I", *(it.length for it in items)),
        bytes(it.algo for it in items),
        b"".join(it.checksum for it in items),
    ]
    return b"".join(parts)


_Encoded = tuple[int, int, bytes]  # (opcode, status, meta)


def _encode_ping(msg: PingRequest) -> _Encoded:
    return Opcode.PING, 0, b""


def _encode_ping_reply(msg: PingReply) -> _Encoded:
    return Opcode.PING | Opcode.REPLY, 0, b""


def _encode_hello_ok(msg: HelloOk) -> _Encoded:
    body: dict[str, object] = {"node_id": msg.node_id, "limits": msg.limits.to_json()}
    if msg.local_socket is not None:  # absent, not null: a client that predates it ignores the key
        body["local_socket"] = msg.local_socket
    if msg.shared_memory:
        body["shared_values"] = True
    return Opcode.HELLO_OK, 0, json.dumps(body).encode()


def _encode_exists(msg: ExistsRequest) -> _Encoded:
    return Opcode.EXISTS, 0, _pack_keys(msg.keys)


def _encode_delete(msg: DeleteRequest) -> _Encoded:
    return Opcode.DELETE, 0, _pack_keys(msg.keys)


def _pack_get(msg: GetRequest | ShmGetRequest) -> bytes:
    return _pack_keys(msg.keys) + struct.pack(f">{len(msg.keys)}I", *msg.expected_lengths)


def _encode_get(msg: GetRequest) -> _Encoded:
    return Opcode.GET, 0, _pack_get(msg)


def _pack_put(items: Sequence[PutItem]) -> bytes:
    n = len(items)
    parts = [
        _pack_keys([it.key for it in items]),
        struct.pack(f">{n}I", *(it.length for it in items)),
        bytes(it.algo for it in items),
        b"".join(it.checksum for it in items),
    ]
    return b"".join(parts)


def _encode_put(msg: PutRequest) -> _Encoded:
    return Opcode.PUT, 0, _pack_put(msg.items)


def _encode_status_reply(msg: StatusReply) -> _Encoded:
    return msg.opcode | Opcode.REPLY, 0, _COUNT.pack(len(msg.statuses)) + msg.statuses


def _encode_get_reply(msg: GetReply) -> _Encoded:
    return Opcode.GET | Opcode.REPLY, 0, _pack_items(msg.items)


def _encode_list(msg: ListRequest) -> _Encoded:
    return Opcode.LIST, 0, _LIST_HEAD.pack(msg.limit, len(msg.prefix)) + msg.prefix


def _encode_list_reply(msg: ListReply) -> _Encoded:
    if len(msg.lengths) != len(msg.keys):
        raise LocalProtocolError("a LIST reply needs one length per key", ErrorCode.MALFORMED)
    n = len(msg.keys)
    return (
        Opcode.LIST | Opcode.REPLY,
        0,
        _pack_keys(msg.keys) + struct.pack(f">{n}I", *msg.lengths) + bytes([bool(msg.truncated)]),
    )


def _encode_lease(msg: LeaseRequest) -> _Encoded:
    return Opcode.LEASE, 0, _pack_keys(msg.keys) + _LEASE_TAIL.pack(msg.ttl_ms, msg.token)


def _encode_lease_reply(msg: LeaseReply) -> _Encoded:
    n = len(msg.statuses)
    if len(msg.lengths) != n:
        raise LocalProtocolError("a LEASE reply needs one length per status", ErrorCode.MALFORMED)
    meta = _COUNT.pack(n) + msg.statuses + struct.pack(f">{n}I", *msg.lengths) + _COUNT.pack(msg.ttl_ms)
    return Opcode.LEASE | Opcode.REPLY, 0, meta


def _encode_release(msg: ReleaseRequest) -> _Encoded:
    return Opcode.RELEASE, 0, _pack_keys(msg.keys) + _TOKEN.pack(msg.token)


def _encode_error(msg: ErrorReply) -> _Encoded:
    return Opcode.ERROR, int(msg.code), msg.message.encode("utf-8", "replace")[:4096]


def _encode_rdma_attach(msg: RdmaAttachRequest) -> _Encoded:
    if not 0 <= msg.backend <= 0xFF:
        raise LocalProtocolError(f"RDMA backend {msg.backend} does not fit a byte", ErrorCode.MALFORMED)
    _check_rdma_metadata(len(msg.metadata), LocalProtocolError)
    return Opcode.RDMA_ATTACH, 0, bytes([msg.backend]) + bytes(msg.metadata)


def _encode_rdma_attach_reply(msg: RdmaAttachReply) -> _Encoded:
    return Opcode.RDMA_ATTACH | Opcode.REPLY, 0, bytes([msg.status]) + msg.info.encode("utf-8", "replace")[:4096]


def _encode_rdma_get(msg: RdmaGetRequest) -> _Encoded:
    n = len(msg.keys)
    if not (len(msg.lengths) == len(msg.addresses) == n):
        raise LocalProtocolError("RDMA_GET needs one length and one address per key", ErrorCode.MALFORMED)
    _check_rdma_window(msg.window_ms, LocalProtocolError)
    parts = [
        _pack_keys(msg.keys),
        struct.pack(f">{n}I", *msg.lengths),
        struct.pack(f">{n}Q", *msg.addresses),
        _RDMA_GET_TAIL.pack(msg.window_ms, msg.token),
    ]
    return Opcode.RDMA_GET, 0, b"".join(parts)


def _encode_rdma_get_reply(msg: RdmaGetReply) -> _Encoded:
    return Opcode.RDMA_GET | Opcode.REPLY, 0, _pack_items(msg.items)


def _encode_shm_get(msg: ShmGetRequest) -> _Encoded:
    _check_flags(msg.want, len(msg.keys), "SHM_GET", LocalProtocolError)
    return Opcode.SHM_GET, 0, _pack_get(msg) + msg.want


def _encode_shm_get_reply(msg: ShmGetReply) -> _Encoded:
    if msg.opcode not in (Opcode.SHM_GET, Opcode.SHM_PUT):
        raise LocalProtocolError(f"opcode 0x{msg.opcode:02x} is not SHM_GET or SHM_PUT", ErrorCode.MALFORMED)
    _check_flags(msg.passed, len(msg.items), "SHM_GET reply", LocalProtocolError)
    return msg.opcode | Opcode.REPLY, 0, _pack_items(msg.items) + msg.passed


def _encode_shm_put(msg: ShmPutRequest) -> _Encoded:
    return Opcode.SHM_PUT, 0, _pack_put(msg.items)


def _encode_shm_commit(msg: ShmCommitRequest) -> _Encoded:
    if any(flag > 1 for flag in msg.written):
        raise LocalProtocolError("SHM_COMMIT flags must be 0 or 1", ErrorCode.MALFORMED)
    if len(msg.checksums) != len(msg.written) or any(len(c) != CHECKSUM_BYTES for c in msg.checksums):
        raise LocalProtocolError(f"SHM_COMMIT needs one {CHECKSUM_BYTES}-byte checksum per flag", ErrorCode.MALFORMED)
    return Opcode.SHM_COMMIT, 0, _COUNT.pack(len(msg.written)) + bytes(msg.written) + b"".join(msg.checksums)


_ENCODERS: dict[type, Callable[[Any], _Encoded]] = {
    PingRequest: _encode_ping,
    PingReply: _encode_ping_reply,
    HelloOk: _encode_hello_ok,
    ExistsRequest: _encode_exists,
    DeleteRequest: _encode_delete,
    GetRequest: _encode_get,
    PutRequest: _encode_put,
    StatusReply: _encode_status_reply,
    GetReply: _encode_get_reply,
    ListRequest: _encode_list,
    ListReply: _encode_list_reply,
    ErrorReply: _encode_error,
    LeaseRequest: _encode_lease,
    LeaseReply: _encode_lease_reply,
    ReleaseRequest: _encode_release,
    RdmaAttachRequest: _encode_rdma_attach,
    RdmaAttachReply: _encode_rdma_attach_reply,
    RdmaGetRequest: _encode_rdma_get,
    RdmaGetReply: _encode_rdma_get_reply,
    ShmGetRequest: _encode_shm_get,
    ShmGetReply: _encode_shm_get_reply,
    ShmPutRequest: _encode_shm_put,
    ShmCommitRequest: _encode_shm_commit,
}


def _encode_meta(msg: Message) -> _Encoded:
    """Return (opcode, status, meta) for a message."""
    encode = _ENCODERS.get(type(msg))
    if encode is None:
        raise LocalProtocolError(f"cannot encode {type(msg).__name__}")
    return encode(msg)


# Decoders: (status, meta, limits) -> (message, bytes of meta consumed). `_decode_meta` checks
# that the whole meta was consumed and maps struct/value errors to RemoteProtocolError.

_Decoded = tuple[Message, int]


def _read_count(meta: memoryview, limits: Limits) -> int:
    """The u32 item count that opens a batch's meta, checked before anything is parsed."""
    (n,) = _COUNT.unpack_from(meta, 0)
    _check_batch(n, limits, RemoteProtocolError)
    return int(n)


def _unpack_keys(meta: memoryview, off: int, n: int) -> tuple[tuple[bytes, ...], int]:
    lengths = struct.unpack_from(f">{n}H", meta, off)
    off += 2 * n
    end = off + sum(lengths)
    if end > len(meta):
        raise RemoteProtocolError("meta truncated inside the key list", ErrorCode.MALFORMED)
    raw = bytes(meta[off:end])
    ends = list(itertools.accumulate(lengths))
    keys = tuple(raw[e - ln : e] for e, ln in zip(ends, lengths))
    return keys, end


def _read_keys(meta: memoryview, limits: Limits) -> tuple[tuple[bytes, ...], int]:
    """A batch's count and key list, every bound checked; returns (keys, offset after them)."""
    n = _read_count(meta, limits)
    keys, off = _unpack_keys(meta, _COUNT.size, n)
    _check_keys(keys, limits, RemoteProtocolError)
    return keys, off


def _read_items(meta: memoryview, limits: Limits) -> tuple[tuple[GetReplyItem, ...], int]:
    """GET / RDMA_GET reply items: count, statuses, lengths, algos, checksums."""
    n = _read_count(meta, limits)
    off = _COUNT.size
    statuses = bytes(meta[off : off + n])
    off += n
    lengths = struct.unpack_from(f">{n}I", meta, off)
    off += 4 * n
    algos = bytes(meta[off : off + n])
    off += n
    sums = bytes(meta[off : off + n * CHECKSUM_BYTES])
    off += n * CHECKSUM_BYTES
    if len(statuses) != n or len(algos) != n or len(sums) != n * CHECKSUM_BYTES:
        raise RemoteProtocolError("meta truncated in GET reply", ErrorCode.MALFORMED)
    items = tuple(
        GetReplyItem(s, ln, a, sums[i * CHECKSUM_BYTES : (i + 1) * CHECKSUM_BYTES])
        for i, (s, ln, a) in enumerate(zip(statuses, lengths, algos))
    )
    return items, off


def _decode_ping(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    return PingRequest(), 0


def _decode_ping_reply(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    return PingReply(), 0


def _decode_error(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    return ErrorReply(status, bytes(meta).decode("utf-8", "replace")), len(meta)


def _decode_hello_ok(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    body = json.loads(bytes(meta))
    shared = body.get("shared_values", False)
    if not isinstance(shared, bool):
        raise RemoteProtocolError(f"HELLO_OK: shared_values must be true or false, got {shared!r}", ErrorCode.MALFORMED)
    return HelloOk(str(body["node_id"]), Limits(**body["limits"]), body.get("local_socket"), shared), len(meta)


def _decode_exists(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    keys, off = _read_keys(meta, limits)
    return ExistsRequest(keys), off


def _decode_delete(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    keys, off = _read_keys(meta, limits)
    return DeleteRequest(keys), off


def _read_get(meta: memoryview, limits: Limits) -> tuple[tuple[bytes, ...], tuple[int, ...], int]:
    """A GET-shaped meta (GET, SHM_GET): key block, expected_length u32 per key."""
    keys, off = _read_keys(meta, limits)
    n = len(keys)
    return keys, struct.unpack_from(f">{n}I", meta, off), off + 4 * n


def _decode_get(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    keys, lengths, off = _read_get(meta, limits)
    return GetRequest(keys, lengths), off


def _read_put_items(meta: memoryview, limits: Limits) -> tuple[tuple[PutItem, ...], int]:
    """A PUT-shaped meta (PUT, SHM_PUT): key block, length u32, algo u8, checksum per key."""
    keys, off = _read_keys(meta, limits)
    n = len(keys)
    lengths = struct.unpack_from(f">{n}I", meta, off)
    off += 4 * n
    algos = bytes(meta[off : off + n])
    off += n
    sums = bytes(meta[off : off + n * CHECKSUM_BYTES])
    off += n * CHECKSUM_BYTES
    if len(algos) != n or len(sums) != n * CHECKSUM_BYTES:
        raise RemoteProtocolError("meta truncated in PUT items", ErrorCode.MALFORMED)
    for ln in lengths:
        _check_value_length(ln, limits, RemoteProtocolError)
    items = tuple(
        PutItem(k, ln, a, sums[i * CHECKSUM_BYTES : (i + 1) * CHECKSUM_BYTES])
        for i, (k, ln, a) in enumerate(zip(keys, lengths, algos))
    )
    return items, off


def _decode_put(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    items, off = _read_put_items(meta, limits)
    return PutRequest(items), off


def _decode_shm_put(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    items, off = _read_put_items(meta, limits)
    return ShmPutRequest(items), off


def _decode_shm_commit(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    n = _read_count(meta, limits)
    off = _COUNT.size
    written = bytes(meta[off : off + n])
    sums = bytes(meta[off + n : off + n + n * CHECKSUM_BYTES])
    if len(written) != n or len(sums) != n * CHECKSUM_BYTES:
        raise RemoteProtocolError("meta truncated in SHM_COMMIT flags or checksums", ErrorCode.MALFORMED)
    if any(flag > 1 for flag in written):
        raise RemoteProtocolError("SHM_COMMIT flags must be 0 or 1", ErrorCode.MALFORMED)
    checksums = tuple(sums[i * CHECKSUM_BYTES : (i + 1) * CHECKSUM_BYTES] for i in range(n))
    return ShmCommitRequest(written, checksums), off + n + n * CHECKSUM_BYTES


def _status_reply_decoder(request_opcode: Opcode) -> Callable[[int, memoryview, Limits], _Decoded]:
    def decode(status: int, meta: memoryview, limits: Limits) -> _Decoded:
        n = _read_count(meta, limits)
        off = _COUNT.size
        statuses = bytes(meta[off : off + n])
        if len(statuses) != n:
            raise RemoteProtocolError("meta truncated in statuses", ErrorCode.MALFORMED)
        return StatusReply(request_opcode, statuses), off + n

    return decode


def _decode_get_reply(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    items, off = _read_items(meta, limits)
    return GetReply(items), off


def _decode_list(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    limit, prefix_len = _LIST_HEAD.unpack_from(meta, 0)
    if len(meta) != _LIST_REQUEST_FIXED + prefix_len:
        raise RemoteProtocolError(
            f"LIST meta of {len(meta)} bytes for a {prefix_len}-byte prefix: must be {_LIST_REQUEST_FIXED + prefix_len}",
            ErrorCode.MALFORMED,
        )
    prefix = bytes(meta[_LIST_REQUEST_FIXED:])
    _check_list_request(prefix, limit, limits, RemoteProtocolError)
    return ListRequest(prefix, limit), len(meta)


def _decode_list_reply(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    (n,) = _COUNT.unpack_from(meta, 0)
    _check_list_reply_count(n, limits, RemoteProtocolError)  # before the keys are parsed
    keys, off = _unpack_keys(meta, _COUNT.size, n)
    _check_keys(keys, limits, RemoteProtocolError)
    lengths = struct.unpack_from(f">{n}I", meta, off)
    off += 4 * n
    if len(meta) != off + 1:
        raise RemoteProtocolError(f"LIST reply meta of {len(meta)} bytes: expected {off + 1}", ErrorCode.MALFORMED)
    truncated = meta[off]
    if truncated > 1:
        raise RemoteProtocolError(f"LIST reply truncated flag {truncated}: must be 0 or 1", ErrorCode.MALFORMED)
    if any(a >= b for a, b in itertools.pairwise(keys)):
        raise RemoteProtocolError("LIST reply keys are not in strictly ascending byte order", ErrorCode.MALFORMED)
    return ListReply(keys, lengths, bool(truncated)), len(meta)


def _decode_lease(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    keys, off = _read_keys(meta, limits)
    ttl_ms, token = _LEASE_TAIL.unpack_from(meta, off)
    _check_lease_ttl(ttl_ms, RemoteProtocolError)
    return LeaseRequest(keys, ttl_ms, token), off + _LEASE_TAIL.size


def _decode_lease_reply(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    n = _read_count(meta, limits)
    off = _COUNT.size
    statuses = bytes(meta[off : off + n])
    if len(statuses) != n:
        raise RemoteProtocolError("meta truncated in LEASE reply statuses", ErrorCode.MALFORMED)
    off += n
    lengths = struct.unpack_from(f">{n}I", meta, off)
    off += 4 * n
    (ttl_ms,) = _COUNT.unpack_from(meta, off)
    _check_lease_ttl(ttl_ms, RemoteProtocolError)
    return LeaseReply(statuses, lengths, ttl_ms), off + _COUNT.size


def _decode_release(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    keys, off = _read_keys(meta, limits)
    (token,) = _TOKEN.unpack_from(meta, off)
    return ReleaseRequest(keys, token), off + _TOKEN.size


def _decode_rdma_attach(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    _check_rdma_metadata(len(meta) - 1, RemoteProtocolError)
    return RdmaAttachRequest(meta[0], bytes(meta[1:])), len(meta)


def _decode_rdma_attach_reply(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    if len(meta) < 1:
        raise RemoteProtocolError("empty RDMA_ATTACH reply", ErrorCode.MALFORMED)
    return RdmaAttachReply(meta[0], bytes(meta[1:]).decode("utf-8", "replace")), len(meta)


def _decode_rdma_get(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    keys, off = _read_keys(meta, limits)
    n = len(keys)
    lengths = struct.unpack_from(f">{n}I", meta, off)
    off += 4 * n
    addresses = struct.unpack_from(f">{n}Q", meta, off)
    off += 8 * n
    window_ms, token = _RDMA_GET_TAIL.unpack_from(meta, off)
    off += _RDMA_GET_TAIL.size
    for ln in lengths:
        if not 1 <= ln <= limits.max_value_bytes:
            raise RemoteProtocolError(
                f"RDMA_GET slot of {ln} bytes: must be 1..{limits.max_value_bytes}", ErrorCode.VALUE_TOO_LARGE
            )
    _check_rdma_window(window_ms, RemoteProtocolError)
    return RdmaGetRequest(keys, lengths, addresses, window_ms, token), off


def _decode_rdma_get_reply(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    items, off = _read_items(meta, limits)
    return RdmaGetReply(items), off


def _decode_shm_get(status: int, meta: memoryview, limits: Limits) -> _Decoded:
    keys, lengths, off = _read_get(meta, limits)
    want = bytes(meta[off : off + len(keys)])
    _check_flags(want, len(keys), "SHM_GET", RemoteProtocolError)
    return ShmGetRequest(keys, lengths, want), off + len(keys)


def _shm_reply_decoder(opcode: Opcode) -> Callable[[int, memoryview, Limits], _Decoded]:
    """SHM_GET's and SHM_PUT's replies (one layout)."""

    def reply(status: int, meta: memoryview, limits: Limits) -> _Decoded:
        items, off = _read_items(meta, limits)
        passed = bytes(meta[off : off + len(items)])
        _check_flags(passed, len(items), f"{opcode.name} reply", RemoteProtocolError)
        return ShmGetReply(items, passed, opcode), off + len(items)

    return reply


_DECODERS: dict[int, Callable[[int, memoryview, Limits], _Decoded]] = {
    Opcode.PING: _decode_ping,
    Opcode.PING | Opcode.REPLY: _decode_ping_reply,
    Opcode.HELLO_OK: _decode_hello_ok,
    Opcode.ERROR: _decode_error,
    Opcode.PUT: _decode_put,
    Opcode.PUT | Opcode.REPLY: _status_reply_decoder(Opcode.PUT),
    Opcode.GET: _decode_get,
    Opcode.GET | Opcode.REPLY: _decode_get_reply,
    Opcode.EXISTS: _decode_exists,
    Opcode.EXISTS | Opcode.REPLY: _status_reply_decoder(Opcode.EXISTS),
    Opcode.DELETE: _decode_delete,
    Opcode.DELETE | Opcode.REPLY: _status_reply_decoder(Opcode.DELETE),
    Opcode.LIST: _decode_list,
    Opcode.LIST | Opcode.REPLY: _decode_list_reply,
    Opcode.LEASE: _decode_lease,
    Opcode.LEASE | Opcode.REPLY: _decode_lease_reply,
    Opcode.RELEASE: _decode_release,
    Opcode.RELEASE | Opcode.REPLY: _status_reply_decoder(Opcode.RELEASE),
    Opcode.RDMA_ATTACH: _decode_rdma_attach,
    Opcode.RDMA_ATTACH | Opcode.REPLY: _decode_rdma_attach_reply,
    Opcode.RDMA_GET: _decode_rdma_get,
    Opcode.RDMA_GET | Opcode.REPLY: _decode_rdma_get_reply,
    Opcode.SHM_GET: _decode_shm_get,
    Opcode.SHM_GET | Opcode.REPLY: _shm_reply_decoder(Opcode.SHM_GET),
    Opcode.SHM_PUT: _decode_shm_put,
    Opcode.SHM_PUT | Opcode.REPLY: _shm_reply_decoder(Opcode.SHM_PUT),
    Opcode.SHM_COMMIT: _decode_shm_commit,
    Opcode.SHM_COMMIT | Opcode.REPLY: _status_reply_decoder(Opcode.SHM_COMMIT),
}


def _decode_meta(opcode: int, status: int, meta: memoryview, limits: Limits) -> Message:
    """Parse a verified frame's meta. Raises RemoteProtocolError on anything malformed."""
    decode = _DECODERS.get(opcode)
    if decode is None:
        raise RemoteProtocolError(f"unknown opcode 0x{opcode:02x}", ErrorCode.UNKNOWN_OPCODE)
    try:
        msg, off = decode(status, meta, limits)
    except struct.error as exc:
        raise RemoteProtocolError(f"meta truncated: {exc}", ErrorCode.MALFORMED) from exc
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: deeply nested JSON
        raise RemoteProtocolError(f"malformed meta: {exc}", ErrorCode.MALFORMED) from exc
    if off != len(meta):
        raise RemoteProtocolError(
            f"{len(meta) - off} unexpected trailing bytes in meta of opcode 0x{opcode:02x}", ErrorCode.MALFORMED
        )
    return msg


# --------------------------------------------------------------------------------------------
# Frame header and MAC
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FrameHeader:
    opcode: int
    status: int
    seq: int
    meta_len: int
    payload_len: int
    mac: bytes


class FrameCodec:
    """Encodes and verifies frames of one authenticated connection, one side's view.

    Holds the two direction keys and sequence counters. Not thread-safe: a connection is used
    by one thread at a time. After any error the codec refuses further frames, because the
    stream position is no longer trustworthy.
    """

    def __init__(self, send_key: bytes, recv_key: bytes, limits: Limits) -> None:
        self._send_mac = hmac.new(send_key, digestmod=hashlib.sha256)
        self._recv_mac = hmac.new(recv_key, digestmod=hashlib.sha256)
        self.limits = limits
        self._send_seq = 0
        self._recv_seq = 0
        self.broken: str | None = None

    # -- sending ---------------------------------------------------------------------------

    def encode(self, msg: Message, validate: bool = True) -> bytes:
        """Header + MAC + meta of `msg`; the caller sends the payload after these bytes."""
        self._refuse_if_broken()
        if validate:
            validate_outgoing(msg, self.limits)
        return self._seal(msg)

    def encode_error(self, code: int, message: str) -> bytes:
        """The ERROR frame that tells the peer why the connection closes. The one frame a
        broken codec still encodes: a receive error breaks the stream we read, while our own
        sequence and keys are still in step, so the peer can verify the frame."""
        return self._seal(ErrorReply(code, message))

    def _seal(self, msg: Message) -> bytes:
        opcode, status, meta = _encode_meta(msg)
        if len(meta) > self.limits.max_meta_bytes:
            raise LocalProtocolError(f"meta of {len(meta)} bytes exceeds max_meta_bytes", ErrorCode.FRAME_TOO_LARGE)
        self._send_seq += 1
        header = FRAME_HEADER.pack(
            FRAME_MAGIC, PROTOCOL_VERSION, opcode, 0, status, self._send_seq, len(meta), payload_length(msg)
        )
        mac = self._send_mac.copy()
        mac.update(header)
        mac.update(meta)
        return header + mac.digest() + meta

    # -- receiving -------------------------------------------------------------------------

    def parse_header(self, prefix: bytes | bytearray | memoryview) -> FrameHeader:
        """Check the fixed 60-byte prefix: magic, version, bounds. The MAC is checked with meta."""
        self._refuse_if_broken()
        try:
            return self._parse_header(prefix)
        except RemoteProtocolError as exc:
            self.broken = str(exc)
            raise

    def _parse_header(self, prefix: bytes | bytearray | memoryview) -> FrameHeader:
        if len(prefix) != FRAME_PREFIX_BYTES:
            raise RemoteProtocolError(f"frame prefix must be {FRAME_PREFIX_BYTES} bytes", ErrorCode.MALFORMED)
        magic, version, opcode, flags, status, seq, meta_len, payload_len = FRAME_HEADER.unpack_from(prefix)
        if magic != FRAME_MAGIC:
            raise RemoteProtocolError(f"bad frame magic {bytes(magic)!r}", ErrorCode.BAD_MAGIC)
        if version != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                f"frame of protocol version {version}, this side speaks {PROTOCOL_VERSION}",
                ErrorCode.UNSUPPORTED_VERSION,
            )
        if flags != 0:
            raise RemoteProtocolError(f"reserved flags set: 0x{flags:04x}", ErrorCode.MALFORMED)
        if meta_len > self.limits.max_meta_bytes:
            raise RemoteProtocolError(
                f"meta of {meta_len} bytes exceeds max_meta_bytes {self.limits.max_meta_bytes}",
                ErrorCode.FRAME_TOO_LARGE,
            )
        if payload_len > self.limits.max_payload_bytes:
            raise RemoteProtocolError(
                f"payload of {payload_len} bytes exceeds max_payload_bytes {self.limits.max_payload_bytes}",
                ErrorCode.FRAME_TOO_LARGE,
            )
        mac = bytes(prefix[FRAME_HEADER.size :])
        return FrameHeader(opcode, status, seq, meta_len, payload_len, mac)

    def open(
        self, header: FrameHeader, prefix: bytes | bytearray | memoryview, meta: bytes | bytearray | memoryview
    ) -> Message:
        """Verify MAC and sequence of a frame, then decode its meta into a message."""
        self._refuse_if_broken()
        try:
            mac = self._recv_mac.copy()
            mac.update(memoryview(prefix)[: FRAME_HEADER.size])
            mac.update(meta)
            if not hmac.compare_digest(mac.digest(), header.mac):
                raise AuthError("frame MAC mismatch: the frame was forged, altered, or sent on another connection")
            if header.seq != self._recv_seq + 1:
                raise AuthError(f"frame sequence {header.seq}, expected {self._recv_seq + 1}: replayed or reordered")
            self._recv_seq = header.seq
            msg = _decode_meta(header.opcode, header.status, memoryview(meta), self.limits)
            if payload_length(msg) != header.payload_len:
                raise RemoteProtocolError(
                    f"payload_len {header.payload_len} disagrees with the meta ({payload_length(msg)})",
                    ErrorCode.MALFORMED,
                )
            return msg
        except (AuthError, RemoteProtocolError) as exc:
            self.broken = str(exc)
            raise

    def _refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise LocalProtocolError(f"connection unusable after an earlier error: {self.broken}")


class FrameDecoder:
    """Buffers a byte stream and yields whole frames: (message, payload bytes).

    For small frames and tests; the data path reads the payload straight into its own buffers
    instead (see server/ and client/), using `FrameCodec.parse_header` / `FrameCodec.open`.
    """

    def __init__(self, codec: FrameCodec) -> None:
        self.codec = codec
        self._buf = bytearray()

    def receive_data(self, data: bytes) -> None:
        self._buf += data

    @property
    def trailing_data(self) -> bytes:
        return bytes(self._buf)

    def next_frame(self) -> tuple[Message, bytes] | None:
        """One whole frame, or None when more data is needed."""
        if len(self._buf) < FRAME_PREFIX_BYTES:
            return None
        prefix = bytes(self._buf[:FRAME_PREFIX_BYTES])
        header = self.codec.parse_header(prefix)
        end_meta = FRAME_PREFIX_BYTES + header.meta_len
        end = end_meta + header.payload_len
        if len(self._buf) < end:
            return None
        msg = self.codec.open(header, prefix, bytes(self._buf[FRAME_PREFIX_BYTES:end_meta]))
        payload = bytes(self._buf[end_meta:end])
        del self._buf[:end]
        return msg, payload


# --------------------------------------------------------------------------------------------
# Handshake
# --------------------------------------------------------------------------------------------


def _derive(auth_key: bytes, label: bytes, transcript: bytes) -> bytes:
    return hmac.new(auth_key, label + transcript, hashlib.sha256).digest()


def _transcript(version: int, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return bytes([version]) + client_nonce + server_nonce


def _check_key(auth_key: bytes) -> None:
    if len(auth_key) != KEY_BYTES:
        raise ValueError(f"auth key must be {KEY_BYTES} bytes, got {len(auth_key)}")


class ClientHandshake:
    """Client side of the handshake. The caller supplies a fresh random nonce."""

    def __init__(self, auth_key: bytes, client_nonce: bytes, version: int = PROTOCOL_VERSION) -> None:
        _check_key(auth_key)
        if len(client_nonce) != NONCE_BYTES:
            raise ValueError("client nonce must be 32 bytes")
        self._key = auth_key
        self._nonce = client_nonce
        self._version = version
        self._transcript: bytes | None = None

    def hello(self) -> bytes:
        return CLIENT_HELLO.pack(HELLO_MAGIC, self._version, self._nonce)

    def receive_server_hello(self, data: bytes) -> bytes:
        """Verify the server's proof; return the ClientAuth bytes to send."""
        if len(data) != SERVER_HELLO.size:
            raise RemoteProtocolError("server hello has the wrong size", ErrorCode.MALFORMED)
        magic, version, status, vmin, vmax, server_nonce, proof = SERVER_HELLO.unpack(data)
        if magic != SERVER_HELLO_MAGIC:
            raise RemoteProtocolError(
                f"not a MemKV node (got {bytes(magic)!r}): is this the data port and not the admin port?",
                ErrorCode.BAD_MAGIC,
            )
        if status == ErrorCode.UNSUPPORTED_VERSION:
            raise RemoteProtocolError(
                f"node refused protocol version {self._version}; it speaks {vmin}..{vmax}",
                ErrorCode.UNSUPPORTED_VERSION,
            )
        if status != ErrorCode.OK:
            raise RemoteProtocolError(f"node refused the handshake: {error_name(status)}", status)
        if version != self._version:
            raise RemoteProtocolError(f"node answered version {version} to a version {self._version} hello")
        self._transcript = _transcript(version, self._nonce, server_nonce)
        expected = _derive(self._key, b"memkv/1 server proof", self._transcript)
        if not hmac.compare_digest(expected, proof):
            raise AuthError("the node does not hold our auth key: MEMKV_AUTH_KEY differs between client and node")
        return CLIENT_AUTH.pack(AUTH_MAGIC, _derive(self._key, b"memkv/1 client proof", self._transcript))

    def codec(self, limits: Limits | None = None) -> FrameCodec:
        assert self._transcript is not None, "handshake not finished"
        return FrameCodec(
            _derive(self._key, b"memkv/1 c2s", self._transcript),
            _derive(self._key, b"memkv/1 s2c", self._transcript),
            limits or Limits(),
        )


class ServerHandshake:
    """Server side of the handshake. The caller supplies a fresh random nonce."""

    def __init__(self, auth_key: bytes, server_nonce: bytes) -> None:
        _check_key(auth_key)
        if len(server_nonce) != NONCE_BYTES:
            raise ValueError("server nonce must be 32 bytes")
        self._key = auth_key
        self._nonce = server_nonce
        self._transcript: bytes | None = None

    def receive_hello(self, data: bytes) -> bytes:
        """Parse ClientHello; return ServerHello bytes. Raises after producing a refusal."""
        if len(data) != CLIENT_HELLO.size:
            raise RemoteProtocolError("client hello has the wrong size", ErrorCode.MALFORMED)
        magic, version, client_nonce = CLIENT_HELLO.unpack(data)
        if magic != HELLO_MAGIC:
            raise RemoteProtocolError(f"bad hello magic {bytes(magic)!r}", ErrorCode.BAD_MAGIC)
        if not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
            raise RemoteProtocolError(
                f"client asked for protocol version {version}; this node speaks "
                f"{MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}",
                ErrorCode.UNSUPPORTED_VERSION,
            )
        self._transcript = _transcript(version, client_nonce, self._nonce)
        proof = _derive(self._key, b"memkv/1 server proof", self._transcript)
        return SERVER_HELLO.pack(
            SERVER_HELLO_MAGIC, version, ErrorCode.OK, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, self._nonce, proof
        )

    @staticmethod
    def refusal(code: int) -> bytes:
        """The ServerHello that refuses a hello (bad version, busy, shutting down)."""
        return SERVER_HELLO.pack(
            SERVER_HELLO_MAGIC, PROTOCOL_VERSION, code, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, bytes(32), bytes(32)
        )

    def receive_auth(self, data: bytes) -> None:
        """Verify ClientAuth. Raises AuthError when the client does not hold the key."""
        assert self._transcript is not None, "hello not received"
        if len(data) != CLIENT_AUTH.size:
            raise RemoteProtocolError("client auth has the wrong size", ErrorCode.MALFORMED)
        magic, proof = CLIENT_AUTH.unpack(data)
        if magic != AUTH_MAGIC:
            raise RemoteProtocolError(f"bad auth magic {bytes(magic)!r}", ErrorCode.BAD_MAGIC)
        expected = _derive(self._key, b"memkv/1 client proof", self._transcript)
        if not hmac.compare_digest(expected, proof):
            raise AuthError("client proof does not verify: wrong auth key or a replayed handshake")

    def codec(self, limits: Limits) -> FrameCodec:
        assert self._transcript is not None, "handshake not finished"
        return FrameCodec(
            _derive(self._key, b"memkv/1 s2c", self._transcript),
            _derive(self._key, b"memkv/1 c2s", self._transcript),
            limits,
        )


def auth_reject(code: int) -> bytes:
    return AUTH_REJECT.pack(REJECT_MAGIC, code)


def parse_auth_outcome_prefix(data: bytes) -> int | None:
    """After ClientAuth the node sends either a frame (b"MK"...) or AuthReject (b"MKVX" code)."""
    if data[:4] == REJECT_MAGIC:
        return int(AUTH_REJECT.unpack(data[: AUTH_REJECT.size])[1])
    return None


def error_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"error {code}"
