"""MemKV's exception tree.

    MemKVError
    ├── ConfigError            a bad setting; names the variable or key, never prints a secret
    ├── ProtocolError          (abstract) a frame broke the protocol
    │   ├── LocalProtocolError     we tried to send something the protocol forbids (our bug / bad input)
    │   └── RemoteProtocolError    the peer sent something the protocol forbids
    ├── AuthError              the handshake or a frame MAC failed: wrong key, tampering, replay
    ├── TransportError         the network failed us (marks the node down)
    │   ├── MemKVTimeout           (abstract base of the timeouts)
    │   │   ├── ConnectTimeout
    │   │   ├── ReadTimeout
    │   │   ├── WriteTimeout       (no down mark when the node was still taking the bytes)
    │   │   └── PoolTimeout
    │   ├── ConnectError
    │   ├── ReadError          the peer closed or reset mid-frame
    │   ├── WriteError
    │   └── TlsError           TLS failed: unknown CA, hostname mismatch, expired or missing
    │                          certificate, TLS against a plain port (the message says which)
    ├── NodeUnavailable        the node is marked down; the call failed fast without I/O
    ├── ServerError            the node answered with an error code (see protocol.ErrorCode)
    ├── IntegrityError         a value's checksum did not match its bytes
    └── RdmaError              the RDMA path failed (NIXL/UCX, a node without RDMA, a write
                               that did not complete); not a TransportError: TCP may be fine

    Usage errors, outside the tree on purpose:
    ClientClosed (a RuntimeError)   a method of a closed `memkv.Client` was called
    ValueError / TypeError          a key that is too long, a value over the size limit, a
                                    buffer of the wrong type

Usage errors are raised before any I/O and never caught by the client or the tier: catching
MemKVError never hides a bug.

`map_os_error` is the one place an OSError from a socket becomes one of these classes.
"""

from __future__ import annotations

import errno
import socket
import ssl

from memkv.sockio import SendTimeout


class MemKVError(Exception):
    """Base of every error MemKV raises on purpose."""


class ConfigError(MemKVError):
    """A configuration value is missing or invalid. The message names the setting."""


class ProtocolError(MemKVError):
    """A frame violated the wire protocol. Not raised directly: see the two subclasses."""

    def __init__(self, msg: str, code: int | None = None) -> None:
        if type(self) is ProtocolError:
            raise TypeError("ProtocolError is abstract; raise LocalProtocolError or RemoteProtocolError")
        super().__init__(msg)
        self.code = code


class LocalProtocolError(ProtocolError):
    """We were asked to send something the protocol forbids."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids."""


class AuthError(MemKVError):
    """Authentication failed: wrong auth key, a forged, altered or replayed frame. `reason` says
    which (a metrics label and what the node answers): "bad_mac", "bad_sequence", "wrong_key"."""

    def __init__(self, msg: str, reason: str = "wrong_key") -> None:
        super().__init__(msg)
        self.reason = reason


class TransportError(MemKVError):
    """The connection failed. `server` names the peer when known."""

    def __init__(self, msg: str, server: str | None = None) -> None:
        super().__init__(f"{server}: {msg}" if server else msg)
        self.server = server


class MemKVTimeout(TransportError):
    """An operation ran past its timeout."""


class ConnectTimeout(MemKVTimeout):
    pass


class ReadTimeout(MemKVTimeout):
    pass


class WriteTimeout(MemKVTimeout):
    """A request not sent within its timeout. `node_idle_s`: how long before the timeout the node
    last took bytes of it, where the send knows (None: unknown). A node still taking them is
    busy, not gone (memkv.client.node.node_is_busy)."""

    node_idle_s: float | None = None


class PoolTimeout(MemKVTimeout):
    pass


class ConnectError(TransportError):
    pass


class ReadError(TransportError):
    pass


class WriteError(TransportError):
    pass


class TlsError(TransportError):
    """The TLS layer failed; the message names the cause and the setting to fix
    (memkv/tls.py `explain`). Not a ConnectError: no address or reachability hint applies."""


class NodeUnavailable(MemKVError):
    """The node is marked down after a failure; the call failed fast without touching it."""

    def __init__(self, server: str, retry_in_s: float) -> None:
        super().__init__(f"{server}: marked down after a failure, retried in {retry_in_s:.1f}s")
        self.server = server
        self.retry_in_s = retry_in_s


class ServerError(MemKVError):
    """The node refused the request with an error code."""

    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.code = code


class IntegrityError(MemKVError):
    """A value's checksum did not match its bytes: corruption in memory or on the wire."""


class RdmaError(MemKVError):
    """The RDMA path failed: NIXL/UCX missing or broken, a node without RDMA, a write that did
    not complete. Not a TransportError on purpose: the node's TCP path may be fine, so it must
    not mark the node down."""


