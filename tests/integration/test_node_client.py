"""Real `memkv serve` processes on 127.0.0.1 and the real client: the data path end to end.

Behaviour under test:
* put/get/exists/delete round-trip values of 1 KiB, 1 MiB, 16 MiB and 64 MiB over 3 nodes, and
  each value lands on its HRW owner (and only there);
* batch_put_views / batch_get_into move values between caller-owned slices of pre-faulted
  mmaps byte-exact; a GET into a buffer of the wrong length is a miss that leaves it untouched;
* a wrong auth key is refused at the handshake, with an AuthError naming the server;
* hostile input on a raw socket (after a real handshake): a frame with a flipped MAC, meta or
  sequence byte, a replayed frame, an oversized frame, an unknown opcode, a value over the
  limit, a truncated frame, a stalled frame, garbage or an old version instead of a hello: the
  node answers with an ERROR frame, an AuthReject or a refusal ServerHello, or just closes,
  never stores a partial value, and keeps serving good clients;
* a SIGKILLed or SIGSTOPped node turns its keys into misses within the client timeout while the
  other nodes keep serving; a stopped node serves again once continued;
* capacity is never exceeded under overcommit (status and RSS), evictions are counted;
* SIGTERM makes the node exit 0 promptly, and clients then see misses;
* the admin endpoints answer and never serve the key; the `memkv` CLI (serve without a key,
  keygen, probe) does what its help says.

All traffic is on 127.0.0.1; every wait is a socket timeout, a process wait or a
deadline-bounded poll.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import random
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib

import pytest

from memkv import AuthError, LocalProtocolError, NodeUnavailable, RemoteProtocolError
from memkv import protocol as p
from memkv.client.node import NodeConnection
from memkv.local import LocalNode, new_key_hex
from memkv.sockio import recv_exactly
from tests.faults.nodeops import all_threads_stopped, rss_bytes

pytestmark = pytest.mark.integration

KiB, MiB = 1 << 10, 1 << 20
MARGIN_S = 3.0  # slack on top of a client timeout for "did not hang" bounds on a busy 2-core box


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def pattern(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def keys_on_every_node(client, nodes, prefix: str, per_node: int = 1, search: int = 500) -> list[str]:
    """Deterministic keys, `per_node` of them owned by each node (bounded search)."""
    wanted = {n.address: per_node for n in nodes}
    keys = []
    for i in range(search):
        key = f"{prefix}/{i}"
        owner = client.owner(key).name
        if wanted.get(owner, 0) > 0:
            wanted[owner] -= 1
            keys.append(key)
        if not any(wanted.values()):
            return keys
    raise AssertionError(f"no key spread found in {search} candidates")


def admin_get(node: LocalNode, path: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(node.admin_url + path, timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def status_of(node: LocalNode) -> dict:
    code, _, body = admin_get(node, "/v1/status")
    assert code == 200
    return json.loads(body)


def metrics_of(node: LocalNode) -> str:
    code, _, body = admin_get(node, "/v1/metrics")
    assert code == 200
    return body.decode()


def cli(*args: str, env: dict | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MEMKV_")}
    return subprocess.run(
        [sys.executable, "-m", "memkv", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


class RawSession:
    """A hand-driven client connection: a real handshake with memkv.protocol, then raw bytes."""

    def __init__(self, node: LocalNode, key_hex: str, timeout_s: float = 5.0) -> None:
        self.key = bytes.fromhex(key_hex)
        self.sock = socket.create_connection((node.host, node.port), timeout=timeout_s)
        self.client_nonce = os.urandom(32)

    def handshake(self) -> p.HelloOk:
        hs = p.ClientHandshake(self.key, self.client_nonce)
        self.sock.sendall(hs.hello())
        server_hello = bytes(recv_exactly(self.sock, p.SERVER_HELLO.size))
        self.sock.sendall(hs.receive_server_hello(server_hello))
        transcript = bytes([p.PROTOCOL_VERSION]) + self.client_nonce + server_hello[8:40]
        self.c2s_key = hmac.new(self.key, b"memkv/1 c2s" + transcript, hashlib.sha256).digest()
        self.codec = hs.codec()
        self.decoder = p.FrameDecoder(self.codec)
        hello, _ = self.read_frame()
        assert isinstance(hello, p.HelloOk)
        self.send_seq = 1
        return hello

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def raw_frame(self, opcode: int, meta: bytes = b"", *, meta_len: int | None = None, payload_len: int = 0) -> bytes:
        """A frame with a valid MAC and the next sequence number, whatever its fields say."""
        header = struct.pack(
            ">2sBBHHQIQ",
            b"MK",
            1,
            opcode,
            0,
            0,
            self.send_seq,
            len(meta) if meta_len is None else meta_len,
            payload_len,
        )
        self.send_seq += 1
        return header + hmac.new(self.c2s_key, header + meta, hashlib.sha256).digest() + meta

    def encode(self, msg: p.Message) -> bytes:
        self.send_seq += 1
        return self.codec.encode(msg)

    def read_frame(self) -> tuple[p.Message, bytes]:
        for _ in range(10_000):  # bounded; each recv is bounded by the socket timeout
            frame = self.decoder.next_frame()
            if frame is not None:
                return frame
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("node closed the connection")
            self.decoder.receive_data(data)
        raise AssertionError("no frame after 10000 reads")

    def read_to_eof(self) -> bytes:
        """Everything the node sends until it closes (a reset also counts as closed)."""
        chunks = []
        for _ in range(10_000):
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            chunks.append(data)
        else:
            raise AssertionError("node never closed the connection")
        return b"".join(chunks)

    def expect_error_then_close(self) -> p.ErrorReply:
        self.decoder.receive_data(self.read_to_eof())
        frame = self.decoder.next_frame()
        assert frame is not None, "no ERROR frame before the close"
        msg, _ = frame
        assert isinstance(msg, p.ErrorReply), msg
        assert self.decoder.trailing_data == b""
        return msg

    def close(self) -> None:
        self.sock.close()


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(start_module_node) -> list[LocalNode]:
    return start_module_node.many(3, capacity="256MiB")


@pytest.fixture(scope="module")
def hostile_node(start_module_node) -> LocalNode:
    """A node for bad input: short I/O timeout (stalled frames) and a small value limit."""
    return start_module_node(capacity="64MiB", extra_args=["--io-timeout", "1", "--max-value-size", "4MiB"])


@pytest.fixture
def assert_still_serves(make_client):
    def check(node: LocalNode, tag: str) -> None:
        assert node.proc.poll() is None, "the node died"
        client = make_client([node])
        value = pattern(64 * KiB, zlib.crc32(tag.encode()))
        client.put(f"still-serves/{tag}", value)
        assert client.get(f"still-serves/{tag}") == value

    return check


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1 * KiB, 1 * MiB, 16 * MiB, 64 * MiB], ids=["1KiB", "1MiB", "16MiB", "64MiB"])
def test_values_round_trip_on_their_hrw_owner_across_three_nodes(cluster, make_client, size) -> None:
    client = make_client(cluster)
    keys = keys_on_every_node(client, cluster, f"rt/{size}")
    values = {k: pattern(size, i) for i, k in enumerate(keys)}
    for k, v in values.items():
        client.put(k, v)
    for k, v in values.items():
        owner = client.owner(k)
        assert client.exists_on(owner, [k]) == [True]
        others = [n.address for n in cluster if n.address != owner.name]
        assert [client.exists_on(o, [k]) for o in others] == [[False], [False]]
        assert client.get(k) == v
    assert client.exists([*keys, "rt/never-stored"]) == [True] * len(keys) + [False]
    assert client.delete(keys) == [True] * len(keys)
    assert client.exists(keys) == [False] * len(keys)
    assert [client.get(k) for k in keys] == [None] * len(keys)
    assert client.delete(keys) == [False] * len(keys)


def test_replacing_a_value_returns_the_new_bytes(cluster, make_client) -> None:
    client = make_client(cluster)
    client.put("replace/k", b"old" * 1000)
    client.put("replace/k", b"new!" * 2000)
    assert client.get("replace/k") == b"new!" * 2000
    client.delete(["replace/k"])


def test_batch_views_land_byte_exact_in_slices_of_one_prefaulted_mmap(cluster, make_client) -> None:
    client = make_client(cluster)
    slot, slots = 1 * MiB, 24
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    src = mmap.mmap(-1, slot * slots, flags=flags)
    dst = mmap.mmap(-1, slot * slots, flags=flags)
    try:
        src[:] = pattern(slot * slots, 7)
        src_view, dst_view = memoryview(src), memoryview(dst)
        keys = [f"slots/{i}" for i in range(slots)]
        assert len({client.owner(k).name for k in keys}) == 3
        items = [(k, src_view[i * slot : (i + 1) * slot]) for i, k in enumerate(keys)]
        assert client.batch_put_views(items) == [True] * slots
        # Load into the slots in another order, plus one key that was never stored.
        order = list(range(slots))
        random.Random(3).shuffle(order)
        targets = [(keys[i], dst_view[j * slot : (j + 1) * slot]) for j, i in enumerate(order)]
        targets.append(("slots/missing", dst_view[: 4 * KiB]))  # overlaps slot 0 on purpose
        loaded = client.batch_get_into(targets[:-1])
        assert loaded == [True] * slots
        for j, i in enumerate(order):
            assert dst_view[j * slot : (j + 1) * slot] == src_view[i * slot : (i + 1) * slot], f"slot {j}"
        before = bytes(dst_view[: 4 * KiB])
        assert client.batch_get_into(targets[-1:]) == [False]
        assert bytes(dst_view[: 4 * KiB]) == before  # a miss writes nothing
        client.delete(keys)
        del src_view, dst_view, items, targets
    finally:
        src.close()
        dst.close()


def test_get_into_buffer_of_wrong_length_is_a_miss_and_the_buffer_is_untouched(cluster, make_client) -> None:
    client = make_client(cluster)
    value = pattern(4 * KiB, 11)
    client.put("mismatch/k", value)
    owner = next(n for n in cluster if n.address == client.owner("mismatch/k").name)
    misses_before = status_of(owner)["misses"]
    short, long = bytearray(b"\xab" * (4 * KiB - 1)), bytearray(b"\xab" * (4 * KiB + 1))
    assert client.batch_get_into([("mismatch/k", short), ("mismatch/k", long)]) == [False, False]
    assert short == b"\xab" * (4 * KiB - 1) and long == b"\xab" * (4 * KiB + 1)
    assert status_of(owner)["misses"] == misses_before + 2  # SIZE_MISMATCH counts as a miss
    assert all(h["up"] for h in client.health())  # a miss says nothing bad about the node
    exact = bytearray(4 * KiB)
    assert client.batch_get_into([("mismatch/k", exact)]) == [True]
    assert exact == value
    client.delete(["mismatch/k"])


def test_key_over_480_bytes_is_a_usage_error_that_leaves_the_node_up(cluster, make_client) -> None:
    client = make_client(cluster, down_for_s=30.0)
    client.put("usage/ok", b"v")
    for call in (
        lambda: client.exists([b"k" * 481, b"usage/ok"]),
        lambda: client.batch_get_into([(b"k" * 481, bytearray(1))]),
        lambda: client.batch_put_views([(b"k" * 481, b"v")]),
        lambda: client.delete([b""]),
        lambda: client.get(b"k" * 481),
    ):
        with pytest.raises(ValueError, match="480"):
            call()
    assert all(h["up"] for h in client.health())
    assert client.exists(["usage/ok"]) == [True]
    client.delete(["usage/ok"])


def test_value_over_the_nodes_limit_is_refused_before_sending_and_leaves_the_node_up(hostile_node, make_client) -> None:
    client = make_client([hostile_node], down_for_s=30.0)
    client.probe()  # learn the node's limits (4 MiB)
    with pytest.raises(ValueError, match="limit"):
        client.batch_put_views([("big", bytearray(4 * MiB + 1))])
    with pytest.raises(LocalProtocolError):
        client.put("big", bytearray(4 * MiB + 1))
    assert all(h["up"] for h in client.health())
    client.put("small", b"s")
    assert client.get("small") == b"s"


# --------------------------------------------------------------------------------------------
# Authentication
# --------------------------------------------------------------------------------------------


def test_wrong_auth_key_is_refused_at_handshake_with_auth_error_naming_the_server(cluster, make_client) -> None:
    wrong = make_client(cluster[:1], auth_key_hex=new_key_hex())
    with pytest.raises(AuthError, match=re.escape(cluster[0].address)) as info:
        wrong.probe()
    assert "MEMKV_AUTH_KEY" in str(info.value)
    assert wrong.exists(["anything"]) == [False]  # reads never raise
    make_client(cluster[:1]).probe()  # the right key still works


def test_client_proof_under_the_wrong_key_gets_auth_reject_and_a_close(
    hostile_node, auth_key_hex, assert_still_serves
) -> None:
    raw = RawSession(hostile_node, auth_key_hex)
    try:
        raw.send(p.ClientHandshake(raw.key, raw.client_nonce).hello())
        recv_exactly(raw.sock, p.SERVER_HELLO.size)
        raw.send(b"MKVA" + os.urandom(32))
        assert raw.read_to_eof() == p.auth_reject(p.ErrorCode.AUTH_FAILED)
    finally:
        raw.close()
    assert_still_serves(hostile_node, "bad-proof")


def test_old_protocol_version_is_refused_with_unsupported_version(hostile_node, auth_key_hex) -> None:
    from memkv.config import ServerAddress

    address = ServerAddress(hostile_node.host, hostile_node.port)
    with pytest.raises(RemoteProtocolError, match="version 0") as info:
        NodeConnection(address, bytes.fromhex(auth_key_hex), 2.0, 2.0, version=0)
    assert info.value.code == p.ErrorCode.UNSUPPORTED_VERSION
    assert hostile_node.address in str(info.value)


@pytest.mark.parametrize(
    "hello", [b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n".ljust(40, b"\n"), os.urandom(40)], ids=["http", "random"]
)
def test_garbage_instead_of_a_hello_gets_a_refusal_and_a_close(
    hostile_node, auth_key_hex, assert_still_serves, hello
) -> None:
    raw = RawSession(hostile_node, auth_key_hex)
    try:
        raw.send(hello)
        reply = raw.read_to_eof()
    finally:
        raw.close()
    assert reply == p.ServerHandshake.refusal(p.ErrorCode.BAD_MAGIC)
    assert_still_serves(hostile_node, "garbage-hello")


# --------------------------------------------------------------------------------------------
# Hostile frames after a real handshake
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "offset",
    [p.FRAME_HEADER.size, p.FRAME_HEADER.size + 31, 15, 3, -1],
    ids=["mac-first", "mac-last", "seq", "opcode", "meta"],
)
def test_tampered_frame_gets_bad_mac_error_then_close_and_node_keeps_serving(
    hostile_node, auth_key_hex, assert_still_serves, offset
) -> None:
    raw = RawSession(hostile_node, auth_key_hex)
    try:
        raw.handshake()
        frame = bytearray(raw.encode(p.ExistsRequest((b"tamper/k",))))
        frame[offset] ^= 0x01
        raw.send(bytes(frame))
        error = raw.expect_error_then_close()
    finally:
        raw.close()
    assert error.code == p.ErrorCode.BAD_MAC
    assert "MAC" in error.message
    assert_still_serves(hostile_node, f"tamper-{offset}")


def test_replayed_frame_gets_bad_sequence_error_then_close(hostile_node, auth_key_hex, assert_still_serves) -> None:
    raw = RawSession(hostile_node, auth_key_hex)
    try:
        raw.handshake()
        frame = raw.encode(p.ExistsRequest((b"replay/k",)))
        raw.send(frame)
        reply, _ = raw.read_frame()
        assert reply == p.StatusReply(p.Opcode.EXISTS, bytes([p.ItemStatus.MISS]))
        raw.send(frame)
        error = raw.expect_error_then_close()
    finally:
        raw.close()
    assert error.code == p.ErrorCode.BAD_SEQUENCE
    assert_still_serves(hostile_node, "replay")


@pytest.mark.parametrize(
    "meta_len,payload_len,code",
    [
        (p.DEFAULT_MAX_META_BYTES + 1, 0, p.ErrorCode.FRAME_TOO_LARGE),
        (0xFFFFFFFF, 0, p.ErrorCode.FRAME_TOO_LARGE),
        (0, p.DEFAULT_MAX_PAYLOAD_BYTES + 1, p.ErrorCode.FRAME_TOO_LARGE),
        (0, 2**64 - 1, p.ErrorCode.FRAME_TOO_LARGE),
    ],
    ids=["meta-over-limit", "meta-max-u32", "payload-over-limit", "payload-max-u64"],
)
def test_oversized_frame_gets_a_clear_error_before_anything_is_read(
    hostile_node, auth_key_hex, assert_still_serves, meta_len, payload_len, code
) -> None:
    raw = RawSession(hostile_node, auth_key_hex)
    try:
        raw.handshake()
        raw.send(raw.raw_frame(p.Opcode.PUT, meta_len=meta_len, payload_len=payload_len))  # the prefix only
        error = raw.expect_error_then_close()
    finally:
        raw.close()
    assert error.code == code
    assert "exceeds" in error.message
    assert_still_serves(hostile_node, f"oversized-{meta_len}-{payload_len}")


def test_value_over_max_value_bytes_is_refused_from_the_meta(hostile_node, auth_key_hex, assert_still_serves) -> None:
    raw = RawSession(hostile_node, auth_key_hex)
    size = 4 * MiB + 1
    meta = struct.pack(">IH", 1, 3) + b"big" + struct.pack(">I", size) + b"\x01" + bytes(32)
    try:
        hello = raw.handshake()
        assert hello.limits.max_value_bytes == 4 * MiB
        raw.send(raw.raw_frame(p.Opcode.PUT, meta, payload_len=size))  # no payload follows
        error = raw.expect_error_then_close()
    finally:
        raw.close()
    assert error.code == p.ErrorCode.VALUE_TOO_LARGE
    assert_still_serves(hostile_node, "value-too-large")


def test_unknown_opcode_gets_an_error_then_close(hostile_node, auth_key_hex, assert_still_serves) -> None:
    raw = RawSession(hostile_node, auth_key_hex)
    try:
        raw.handshake()
        raw.send(raw.raw_frame(0x55, struct.pack(">I", 0)))
        error = raw.expect_error_then_close()
    finally:
        raw.close()
    assert error.code == p.ErrorCode.UNKNOWN_OPCODE
    assert_still_serves(hostile_node, "unknown-opcode")


def test_truncated_frame_then_close_is_dropped_and_node_keeps_serving(
    hostile_node, auth_key_hex, assert_still_serves
) -> None:
    raw = RawSession(hostile_node, auth_key_hex)
    try:
        raw.handshake()
        frame = raw.encode(p.ExistsRequest((b"truncated/k",)))
        raw.send(frame[: len(frame) // 2])
        raw.sock.shutdown(socket.SHUT_WR)
        assert raw.read_to_eof() == b""  # the node closes its side too
    finally:
        raw.close()
    assert_still_serves(hostile_node, "truncated")


def test_value_truncated_mid_payload_is_never_stored(
    hostile_node, auth_key_hex, make_client, assert_still_serves
) -> None:
    from memkv.integrity import Checksummer

    value = pattern(1 * MiB, 5)
    raw = RawSession(hostile_node, auth_key_hex)
    try:
        raw.handshake()
        item = p.PutItem(b"half/k", len(value), p.ChecksumAlgo.XXH3_128, Checksummer(raw.key).compute(value))
        raw.send(raw.encode(p.PutRequest((item,))) + value[: len(value) // 2])
        raw.sock.shutdown(socket.SHUT_WR)
        assert raw.read_to_eof() == b""
    finally:
        raw.close()
    client = make_client([hostile_node])
    assert client.exists_on(hostile_node.address, ["half/k"]) == [False]
    assert client.get("half/k") is None
    assert_still_serves(hostile_node, "half-value")


def test_stalled_frame_is_closed_after_the_node_io_timeout(hostile_node, auth_key_hex, assert_still_serves) -> None:
    raw = RawSession(hostile_node, auth_key_hex, timeout_s=1.0 + MARGIN_S)
    try:
        raw.handshake()
        frame = raw.encode(p.ExistsRequest((b"stalled/k",)))
        raw.send(frame[:10])  # and then nothing: the node's --io-timeout is 1 s
        started = time.monotonic()
        assert raw.read_to_eof() == b""
        assert time.monotonic() - started < 1.0 + MARGIN_S
    finally:
        raw.close()
    assert_still_serves(hostile_node, "stalled")


def test_refused_frames_are_counted_in_metrics(hostile_node, auth_key_hex, wait_until) -> None:
    raw = RawSession(hostile_node, auth_key_hex)
    try:
        raw.handshake()
        frame = bytearray(raw.encode(p.PingRequest()))
        frame[-1] ^= 0x80
        raw.send(bytes(frame))
        raw.expect_error_then_close()
    finally:
        raw.close()
    wait_until(
        lambda: 'memkv_node_auth_failures_total{reason="bad_mac"}' in metrics_of(hostile_node),
        5.0,
        what="bad_mac metric",
    )


# --------------------------------------------------------------------------------------------
# Node failures
# --------------------------------------------------------------------------------------------


def _store_spread(client, nodes, prefix: str, per_node: int = 4, size: int = 64 * KiB) -> dict[str, bytes]:
    keys = keys_on_every_node(client, nodes, prefix, per_node=per_node)
    values = {k: pattern(size, i) for i, k in enumerate(keys)}
    assert client.batch_put_views(list(values.items())) == [True] * len(values)
    return values


def _load(client, values: dict[str, bytes]) -> tuple[list[bool], dict[str, bytearray]]:
    bufs = {k: bytearray(len(v)) for k, v in values.items()}
    return client.batch_get_into(list(bufs.items())), bufs


def test_get_after_node_kill_is_miss_within_deadline_and_other_nodes_keep_serving(start_node, make_client) -> None:
    nodes = start_node.many(3, capacity="64MiB")
    client = make_client(nodes, io_timeout_s=1.0, connect_timeout_s=0.5, down_for_s=30.0)
    values = _store_spread(client, nodes, "kill")
    loaded, _ = _load(client, values)  # warm the pools: the dead node's sockets are pooled
    assert all(loaded)
    victim = nodes[1]
    victim.kill()
    on_victim = [client.owner(k).name == victim.address for k in values]

    started = time.monotonic()
    loaded, bufs = _load(client, values)
    assert time.monotonic() - started < 1.0 + 0.5 + MARGIN_S
    assert loaded == [not dead for dead in on_victim]
    for (k, v), ok in zip(values.items(), loaded):
        if ok:
            assert bufs[k] == v
    started = time.monotonic()
    assert client.exists(list(values)) == [not dead for dead in on_victim]
    assert [client.get(k) is not None for k in values] == [not dead for dead in on_victim]
    assert time.monotonic() - started < 1.0 + 0.5 + MARGIN_S
    # Writes to the dead node's keys fail (fast: it is marked down); the others succeed.
    dead_key = next(k for k, dead in zip(values, on_victim) if dead)
    assert client.batch_put_views([(k, v) for k, v in values.items()]) == [not dead for dead in on_victim]
    with pytest.raises(NodeUnavailable) as info:
        client.put(dead_key, b"x")
    assert victim.address in str(info.value)


def test_get_from_a_stopped_node_is_miss_within_io_timeout_and_it_serves_again_after_cont(
    start_node, make_client, wait_until
) -> None:
    nodes = start_node.many(2, capacity="64MiB")
    client = make_client(nodes, io_timeout_s=1.0, connect_timeout_s=0.5, down_for_s=0.5)
    values = _store_spread(client, nodes, "stop")
    stopped = nodes[0]
    on_stopped = [client.owner(k).name == stopped.address for k in values]
    stopped.signal(signal.SIGSTOP)
    try:
        wait_until(lambda: all_threads_stopped(stopped.pid), 5.0, what="the node's threads to stop")
        for _ in range(2):  # first through a pooled socket, then after the down mark expires
            started = time.monotonic()
            loaded, bufs = _load(client, values)
            assert time.monotonic() - started < 1.0 + MARGIN_S
            assert loaded == [not s for s in on_stopped]
            assert all(bufs[k] == v for (k, v), ok in zip(values.items(), loaded) if ok)
            started = time.monotonic()
            assert client.exists(list(values)) == [not s for s in on_stopped]
            assert time.monotonic() - started < 1.0 + MARGIN_S
            wait_until(lambda: all(h["up"] for h in client.health()), 5.0, what="the down mark to expire")
    finally:
        stopped.signal(signal.SIGCONT)
    wait_until(lambda: all(_load(client, values)[0]), 10.0, what="the continued node to serve again")


def test_sigterm_exits_zero_promptly_and_clients_then_see_misses(start_node, make_client) -> None:
    node = start_node(capacity="64MiB")
    client = make_client([node], io_timeout_s=1.0, connect_timeout_s=0.5)
    client.put("term/k", b"v" * 1000)
    assert client.get("term/k") == b"v" * 1000  # a pooled connection is open
    node.signal(signal.SIGTERM)
    assert node.proc.wait(timeout=10) == 0
    assert "memkv: node stopped" in "".join(node.output)
    started = time.monotonic()
    assert client.get("term/k") is None
    assert client.exists(["term/k"]) == [False]
    assert client.batch_get_into([("term/k", bytearray(1000))]) == [False]
    assert time.monotonic() - started < 1.0 + 0.5 + MARGIN_S


def test_a_node_crashing_in_native_code_leaves_its_threads_python_stacks_in_its_log(auth_key_hex) -> None:
    """`memkv serve` enables faulthandler: a segfault (NIXL/UCX and the compiled loop are native
    code) ends the process as before (-11) but first writes the fatal error and where its
    threads were, so the log says more than an exit code. No core file is left behind
    (RLIMIT_CORE 0 in the child).

    faulthandler reads the other threads' frames without the GIL: a thread running Python
    code during the dump can cut it short (seen in full runs on two vCPUs: the dump ended at
    the main thread's header, or inside its stack). So the fatal error line and at least one
    thread's header are asserted every time, and the frames written, when there are any, must
    be the node's own; Python without faulthandler writes none of this."""
    import resource

    def no_core() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    node = LocalNode(auth_key_hex, capacity="64MiB", preexec_fn=no_core)
    try:
        node.signal(signal.SIGSEGV)
        assert node.proc.wait(timeout=10) == -signal.SIGSEGV
    finally:
        node.stop()
    log = "".join(node.output)
    assert "Fatal Python error: Segmentation fault" in log
    assert re.search(r"[Tt]hread 0x[0-9a-f]+ \(most recent call first\):", log), log[-2000:]
    frames = re.findall(r'^  File "([^"]+)", line \d+ in \w+', log, re.MULTILINE)
    assert all("/memkv/" in f or "/lib/python3" in f or f.startswith("<frozen ") for f in frames), log[-2000:]


# --------------------------------------------------------------------------------------------
# Capacity
# --------------------------------------------------------------------------------------------


def test_capacity_is_never_exceeded_under_overcommit_and_evictions_are_counted(start_node, make_client) -> None:
    capacity = 64 * MiB
    node = start_node(capacity="64MiB")
    client = make_client([node])
    client.probe()
    baseline_rss = rss_bytes(node.pid)
    blob = pattern(2 * MiB, 99)

    def value(i: int) -> memoryview:  # 200 distinct 1 MiB values, no copies
        return memoryview(blob)[i * 4096 : i * 4096 + MiB]

    peak_rss = 0
    for batch in range(20):
        items = [(f"fill/{i}", value(i)) for i in range(batch * 10, batch * 10 + 10)]
        assert client.batch_put_views(items) == [True] * 10
        status = status_of(node)
        assert status["allocated_bytes"] <= capacity
        assert status["stored_bytes"] <= capacity
        peak_rss = max(peak_rss, rss_bytes(node.pid))
    assert peak_rss <= baseline_rss + capacity + 64 * MiB, (
        f"RSS {peak_rss >> 20} MiB, baseline {baseline_rss >> 20} MiB"
    )
    status = status_of(node)
    assert status["values"] + status["evictions"] == 200
    assert status["evictions"] >= 200 - 64
    assert sum(lane["evictions"] for lane in status["lanes"]) == status["evictions"]
    assert f'memkv_node_evictions_total{{lane="default"}} {float(status["evictions"])}' in metrics_of(node)
    # Least recently used went first; the newest value is intact.
    assert client.get("fill/0") is None
    assert client.get("fill/199") == bytes(value(199))


# --------------------------------------------------------------------------------------------
# Admin HTTP
# --------------------------------------------------------------------------------------------


def test_admin_endpoints_answer_and_never_serve_the_key(cluster, make_client, auth_key_hex, wait_until) -> None:
    node = cluster[0]
    with pytest.raises(AuthError):
        make_client([node], auth_key_hex=new_key_hex()).probe()  # a refused handshake
    wait_until(lambda: "memkv_node_auth_failures_total{" in metrics_of(node), 5.0, what="auth failure metric")

    bodies = []
    code, _, body = admin_get(node, "/v1/health")
    assert (code, json.loads(body)) == (200, {"status": "ok"})
    bodies.append(body)
    code, _, body = admin_get(node, "/v1/ready")
    assert (code, json.loads(body)) == (200, {"ready": True})
    bodies.append(body)
    code, headers, body = admin_get(node, "/v1/status")
    assert code == 200 and headers["Content-Type"] == "application/json"
    status = json.loads(body)
    for field in (
        "node_id",
        "address",
        "capacity_bytes",
        "allocated_bytes",
        "stored_bytes",
        "values",
        "lanes",
        "evictions",
        "connections",
        "max_value_bytes",
    ):
        assert field in status, field
    assert status["capacity_bytes"] == 256 * MiB and status["address"] == node.address and status["ready"] is True
    assert [lane["name"] for lane in status["lanes"]] == ["default"]
    bodies.append(body)
    code, headers, body = admin_get(node, "/v1/metrics")
    assert code == 200 and headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    for name in (
        "memkv_node_stored_bytes",
        "memkv_node_capacity_bytes",
        "memkv_node_auth_failures_total",
        "memkv_node_requests_total",
    ):
        assert name in text, name
    bodies.append(body)
    code, _, body = admin_get(node, "/v1/nope")
    assert code == 404
    bodies.append(body)
    for body in bodies:
        assert auth_key_hex.encode() not in body.lower()
        assert bytes.fromhex(auth_key_hex) not in body


def test_status_reports_lanes_configured_on_the_command_line(start_node) -> None:
    node = start_node(capacity="64MiB", extra_args=["--lane", "fleet-a:a/:0.5", "--lane", "fleet-b:b/:0.25"])
    lanes = {lane["name"]: lane for lane in status_of(node)["lanes"]}
    assert set(lanes) == {"fleet-a", "fleet-b", "default"}
    assert lanes["fleet-a"]["share_bytes"] == 32 * MiB and lanes["fleet-a"]["prefix"] == "a/"
    assert lanes["default"]["share"] == pytest.approx(0.25)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def test_probe_cli_exits_0_against_live_nodes_and_1_with_one_dead(cluster, start_node, auth_key_hex, tmp_path) -> None:
    env = {"MEMKV_AUTH_KEY": auth_key_hex, "XDG_CONFIG_HOME": str(tmp_path)}
    live = ",".join(n.address for n in cluster)
    ok = cli("probe", env={**env, "MEMKV_SERVERS": live})
    assert ok.returncode == 0, ok.stderr
    assert [line.split()[:2] for line in ok.stdout.splitlines()] == [["ok", n.address] for n in cluster]
    dead = start_node(capacity="64MiB")
    dead.kill()
    failed = cli("probe", env={**env, "MEMKV_SERVERS": f"{live},{dead.address}"})
    assert failed.returncode == 1
    assert f"FAIL  {dead.address}" in failed.stdout
    wrong = cli("probe", env={**env, "MEMKV_SERVERS": live, "MEMKV_AUTH_KEY": new_key_hex()})
    assert wrong.returncode == 1 and "MEMKV_AUTH_KEY" in wrong.stdout
    for out in (ok, failed, wrong):
        assert auth_key_hex not in out.stdout + out.stderr


def test_serve_without_a_key_creates_a_0600_key_file_and_prints_the_export_hint(
    start_node, make_client, tmp_path
) -> None:
    xdg = tmp_path / "xdg"
    node = start_node(capacity="64MiB", auth_key_hex="", env={"XDG_CONFIG_HOME": str(xdg)})
    key_file = xdg / "memkv" / "auth.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key_hex = key_file.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", key_hex)
    output = "".join(node.output)
    assert f"export MEMKV_AUTH_KEY=$(cat {key_file})" in output
    assert key_hex not in output
    make_client([node], auth_key_hex=key_hex).probe()
    # A second node on the same host reuses the file instead of making another key.
    again = start_node(capacity="64MiB", auth_key_hex="", env={"XDG_CONFIG_HOME": str(xdg)})
    assert "created one" not in "".join(again.output)
    make_client([again], auth_key_hex=key_hex).probe()


def test_keygen_prints_a_fresh_64_hex_key() -> None:
    first, second = cli("keygen"), cli("keygen")
    assert first.returncode == 0 and second.returncode == 0
    assert re.fullmatch(r"[0-9a-f]{64}\n", first.stdout)
    assert first.stdout != second.stdout
