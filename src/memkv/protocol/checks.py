"""The bounds of `Limits` and of the message fields, one check function each.

Used on both sides: with LocalProtocolError before sending (`validate_outgoing`), with
RemoteProtocolError on receipt, by the decoders of memkv.protocol.codec.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from memkv.errors import LocalProtocolError, RemoteProtocolError
from memkv.protocol.frames import CHECKSUM_BYTES, ErrorCode, Limits
from memkv.protocol.messages import (
    MAX_LEASE_MS,
    MAX_RDMA_METADATA_BYTES,
    MAX_RDMA_WINDOW_MS,
    DeleteRequest,
    ExistsRequest,
    GetRequest,
    LeaseReply,
    LeaseRequest,
    ListReply,
    ListRequest,
    Message,
    PutRequest,
    RdmaGetRequest,
    ReleaseRequest,
    ShmCommitRequest,
    ShmGetRequest,
    ShmPutRequest,
    payload_length,
)

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
