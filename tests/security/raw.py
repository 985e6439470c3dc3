"""Hand-driven connections to a live node: a real handshake with memkv.protocol, then any bytes.

`RawSession` speaks the handshake through `memkv.protocol` (so it holds the real per-connection
frame keys), then lets a test send whatever it wants: frames the codec would refuse to build,
frames with fields changed and the MAC recomputed (so the node parses the hostile meta instead of
stopping at the MAC), replays, frames out of order, frames of another connection.

Every socket has a timeout; every read loop is bounded by a count.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from memkv import protocol as p
from memkv.local import LocalNode
from memkv.sockio import recv_exactly
from tests.tlscerts import connect_to


class RawSession:
    def __init__(self, node: LocalNode, key_hex: str, timeout_s: float = 5.0) -> None:
        self.key = bytes.fromhex(key_hex)
        self.sock = connect_to(node, timeout_s)  # over TLS when the node serves TLS
        self.client_nonce = os.urandom(p.NONCE_BYTES)
        self.send_seq = 0
        self.c2s_key = b""
        self.codec: p.FrameCodec | None = None
        self.decoder: p.FrameDecoder | None = None
        self.hello_bytes = b""
        self.auth_bytes = b""

    # -- handshake ------------------------------------------------------------------------------

    def handshake(self, version: int = p.PROTOCOL_VERSION) -> p.HelloOk:
        hs = p.ClientHandshake(self.key, self.client_nonce, version)
        self.hello_bytes = hs.hello()
        self.sock.sendall(self.hello_bytes)
        server_hello = bytes(recv_exactly(self.sock, p.SERVER_HELLO.size))
        self.auth_bytes = hs.receive_server_hello(server_hello)
        self.sock.sendall(self.auth_bytes)
        transcript = bytes([version]) + self.client_nonce + server_hello[8:40]
        self.c2s_key = hmac.new(self.key, b"memkv/1 c2s" + transcript, hashlib.sha256).digest()
        self.codec = hs.codec()
        self.decoder = p.FrameDecoder(self.codec)
        hello, _ = self.read_frame()
        assert isinstance(hello, p.HelloOk), hello
        self.send_seq = 0
        return hello

    # -- building frames ------------------------------------------------------------------------

    def frame(
        self,
        opcode: int,
        meta: bytes = b"",
        *,
        seq: int | None = None,
        meta_len: int | None = None,
        payload_len: int = 0,
        version: int = p.PROTOCOL_VERSION,
        flags: int = 0,
        status: int = 0,
        mac_key: bytes | None = None,
    ) -> bytes:
        """A frame with a valid MAC (under this session's key unless `mac_key`) and, unless `seq`
        is given, the next sequence number -- whatever its other fields say."""
        if seq is None:
            self.send_seq += 1
            seq = self.send_seq
        header = p.FRAME_HEADER.pack(
            b"MK", version, opcode, flags, status, seq, len(meta) if meta_len is None else meta_len, payload_len
        )
        mac = hmac.new(mac_key or self.c2s_key, header + meta, hashlib.sha256).digest()
        return header + mac + meta

    def encode(self, msg: p.Message) -> bytes:
        """A well-formed request through the real codec (it advances the codec's own counter)."""
        assert self.codec is not None
        self.send_seq += 1
        return self.codec.encode(msg)

    # -- I/O ------------------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_frame(self) -> tuple[p.Message, bytes]:
        assert self.decoder is not None
        for _ in range(10_000):  # bounded; each recv is bounded by the socket timeout
            frame = self.decoder.next_frame()
            if frame is not None:
                return frame
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("node closed the connection")
            self.decoder.receive_data(data)
        raise AssertionError("no frame after 10000 reads")

    def read_to_eof(self, limit_bytes: int = 1 << 20) -> bytes:
        """What the node sends until it closes (a reset also counts as closed)."""
        chunks, total = [], 0
        for _ in range(10_000):
            try:
                data = self.sock.recv(1 << 16)
            except (ConnectionResetError, BrokenPipeError):
                break
            if not data:
                break
            chunks.append(data)
            total += len(data)
            if total > limit_bytes:
                raise AssertionError(f"node sent over {limit_bytes} bytes without closing")
        else:
            raise AssertionError("node never closed the connection")
        return b"".join(chunks)

    def error_then_close(self) -> p.ErrorReply:
        """Read the node's ERROR frame and its close."""
        assert self.decoder is not None
        self.decoder.receive_data(self.read_to_eof())
        frame = self.decoder.next_frame()
        assert frame is not None, "no ERROR frame before the close"
        msg, _ = frame
        assert isinstance(msg, p.ErrorReply), msg
        return msg

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def key_block(keys: list[bytes]) -> bytes:
    return struct.pack(f">I{len(keys)}H", len(keys), *map(len, keys)) + b"".join(keys)
