"""The RDMA control messages of the wire protocol (docs/protocol.md, section 10): pure codec.

Behaviour under test:
* RDMA_ATTACH, its reply, RDMA_GET and its reply round-trip through a real handshake's codecs,
  fed whole, byte by byte and with trailing bytes; their layouts are the documented ones;
* they are MACed frames: a slot address rewritten on the path fails the MAC; replays fail;
* bounds: metadata 1..64 KiB, window 1..3600000 ms, slot lengths 1..max_value_bytes, keys and
  batch as every request, trailing or missing bytes: LocalProtocolError when sending,
  RemoteProtocolError when receiving;
* RDMA_GET carries no payload either way (the values move by RDMA WRITE).
No NIXL, no sockets: runs everywhere.
"""

from __future__ import annotations

import os
import struct

import pytest

from memkv import AuthError, LocalProtocolError, RemoteProtocolError
from memkv import protocol as p

pytestmark = pytest.mark.unit

KEY = bytes(range(32))


def session() -> tuple[p.FrameCodec, p.FrameCodec]:
    ch = p.ClientHandshake(KEY, os.urandom(32))
    sh = p.ServerHandshake(KEY, os.urandom(32))
    sh.receive_auth(ch.receive_server_hello(sh.receive_hello(ch.hello())))
    return ch.codec(p.Limits()), sh.codec(p.Limits())


def decode(codec: p.FrameCodec, wire: bytes, how: str) -> p.Message:
    dec = p.FrameDecoder(codec)
    if how == "whole":
        dec.receive_data(wire)
        got = dec.next_frame()
    elif how == "bytewise":
        got = None
        for i in range(len(wire)):
            assert got is None, "a frame decoded before its last byte"
            dec.receive_data(wire[i : i + 1])
            got = dec.next_frame()
    else:
        dec.receive_data(wire + b"MKtrailing")
        got = dec.next_frame()
        assert dec.trailing_data == b"MKtrailing"
    assert got is not None
    msg, payload = got
    assert payload == b""
    return msg


REQUESTS = [
    p.RdmaAttachRequest(p.RdmaBackend.NIXL_UCX, os.urandom(312)),
    p.RdmaGetRequest((b"a", b"key/2" * 90), (16 << 20, 4096), (0x7F00DEAD0000, 0x7F00DEAD1000), 5000, 2**64 - 1),
    p.RdmaGetRequest((), (), (), 1, 0),
]
REPLIES = [
    p.RdmaAttachReply(p.RdmaAttachStatus.OK, "memkv-node-0123456789abcdef"),
    p.RdmaAttachReply(p.RdmaAttachStatus.UNAVAILABLE, "this node cannot do RDMA: NIXL is not installed"),
    p.RdmaGetReply(
        (
            p.GetReplyItem(p.ItemStatus.OK, 4096, 1, b"c" * 32),
            p.GetReplyItem(p.ItemStatus.TRANSFER_FAILED, 0, 0, bytes(32)),
            p.GetReplyItem(p.ItemStatus.MISS, 0, 0, bytes(32)),
        )
    ),
]


@pytest.mark.parametrize("how", ["whole", "bytewise", "trailing"])
@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_requests_round_trip(msg, how):
    client, server = session()
    assert decode(server, client.encode(msg), how) == msg


@pytest.mark.parametrize("how", ["whole", "bytewise", "trailing"])
@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_replies_round_trip(msg, how):
    client, server = session()
    assert decode(client, server.encode(msg), how) == msg


def test_layouts_are_the_documented_ones():
    client, _ = session()
    md = b"M" * 300
    frame = client.encode(p.RdmaAttachRequest(p.RdmaBackend.NIXL_UCX, md))
    magic, version, opcode, flags, _, seq, meta_len, payload_len = p.FRAME_HEADER.unpack_from(frame)
    assert (magic, version, opcode, flags, seq, meta_len, payload_len) == (b"MK", 1, 0x20, 0, 1, 301, 0)
    assert frame[p.FRAME_PREFIX_BYTES :] == b"\x01" + md
    frame = client.encode(p.RdmaGetRequest((b"ab", b"c"), (10, 20), (0x1000, 0x2000), 700, 42))
    _, _, opcode, _, _, seq, meta_len, payload_len = p.FRAME_HEADER.unpack_from(frame)
    meta = frame[p.FRAME_PREFIX_BYTES :]
    assert (opcode, seq, payload_len) == (0x21, 2, 0)
    expected = struct.pack(">I2H", 2, 2, 1) + b"abc" + struct.pack(">2I2QIQ", 10, 20, 0x1000, 0x2000, 700, 42)
    assert meta == expected and meta_len == len(expected)


