"""MemKV wire protocol, version 1: a sans-I/O codec.

Bytes in, messages out; messages in, bytes out. Nothing here opens a socket, starts a thread or
reads a clock, so every path can be tested with plain bytes. `docs/protocol.md` is the
normative description; this package is its implementation and the two must agree.

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

Layout of this package, one module per idea, each importing only those above it:
* `frames`: the constants, the enums (Opcode, ErrorCode, ItemStatus, ChecksumAlgo), `Limits`
  and the frame header;
* `messages`: the message value objects (`Request` and `Reply` are the complete unions, RDMA
  control frames included), `reply_mismatch` and `payload_length`;
* `checks`: the bound checks and `validate_outgoing`;
* `codec`: the codec as two tables, `_ENCODERS` (message type -> its encoder) and `_DECODERS`
  (opcode -> its decoder), then the frames of one connection, MAC and sequence (`FrameCodec`);
* `handshake`: the handshake, its proofs and the frame keys.
This `__init__` re-exports their public names: `from memkv import protocol as p` then `p.X`.
"""

from __future__ import annotations

from memkv.protocol.checks import validate_outgoing
from memkv.protocol.codec import (
    FrameCodec,
    FrameDecoder,
)
from memkv.protocol.frames import (
    ANY_LENGTH,
    AUTH_MAGIC,
    AUTH_REJECT,
    CHECKSUM_BYTES,
    CLIENT_AUTH,
    CLIENT_HELLO,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_KEY_BYTES,
    DEFAULT_MAX_META_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_MAX_VALUE_BYTES,
    FRAME_HEADER,
    FRAME_MAGIC,
    FRAME_PREFIX_BYTES,
    HELLO_MAGIC,
    KEY_BYTES,
    MAC_BYTES,
    MIN_PROTOCOL_VERSION,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    REJECT_MAGIC,
    SERVER_HELLO,
    SERVER_HELLO_MAGIC,
    ChecksumAlgo,
    ErrorCode,
    FrameHeader,
    ItemStatus,
    Limits,
    Opcode,
    error_name,
)
from memkv.protocol.handshake import (
    ClientHandshake,
    ServerHandshake,
    auth_reject,
    parse_auth_outcome_prefix,
)
from memkv.protocol.messages import (
    MAX_LEASE_MS,
    MAX_RDMA_METADATA_BYTES,
    MAX_RDMA_WINDOW_MS,
    MAX_SHM_FDS,
    SHM_MIN_VALUE,
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
    RdmaAttachStatus,
    RdmaBackend,
    RdmaGetReply,
    RdmaGetRequest,
    ReleaseRequest,
    Reply,
    Request,
    ShmCommitRequest,
    ShmGetReply,
    ShmGetRequest,
    ShmPutRequest,
    StatusReply,
    is_local_socket_name,
    payload_length,
    reply_mismatch,
)

__all__ = [
    # frames
    "PROTOCOL_VERSION",
    "MIN_PROTOCOL_VERSION",
    "HELLO_MAGIC",
    "SERVER_HELLO_MAGIC",
    "AUTH_MAGIC",
    "REJECT_MAGIC",
    "FRAME_MAGIC",
    "NONCE_BYTES",
    "KEY_BYTES",
    "MAC_BYTES",
    "CHECKSUM_BYTES",
    "CLIENT_HELLO",
    "SERVER_HELLO",
    "CLIENT_AUTH",
    "AUTH_REJECT",
    "FRAME_HEADER",
    "FRAME_PREFIX_BYTES",
    "DEFAULT_MAX_KEY_BYTES",
    "DEFAULT_MAX_VALUE_BYTES",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_META_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "ANY_LENGTH",
    "Opcode",
    "ErrorCode",
    "ItemStatus",
    "ChecksumAlgo",
    "error_name",
    "Limits",
    "FrameHeader",
    # messages
    "PingRequest",
    "PingReply",
    "HelloOk",
    "is_local_socket_name",
    "PutItem",
    "PutRequest",
    "GetRequest",
    "GetReplyItem",
    "ExistsRequest",
    "DeleteRequest",
    "ListRequest",
    "ListReply",
    "StatusReply",
    "GetReply",
    "ErrorReply",
    "MAX_LEASE_MS",
    "LeaseRequest",
    "LeaseReply",
    "ReleaseRequest",
    "MAX_RDMA_METADATA_BYTES",
    "MAX_RDMA_WINDOW_MS",
    "RdmaBackend",
    "RdmaAttachStatus",
    "RdmaAttachRequest",
    "RdmaAttachReply",
    "RdmaGetRequest",
    "RdmaGetReply",
    "SHM_MIN_VALUE",
    "MAX_SHM_FDS",
    "ShmGetRequest",
    "ShmPutRequest",
    "ShmCommitRequest",
    "ShmGetReply",
    "Request",
    "Reply",
    "Message",
    "reply_mismatch",
    "payload_length",
    # checks
    "validate_outgoing",
    # codec
    "FrameCodec",
    "FrameDecoder",
    # handshake
    "ClientHandshake",
    "ServerHandshake",
    "auth_reject",
    "parse_auth_outcome_prefix",
]
