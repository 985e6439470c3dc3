"""TLS on the data port and the admin port (docs/operations.md, "Encryption in transit").

TLS is a layer under the MemKV protocol, not a replacement: the HMAC handshake and every
frame's MAC still run inside it, so a stolen certificate alone does not open the cache.

Node side: `ServerTls` holds the node's certificate, key and optional client CA (mutual TLS)
as one `ssl.SSLContext`. `reload()` (on SIGHUP) builds a new context from the same paths and
swaps it in; connections already up keep the context they were made with, new handshakes get
the new certificate. A reload that fails (a half-written file) keeps the old context.

Client side: `client_connect(settings)` is a `memkv.client.node.Connect` seam that wraps each
TCP connection in TLS, hostname verification on. `memkv.errors.explain_tls(exc)` turns
OpenSSL's errors into a sentence naming the cause (unknown CA, hostname mismatch, expired certificate, a client
certificate required, TLS against a plain port); `errors.map_os_error` uses it, so every
caller (the startup probe of the vLLM tier included) gets that sentence.

Data path: `SSLSocket.recv_into` decrypts straight into the caller's memoryview; a send
encrypts from the caller's memory into OpenSSL's record buffer (the one copy per byte, which
the encryption makes anyway). See memkv/sockio.py.

Handshakes are bounded by a deadline on a non-blocking socket: a peer dripping bytes cannot
hold a connection slot past it.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable

from memkv.config import ClientTls, ServerAddress
from memkv.errors import ConfigError
from memkv.errors import explain_tls as explain

log = logging.getLogger("memkv.tls")

# The first byte of every TLS record that opens a connection (a handshake record).
TLS_HANDSHAKE_BYTE = 0x16


def server_context(cert: str, key: str, ca: str | None) -> ssl.SSLContext:
    """The node's context: TLS 1.3 only, the node's certificate, and with `ca` mutual TLS
    (a client without a certificate signed by `ca` fails the handshake). Raises ConfigError
    naming the file that could not be used (never its contents)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    _load_chain(ctx, cert, key, "--tls-cert", "--tls-key")
    if ca is not None:
        _load_ca(ctx, ca, "--tls-ca")
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(settings: ClientTls) -> ssl.SSLContext:
    """A client's context: TLS 1.3, the node's certificate verified against `settings.ca` (or
    the system store), hostname checked."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname by default
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if settings.ca is not None:
        _load_ca(ctx, settings.ca, "MEMKV_TLS_CA")
    else:
        ctx.load_default_certs()
    if settings.cert is not None and settings.key is not None:
        _load_chain(ctx, settings.cert, settings.key, "MEMKV_TLS_CERT", "MEMKV_TLS_KEY")
    return ctx


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str, cert_setting: str, key_setting: str) -> None:
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError:
        # ssl does not say which file is missing
        which, path = (cert_setting, cert) if not os.path.exists(cert) else (key_setting, key)
        raise ConfigError(f"{which}: no such file {path}") from None
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{cert_setting} {cert} / {key_setting} {key}: not a PEM certificate and its matching private key "
            f"({exc.reason or exc.__class__.__name__})"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{cert_setting} {cert} / {key_setting} {key}: cannot read: {exc.strerror}") from None


def _load_ca(ctx: ssl.SSLContext, ca: str, setting: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca)
    except FileNotFoundError:
        raise ConfigError(f"{setting}: no such file {ca}") from None
    except ssl.SSLError as exc:
        raise ConfigError(f"{setting} {ca}: not a PEM CA certificate ({exc.reason or 'unreadable'})") from None
    except OSError as exc:
        raise ConfigError(f"{setting} {ca}: cannot read: {exc.strerror}") from None


class ServerTls:
    """The node's TLS context, re-read from its files by `reload()`. Thread-safe: `context` is
    one attribute read; `reload` swaps it whole."""

    def __init__(self, cert: str, key: str, ca: str | None) -> None:
        self.cert, self.key, self.ca = cert, key, ca
        self._lock = threading.Lock()
        self._contexts = self._load()
        self.reloads = 0

    def _load(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        # The admin port's context never asks for a client certificate (server/admin.py).
        return server_context(self.cert, self.key, self.ca), server_context(self.cert, self.key, None)

    @property
    def context(self) -> ssl.SSLContext:
        return self._contexts[0]

    @property
    def admin_context(self) -> ssl.SSLContext:
        return self._contexts[1]

    @property
    def mutual(self) -> bool:
        return self.ca is not None

    def reload(self) -> bool:
        """Re-read the certificate, key and CA; True when the new ones are in use. On failure the
        old context stays (a node never loses TLS to a bad rotation) and an ERROR is logged."""
        with self._lock:
            try:
                contexts = self._load()
            except ConfigError as exc:
                log.error("TLS reload failed, still serving the previous certificate: %s", exc)
                return False
            self._contexts = contexts  # one assignment: readers see the old pair or the new
            self.reloads += 1
        log.warning("TLS certificate reloaded from %s (new handshakes use it; open connections keep theirs)", self.cert)
        return True

    def wrap(self, sock: socket.socket, deadline: float) -> ssl.SSLSocket:
        """The server side of a handshake on an accepted socket, bounded by `deadline`."""
        tls = self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        try:
            handshake(tls, deadline)
        except OSError:
            _linger(tls, min(deadline, time.monotonic() + LINGER_S))
            raise
        except BaseException:
            tls.close()
            raise
        return tls


# How long a refused handshake's socket drains the client's bytes before closing (see _linger).
LINGER_S = 1.0


def _linger(tls: ssl.SSLSocket, until: float) -> None:
    """Close after a failed handshake without losing the alert that says why. Under TLS 1.3
    the client believes the handshake done and sends its MemKV hello at once; closing with
    those bytes unread makes the kernel send a reset, which can discard the alert (unknown
    CA, certificate required) before the client reads it. So: FIN after the alert, read and
    drop what comes until the client closes or `until`, then close."""
    try:
        raw = socket.socket(fileno=tls.detach())
    except OSError:
        tls.close()
        return
    try:
        raw.shutdown(socket.SHUT_WR)
        while (left := until - time.monotonic()) > 0:
            raw.settimeout(left)
            if not raw.recv(4096):
                break
    except OSError:
        pass
    finally:
        raw.close()


def handshake(tls: ssl.SSLSocket, deadline: float) -> None:
    """Run the TLS handshake on a non-blocking socket, waiting at most until `deadline`
    (a `time.monotonic()` instant); leaves the socket blocking. Raises ssl.SSLError,
    OSError, or TimeoutError."""
    tls.setblocking(False)
    while True:
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            want_write = False
        except ssl.SSLWantWriteError:
            want_write = True
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("TLS handshake timed out")
        poller = select.poll()  # not select(): a node's descriptors go past FD_SETSIZE (1024)
        poller.register(tls.fileno(), select.POLLOUT if want_write else select.POLLIN)
        if not poller.poll(max(1, int(left * 1000 + 0.999))):
            raise TimeoutError("TLS handshake timed out")
    tls.setblocking(True)


def client_connect(
    settings: ClientTls, tcp: Callable[[ServerAddress, float], socket.socket]
) -> Callable[[ServerAddress, float], socket.socket]:
    """A Connect seam: `tcp(address, timeout)`, then a TLS handshake checking the node's
    certificate against `settings.server_name` or the address's host."""
    ctx = client_context(settings)

    def connect(address: ServerAddress, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        sock = tcp(address, timeout_s)
        name = settings.server_name or address.host
        try:
            tls = ctx.wrap_socket(sock, server_hostname=name, do_handshake_on_connect=False)
        except BaseException:
            sock.close()
            raise
        try:
            handshake(tls, deadline)
        except BaseException:
            tls.close()
            raise
        return tls

    return connect


__all__ = ["ServerTls", "TLS_HANDSHAKE_BYTE", "client_connect", "client_context", "explain", "handshake"]