class ClientClosed(RuntimeError):
    """A `memkv.Client` method was called after `close()` (or after its `with` block).

    A usage error like ValueError, so not a MemKVError: code that turns MemKVError into a miss
    must not hide it. Every public method of a closed client raises it, reads included."""


def map_os_error(exc: OSError, op: str, server: str | None = None) -> TransportError:
    """Translate a socket-level OSError raised during `op` ("connect", "read", "write")."""
    if isinstance(exc, ssl.SSLError):  # before the timeouts: SSLError is no timeout
        return TlsError(explain_tls(exc), server)
    # BlockingIOError: a kernel timeout (SO_RCVTIMEO/SO_SNDTIMEO) expired on a blocking socket.
    if isinstance(exc, (socket.timeout, TimeoutError, BlockingIOError)):
        if isinstance(exc, SendTimeout):
            mib = 1 << 20
            err = WriteTimeout(
                f"write timed out after {exc.sent / mib:.1f} of {exc.total / mib:.1f} MiB, "
                f"the last taken {exc.idle_s:.2f}s before",
                server,
            )
            err.node_idle_s = exc.idle_s
            return err
        timeout: type[MemKVTimeout] = {"connect": ConnectTimeout, "read": ReadTimeout, "write": WriteTimeout}[op]
        return timeout(f"{op} timed out", server)
    if op == "connect":
        hint = ""
        if exc.errno == errno.ECONNREFUSED:
            hint = " (nothing listens there: is `memkv serve` running, and is the port right?)"
        elif isinstance(exc, socket.gaierror):
            hint = " (the host name does not resolve)"
        return ConnectError(f"connect failed: {exc.strerror or exc}{hint}", server)
    cls = ReadError if op == "read" else WriteError
    return cls(f"{op} failed: {exc.strerror or exc}", server)


# OpenSSL's X509 verify codes (x509_vfy.h) that name a cause we can explain.
_UNKNOWN_CA_CODES = {2, 18, 19, 20, 21}  # issuer unknown, self-signed, self-signed in chain, ...
_EXPIRED = 10
_NOT_YET_VALID = 9
_HOSTNAME_MISMATCH = 62
# OpenSSL reasons that mean "the bytes that came back are not TLS": the peer speaks plain MemKV.
_NOT_TLS_REASONS = {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"}


def explain_tls(exc: ssl.SSLError) -> str:
    """What went wrong in a TLS handshake, in words an operator can act on."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code
        if code in _UNKNOWN_CA_CODES:
            return (
                "TLS: the node's certificate is not signed by a CA we trust (unknown CA) -- "
                "set MEMKV_TLS_CA to the CA certificate that signed the node's certificate"
            )
        if code == _HOSTNAME_MISMATCH:
            return (
                f"TLS: the node's certificate does not name the host we connected to (hostname mismatch: "
                f"{exc.verify_message}) -- connect by a name in its certificate or set MEMKV_TLS_SERVER_NAME"
            )
        if code == _EXPIRED:
            return "TLS: the node's certificate has expired -- renew it, then send the node SIGHUP to reload it"
        if code == _NOT_YET_VALID:
            return "TLS: the node's certificate is not valid yet -- check the clocks of client and node"
        return f"TLS: the node's certificate failed verification: {exc.verify_message}"
    reason = exc.reason or ""
    if reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED" or reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
        return (
            "TLS: the node requires a client certificate (mutual TLS) and we sent none -- "
            "set MEMKV_TLS_CERT and MEMKV_TLS_KEY"
        )
    if reason in ("TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_BAD_CERTIFICATE"):
        return "TLS: the node does not trust our client certificate (unknown CA) -- use a certificate signed by its --tls-ca"
    if reason == "SSLV3_ALERT_CERTIFICATE_EXPIRED":
        return "TLS: the node refused our client certificate: it has expired -- renew MEMKV_TLS_CERT"
    if reason in _NOT_TLS_REASONS:
        return (
            "TLS: the node answered without TLS: this port serves plain MemKV (a TLS client on a plain port) -- "
            "use the node's TLS port (its --tls-listen) or unset MEMKV_TLS_CA/MEMKV_TLS_CERT"
        )
    if isinstance(exc, ssl.SSLEOFError) or reason == "UNEXPECTED_EOF_WHILE_READING":
        return (
            "TLS: the node closed the connection without a TLS close (in a handshake: is this a TLS port, "
            "and does it need a client certificate?)"
        )
    return f"TLS: {reason or exc}"


__all__ = [
    "MemKVError",
    "ConfigError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "AuthError",
    "TransportError",
    "MemKVTimeout",
    "ConnectTimeout",
    "ReadTimeout",
    "WriteTimeout",
    "PoolTimeout",
    "ConnectError",
    "ReadError",
    "WriteError",
    "TlsError",
    "NodeUnavailable",
    "ServerError",
    "IntegrityError",
    "RdmaError",
    "ClientClosed",
    "map_os_error",
]