def test_a_slot_address_rewritten_on_the_path_fails_the_mac():
    client, server = session()
    frame = bytearray(client.encode(p.RdmaGetRequest((b"k",), (4096,), (0x7F0000001000,), 1000, 5)))
    at = p.FRAME_PREFIX_BYTES + 4 + 2 + 1 + 4  # count | key_len | key | length | address
    assert struct.unpack_from(">Q", frame, at)[0] == 0x7F0000001000
    struct.pack_into(">Q", frame, at, 0x7F0000002000)
    with pytest.raises(AuthError):
        decode(server, bytes(frame), "whole")


def test_a_replayed_rdma_get_fails_the_sequence_check():
    client, server = session()
    frame = client.encode(p.RdmaGetRequest((b"k",), (4096,), (0x1000,), 1000, 5))
    dec = p.FrameDecoder(server)
    dec.receive_data(frame + frame)
    assert dec.next_frame() is not None
    with pytest.raises(AuthError):
        dec.next_frame()


@pytest.mark.parametrize(
    "msg",
    [
        p.RdmaAttachRequest(1, b""),
        p.RdmaAttachRequest(1, b"x" * (p.MAX_RDMA_METADATA_BYTES + 1)),
        p.RdmaGetRequest((b"k",), (1,), (1,), 0, 1),
        p.RdmaGetRequest((b"k",), (1,), (1,), p.MAX_RDMA_WINDOW_MS + 1, 1),
        p.RdmaGetRequest((b"k",), (1, 2), (1,), 10, 1),
        p.RdmaGetRequest((b"",), (1,), (1,), 10, 1),
        p.RdmaGetRequest((b"k" * 481,), (1,), (1,), 10, 1),
    ],
    ids=["empty-md", "md-too-big", "window-0", "window-too-long", "lengths-mismatch", "empty-key", "key-too-long"],
)
def test_bound_violations_are_refused_before_sending(msg):
    client, _ = session()
    with pytest.raises(LocalProtocolError):
        client.encode(msg)


def _raw(codec_keys, opcode: int, meta: bytes) -> bytes:
    import hashlib
    import hmac

    header = p.FRAME_HEADER.pack(b"MK", 1, opcode, 0, 0, 1, len(meta), 0)
    return header + hmac.new(codec_keys, header + meta, hashlib.sha256).digest() + meta


def _server_codec() -> tuple[p.FrameCodec, bytes]:
    key = os.urandom(32)
    return p.FrameCodec(os.urandom(32), key, p.Limits()), key


def _get_meta(n_keys: int = 1, length: int = 4096, window: int = 1000, extra: bytes = b"") -> bytes:
    keys = [b"k%d" % i for i in range(n_keys)]
    return (
        struct.pack(f">I{n_keys}H", n_keys, *map(len, keys))
        + b"".join(keys)
        + struct.pack(f">{n_keys}I", *[length] * n_keys)
        + struct.pack(f">{n_keys}Q", *[4096] * n_keys)
        + struct.pack(">IQ", window, 7)
        + extra
    )


@pytest.mark.parametrize(
    "opcode, meta, code",
    [
        (0x20, b"\x01", p.ErrorCode.FRAME_TOO_LARGE),  # no metadata at all
        (0x20, b"\x01" + b"m" * (p.MAX_RDMA_METADATA_BYTES + 1), p.ErrorCode.FRAME_TOO_LARGE),
        (0x21, _get_meta(extra=b"x"), p.ErrorCode.MALFORMED),
        (0x21, _get_meta()[:-3], p.ErrorCode.MALFORMED),
        (0x21, _get_meta(length=0), p.ErrorCode.VALUE_TOO_LARGE),
        (0x21, _get_meta(length=(64 << 20) + 1), p.ErrorCode.VALUE_TOO_LARGE),
        (0x21, _get_meta(window=0), p.ErrorCode.MALFORMED),
        (0x21, struct.pack(">I", 5000) + b"\x00" * 20, p.ErrorCode.BATCH_TOO_LARGE),
    ],
    ids=[
        "no-metadata",
        "metadata-too-big",
        "trailing",
        "truncated",
        "zero-length",
        "length-too-big",
        "window-0",
        "batch",
    ],
)
def test_malformed_rdma_requests_are_remote_protocol_errors(opcode, meta, code):
    codec, key = _server_codec()
    with pytest.raises(RemoteProtocolError) as info:
        decode(codec, _raw(key, opcode, meta), "whole")
    assert info.value.code == code
