"""The sans-I/O wire codec (memkv.protocol), driven with plain bytes only.

Behaviour under test:
* every message type (handshake messages, HELLO_OK, PING, PUT, GET, EXISTS, DELETE, LIST, their
  replies, ERROR) round-trips; frames decode identically when fed whole, one byte at a time,
  and followed by trailing garbage (which stays in `trailing_data`), as h11's tests do;
  a hypothesis property round-trips random batches through encode -> FrameDecoder;
* the byte layouts, the key derivation and the MAC are the ones docs/protocol.md states
  (checked against independent HMAC computations, not against the codec itself);
* every bound (key length, batch size, meta size, payload size, value size) raises
  LocalProtocolError when sending and RemoteProtocolError when receiving, with its ErrorCode;
* a frame that was altered in any header or meta byte, replayed, reordered, dropped, reflected,
  or taken from another session never decodes: AuthError (or a RemoteProtocolError from the
  structural checks that run before the MAC);
* the handshake: a wrong key on either side is an AuthError, an old or future version is refused
  with UNSUPPORTED_VERSION, garbage is a RemoteProtocolError;
* after a receive error the codec refuses all further use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import struct
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memkv import protocol as p
from memkv.errors import AuthError, LocalProtocolError, RemoteProtocolError
from memkv.integrity import Checksummer
from memkv.protocol import codec

pytestmark = pytest.mark.unit

KEY = bytes(range(32))
OTHER_KEY = bytes(range(100, 132))
C_NONCE = b"\x11" * 32
S_NONCE = b"\x22" * 32
GARBAGE = b"\x00garbage\xff\xfe"  # shorter than a frame prefix, so it stays buffered

# --------------------------------------------------------------------------------------------
# Helpers: an in-memory connection pair (h11's ConnectionPair) and independent crypto
# --------------------------------------------------------------------------------------------


def session(
    client_limits: p.Limits | None = None,
    server_limits: p.Limits | None = None,
    c_nonce: bytes = C_NONCE,
    s_nonce: bytes = S_NONCE,
) -> tuple[p.FrameCodec, p.FrameCodec]:
    """Run a full handshake in memory; return (client codec, server codec)."""
    ch = p.ClientHandshake(KEY, c_nonce)
    sh = p.ServerHandshake(KEY, s_nonce)
    sh.receive_auth(ch.receive_server_hello(sh.receive_hello(ch.hello())))
    return ch.codec(client_limits or p.Limits()), sh.codec(server_limits or p.Limits())


def hmac256(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def transcript(version: int = 1, c_nonce: bytes = C_NONCE, s_nonce: bytes = S_NONCE) -> bytes:
    return bytes([version]) + c_nonce + s_nonce


C2S_KEY = hmac256(KEY, b"memkv/1 c2s" + transcript())
S2C_KEY = hmac256(KEY, b"memkv/1 s2c" + transcript())


def raw_frame(
    opcode: int,
    meta: bytes = b"",
    *,
    seq: int = 1,
    payload_len: int = 0,
    status: int = 0,
    flags: int = 0,
    version: int = 1,
    magic: bytes = b"MK",
    meta_len: int | None = None,
    send_key: bytes = C2S_KEY,
) -> bytes:
    """A frame built by hand with a valid MAC (client -> server of `session()` by default)."""
    header = struct.pack(
        ">2sBBHHQIQ",
        magic,
        version,
        opcode,
        flags,
        status,
        seq,
        len(meta) if meta_len is None else meta_len,
        payload_len,
    )
    return header + hmac256(send_key, header + meta) + meta


def keys_meta(keys: list[bytes]) -> bytes:
    return struct.pack(f">I{len(keys)}H", len(keys), *map(len, keys)) + b"".join(keys)


def decode_one(codec: p.FrameCodec, wire: bytes) -> tuple[p.Message, bytes]:
    dec = p.FrameDecoder(codec)
    dec.receive_data(wire)
    got = dec.next_frame()
    assert got is not None, "frame incomplete"
    assert dec.trailing_data == b""
    return got


# --------------------------------------------------------------------------------------------
# Feeding bytes three ways (h11/tests/test_io.py: tr())
# --------------------------------------------------------------------------------------------


def feed_whole(dec: p.FrameDecoder, wire: bytes) -> tuple[p.Message, bytes]:
    dec.receive_data(wire)
    got = dec.next_frame()
    assert got is not None
    assert dec.next_frame() is None
    assert dec.trailing_data == b""
    return got


def feed_byte_by_byte(dec: p.FrameDecoder, wire: bytes) -> tuple[p.Message, bytes]:
    for i in range(len(wire) - 1):
        dec.receive_data(wire[i : i + 1])
        assert dec.next_frame() is None, f"a frame was produced after {i + 1} of {len(wire)} bytes"
    dec.receive_data(wire[-1:])
    got = dec.next_frame()
    assert got is not None
    assert dec.trailing_data == b""
    return got


def feed_with_trailing_garbage(dec: p.FrameDecoder, wire: bytes) -> tuple[p.Message, bytes]:
    dec.receive_data(wire + GARBAGE)
    got = dec.next_frame()
    assert got is not None
    assert dec.trailing_data == GARBAGE
    assert dec.next_frame() is None  # the garbage is not a frame prefix yet
    return got


FEEDS = [feed_whole, feed_byte_by_byte, feed_with_trailing_garbage]

_SUMS = Checksummer(KEY)
_V1, _V2 = b"hello world", bytes(range(256)) * 2

# (id, direction, message, payload)
MESSAGES = [
    ("ping", "c2s", p.PingRequest(), b""),
    ("ping-reply", "s2c", p.PingReply(), b""),
    ("hello-ok", "s2c", p.HelloOk("node-a:9900", p.Limits()), b""),
    ("hello-ok-local-socket", "s2c", p.HelloOk("node-a:9900", p.Limits(), "@memkv-9900-" + "ab" * 12), b""),
    ("hello-ok-shared-memory", "s2c", p.HelloOk("node-a:9900", p.Limits(), "@memkv-9900-" + "ab" * 12, True), b""),
    (
        "hello-ok-node-written-memfds",
        "s2c",
        p.HelloOk("node-a:9900", p.Limits(), "@memkv-9900-" + "ab" * 12, True, shm_put=False),
        b"",
    ),
    (
        "hello-ok-custom-limits",
        "s2c",
        p.HelloOk(
            "n\u00f6de",
            p.Limits(
                max_key_bytes=64, max_value_bytes=1 << 20, max_batch=7, max_meta_bytes=4096, max_payload_bytes=2 << 20
            ),
        ),
        b"",
    ),
    (
        "put",
        "c2s",
        p.PutRequest(
            (
                p.PutItem(b"k", len(_V1), p.ChecksumAlgo.XXH3_128, _SUMS.compute(_V1)),
                p.PutItem(b"\x00\xff" * 240, 0, p.ChecksumAlgo.XXH3_128, _SUMS.compute(b"")),
                p.PutItem(
                    b"model/layout/abc",
                    len(_V2),
                    p.ChecksumAlgo.BLAKE3_KEYED,
                    _SUMS.compute(_V2, p.ChecksumAlgo.BLAKE3_KEYED),
                ),
            )
        ),
        _V1 + _V2,
    ),
    ("put-empty-batch", "c2s", p.PutRequest(()), b""),
    ("get", "c2s", p.GetRequest((b"a", b"b" * 480, b"c"), (p.ANY_LENGTH, 0, 64 << 20)), b""),
    (
        "get-reply",
        "s2c",
        p.GetReply(
            (
                p.GetReplyItem(p.ItemStatus.OK, len(_V1), p.ChecksumAlgo.XXH3_128, _SUMS.compute(_V1)),
                p.GetReplyItem(p.ItemStatus.MISS, 0, 0, bytes(32)),
                p.GetReplyItem(p.ItemStatus.SIZE_MISMATCH, 0, 0, bytes(32)),
                p.GetReplyItem(p.ItemStatus.OK, 0, p.ChecksumAlgo.XXH3_128, _SUMS.compute(b"")),
                p.GetReplyItem(
                    p.ItemStatus.OK,
                    len(_V2),
                    p.ChecksumAlgo.BLAKE3_KEYED,
                    _SUMS.compute(_V2, p.ChecksumAlgo.BLAKE3_KEYED),
                ),
            )
        ),
        _V1 + _V2,
    ),
    ("exists", "c2s", p.ExistsRequest((b"x", b"y" * 100, b"\x00")), b""),
    ("exists-empty-batch", "c2s", p.ExistsRequest(()), b""),
    ("delete", "c2s", p.DeleteRequest((b"gone", b"also/gone")), b""),
    ("put-reply", "s2c", p.StatusReply(p.Opcode.PUT, bytes([p.ItemStatus.OK, p.ItemStatus.NO_SPACE])), b""),
    (
        "exists-reply",
        "s2c",
        p.StatusReply(p.Opcode.EXISTS, bytes([p.ItemStatus.OK, p.ItemStatus.MISS, p.ItemStatus.OK])),
        b"",
    ),
    ("delete-reply", "s2c", p.StatusReply(p.Opcode.DELETE, bytes([p.ItemStatus.MISS])), b""),
    ("error", "s2c", p.ErrorReply(p.ErrorCode.BAD_MAC, "frame MAC mismatch: \u00e9t\u00e9"), b""),
    ("list", "c2s", p.ListRequest(b"model/b65536/", 1000), b""),
    ("list-every-key", "c2s", p.ListRequest(b"", 1), b""),
    ("list-binary-prefix", "c2s", p.ListRequest(b"\x00\xff" * 240, 4096), b""),
    ("list-reply", "s2c", p.ListReply((b"\x00", b"a", b"a/b" * 160, b"\xff"), (1, 16 << 20, 0, 64 << 20), True), b""),
    ("list-reply-empty", "s2c", p.ListReply((), (), False), b""),
    ("lease", "c2s", p.LeaseRequest((b"chunk/r0", b"chunk/r1" * 60), 30_000, 2**64 - 1), b""),
    ("lease-empty-batch", "c2s", p.LeaseRequest((), 1, 0), b""),
    ("lease-reply", "s2c", p.LeaseReply(bytes([p.ItemStatus.OK, p.ItemStatus.MISS]), (16 << 20, 0), 60_000), b""),
    ("release", "c2s", p.ReleaseRequest((b"chunk/r0",), 7), b""),
    ("release-reply", "s2c", p.StatusReply(p.Opcode.RELEASE, bytes([p.ItemStatus.OK, p.ItemStatus.MISS])), b""),
    ("put-reply-leased", "s2c", p.StatusReply(p.Opcode.PUT, bytes([p.ItemStatus.LEASED])), b""),
    ("rdma-attach", "c2s", p.RdmaAttachRequest(p.RdmaBackend.NIXL_UCX, b"\x00agent-metadata\xff" * 20), b""),
    ("rdma-attach-reply", "s2c", p.RdmaAttachReply(p.RdmaAttachStatus.OK, "memkv-node-0123456789abcdef"), b""),
    (
        "rdma-get",
        "c2s",
        p.RdmaGetRequest((b"a", b"b" * 480), (4096, 64 << 20), (0x7F00_0000_1000, 2**64 - 1), 5000, 2**64 - 1),
        b"",
    ),
    (
        "rdma-get-reply",
        "s2c",
        p.RdmaGetReply(
            (
                p.GetReplyItem(p.ItemStatus.OK, 4096, p.ChecksumAlgo.XXH3_128, _SUMS.compute(b"x" * 4096)),
                p.GetReplyItem(p.ItemStatus.TRANSFER_FAILED, 0, 0, bytes(32)),
            )
        ),
        b"",  # RDMA values never travel in the frame
    ),
    ("shm-get", "c2s", p.ShmGetRequest((b"a", b"b" * 480), (16 << 20, p.ANY_LENGTH)), b""),
    ("shm-get-mapped", "c2s", p.ShmGetRequest((b"a", b"b"), (16 << 20, 1 << 20), b"\x00\x01"), b""),
    (
        "shm-get-reply",
        "s2c",
        p.ShmGetReply(
            (
                p.GetReplyItem(p.ItemStatus.OK, 16 << 20, p.ChecksumAlgo.XXH3_128, _SUMS.compute(b"x")),
                p.GetReplyItem(p.ItemStatus.OK, 1 << 20, p.ChecksumAlgo.XXH3_128, _SUMS.compute(b"y")),
                p.GetReplyItem(p.ItemStatus.NOT_SHARED, 0, 0, bytes(32)),
                p.GetReplyItem(p.ItemStatus.MISS, 0, 0, bytes(32)),
            ),
            b"\x01\x00\x00\x00",
        ),
        b"",  # the memfds ride beside the frame (SCM_RIGHTS); values are never sent
    ),
    (
        "shm-put",
        "c2s",
        p.ShmPutRequest(
            (
                p.PutItem(b"k", 16 << 20, p.ChecksumAlgo.XXH3_128, _SUMS.compute(b"x")),
                p.PutItem(
                    b"\x00\xff" * 240, 0, p.ChecksumAlgo.BLAKE3_KEYED, _SUMS.compute(b"", p.ChecksumAlgo.BLAKE3_KEYED)
                ),
            )
        ),
        b"",  # the client writes the values into the node's memory, never sends them
    ),
    ("shm-put-empty-batch", "c2s", p.ShmPutRequest(()), b""),
    (
        "shm-put-reply",
        "s2c",
        p.ShmGetReply(
            (
                p.GetReplyItem(p.ItemStatus.OK, 16 << 20, p.ChecksumAlgo.XXH3_128, _SUMS.compute(b"x")),
                p.GetReplyItem(p.ItemStatus.NOT_SHARED, 0, 0, bytes(32)),
            ),
            b"\x01\x00",
            p.Opcode.SHM_PUT,
        ),
        b"",
    ),
    ("shm-commit", "c2s", p.ShmCommitRequest(b"\x01\x00\x01", (_SUMS.compute(b"x"), bytes(32), b"\xff" * 32)), b""),
    ("shm-commit-empty", "c2s", p.ShmCommitRequest(b"", ()), b""),
    (
        "shm-commit-reply",
        "s2c",
        p.StatusReply(p.Opcode.SHM_COMMIT, bytes([p.ItemStatus.OK, p.ItemStatus.MISS, p.ItemStatus.STILL_MAPPED])),
        b"",
    ),
]


@pytest.mark.parametrize("feed", FEEDS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("direction,msg,payload", [m[1:] for m in MESSAGES], ids=[m[0] for m in MESSAGES])
def test_every_message_round_trips_fed_whole_bytewise_and_with_trailing_garbage(feed, direction, msg, payload) -> None:
    client, server = session()
    sender, receiver = (client, server) if direction == "c2s" else (server, client)
    assert p.payload_length(msg) == len(payload)
    wire = sender.encode(msg) + payload
    got, got_payload = feed(p.FrameDecoder(receiver), wire)
    assert got == msg
    assert got_payload == payload


def test_two_frames_in_one_read_decode_in_order_and_leave_nothing_behind() -> None:
    client, server = session()
    wire = client.encode(p.PingRequest()) + client.encode(p.ExistsRequest((b"k",)))
    dec = p.FrameDecoder(server)
    dec.receive_data(wire)
    first = dec.next_frame()
    assert first == (p.PingRequest(), b"")
    assert len(dec.trailing_data) == len(wire) - p.FRAME_PREFIX_BYTES  # a PING is a bare prefix
    assert dec.next_frame() == (p.ExistsRequest((b"k",)), b"")
    assert dec.next_frame() is None
    assert dec.trailing_data == b""


def test_reply_opcode_is_request_opcode_with_high_bit() -> None:
    _, server = session()
    for op in (p.Opcode.PUT, p.Opcode.EXISTS, p.Opcode.DELETE):
        wire = server.encode(p.StatusReply(op, b""))
        assert wire[3] == op | 0x80
    assert server.encode(p.PingReply())[3] == 0x81
    assert server.encode(p.GetReply(()))[3] == 0x91
    assert server.encode(p.ListReply((), (), False))[3] == p.Opcode.LIST | 0x80 == 0x94
    assert server.encode(p.ShmGetReply((), b"", p.Opcode.SHM_PUT))[3] == 0xB6


def test_an_shm_reply_is_shm_get_or_shm_put_only_with_one_flag_per_item() -> None:
    client, server = session()
    with pytest.raises(LocalProtocolError, match="opcode 0x10 is not SHM_GET or SHM_PUT"):
        server.encode(p.ShmGetReply((), b"", p.Opcode.PUT))
    ok = p.GetReplyItem(p.ItemStatus.OK, 1, 1, bytes(32))
    for passed in (b"", b"\x02", b"\x01\x01"):
        with pytest.raises(LocalProtocolError, match="one flag"):
            server.encode(p.ShmGetReply((ok,), passed))
    with pytest.raises(LocalProtocolError, match="one flag"):
        client.encode(p.ShmGetRequest((b"k",), (1,), b"\x03"))


def test_an_shm_commit_flag_other_than_0_or_1_is_refused_on_both_sides() -> None:
    client, server = session()
    with pytest.raises(LocalProtocolError, match="SHM_COMMIT flags must be 0 or 1"):
        client.encode(p.ShmCommitRequest(b"\x01\x02", (bytes(32), bytes(32))))
    with pytest.raises(LocalProtocolError, match="one 32-byte checksum per flag"):
        client.encode(p.ShmCommitRequest(b"\x01\x01", (bytes(32),)))
    with pytest.raises(LocalProtocolError, match="one 32-byte checksum per flag"):
        client.encode(p.ShmCommitRequest(b"\x01", (bytes(16),)))
    with pytest.raises(RemoteProtocolError, match="SHM_COMMIT flags must be 0 or 1") as info:
        decode_one(server, raw_frame(p.Opcode.SHM_COMMIT, struct.pack(">I", 2) + b"\x00\x07" + bytes(64)))
    assert info.value.code == p.ErrorCode.MALFORMED
    for short in (b"\x01", b"\x01\x00\x01" + bytes(95)):  # flags, then checksums, cut short
        _, server = session()
        with pytest.raises(RemoteProtocolError, match="truncated in SHM_COMMIT") as info:
            decode_one(server, raw_frame(p.Opcode.SHM_COMMIT, struct.pack(">I", 3) + short))
        assert info.value.code == p.ErrorCode.MALFORMED


# --------------------------------------------------------------------------------------------
# Property: random batches round-trip through encode -> FrameDecoder in random chunks
# --------------------------------------------------------------------------------------------

_keys = st.binary(min_size=1, max_size=480)
_algos = st.sampled_from(list(p.ChecksumAlgo))
_sums = st.binary(min_size=32, max_size=32)


def _payload_for(lengths: list[int]) -> bytes:
    return b"".join(bytes([i % 251]) * n for i, n in enumerate(lengths))


@st.composite
def batches(draw) -> tuple[str, p.Message, bytes]:
    kind = draw(st.sampled_from(["put", "get", "exists", "delete", "get-reply", "status-reply", "list", "list-reply"]))
    n = draw(st.integers(0, 24))
    if kind == "put":
        items = [p.PutItem(draw(_keys), draw(st.integers(0, 300)), draw(_algos), draw(_sums)) for _ in range(n)]
        return "c2s", p.PutRequest(tuple(items)), _payload_for([it.length for it in items])
    if kind == "get":
        keys = tuple(draw(_keys) for _ in range(n))
        lengths = tuple(draw(st.integers(0, p.ANY_LENGTH)) for _ in range(n))
        return "c2s", p.GetRequest(keys, lengths), b""
    if kind in ("exists", "delete"):
        keys = tuple(draw(_keys) for _ in range(n))
        return "c2s", (p.ExistsRequest if kind == "exists" else p.DeleteRequest)(keys), b""
    if kind == "get-reply":
        items = []
        for _ in range(n):
            status = draw(st.sampled_from(list(p.ItemStatus)))
            # Only OK items carry bytes; the others may still announce a length in the meta.
            length = draw(st.integers(0, 300)) if status == p.ItemStatus.OK else draw(st.integers(0, p.ANY_LENGTH))
            items.append(p.GetReplyItem(status, length, draw(_algos), draw(_sums)))
        ok = [it.length for it in items if it.status == p.ItemStatus.OK]
        return "s2c", p.GetReply(tuple(items)), _payload_for(ok)
    if kind == "list":
        return "c2s", p.ListRequest(draw(st.binary(max_size=480)), draw(st.integers(1, 4096))), b""
    if kind == "list-reply":
        keys = tuple(sorted({draw(_keys) for _ in range(n)}))
        lengths = tuple(draw(st.integers(0, p.ANY_LENGTH)) for _ in keys)
        return "s2c", p.ListReply(keys, lengths, draw(st.booleans())), b""
    op = draw(st.sampled_from([p.Opcode.PUT, p.Opcode.EXISTS, p.Opcode.DELETE]))
    statuses = bytes(draw(st.lists(st.sampled_from(list(p.ItemStatus)), max_size=n)))
    return "s2c", p.StatusReply(op, statuses), b""


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), chunk_sizes=st.lists(st.integers(1, 97), min_size=1, max_size=40), frames=st.integers(1, 3))
def test_random_batches_round_trip_through_frame_decoder_in_any_chunking(batch, chunk_sizes, frames) -> None:
    direction, msg, payload = batch
    client, server = session()
    sender, receiver = (client, server) if direction == "c2s" else (server, client)
    wire = b"".join(sender.encode(msg) + payload for _ in range(frames))
    dec = p.FrameDecoder(receiver)
    got = []
    pos, i = 0, 0
    while pos < len(wire):
        step = chunk_sizes[i % len(chunk_sizes)]
        dec.receive_data(wire[pos : pos + step])
        pos += step
        i += 1
        while (frame := dec.next_frame()) is not None:
            got.append(frame)
    assert got == [(msg, payload)] * frames
    assert dec.trailing_data == b""


# --------------------------------------------------------------------------------------------
# Byte layouts, key derivation and MAC, checked independently of the codec
# --------------------------------------------------------------------------------------------


def test_handshake_message_layouts_and_sizes_are_as_documented() -> None:
    assert (p.CLIENT_HELLO.size, p.SERVER_HELLO.size, p.CLIENT_AUTH.size, p.AUTH_REJECT.size) == (40, 72, 36, 6)
    assert (p.FRAME_HEADER.size, p.MAC_BYTES, p.FRAME_PREFIX_BYTES) == (28, 32, 60)
    ch = p.ClientHandshake(KEY, C_NONCE)
    assert ch.hello() == b"MKVH" + b"\x01" + b"\x00\x00\x00" + C_NONCE
    sh = p.ServerHandshake(KEY, S_NONCE)
    server_hello = sh.receive_hello(ch.hello())
    server_proof = hmac256(KEY, b"memkv/1 server proof" + transcript())
    assert server_hello == b"MKVS" + bytes([1, 0, 1, 1]) + S_NONCE + server_proof
    client_auth = ch.receive_server_hello(server_hello)
    assert client_auth == b"MKVA" + hmac256(KEY, b"memkv/1 client proof" + transcript())
    assert p.auth_reject(p.ErrorCode.AUTH_FAILED) == b"MKVX\x00\x03"
    assert p.parse_auth_outcome_prefix(b"MKVX\x00\x03") == p.ErrorCode.AUTH_FAILED
    assert p.parse_auth_outcome_prefix(b"MK\x01\x02\x00\x00") is None


def test_frame_header_layout_and_mac_are_hmac_of_header_and_meta_under_the_direction_key() -> None:
    client, server = session()
    msg = p.ExistsRequest((b"abc", b"de"))
    wire = client.encode(msg)
    meta = keys_meta([b"abc", b"de"])
    header = struct.pack(">2sBBHHQIQ", b"MK", 1, p.Opcode.EXISTS, 0, 0, 1, len(meta), 0)
    assert wire == header + hmac256(C2S_KEY, header + meta) + meta
    # The server's frames use the other direction's key.
    reply = server.encode(p.PingReply())
    header = struct.pack(">2sBBHHQIQ", b"MK", 1, 0x81, 0, 0, 1, 0, 0)
    assert reply == header + hmac256(S2C_KEY, header)


def test_value_bytes_are_not_covered_by_the_mac_but_their_checksums_are() -> None:
    client, server = session()
    value = b"v" * 100
    msg = p.PutRequest((p.PutItem(b"k", 100, p.ChecksumAlgo.XXH3_128, _SUMS.compute(value)),))
    frame = client.encode(msg)
    # A flipped value byte still decodes (the reader's checksum catches it, not the MAC)...
    got, payload = decode_one(server, frame + b"w" + value[1:])
    assert got == msg
    assert not _SUMS.verify(payload, got.items[0].algo, got.items[0].checksum)
    # ...while the checksum itself sits in the MACed meta.
    tampered = bytearray(frame)
    tampered[-1] ^= 0x01  # last byte of the meta: the checksum
    _, server2 = session()
    with pytest.raises(AuthError, match="MAC"):
        decode_one(server2, bytes(tampered) + value)


def test_hand_built_frame_with_documented_mac_is_accepted() -> None:
    _, server = session()
    wire = raw_frame(p.Opcode.DELETE, keys_meta([b"k1", b"k2"]))
    assert decode_one(server, wire) == (p.DeleteRequest((b"k1", b"k2")), b"")


def test_xxh3_checksum_is_16_bytes_zero_padded_and_blake3_is_keyed() -> None:
    import blake3
    import xxhash

    value = b"some value bytes"
    assert _SUMS.compute(value) == xxhash.xxh3_128_digest(value) + bytes(16)
    value_key = hmac256(KEY, b"memkv/1 value checksum")
    assert _SUMS.compute(value, p.ChecksumAlgo.BLAKE3_KEYED) == blake3.blake3(value, key=value_key).digest()
    assert _SUMS.compute(value, p.ChecksumAlgo.BLAKE3_KEYED) != Checksummer(OTHER_KEY).compute(
        value, p.ChecksumAlgo.BLAKE3_KEYED
    )
    assert not _SUMS.verify(value, 99, _SUMS.compute(value))  # unknown algorithm never verifies


# --------------------------------------------------------------------------------------------
# Bounds: LocalProtocolError when sending, RemoteProtocolError when receiving
# --------------------------------------------------------------------------------------------

STRICT = p.Limits(max_key_bytes=480, max_value_bytes=1024, max_batch=8, max_meta_bytes=4096, max_payload_bytes=4096)
LAX = p.Limits(
    max_key_bytes=4096, max_value_bytes=1 << 20, max_batch=1000, max_meta_bytes=1 << 20, max_payload_bytes=1 << 20
)


def _put(*items: tuple[bytes, int]) -> p.PutRequest:
    return p.PutRequest(tuple(p.PutItem(k, n, p.ChecksumAlgo.XXH3_128, bytes(32)) for k, n in items))


def _keyed(key: bytes) -> list[p.Message]:
    return [
        p.ExistsRequest((b"ok", key)),
        p.DeleteRequest((key,)),
        p.GetRequest((key,), (p.ANY_LENGTH,)),
        _put((key, 0)),
        p.LeaseRequest((key,), 1000, 1),
        p.ReleaseRequest((key,), 1),
    ]


BOUNDS = [
    *[(f"key-481-bytes-{type(m).__name__}", m, p.ErrorCode.KEY_TOO_LONG) for m in _keyed(b"k" * 481)],
    *[(f"empty-key-{type(m).__name__}", m, p.ErrorCode.KEY_TOO_LONG) for m in _keyed(b"")],
    ("batch-over-max-batch-exists", p.ExistsRequest(tuple(b"k%d" % i for i in range(9))), p.ErrorCode.BATCH_TOO_LARGE),
    ("batch-over-max-batch-put", _put(*[(b"k%d" % i, 1) for i in range(9)]), p.ErrorCode.BATCH_TOO_LARGE),
    ("meta-over-max-meta-bytes", _put(*[(bytes([65 + i]) * 480, 0) for i in range(8)]), p.ErrorCode.FRAME_TOO_LARGE),
    ("payload-over-max-payload-bytes", _put(*[(b"v%d" % i, 1024) for i in range(5)]), p.ErrorCode.FRAME_TOO_LARGE),
    ("value-over-max-value-bytes", _put((b"big", 1025)), p.ErrorCode.VALUE_TOO_LARGE),
    ("list-prefix-481-bytes", p.ListRequest(b"k" * 481, 1), p.ErrorCode.KEY_TOO_LONG),
    ("list-limit-0", p.ListRequest(b"k", 0), p.ErrorCode.MALFORMED),
    ("list-limit-over-max-list-keys", p.ListRequest(b"k", 9), p.ErrorCode.BATCH_TOO_LARGE),
    ("lease-ttl-0", p.LeaseRequest((b"k",), 0, 1), p.ErrorCode.MALFORMED),
    ("lease-ttl-over-max", p.LeaseRequest((b"k",), p.MAX_LEASE_MS + 1, 1), p.ErrorCode.MALFORMED),
]


@pytest.mark.parametrize("msg,code", [b[1:] for b in BOUNDS], ids=[b[0] for b in BOUNDS])
def test_bound_violation_is_local_error_when_sending(msg, code) -> None:
    client, server = session(client_limits=STRICT)
    with pytest.raises(LocalProtocolError) as info:
        client.encode(msg)
    assert info.value.code == code
    # A refused send emits nothing and consumes no sequence number: the connection stays usable.
    assert decode_one(server, client.encode(p.PingRequest())) == (p.PingRequest(), b"")


@pytest.mark.parametrize("msg,code", [b[1:] for b in BOUNDS], ids=[b[0] for b in BOUNDS])
def test_bound_violation_is_remote_error_when_receiving(msg, code) -> None:
    client, server = session(client_limits=LAX, server_limits=STRICT)
    wire = client.encode(msg, validate=False) + bytes(p.payload_length(msg))
    dec = p.FrameDecoder(server)
    dec.receive_data(wire)
    with pytest.raises(RemoteProtocolError) as info:
        dec.next_frame()
    assert info.value.code == code
    assert server.broken is not None


@pytest.mark.parametrize(
    "meta_len,payload_len",
    [(STRICT.max_meta_bytes + 1, 0), (0, STRICT.max_payload_bytes + 1), (0xFFFFFFFF, 0), (0, 2**64 - 1)],
)
def test_oversized_lengths_are_refused_from_the_prefix_alone(meta_len, payload_len) -> None:
    """The bound is checked before any meta or payload byte is read or buffered."""
    _, server = session(server_limits=STRICT)
    prefix = raw_frame(p.Opcode.PUT, meta_len=meta_len, payload_len=payload_len)
    assert len(prefix) == p.FRAME_PREFIX_BYTES
    dec = p.FrameDecoder(server)
    dec.receive_data(prefix)
    with pytest.raises(RemoteProtocolError) as info:
        dec.next_frame()
    assert info.value.code == p.ErrorCode.FRAME_TOO_LARGE


def test_batch_count_over_max_batch_is_refused_before_parsing_keys() -> None:
    _, server = session(server_limits=STRICT)
    meta = struct.pack(">I", 10**6)  # claims a million keys, carries none
    with pytest.raises(RemoteProtocolError) as info:
        decode_one(server, raw_frame(p.Opcode.EXISTS, meta))
    assert info.value.code == p.ErrorCode.BATCH_TOO_LARGE


def test_limits_reject_inconsistent_values() -> None:
    for bad in (
        {"max_key_bytes": 0},
        {"max_key_bytes": 65536},
        {"max_value_bytes": 0},
        {"max_value_bytes": p.ANY_LENGTH},
        {"max_batch": 0},
        {"max_meta_bytes": 63},
        {"max_value_bytes": 2048, "max_payload_bytes": 1024},
    ):
        with pytest.raises(ValueError):
            p.Limits(**bad)


def test_default_limits_are_the_documented_ones() -> None:
    limits = p.Limits()
    assert limits.max_key_bytes == 480
    assert limits.max_value_bytes == 64 << 20
    assert limits.max_batch == 4096
    assert limits.max_meta_bytes == 4 << 20
    assert limits.max_payload_bytes == 1 << 30


def test_list_layouts_are_as_documented() -> None:
    _, server = session()
    # LIST: limit u32 | prefix_len u16 | prefix.
    assert decode_one(server, raw_frame(0x14, struct.pack(">IH", 7, 3) + b"ns/")) == (p.ListRequest(b"ns/", 7), b"")
    client, _ = session()
    # LIST reply: key block | length u32 x n | truncated u8.
    meta = keys_meta([b"a", b"bc"]) + struct.pack(">IIB", 5, 1 << 24, 1)
    assert decode_one(client, raw_frame(0x94, meta, send_key=S2C_KEY)) == (
        p.ListReply((b"a", b"bc"), (5, 1 << 24), True),
        b"",
    )
    _, server2 = session()
    assert server2.encode(p.ListReply((b"a", b"bc"), (5, 1 << 24), True)).endswith(meta)


def test_max_list_keys_is_max_batch_unless_the_meta_bound_is_smaller() -> None:
    assert p.Limits().max_list_keys == 4096
    assert STRICT.max_list_keys == 8
    # 10 keys of 480 bytes need 5 + 10 * 486 bytes of meta; one byte less holds 9.
    tight = p.Limits(max_batch=100, max_meta_bytes=5 + 10 * 486 - 1)
    assert tight.max_list_keys == 9
    # A reply of max_list_keys keys of the longest length fits the meta bound exactly as computed.
    _, server = session(server_limits=tight)
    keys = tuple(bytes([i]) * 480 for i in range(9))
    server.encode(p.ListReply(keys, (0,) * 9, False))


def test_list_reply_with_more_keys_than_max_list_keys_is_refused_before_parsing() -> None:
    client, server = session(client_limits=STRICT, server_limits=LAX)
    wire = server.encode(p.ListReply(tuple(b"k%02d" % i for i in range(9)), (1,) * 9, False), validate=False)
    with pytest.raises(RemoteProtocolError) as info:
        decode_one(client, wire)
    assert info.value.code == p.ErrorCode.BATCH_TOO_LARGE


# --------------------------------------------------------------------------------------------
# Malformed frames with a valid MAC: RemoteProtocolError with a code
# --------------------------------------------------------------------------------------------

MALFORMED = [
    (
        "payload-len-on-a-frame-without-values",
        raw_frame(p.Opcode.EXISTS, keys_meta([b"k"]), payload_len=10) + bytes(10),
        p.ErrorCode.MALFORMED,
    ),
    (
        "payload-len-shorter-than-put-lengths",
        raw_frame(p.Opcode.PUT, keys_meta([b"k"]) + struct.pack(">I", 5) + b"\x01" + bytes(32), payload_len=4)
        + bytes(4),
        p.ErrorCode.MALFORMED,
    ),
    (
        "payload-len-longer-than-put-lengths",
        raw_frame(p.Opcode.PUT, keys_meta([b"k"]) + struct.pack(">I", 5) + b"\x01" + bytes(32), payload_len=6)
        + bytes(6),
        p.ErrorCode.MALFORMED,
    ),
    ("unknown-opcode", raw_frame(0x55, keys_meta([b"k"])), p.ErrorCode.UNKNOWN_OPCODE),
    ("trailing-bytes-in-meta", raw_frame(p.Opcode.EXISTS, keys_meta([b"k"]) + b"\x00"), p.ErrorCode.MALFORMED),
    (
        "key-list-truncated",
        raw_frame(p.Opcode.EXISTS, struct.pack(">I3H", 3, 5, 5, 5) + b"abcde"),
        p.ErrorCode.MALFORMED,
    ),
    ("count-without-lengths", raw_frame(p.Opcode.DELETE, struct.pack(">I", 2)), p.ErrorCode.MALFORMED),
    ("empty-meta-for-a-batch", raw_frame(p.Opcode.GET, b""), p.ErrorCode.MALFORMED),
    ("get-without-expected-lengths", raw_frame(p.Opcode.GET, keys_meta([b"k"])), p.ErrorCode.MALFORMED),
    (
        "put-without-checksums",
        raw_frame(p.Opcode.PUT, keys_meta([b"k"]) + struct.pack(">I", 0) + b"\x01"),
        p.ErrorCode.MALFORMED,
    ),
    ("bad-magic", raw_frame(p.Opcode.PING, magic=b"HT"), p.ErrorCode.BAD_MAGIC),
    ("future-version", raw_frame(p.Opcode.PING, version=2), p.ErrorCode.UNSUPPORTED_VERSION),
    ("old-version", raw_frame(p.Opcode.PING, version=0), p.ErrorCode.UNSUPPORTED_VERSION),
    ("reserved-flags", raw_frame(p.Opcode.PING, flags=1), p.ErrorCode.MALFORMED),
    ("list-meta-empty", raw_frame(p.Opcode.LIST, b""), p.ErrorCode.MALFORMED),
    (
        "list-prefix-shorter-than-announced",
        raw_frame(p.Opcode.LIST, struct.pack(">IH", 10, 4) + b"abc"),
        p.ErrorCode.MALFORMED,
    ),
    (
        "list-prefix-longer-than-announced",
        raw_frame(p.Opcode.LIST, struct.pack(">IH", 10, 2) + b"abc"),
        p.ErrorCode.MALFORMED,
    ),
    ("list-limit-4097", raw_frame(p.Opcode.LIST, struct.pack(">IH", 4097, 0)), p.ErrorCode.BATCH_TOO_LARGE),
    ("list-limit-2**32-1", raw_frame(p.Opcode.LIST, struct.pack(">IH", 2**32 - 1, 0)), p.ErrorCode.BATCH_TOO_LARGE),
    (
        "list-prefix-over-480-bytes",
        raw_frame(p.Opcode.LIST, struct.pack(">IH", 1, 481) + b"k" * 481),
        p.ErrorCode.KEY_TOO_LONG,
    ),
    # The retired arena messages (SHM_ATTACH, SHM_GET and SHM_PLACE of the arena design) are no requests.
    ("retired-shm-attach", raw_frame(0x30, struct.pack(">II", 1, 0)), p.ErrorCode.UNKNOWN_OPCODE),
    ("retired-shm-place", raw_frame(0x32, keys_meta([b"a"]) + struct.pack(">I", 1)), p.ErrorCode.UNKNOWN_OPCODE),
    (
        "shm-get-without-flags",
        raw_frame(p.Opcode.SHM_GET, keys_meta([b"a"]) + struct.pack(">I", 1 << 20)),
        p.ErrorCode.MALFORMED,
    ),
    (
        "shm-get-flag-2",
        raw_frame(p.Opcode.SHM_GET, keys_meta([b"a"]) + struct.pack(">IB", 1 << 20, 2)),
        p.ErrorCode.MALFORMED,
    ),
]

MALFORMED_REPLIES = [
    ("hello-ok-not-json", raw_frame(p.Opcode.HELLO_OK, b"{not json", send_key=S2C_KEY), p.ErrorCode.MALFORMED),
    (
        "hello-ok-bad-limits",
        raw_frame(
            p.Opcode.HELLO_OK, json.dumps({"node_id": "n", "limits": {"max_key_bytes": 0}}).encode(), send_key=S2C_KEY
        ),
        p.ErrorCode.MALFORMED,
    ),
    # A same-host socket name is "@" + an abstract name, never a path or anything else.
    (
        "hello-ok-local-socket-path",
        raw_frame(
            p.Opcode.HELLO_OK,
            json.dumps({"node_id": "n", "limits": {}, "local_socket": "/tmp/memkv.sock"}).encode(),
            send_key=S2C_KEY,
        ),
        p.ErrorCode.MALFORMED,
    ),
    (
        "hello-ok-local-socket-empty",
        raw_frame(
            p.Opcode.HELLO_OK,
            json.dumps({"node_id": "n", "limits": {}, "local_socket": "@"}).encode(),
            send_key=S2C_KEY,
        ),
        p.ErrorCode.MALFORMED,
    ),
    (
        "hello-ok-local-socket-not-a-string",
        raw_frame(
            p.Opcode.HELLO_OK, json.dumps({"node_id": "n", "limits": {}, "local_socket": 1}).encode(), send_key=S2C_KEY
        ),
        p.ErrorCode.MALFORMED,
    ),
    (
        "hello-ok-local-socket-too-long",
        raw_frame(
            p.Opcode.HELLO_OK,
            json.dumps({"node_id": "n", "limits": {}, "local_socket": "@" + "a" * 101}).encode(),
            send_key=S2C_KEY,
        ),
        p.ErrorCode.MALFORMED,
    ),
    (
        "hello-ok-shm-put-not-a-bool",
        raw_frame(
            p.Opcode.HELLO_OK,
            json.dumps({"node_id": "n", "limits": {}, "shared_values": True, "shm_put": 0}).encode(),
            send_key=S2C_KEY,
        ),
        p.ErrorCode.MALFORMED,
    ),
    (
        "hello-ok-shared-values-not-a-bool",
        raw_frame(
            p.Opcode.HELLO_OK,
            json.dumps({"node_id": "n", "limits": {}, "shared_values": "yes"}).encode(),
            send_key=S2C_KEY,
        ),
        p.ErrorCode.MALFORMED,
    ),
    # SHM_GET's reply carries one descriptor flag per item.
    (
        "shm-get-reply-no-flags",
        raw_frame(0xB5, struct.pack(">I", 1) + b"\x00" + struct.pack(">I", 5) + b"\x01" + bytes(32), send_key=S2C_KEY),
        p.ErrorCode.MALFORMED,
    ),
    (
        "status-reply-truncated",
        raw_frame(0x92, struct.pack(">I", 3) + b"\x00", send_key=S2C_KEY),
        p.ErrorCode.MALFORMED,
    ),
    (
        "get-reply-truncated",
        raw_frame(0x91, struct.pack(">I", 1) + b"\x00" + struct.pack(">I", 0), send_key=S2C_KEY),
        p.ErrorCode.MALFORMED,
    ),
    (
        "list-reply-without-flag",
        raw_frame(0x94, keys_meta([b"a"]) + struct.pack(">I", 1), send_key=S2C_KEY),
        p.ErrorCode.MALFORMED,
    ),
    (
        "list-reply-trailing-byte",
        raw_frame(0x94, keys_meta([b"a"]) + struct.pack(">IBB", 1, 0, 0), send_key=S2C_KEY),
        p.ErrorCode.MALFORMED,
    ),
    (
        "list-reply-flag-2",
        raw_frame(0x94, keys_meta([b"a"]) + struct.pack(">IB", 1, 2), send_key=S2C_KEY),
        p.ErrorCode.MALFORMED,
    ),
    (
        "list-reply-unsorted",
        raw_frame(0x94, keys_meta([b"b", b"a"]) + struct.pack(">IIB", 1, 1, 0), send_key=S2C_KEY),
        p.ErrorCode.MALFORMED,
    ),
    (
        "list-reply-duplicate",
        raw_frame(0x94, keys_meta([b"a", b"a"]) + struct.pack(">IIB", 1, 1, 0), send_key=S2C_KEY),
        p.ErrorCode.MALFORMED,
    ),
    (
        "list-reply-empty-key",
        raw_frame(0x94, keys_meta([b""]) + struct.pack(">IB", 1, 0), send_key=S2C_KEY),
        p.ErrorCode.KEY_TOO_LONG,
    ),
    (
        "list-reply-count-over-max",
        raw_frame(0x94, struct.pack(">I", 4097), send_key=S2C_KEY),
        p.ErrorCode.BATCH_TOO_LARGE,
    ),
]


@pytest.mark.parametrize("wire,code", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_request_frame_is_remote_protocol_error(wire, code) -> None:
    _, server = session()
    dec = p.FrameDecoder(server)
    dec.receive_data(wire)
    with pytest.raises(RemoteProtocolError) as info:
        dec.next_frame()
    assert info.value.code == code


@pytest.mark.parametrize("wire,code", [m[1:] for m in MALFORMED_REPLIES], ids=[m[0] for m in MALFORMED_REPLIES])
def test_malformed_reply_frame_is_remote_protocol_error(wire, code) -> None:
    client, _ = session()
    dec = p.FrameDecoder(client)
    dec.receive_data(wire)
    with pytest.raises(RemoteProtocolError) as info:
        dec.next_frame()
    assert info.value.code == code


def test_wrong_size_frame_prefix_is_remote_protocol_error() -> None:
    _, server = session()
    with pytest.raises(RemoteProtocolError):
        server.parse_header(bytes(59))


# --------------------------------------------------------------------------------------------
# Tampering, replay, reordering, other sessions
# --------------------------------------------------------------------------------------------

TAMPER_LIMITS = p.Limits(
    max_key_bytes=480, max_value_bytes=1 << 20, max_batch=64, max_meta_bytes=4096, max_payload_bytes=1 << 20
)
_HEADER_FIELDS = {  # byte offsets in the 28-byte header
    "magic": range(2),
    "version": range(2, 3),
    "opcode": range(3, 4),
    "flags": range(4, 6),
    "status": range(6, 8),
    "seq": range(8, 16),
    "meta_len": range(16, 20),
    "payload_len": range(20, 28),
}


def _field_of(offset: int) -> str:
    if offset >= p.FRAME_PREFIX_BYTES:
        return "meta"
    if offset >= p.FRAME_HEADER.size:
        return "mac"
    return next(name for name, r in _HEADER_FIELDS.items() if offset in r)


def _tamper_cases() -> list[tuple[int, int]]:
    wire = session(TAMPER_LIMITS)[0].encode(_TAMPER_MSG)
    return [(i, x) for i in range(len(wire)) for x in (0x01, 0x80)]


_TAMPER_VALUE = b"payload!" * 4
_TAMPER_MSG = p.PutRequest(
    (p.PutItem(b"tamper/key", len(_TAMPER_VALUE), p.ChecksumAlgo.XXH3_128, _SUMS.compute(_TAMPER_VALUE)),)
)


@pytest.mark.parametrize("offset,xor", _tamper_cases())
def test_any_single_flipped_header_mac_or_meta_byte_never_decodes(offset, xor) -> None:
    """Flips in MAC-covered fields are AuthErrors; flips in the fields checked before the MAC
    (magic, version, flags, an over-limit length) are RemoteProtocolErrors. Never a message."""
    client, server = session(TAMPER_LIMITS, TAMPER_LIMITS)
    wire = bytearray(client.encode(_TAMPER_MSG) + _TAMPER_VALUE)
    wire[offset] ^= xor
    field = _field_of(offset)
    _, _, _, _, _, _, meta_len, payload_len = p.FRAME_HEADER.unpack_from(wire)
    over_limit = meta_len > TAMPER_LIMITS.max_meta_bytes or payload_len > TAMPER_LIMITS.max_payload_bytes
    dec = p.FrameDecoder(server)
    dec.receive_data(bytes(wire))
    # A length that grew within bounds makes the decoder wait; give it the bytes it asks for.
    missing = p.FRAME_PREFIX_BYTES + meta_len + payload_len - len(wire)
    if not over_limit and missing > 0:
        assert dec.next_frame() is None
        dec.receive_data(bytes(missing))
    expected = RemoteProtocolError if field in ("magic", "version", "flags") or over_limit else AuthError
    with pytest.raises(expected):
        dec.next_frame()
    if expected is AuthError:
        assert server.broken is not None


def test_replayed_frame_is_auth_error() -> None:
    client, server = session()
    frame = client.encode(p.DeleteRequest((b"k",)))
    dec = p.FrameDecoder(server)
    dec.receive_data(frame + frame)
    assert dec.next_frame() == (p.DeleteRequest((b"k",)), b"")
    with pytest.raises(AuthError, match="sequence"):
        dec.next_frame()


def test_reordered_frames_are_auth_error() -> None:
    client, server = session()
    first = client.encode(p.PingRequest())
    second = client.encode(p.ExistsRequest((b"k",)))
    dec = p.FrameDecoder(server)
    dec.receive_data(second + first)
    with pytest.raises(AuthError, match="sequence 2, expected 1"):
        dec.next_frame()


def test_dropped_frame_is_auth_error() -> None:
    client, server = session()
    client.encode(p.PingRequest())  # never delivered
    with pytest.raises(AuthError, match="sequence"):
        decode_one(server, client.encode(p.PingRequest()))


def test_frame_from_another_session_is_auth_error() -> None:
    client_a, _ = session(c_nonce=b"\x01" * 32)
    _, server_b = session(c_nonce=b"\x02" * 32)
    with pytest.raises(AuthError, match="MAC"):
        decode_one(server_b, client_a.encode(p.PingRequest()))


def test_frame_reflected_back_to_its_sender_is_auth_error() -> None:
    client, _ = session()
    with pytest.raises(AuthError, match="MAC"):
        decode_one(client, client.encode(p.PingRequest()))


def test_frame_macd_with_a_different_auth_key_is_auth_error() -> None:
    _, server = session()
    wrong = hmac256(OTHER_KEY, b"memkv/1 c2s" + transcript())
    with pytest.raises(AuthError):
        decode_one(server, raw_frame(p.Opcode.PING, send_key=wrong))


def test_codec_refuses_all_use_after_a_receive_error() -> None:
    client, server = session()
    bad = bytearray(client.encode(p.PingRequest()))
    bad[p.FRAME_HEADER.size] ^= 0xFF  # first MAC byte
    dec = p.FrameDecoder(server)
    dec.receive_data(bytes(bad))
    with pytest.raises(AuthError):
        dec.next_frame()
    good = client.encode(p.PingRequest())
    with pytest.raises(LocalProtocolError, match="unusable"):
        server.parse_header(good[: p.FRAME_PREFIX_BYTES])
    with pytest.raises(LocalProtocolError, match="unusable"):
        server.open(p.FrameHeader(p.Opcode.PING, 0, 2, 0, 0, good[28:60]), good[:60], b"")
    with pytest.raises(LocalProtocolError, match="unusable"):
        server.encode(p.PingReply())


def test_codec_refuses_all_use_after_a_malformed_frame() -> None:
    _, server = session()
    with pytest.raises(RemoteProtocolError):
        decode_one(server, raw_frame(0x55))
    with pytest.raises(LocalProtocolError, match="unusable"):
        decode_one(server, raw_frame(p.Opcode.PING, seq=2))


# --------------------------------------------------------------------------------------------
# Handshake
# --------------------------------------------------------------------------------------------


def test_handshake_gives_both_sides_matching_direction_keys() -> None:
    client, server = session()
    assert decode_one(server, client.encode(p.PingRequest())) == (p.PingRequest(), b"")
    assert decode_one(client, server.encode(p.PingReply())) == (p.PingReply(), b"")


def test_client_with_wrong_key_rejects_the_server_proof() -> None:
    ch = p.ClientHandshake(OTHER_KEY, C_NONCE)
    sh = p.ServerHandshake(KEY, S_NONCE)
    with pytest.raises(AuthError, match="MEMKV_AUTH_KEY"):
        ch.receive_server_hello(sh.receive_hello(ch.hello()))


def test_server_rejects_a_client_proof_made_with_the_wrong_key() -> None:
    sh = p.ServerHandshake(KEY, S_NONCE)
    sh.receive_hello(p.ClientHandshake(OTHER_KEY, C_NONCE).hello())
    proof = hmac256(OTHER_KEY, b"memkv/1 client proof" + transcript())
    with pytest.raises(AuthError):
        sh.receive_auth(b"MKVA" + proof)


def test_server_rejects_a_client_auth_replayed_from_an_earlier_handshake() -> None:
    ch = p.ClientHandshake(KEY, C_NONCE)
    recorded_auth = ch.receive_server_hello(p.ServerHandshake(KEY, S_NONCE).receive_hello(ch.hello()))
    sh = p.ServerHandshake(KEY, b"\x33" * 32)  # a fresh server nonce
    sh.receive_hello(ch.hello())  # the attacker replays the recorded hello too
    with pytest.raises(AuthError):
        sh.receive_auth(recorded_auth)


def test_client_rejects_a_server_hello_replayed_into_a_new_handshake() -> None:
    recorded = p.ServerHandshake(KEY, S_NONCE).receive_hello(p.ClientHandshake(KEY, C_NONCE).hello())
    with pytest.raises(AuthError):
        p.ClientHandshake(KEY, b"\x44" * 32).receive_server_hello(recorded)


@pytest.mark.parametrize("offset", [4, *range(8, 40), *range(40, 72)], ids=lambda o: f"byte{o}")
def test_altered_server_hello_fails_the_client_proof_check(offset) -> None:
    ch = p.ClientHandshake(KEY, C_NONCE)
    server_hello = bytearray(p.ServerHandshake(KEY, S_NONCE).receive_hello(ch.hello()))
    server_hello[offset] ^= 0x01
    with pytest.raises((AuthError, RemoteProtocolError)):
        ch.receive_server_hello(bytes(server_hello))


def test_altered_client_nonce_fails_the_handshake() -> None:
    ch = p.ClientHandshake(KEY, C_NONCE)
    hello = bytearray(ch.hello())
    hello[-1] ^= 0x01  # a man in the middle changes the client nonce
    server_hello = p.ServerHandshake(KEY, S_NONCE).receive_hello(bytes(hello))
    with pytest.raises(AuthError):
        ch.receive_server_hello(server_hello)


@pytest.mark.parametrize("version", [0, 2, 255])
def test_unsupported_client_version_is_refused_with_unsupported_version(version) -> None:
    ch = p.ClientHandshake(KEY, C_NONCE, version=version)
    sh = p.ServerHandshake(KEY, S_NONCE)
    with pytest.raises(RemoteProtocolError) as info:
        sh.receive_hello(ch.hello())
    assert info.value.code == p.ErrorCode.UNSUPPORTED_VERSION
    refusal = p.ServerHandshake.refusal(info.value.code)
    assert refusal[:8] == b"MKVS" + bytes([1, p.ErrorCode.UNSUPPORTED_VERSION, 1, 1])
    assert refusal[8:] == bytes(64)  # no nonce, no proof: nothing derived from the key
    with pytest.raises(RemoteProtocolError) as info:
        ch.receive_server_hello(refusal)
    assert info.value.code == p.ErrorCode.UNSUPPORTED_VERSION
    assert "1..1" in str(info.value)


def test_busy_refusal_reaches_the_client_with_its_code() -> None:
    ch = p.ClientHandshake(KEY, C_NONCE)
    with pytest.raises(RemoteProtocolError) as info:
        ch.receive_server_hello(p.ServerHandshake.refusal(p.ErrorCode.SERVER_BUSY))
    assert info.value.code == p.ErrorCode.SERVER_BUSY


@pytest.mark.parametrize(
    "data",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(13), bytes(40), b"MKVX" + bytes(36), b"\xff" * 40],
    ids=["http", "zeros", "wrong-magic", "ones"],
)
def test_garbage_client_hello_is_remote_protocol_error(data) -> None:
    assert len(data) == p.CLIENT_HELLO.size
    with pytest.raises(RemoteProtocolError) as info:
        p.ServerHandshake(KEY, S_NONCE).receive_hello(data)
    assert info.value.code == p.ErrorCode.BAD_MAGIC


def test_garbage_server_hello_names_the_likely_cause() -> None:
    http = b"HTTP/1.0 400 Bad Request\r\n".ljust(p.SERVER_HELLO.size, b"x")
    with pytest.raises(RemoteProtocolError, match="admin port") as info:
        p.ClientHandshake(KEY, C_NONCE).receive_server_hello(http)
    assert info.value.code == p.ErrorCode.BAD_MAGIC


def test_garbage_client_auth_is_remote_protocol_error() -> None:
    sh = p.ServerHandshake(KEY, S_NONCE)
    sh.receive_hello(p.ClientHandshake(KEY, C_NONCE).hello())
    with pytest.raises(RemoteProtocolError):
        sh.receive_auth(b"XXXX" + bytes(32))


def _handshake_messages() -> list[tuple[str, object, bytes]]:
    ch = p.ClientHandshake(KEY, C_NONCE)
    sh = p.ServerHandshake(KEY, S_NONCE)
    hello = ch.hello()
    server_hello = sh.receive_hello(hello)
    auth = ch.receive_server_hello(server_hello)
    return [
        ("client-hello", lambda data: p.ServerHandshake(KEY, S_NONCE).receive_hello(data), hello),
        ("server-hello", lambda data: p.ClientHandshake(KEY, C_NONCE).receive_server_hello(data), server_hello),
        ("client-auth", _auth_receiver, auth),
    ]


def _auth_receiver(data: bytes) -> None:
    sh = p.ServerHandshake(KEY, S_NONCE)
    sh.receive_hello(p.ClientHandshake(KEY, C_NONCE).hello())
    sh.receive_auth(data)


@pytest.mark.parametrize("name,receive,data", _handshake_messages(), ids=[m[0] for m in _handshake_messages()])
def test_handshake_messages_are_accepted_whole_and_refused_truncated_or_with_trailing_bytes(
    name, receive, data
) -> None:
    """Handshake messages have fixed sizes: the reader takes exactly that many bytes. Any
    other length (a truncated read, bytes glued on) is a RemoteProtocolError, never a crash."""
    receive(data)  # whole
    for cut in range(len(data)):
        with pytest.raises(RemoteProtocolError):
            receive(data[:cut])
    with pytest.raises(RemoteProtocolError):
        receive(data + GARBAGE)


def test_handshake_rejects_keys_and_nonces_of_the_wrong_size() -> None:
    with pytest.raises(ValueError):
        p.ClientHandshake(bytes(31), C_NONCE)
    with pytest.raises(ValueError):
        p.ServerHandshake(KEY, bytes(16))


# --------------------------------------------------------------------------------------------
# The message tables: complete unions, one encoder per message type, one decoder per opcode
# --------------------------------------------------------------------------------------------


def _union_members(alias) -> set[type]:
    return set(typing.get_args(alias))


def _message_classes() -> set[type]:
    """Every frame message class the package defines (value objects with a frame of their own)."""
    parts = {p.PutItem, p.GetReplyItem, p.Limits, p.FrameHeader}
    return {
        obj
        for obj in vars(p).values()
        if isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and obj.__module__.startswith(f"{p.__name__}.")
        and obj not in parts
    }


def test_request_and_reply_unions_hold_every_message_rdma_frames_included() -> None:
    requests, replies = _union_members(p.Request), _union_members(p.Reply)
    assert not requests & replies
    assert requests | replies == _message_classes()
    assert {p.RdmaAttachRequest, p.RdmaGetRequest} <= requests
    assert {p.RdmaAttachReply, p.RdmaGetReply} <= replies


def test_every_message_class_has_a_round_trip_fixture() -> None:
    assert {type(m[2]) for m in MESSAGES} == _message_classes()


def test_every_request_opcode_and_its_reply_decode_and_nothing_else_does() -> None:
    requests = [op for op in p.Opcode if op not in (p.Opcode.HELLO_OK, p.Opcode.ERROR, p.Opcode.REPLY)]
    known = (
        {int(p.Opcode.HELLO_OK), int(p.Opcode.ERROR)}
        | {int(op) for op in requests}
        | {op | p.Opcode.REPLY for op in requests}
    )
    assert set(codec._DECODERS) == known
    for opcode in sorted(set(range(256)) - known):
        _, server = session()
        with pytest.raises(RemoteProtocolError) as info:
            decode_one(server, raw_frame(opcode))
        assert info.value.code == p.ErrorCode.UNKNOWN_OPCODE


def test_an_object_that_is_not_a_message_cannot_be_encoded() -> None:
    client, _ = session()
    with pytest.raises(LocalProtocolError, match="cannot encode PutItem"):
        client.encode(p.PutItem(b"k", 1, 1, bytes(32)), validate=False)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "msg",
    [
        p.ExistsRequest((b"k",) * 5),
        p.DeleteRequest((b"k",) * 5),
        p.GetRequest((b"k",) * 5, (1,) * 5),
        p.PutRequest(tuple(p.PutItem(b"k", 0, 1, bytes(32)) for _ in range(5))),
        p.RdmaGetRequest((b"k",) * 5, (1,) * 5, (0,) * 5, 10, 1),
        p.LeaseRequest((b"k",) * 5, 10, 1),
        p.ReleaseRequest((b"k",) * 5, 1),
    ],
    ids=lambda m: type(m).__name__,
)
def test_max_batch_is_one_bound_for_every_batch_both_ways(msg) -> None:
    limits = p.Limits(max_batch=4)
    with pytest.raises(LocalProtocolError, match="batch of 5 keys exceeds max_batch 4") as sent:
        p.validate_outgoing(msg, limits)
    client, server = session(server_limits=limits)
    with pytest.raises(RemoteProtocolError, match="batch of 5 keys exceeds max_batch 4") as received:
        decode_one(server, client.encode(msg, validate=False))
    assert sent.value.code == received.value.code == p.ErrorCode.BATCH_TOO_LARGE


def test_a_broken_codec_still_encodes_the_error_frame_that_explains_the_close_and_nothing_else() -> None:
    client, server = session()
    wire = bytearray(client.encode(p.PingRequest()))
    wire[p.FRAME_HEADER.size] ^= 1  # a flipped MAC byte
    with pytest.raises(AuthError):
        decode_one(server, bytes(wire))
    assert server.broken is not None
    with pytest.raises(LocalProtocolError):
        server.encode(p.PingReply())
    error, _ = decode_one(client, server.encode_error(p.ErrorCode.BAD_MAC, "frame MAC mismatch"))
    assert error == p.ErrorReply(p.ErrorCode.BAD_MAC, "frame MAC mismatch")
    assert server.broken is not None  # still refuses everything else


def test_a_hello_ok_of_the_arena_design_offers_no_shared_memory_to_this_client() -> None:
    """A node of the earlier arena design says `"shared_memory": true`: a client of the sealed-memfd
    design must not take that for its own SHM messages (other opcodes and layouts): it stays on
    the socket. The new key is one such a node never sends."""
    client, _ = session()
    for body, offered in (({"shared_memory": True}, False), ({"shared_values": True}, True), ({}, False)):
        wire = raw_frame(
            p.Opcode.HELLO_OK, json.dumps({"node_id": "n", "limits": {}, **body}).encode(), send_key=S2C_KEY
        )
        msg, _ = decode_one(client, wire)
        assert isinstance(msg, p.HelloOk) and msg.shared_memory is offered
        client, _ = session()
    _, server = session()
    assert b'"shared_values": true' in server.encode(p.HelloOk("n", p.Limits(), "@x", True))
    assert b"shm_put" not in server.encode(p.HelloOk("n", p.Limits(), "@x", True)), "absent unless false"
