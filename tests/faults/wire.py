"""The two ends of a FaultProxy link (tests/faults/proxy.py): a plain socket, or TLS terminated
and re-originated by the proxy.

Both ends offer what a pump needs: `recv(n, wait_s)` returns plaintext bytes, b"" at the end of
the stream, or None when nothing arrived within `wait_s`; `sendall(data)` sends plaintext;
`raw` is the TCP socket, which faults act on directly (a FIN or an RST ends TLS the way a
network fault would: no close_notify).

TLS (`TlsEnd`): an `ssl.SSLObject` over two memory BIOs, the ciphertext moved by the proxy's
own socket calls. Why not an `SSLSocket`: each end is read by one pump thread and written by
the other, and OpenSSL does not allow one SSL connection to be used by two threads at once. So
every call into the SSLObject holds the end's lock, and socket I/O happens outside it; a second
lock keeps the ciphertext of two writers in the order OpenSSL made it.

Handshakes are bounded by a deadline; a failed one raises ssl.SSLError, OSError or TimeoutError.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time

_CIPHER_CHUNK = 256 << 10


class PlainEnd:
    def __init__(self, raw: socket.socket) -> None:
        self.raw = raw

    def recv(self, n: int, wait_s: float) -> bytes | None:
        ready, _, _ = select.select([self.raw], [], [], wait_s)
        if not ready:
            return None
        try:
            return self.raw.recv(n)
        except OSError:
            return b""

    def sendall(self, data: bytes) -> None:
        self.raw.sendall(data)


class TlsEnd:
    """One TLS side of a link: `server_side` toward the client (the proxy presents a certificate
    the client trusts), client side toward the node (the proxy verifies the node's)."""

    def __init__(self, raw: socket.socket, ctx: ssl.SSLContext, server_side: bool, server_hostname: str | None = None):
        self.raw = raw
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = ctx.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)
        self._lock = threading.Lock()  # the SSLObject and both BIOs: one thread at a time
        self._send_lock = threading.Lock()  # ciphertext leaves in the order it was made

    def handshake(self, deadline: float) -> None:
        """Run the TLS handshake on the (blocking) raw socket, bounded by `deadline`."""
        while True:
            try:
                with self._lock:
                    self._tls.do_handshake()
                self._flush()
                return
            except ssl.SSLWantReadError:
                self._flush()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("TLS handshake through the proxy timed out")
            self.raw.settimeout(left)
            try:
                data = self.raw.recv(_CIPHER_CHUNK)
            finally:
                self.raw.settimeout(None)
            if not data:
                raise ConnectionError("the peer closed the connection during the TLS handshake")
            with self._lock:
                self._in.write(data)

    def recv(self, n: int, wait_s: float) -> bytes | None:
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                plain = self._read(n)
            if plain is not None:
                try:
                    self._flush()  # what reading made OpenSSL answer (e.g. a close_notify back)
                except OSError:
                    pass  # the peer is gone: the pump writing to it finds out
                return plain
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.raw], [], [], max(0.0, left))
            if not ready:
                return None
            try:
                data = self.raw.recv(_CIPHER_CHUNK)
            except OSError:
                data = b""
            with self._lock:
                if data:
                    self._in.write(data)
                else:
                    self._in.write_eof()

    def _read(self, n: int) -> bytes | None:
        """Plaintext already decryptable (caller holds the lock), b"" at the end, else None."""
        try:
            return self._tls.read(n)  # b"" only at a close_notify
        except ssl.SSLWantReadError:
            return None
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # close_notify, or a bare FIN
            return b""
        except ssl.SSLError:  # garbage where a record should be: the stream is over
            return b""

    def sendall(self, data: bytes) -> None:
        with self._lock:
            self._tls.write(data)
            out = self._out.read()
            self._send_lock.acquire()
        try:
            self.raw.sendall(out)
        finally:
            self._send_lock.release()

    def _flush(self) -> None:
        with self._lock:
            out = self._out.read()
            if not out:
                return
            self._send_lock.acquire()
        try:
            self.raw.sendall(out)
        finally:
            self._send_lock.release()
