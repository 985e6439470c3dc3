"""The compiled receive-and-verify loop (csrc/recv_verify.c, memkv.sockio.recv_xxh3_into) on real
sockets over 127.0.0.1, held to the pure-Python loop it stands in for.

Behaviour under test:
* where a C compiler and Python's headers are there, the extension was built (a silent build
  failure would leave every user on the slower loop);
* its xxh3-128 is python-xxhash's, for any bytes (hypothesis), and so is the digest of its
  copy-and-hash loop (copy_xxh3), whose target holds the source whole, and of its write loop
  (write_xxh3), whose file holds the source whole;
* a value of any length, in pieces that do or do not divide it, lands whole and its digest is
  that of the bytes sent;
* a peer that closes mid-value raises PeerClosed naming how many bytes had come; the kernel
  timeout expiring with no deadline raises socket.timeout within its bound plus slack (a deadline
  passing while bytes trickle in: tests/unit/test_sockio_pieces.py, for both loops);
* a signal during a receive runs Python's handler: an exception it raises ends the receive at
  once, a handler that returns lets it finish (PEP 475);
* a socket with a Python-level timeout (non-blocking underneath) or TLS is not handed to it;
* the client's GET of real `memkv serve` nodes gives the same bytes with either loop, and a
  value that fails its checksum is a miss with either loop (fake network: the node flips a byte).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from memkv import sockio
from memkv.sockio import PeerClosed, can_recv_xxh3, recv_xxh3_into, set_timeouts
from tests.unit.loopback import in_thread

try:
    from memkv import _recv_verify as compiled
except ImportError:
    compiled = None
needs_compiled = pytest.mark.skipif(compiled is None, reason="the compiled loop is not built here")

KiB, MiB = 1 << 10, 1 << 20
SLACK_S = 3.0  # on top of a deadline, for "did not hang" on a busy 2-core box


def _xxhash_header_found(compiler: str) -> bool:
    """Whether the compiler finds xxHash's header (libxxhash-dev), as setup.py's build needs."""
    probe = subprocess.run(
        [compiler, "-E", "-x", "c", "-", "-o", os.devnull],
        input="#include <xxhash.h>\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    return probe.returncode == 0


def test_the_extension_is_built_where_it_can_be() -> None:
    # The other tests here skip without the extension; this one says whether they should have.
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    compiler = shutil.which("cc") or shutil.which("gcc")
    if (
        headers
        and compiler
        and _xxhash_header_found(compiler)
        and sys.version_info >= (3, 11)
        and sys.platform.startswith("linux")
    ):
        assert compiled is not None, "a compiler, Python.h and xxhash.h are here, but memkv._recv_verify was not built"
    else:
        pytest.skip("no compiler, Python headers or xxHash header: the pure-Python loop is expected")


@needs_compiled
def test_an_x86_64_cpu_with_avx2_runs_the_avx2_update_loop() -> None:
    # SSE2 hashes at about a third of AVX2's speed: a CPU that has AVX2 must not be left on it.
    with open("/proc/cpuinfo") as cpuinfo:
        has_avx2 = " avx2" in cpuinfo.read()
    expected = "avx2" if os.uname().machine == "x86_64" and has_avx2 else "baseline"
    assert expected == compiled.XXH3_VARIANT


def test_memkv_pure_python_selects_the_python_receive_loop():
    """MEMKV_PURE_PYTHON=1 (read at import) turns the compiled loop off; unset, it is on exactly
    when the extension was built."""
    probe = "from memkv import sockio; print(sockio.COMPILED_RECEIVE)"
    env = {k: v for k, v in os.environ.items() if k != "MEMKV_PURE_PYTHON"}
    off = subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, "MEMKV_PURE_PYTHON": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    on = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert off.stdout.strip() == "False"
    assert on.stdout.strip() == str(importlib.util.find_spec("memkv._recv_verify") is not None)


@pytest.fixture
def pair(pair):
    """The shared loopback pair, its receiver with kernel timeouts as the client's connections
    have (blocking sockets)."""
    set_timeouts(pair[1], 10.0)
    return pair


@needs_compiled
@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300 * KiB))
def test_its_xxh3_is_python_xxhashs(data: bytes) -> None:
    # Both update loops: the one chosen at import and the baseline one it stands in for.
    assert compiled.xxh3_128_digest(data) == xxhash.xxh3_128_digest(data)
    assert compiled.xxh3_128_digest(data, True) == xxhash.xxh3_128_digest(data)


@needs_compiled
@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=600 * KiB), st.integers(min_value=1, max_value=300 * KiB))
def test_copy_xxh3_copies_whole_and_digests_the_copy(data: bytes, piece: int) -> None:
    # The one-copy load of bench/shm_copy.py: a read-only source (an mmap in use), any piece.
    target = bytearray(len(data))
    assert compiled.copy_xxh3(target, memoryview(data), piece) == xxhash.xxh3_128_digest(data)
    assert target == data


@needs_compiled
@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=600 * KiB), st.integers(min_value=1, max_value=300 * KiB))
def test_write_xxh3_writes_whole_and_digests_what_it_wrote(data: bytes, piece: int) -> None:
    # The same-host store into a memfd the node passed (memkv/client/shared.py pwrite_hashed).
    fd = os.memfd_create("write-xxh3")
    try:
        assert compiled.write_xxh3(fd, memoryview(data), piece) == xxhash.xxh3_128_digest(data)
        assert os.pread(fd, len(data) + 1, 0) == data
    finally:
        os.close(fd)


@needs_compiled
def test_write_xxh3_raises_the_writes_error() -> None:
    fd = os.memfd_create("sealed", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        with pytest.raises(PermissionError):
            compiled.write_xxh3(fd, b"abcd", 2)
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="piece_bytes must be positive"):
        compiled.write_xxh3(0, b"abcd", 0)


@needs_compiled
def test_copy_xxh3_refuses_what_it_cannot_copy() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        compiled.copy_xxh3(bytearray(3), b"abcd", 1)
    with pytest.raises(ValueError, match="piece_bytes must be positive"):
        compiled.copy_xxh3(bytearray(4), b"abcd", 0)
    with pytest.raises(BufferError, match="not writable"):
        compiled.copy_xxh3(b"read-only", b"read-only", 4)


@needs_compiled
@pytest.mark.parametrize(
    ("length", "piece"),
    [
        (1, 256 * KiB),
        (256 * KiB, 256 * KiB),
        (256 * KiB + 1, 256 * KiB),
        (5 * MiB + 123, 256 * KiB),
        (70_001, 7),
        (16 * MiB, 1 * MiB),
    ],
)
def test_a_value_lands_whole_with_the_digest_of_the_bytes_sent(pair, length: int, piece: int) -> None:
    a, b = pair
    value = os.urandom(length)
    sender = in_thread(lambda: a.sendall(value))
    got = bytearray(length)
    assert can_recv_xxh3(b)
    digest = recv_xxh3_into(b, memoryview(got), time.monotonic() + 30, piece)
    sender.join(10)
    assert got == value
    assert digest == xxhash.xxh3_128_digest(value)


@needs_compiled
def test_a_peer_closing_mid_value_raises_peer_closed_with_the_count(pair) -> None:
    a, b = pair
    a.sendall(bytes(300 * KiB + 5))
    a.close()
    with pytest.raises(PeerClosed) as info:
        recv_xxh3_into(b, memoryview(bytearray(1 * MiB)), time.monotonic() + 10, 256 * KiB)
    assert (info.value.got, info.value.total) == (300 * KiB + 5, 1 * MiB)


@needs_compiled
def test_without_a_deadline_the_kernel_timeout_still_ends_a_silent_receive(pair) -> None:
    _, b = pair
    set_timeouts(b, 0.5)
    started = time.monotonic()
    with pytest.raises(socket.timeout, match="after 0 of"):
        recv_xxh3_into(b, memoryview(bytearray(1 * MiB)), None, 256 * KiB)
    assert time.monotonic() - started < 0.5 + SLACK_S


class _Interrupted(Exception):
    pass


@needs_compiled
def test_an_exception_from_a_signal_handler_ends_the_receive(pair) -> None:
    _, b = pair

    def handler(signum, frame):
        raise _Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    started = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(_Interrupted):
            recv_xxh3_into(b, memoryview(bytearray(1 * MiB)), time.monotonic() + 8, 256 * KiB)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - started < 8  # the handler's exception, not the deadline


@needs_compiled
def test_a_signal_whose_handler_returns_does_not_cut_the_value(pair) -> None:
    a, b = pair
    value = os.urandom(3 * MiB)
    calls = []
    old = signal.signal(signal.SIGALRM, lambda signum, frame: calls.append(signum))

    def send_late() -> None:
        time.sleep(0.4)  # the signal comes while the receive waits for the first byte
        a.sendall(value)

    sender = in_thread(send_late)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        got = bytearray(len(value))
        digest = recv_xxh3_into(b, memoryview(got), time.monotonic() + 10, 256 * KiB)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        sender.join(10)
    assert calls == [signal.SIGALRM]
    assert got == value and digest == xxhash.xxh3_128_digest(value)


@needs_compiled
def test_a_socket_with_a_python_timeout_is_left_to_the_python_loop(pair) -> None:
    _, b = pair
    b.settimeout(1.0)  # O_NONBLOCK underneath: a recv without poll() would fail at once
    assert not can_recv_xxh3(b)


@needs_compiled
def test_turning_the_compiled_loop_off_leaves_every_socket_to_python(pair, monkeypatch) -> None:
    _, b = pair
    monkeypatch.setattr(sockio, "COMPILED_RECEIVE", False)
    assert not can_recv_xxh3(b)


@pytest.mark.integration
@pytest.mark.parametrize("receive_loop", ["compiled", "python"])
def test_a_real_nodes_values_come_back_byte_exact_with_either_loop(
    start_node, make_client, monkeypatch, receive_loop
) -> None:
    if receive_loop == "compiled" and compiled is None:
        pytest.skip("the compiled loop is not built here")
    monkeypatch.setattr(sockio, "COMPILED_RECEIVE", receive_loop == "compiled")
    node = start_node()
    client = make_client([node], io_timeout_s=10.0)
    values = {f"v{n}".encode(): os.urandom(n) for n in (1, 4 * KiB + 3, 1 * MiB, 16 * MiB + 1)}
    assert client.batch_put_views(list(values.items())) == [True] * len(values)
    targets = {k: bytearray(len(v)) for k, v in values.items()}
    assert client.batch_get_into(list(targets.items())) == [True] * len(values)
    assert all(targets[k] == v for k, v in values.items())
    assert client.batch_get_into([(b"v1", bytearray(2))]) == [False]  # wrong length: a miss, as before
