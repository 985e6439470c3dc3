"""Wire constants, the enums every frame carries, `Limits` and the frame header.

The fixed layouts of the handshake messages and of the frame header live here, with the
numbers the two sides agree on (docs/protocol.md); nothing here encodes a message.
"""

from __future__ import annotations

import dataclasses
import enum
import struct

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

# Defaults for `Limits`. Keys: 480 bytes is what the spec promises users. Batches: 4096 keys
# covers a lookup of a 256k-token prompt in 64-token blocks in one round trip. Meta: every
# field of a 4096-item batch fits with room. Payload: a batch of 8 x 64 MiB values fits twice.
DEFAULT_MAX_KEY_BYTES = 480
DEFAULT_MAX_VALUE_BYTES = 64 << 20
DEFAULT_MAX_BATCH = 4096
DEFAULT_MAX_META_BYTES = 4 << 20
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
ANY_LENGTH = 0xFFFFFFFF  # GET: accept a value of any length
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


def error_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"error {code}"


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
# Frame header (its MAC and sequence are checked by memkv.protocol.codec.FrameCodec)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FrameHeader:
    opcode: int
    status: int
    seq: int
    meta_len: int
    payload_len: int
    mac: bytes
