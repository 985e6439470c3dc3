"""The handshake: HELLO, proofs of the auth key, and the per-direction frame keys.

Fixed-size, unMACed messages (layouts in memkv.protocol.frames); a finished handshake gives
each side its `FrameCodec`.
"""

from __future__ import annotations

import hashlib
import hmac

from memkv.errors import AuthError, RemoteProtocolError
from memkv.protocol.codec import FrameCodec
from memkv.protocol.frames import (
    AUTH_MAGIC,
    AUTH_REJECT,
    CLIENT_AUTH,
    CLIENT_HELLO,
    HELLO_MAGIC,
    KEY_BYTES,
    MIN_PROTOCOL_VERSION,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    REJECT_MAGIC,
    SERVER_HELLO,
    SERVER_HELLO_MAGIC,
    ErrorCode,
    Limits,
    error_name,
)


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
