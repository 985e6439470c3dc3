"""The shared-memory way: a same-host node's values exchanged as sealed memfds (docs/protocol.md
section 13); the node's half is memkv/server/shm.py, the memfd primitives and the mappings this
process keeps are memkv/client/shared.py.

`SharedMemory` moves the values of one connection to the node's same-host socket whose node
offered shared memory (HELLO_OK `shared_memory`) while `shared_memory` is on here; it is chosen
once, when the connection is opened (`memkv.transport.open_way`). Values of SHM_MIN_VALUE and
more go through memfds:
  * loads: SHM_GET; each value is copied from a mapping this process kept when it stored it
    (the node answers its status and checksum only) or read from the sealed memfd the node
    passes now, and verified here;
  * stores: SHM_PUT; the node passes a memfd per value, the value is written into it (hashed as
    it is copied) and SHM_COMMIT declares the checksums; or, where the node writes its memfds
    itself (HELLO_OK `shm_put` false: `memkv serve --shared-memory-stores node`), over the socket.
A node-written memfd may hold another value by the time it is read: a value read from one that
does not verify is taken over the socket (the node's current value of that key, or a miss),
not counted as an integrity failure.
Smaller values, and those the node answers NOT_SHARED (kept in its private memory), take the
socket as `SocketStream` moves them. A memfd this process refuses (not sealed as it must be)
turns shared memory off for that node process (`MappedValues.refuse`): from then on every
value of this connection takes the socket, and new connections are not offered this way.

Threading: like its connection, used by one thread at a time; the `MappedValues` it shares
with the node's other connections is thread-safe.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Sequence

from memkv import protocol as p
from memkv.client.node import NodeConnection
from memkv.client.shared import MappedValues, SealError, check_loadable, copy_verified, read_verified, write_value
from memkv.errors import RemoteProtocolError, ServerError
from memkv.integrity import Checksummer
from memkv.memfd import unmap
from memkv.sockio import recv_exactly_with_fds
from memkv.transport.stream import SocketStream

log = logging.getLogger("memkv.client")


class SharedMemory(SocketStream):
    """The values of one same-host connection: large ones through the node's memfds, the rest
    over the socket (`SocketStream`). `memory` holds the mappings of the node process this
    connection reaches, shared by all of its connections (NodeClient keeps one per process)."""

    name = "shm"

    def __init__(self, conn: NodeConnection, memory: MappedValues) -> None:
        super().__init__(conn)
        self.memory = memory

    def get_into(
        self, keys: Sequence[bytes], views: Sequence[memoryview], checksummer: Checksummer
    ) -> tuple[list[bool], int]:
        """SHM_GET the values of SHM_MIN_VALUE and more: each copied from its sealed memfd (one
        this process still maps, or one the node passes now) and verified here. The others
        (smaller, or NOT_SHARED: in the node's private memory) come by GET (docs/protocol.md
        section 13). Returns and raises as `SocketStream.get_into`."""
        memory = self.memory
        big = [i for i, v in enumerate(views) if len(v) >= p.SHM_MIN_VALUE]
        # retired: the node process it maps is gone or replaced, or its memfds were refused
        if not big or memory.retired:
            return super().get_into(keys, views, checksummer)
        results = [False] * len(keys)
        bad_sums = 0
        by_socket = [i for i, v in enumerate(views) if len(v) < p.SHM_MIN_VALUE]
        big_keys = [keys[i] for i in big]
        want = bytes(not mapped for mapped in memory.has(big_keys))
        request = p.ShmGetRequest(tuple(big_keys), tuple(len(views[i]) for i in big), want)
        reply, fds = exchange(self.conn, request)
        try:
            for j, i in enumerate(big):
                item = reply.items[j]
                fd = fds.pop(0) if reply.passed[j] else None
                if item.status not in (p.ItemStatus.OK, p.ItemStatus.NOT_SHARED):
                    memory.forget(keys[i])  # gone from the node: the bytes this process still maps go too
                    continue  # a miss, not a checksum failure (a passed item is OK: `exchange`)
                try:
                    ok = self._copy(keys[i], item, fd, views[i], checksummer)
                finally:
                    if fd is not None:
                        os.close(fd)
                if ok is None:
                    by_socket.append(i)
                else:
                    bad_sums += not ok
                    results[i] = ok
        finally:
            for fd in fds:
                os.close(fd)
        if by_socket:
            by_socket.sort()
            got, bad = super().get_into([keys[i] for i in by_socket], [views[i] for i in by_socket], checksummer)
            for i, ok in zip(by_socket, got):
                results[i] = ok
            bad_sums += bad
        return results, bad_sums

    def _copy(
        self, key: bytes, item: p.GetReplyItem, fd: int | None, view: memoryview, checksummer: Checksummer
    ) -> bool | None:
        """One SHM_GET item (OK or NOT_SHARED) into `view`: whether it verified, or None when it
        must come over the socket (NOT_SHARED, a mapping of another value, a refused memfd, a
        node-written memfd that holds another value by now)."""
        memory = self.memory
        if item.status == p.ItemStatus.NOT_SHARED:
            return None
        if item.length != len(view):
            raise RemoteProtocolError(f"{self.conn.name}: SHM_GET gave {item.length} bytes for a {len(view)}-byte GET")
        if fd is None:
            found = memory.find(key)
            if found is None:
                return None
            try:
                if found.length != item.length or not hmac.compare_digest(found.checksum, item.checksum):
                    memory.forget(key)  # the node holds another value of this key now
                    return None
                return copy_verified(view, found.addr, item.algo, item.checksum, checksummer)
            finally:
                memory.done(found)
        try:
            node_written = check_loadable(fd, item.length)
        except SealError as exc:
            log.warning("MemKV: %s: shared memory off for this node process: %s", self.conn.name, exc.strerror)
            memory.refuse(str(exc.strerror))
            return None
        ok = read_verified(view, fd, item.algo, item.checksum, checksummer)
        return None if node_written and not ok else ok

    def put(self, keys: Sequence[bytes], views: Sequence[memoryview], checksummer: Checksummer) -> bytes:
        """PUT `views` under `keys` (one request's worth: `byte_chunks`); one status per key.
        Values of SHM_MIN_VALUE and more are written into memfds (SHM_PUT, `_put_shared`, hashed
        as they are copied); the rest, and those the node answered NOT_SHARED, go over the
        socket (hashed first)."""
        big = [i for i, v in enumerate(views) if len(v) >= p.SHM_MIN_VALUE]
        if not big or self.memory.retired or not self.conn.hello.shm_put:
            return super().put(keys, views, checksummer)
        statuses = bytearray(len(keys))
        shared, not_shared = self._put_shared([keys[i] for i in big], [views[i] for i in big], checksummer)
        for i, status in zip(big, shared):
            statuses[i] = status
        small = [i for i, v in enumerate(views) if len(v) < p.SHM_MIN_VALUE]
        by_socket = sorted(small + [big[j] for j in not_shared])
        if by_socket:
            sent = super().put([keys[i] for i in by_socket], [views[i] for i in by_socket], checksummer)
            for i, status in zip(by_socket, sent):
                statuses[i] = status
        return bytes(statuses)

    def _put_shared(
        self, keys: Sequence[bytes], values: Sequence[memoryview], checksummer: Checksummer
    ) -> tuple[bytes, list[int]]:
        """SHM_PUT `keys` (values of SHM_MIN_VALUE and more), write each value into the memfd the
        node passed for it, hashing it as it is written (`write_value`: one pass over the bytes,
        no writable mapping left after), SHM_COMMIT them with those checksums: (one status per
        key, the indexes answered NOT_SHARED, which the caller PUTs over the socket). This
        process keeps a read-only mapping of each value stored so (`MappedValues`)."""
        conn, memory = self.conn, self.memory
        algo = checksummer.algo
        no_sum = bytes(p.CHECKSUM_BYTES)
        items = [p.PutItem(k, len(v), algo, no_sum) for k, v in zip(keys, values)]
        kept: dict[int, tuple[int, int]] = {}
        try:
            reply, fds = exchange(conn, p.ShmPutRequest(tuple(items)))
            places = [i for i, passed in enumerate(reply.passed) if passed]
            # Once the node has passed them, the next frame must be their SHM_COMMIT: a value not
            # written (a memfd this process refuses) is committed as not written.
            written = bytearray()
            checksums = []
            try:
                for i in places:
                    fd = fds.pop(0)
                    checksum = no_sum
                    if reply.items[i].length != items[i].length:
                        os.close(fd)
                        raise RemoteProtocolError(
                            f"{conn.name}: SHM_PUT passed {reply.items[i].length} bytes for {items[i].length}"
                        )
                    if memory.refused:
                        os.close(fd)
                    else:
                        try:
                            checksum, mapping = write_value(fd, values[i], algo, checksummer, keep=True)
                            if mapping is not None:
                                kept[i] = mapping
                        except SealError as exc:
                            log.warning(
                                "MemKV: %s: shared memory off for this node process: %s", conn.name, exc.strerror
                            )
                            memory.refuse(str(exc.strerror))
                    written.append(i in kept)
                    checksums.append(checksum)
            finally:
                for fd in fds:
                    os.close(fd)
            statuses = bytearray(item.status for item in reply.items)
            if places:
                done = conn.request(p.ShmCommitRequest(bytes(written), tuple(checksums)))
                assert isinstance(done, p.StatusReply)  # one status per flag: NodeConnection.matched
                for i, ok, checksum, status in zip(places, written, checksums, done.statuses):
                    statuses[i] = status if ok else p.ItemStatus.NOT_SHARED
                    if ok and status == p.ItemStatus.OK:
                        addr, size = kept.pop(i)
                        memory.add(keys[i], addr, size, items[i].length, checksum)
        finally:
            for addr, size in kept.values():  # not stored: nothing to load from
                unmap(addr, size)
        return bytes(statuses), [i for i, s in enumerate(statuses) if s == p.ItemStatus.NOT_SHARED]


def exchange(conn: NodeConnection, msg: p.ShmGetRequest | p.ShmPutRequest) -> tuple[p.ShmGetReply, list[int]]:
    """Send an SHM_GET or SHM_PUT on `conn`; its reply and the descriptors it passed, exactly one
    per item it flags (the caller closes them; none is left open on an error)."""
    opcode = p.Opcode.SHM_GET if isinstance(msg, p.ShmGetRequest) else p.Opcode.SHM_PUT
    conn.send(msg)
    deadline = conn.deadline()
    with conn.io("read"):
        prefix, fds = recv_exactly_with_fds(conn.sock, p.FRAME_PREFIX_BYTES, p.MAX_SHM_FDS, deadline)
        try:
            header = conn.codec.parse_header(prefix)
            meta, more = recv_exactly_with_fds(conn.sock, header.meta_len, p.MAX_SHM_FDS, deadline)
            fds += more
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
    try:
        reply = conn.codec.open(header, bytes(prefix), meta)
        if isinstance(reply, p.ErrorReply):
            raise ServerError(f"{conn.name}: node error {p.error_name(reply.code)}: {reply.message}", reply.code)
        reply = conn.matched(msg, reply)
        assert isinstance(reply, p.ShmGetReply)
        if sum(reply.passed) != len(fds):
            raise RemoteProtocolError(
                f"{conn.name}: {opcode.name} reply flags {sum(reply.passed)} memfd(s), passed {len(fds)}"
            )
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return reply, fds


__all__ = ["SharedMemory", "exchange"]
