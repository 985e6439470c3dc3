"""The codec: meta encoders and decoders (two tables), and the frames of one connection.

`_ENCODERS` maps a message type to its encoder and `_DECODERS` an opcode to its decoder;
`FrameCodec` seals and opens the frames of one authenticated connection (header, MAC,
sequence) and `FrameDecoder` cuts a byte stream into frames.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

from memkv.errors import AuthError, LocalProtocolError, RemoteProtocolError
from memkv.protocol.checks import (
    _check_batch,
    _check_flags,
    _check_keys,
    _check_lease_ttl,
    _check_list_reply_count,
    _check_list_request,
    _check_rdma_metadata,
    _check_rdma_window,
    _check_value_length,
    validate_outgoing,
)
from memkv.protocol.frames import (
    CHECKSUM_BYTES,
    FRAME_HEADER,
    FRAME_MAGIC,
    FRAME_PREFIX_BYTES,
    PROTOCOL_VERSION,
    ErrorCode,
    FrameHeader,
    Limits,
    Opcode,
)
from memkv.protocol.messages import (
    DeleteRequest,
    ErrorReply,
    ExistsRequest,
    GetReply,
    GetReplyItem,
    GetRequest,
    HelloOk,
    LeaseReply,
    LeaseRequest,
    ListReply,
    ListRequest,
    Message,
    PingReply,
    PingRequest,
    PutItem,
    PutRequest,
    RdmaAttachReply,
    RdmaAttachRequest,
    RdmaGetReply,
    RdmaGetRequest,
    ReleaseRequest,
    ShmCommitRequest,
    ShmGetReply,
    ShmGetRequest,
    ShmPutRequest,
    StatusReply,
    payload_length,
)

_COUNT = struct.Struct(">I")
_LIST_HEAD = struct.Struct(">IH")  # LIST: limit u32 | prefix_len u16
_LIST_REQUEST_FIXED = 6  # LIST meta: limit u32 | prefix_len u16, then the prefix
_LEASE_TAIL = struct.Struct(">IQ")  # ttl_ms u32 | token u64
_TOKEN = struct.Struct(">Q")
_RDMA_GET_TAIL = struct.Struct(">IQ")  # window_ms u32 | token u64


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
        if not msg.shm_put:
            body["shm_put"] = False
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
    shared, shm_put = body.get("shared_values", False), body.get("shm_put", True)
    for name, flag in (("shared_values", shared), ("shm_put", shm_put)):
        if not isinstance(flag, bool):
            raise RemoteProtocolError(f"HELLO_OK: {name} must be true or false, got {flag!r}", ErrorCode.MALFORMED)
    return HelloOk(str(body["node_id"]), Limits(**body["limits"]), body.get("local_socket"), shared, shm_put), len(meta)


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
# Frames of one connection: MAC and sequence
# --------------------------------------------------------------------------------------------


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
                raise AuthError(
                    "frame MAC mismatch: the frame was forged, altered, or sent on another connection", "bad_mac"
                )
            if header.seq != self._recv_seq + 1:
                raise AuthError(
                    f"frame sequence {header.seq}, expected {self._recv_seq + 1}: replayed or reordered", "bad_sequence"
                )
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
