"""A same-host client process that holds the key and does to the memfds it receives whatever a
process can: ftruncate, fallocate, write, mmap, mprotect, reopen through /proc
(tests/security/test_shared_memory_attacks.py runs it as a subprocess, as root or another uid).

    python -m tests.security.shm_peer ACTION HOST PORT SOCKET [ARG...]   (key in MEMKV_AUTH_KEY)

Prints one JSON object on stdout; `hold` actions then keep every descriptor and mapping until
stdin closes.
"""

from __future__ import annotations

# Imported before `become` drops to a uid that may not read the interpreter's files: what the
# client imports lazily.
import concurrent.futures.thread  # noqa: F401
import ctypes
import encodings.idna  # noqa: F401
import errno
import fcntl
import json
import mmap
import os
import sys
from collections.abc import Callable

from memkv import nixl_adapter  # noqa: F401
from memkv import protocol as p
from memkv.client.cluster import Client
from memkv.client.node import NodeConnection, local_connect
from memkv.client.shared import write_value
from memkv.config import AuthKey, ClientConfig, ServerAddress
from memkv.errors import MemKVError
from memkv.integrity import Checksummer
from memkv.transport import shm

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
KEY = AuthKey.from_hex(os.environ["MEMKV_AUTH_KEY"], "MEMKV_AUTH_KEY").raw
SUMS = Checksummer(KEY)


def attempt(fn: Callable[[], object]) -> str:
    """ "ok", or the errno name of the OSError it raised."""
    try:
        fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return "ok"


def _libc(rc: int) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _mprotect_write(fd: int, size: int) -> None:
    """Map read-only shared, then ask for write access to that mapping."""
    addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    try:
        _libc(_LIBC.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_WRITE))
        ctypes.memset(addr, 0x58, 1)  # reached only when the kernel allowed it
    finally:
        _LIBC.munmap(addr, size)


def _reopen_write(fd: int) -> None:
    other = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        os.pwrite(other, b"X", 0)
    finally:
        os.close(other)


def resizes(fd: int, size: int) -> dict[str, str]:
    return {
        "ftruncate_shrink": attempt(lambda: os.ftruncate(fd, 0)),
        "ftruncate_grow": attempt(lambda: os.ftruncate(fd, 2 * size)),
        "fallocate_grow": attempt(lambda: os.posix_fallocate(fd, size, mmap.PAGESIZE)),
    }


def modifications(fd: int, size: int) -> dict[str, str]:
    """Every way to change the bytes of a memfd this process holds a descriptor of."""
    return {
        **resizes(fd, size),
        "pwrite": attempt(lambda: os.pwrite(fd, b"X", 0)),
        "mmap_shared_writable": attempt(lambda: mmap.mmap(fd, size, flags=mmap.MAP_SHARED).close()),
        "mprotect_writable": attempt(lambda: _mprotect_write(fd, size)),
        "reopen_writable": attempt(lambda: _reopen_write(fd)),
        "punch_hole": attempt(lambda: _libc(_LIBC.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size))),
    }


def connect(host: str, port: int, name: str) -> NodeConnection:
    return NodeConnection(ServerAddress(host, port), KEY, 2.0, 10.0, connect=local_connect(name))


def shm_put(conn: NodeConnection, key: bytes, size: int, count: int = 1) -> tuple[p.ShmGetReply, list[int]]:
    items = tuple(p.PutItem(key + b"%d" % i if count > 1 else key, size, SUMS.algo, bytes(32)) for i in range(count))
    return shm.exchange(conn, p.ShmPutRequest(items))


def shm_get(conn: NodeConnection, keys: list[bytes], size: int) -> tuple[p.ShmGetReply, list[int]]:
    return shm.exchange(conn, p.ShmGetRequest(tuple(keys), (size,) * len(keys)))


def commit(conn: NodeConnection, checksums: list[bytes]) -> list[int]:
    reply = conn.request(p.ShmCommitRequest(bytes([1]) * len(checksums), tuple(checksums)))
    assert isinstance(reply, p.StatusReply)
    return list(reply.statuses)


def fill(fd: int, size: int, byte: int) -> bytes:
    """Write `size` bytes of `byte` with pwrite (no mapping left): their checksum."""
    value = bytes([byte]) * size
    os.pwrite(fd, value, 0)
    return SUMS.compute(memoryview(value))


def become(spec: str) -> None:
    """MEMKV_PEER_AS="uid:gid[:group,...]": drop to that uid, gid and supplementary groups before
    connecting (the node sees them through SO_PEERCRED / SO_PEERGROUPS); imports are done by then."""
    uid, gid, *rest = spec.split(":")
    os.setgroups([int(g) for g in rest[0].split(",") if g] if rest else [])
    os.setgid(int(gid))
    os.setuid(int(uid))


def main(action: str, host: str, port: str, name: str, *args: str) -> dict[str, object]:
    if spec := os.environ.get("MEMKV_PEER_AS"):
        become(spec)
    conn = connect(host, int(port), name)
    out: dict[str, object] = {"shared_memory": conn.hello.shared_memory}
    if action == "hello":  # what a peer of this uid is offered, and whether SHM_PUT is refused
        try:
            shm_put(conn, b"hello", 1 << 20)
            out["shm_put"] = "ok"
        except MemKVError as exc:
            out["shm_put"] = str(exc)
        config = ClientConfig(servers=(ServerAddress(host, int(port)),), auth_key=AuthKey(KEY, "MEMKV_AUTH_KEY"))
        with Client(config) as client:  # what the real client makes of it
            value = os.urandom(2 << 20)
            client.put("hello", value)
            out["roundtrip"] = client.get("hello") == value
            out["shared_memory_servers"] = client.shared_memory_servers()
            out["via"] = "local" if client.local_servers() else "tcp"
    elif action == "resize":  # KEY SIZE OTHER: change the size of its reservation and of OTHER
        key, size, other = args[0].encode(), int(args[1]), args[2].encode()
        _, (fd,) = shm_put(conn, key, size)
        out["reservation"] = resizes(fd, size)
        out["commit"] = commit(conn, [fill(fd, size, 0xAB)])
        out["after_commit"] = resizes(fd, size)
        os.close(fd)
        reply, fds = shm_get(conn, [other], size)
        out["other"] = resizes(fds[0], size) if fds else None
    elif action == "keep-mapped":  # KEY SIZE: commit while still mapping the memfd writable
        key, size = args[0].encode(), int(args[1])
        _, (fd,) = shm_put(conn, key, size)
        writable = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        writable[:] = b"\xcd" * size
        out["commit"] = commit(conn, [SUMS.compute(memoryview(b"\xcd" * size))])
        writable[:1] = b"\x00"  # still the client's own memory: no value holds it
        writable.close()
        os.close(fd)
    elif action == "modify":  # KEY SIZE OWN: modify KEY (another's value) and OWN (stored here)
        key, size, own = args[0].encode(), int(args[1]), args[2].encode()
        _, fds = shm_get(conn, [key], size)
        out["others_value"] = modifications(fds[0], size)
        _, (fd,) = shm_put(conn, own, size)
        out["commit"] = commit(conn, [fill(fd, size, 0xEF)])
        out["own_value"] = modifications(fd, size)  # the very descriptor it wrote through
    elif action == "modify-node-written":  # KEY SIZE: modify KEY's node-written memfd
        key, size = args[0].encode(), int(args[1])
        _, fds = shm_get(conn, [key], size)
        out["seals"] = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
        out["value"] = modifications(fds[0], size)
        os.close(fds[0])
    elif action == "hold":  # KEY SIZE COUNT: store COUNT values, then map and read all of them
        key, size, count = args[0].encode(), int(args[1]), int(args[2])
        statuses, held = [], []
        for i in range(count):
            reply, fds = shm_put(conn, key + b"%d" % i, size)
            if not fds:
                statuses.append(reply.items[0].status)
                continue
            # Written through a shared mapping (pages faulted by this process), kept open.
            checksum, _ = write_value(os.dup(fds[0]), memoryview(bytes([i % 251]) * size), SUMS.algo, SUMS, True)
            statuses += commit(conn, [checksum])
            held.append(fds[0])
        reply, fds = shm_get(conn, [key + b"%d" % i for i in range(count)], size)
        maps = []
        for fd in fds:  # read every page of every value this process may map
            m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
            sum(m[off] for off in range(0, size, mmap.PAGESIZE))
            maps.append(m)
        out.update(statuses=statuses, mapped=len(maps))
        print(json.dumps(out), flush=True)
        sys.stdin.read()
        return {}
    elif action == "reserve":  # SIZE COUNT: reserve COUNT memfds, write them all, never commit
        size, count = int(args[0]), int(args[1])
        reply, fds = shm_put(conn, b"pending", size, count)
        for fd in fds:
            fill(fd, size, 0x11)
        out.update(statuses=[it.status for it in reply.items], passed=len(fds))
        print(json.dumps(out), flush=True)
        sys.stdin.read()
        return {}
    else:
        raise SystemExit(f"unknown action {action}")
    conn.close()
    return out


if __name__ == "__main__":
    result = main(*sys.argv[1:])
    if result:
        print(json.dumps(result), flush=True)
