"""The staging region: a small shared-memory file through which every direct-mode chunk moves.

Layout. The region is `num_slots` slots of `slot_bytes`; a slot holds one offloaded chunk for
every tensor-parallel rank: rank r's bytes are `[r * section_bytes, r * section_bytes +
value_bytes)` of the slot (sections are page aligned). One MemKV value is one rank's section
of one chunk (rank-qualified keys, memkv_vllm.direct.keys).

Ownership. The scheduler-side manager allocates slots and does every network transfer into
and out of them. Workers (other processes: one per TP rank)
map the same file by name when vLLM hands them their KV caches, and host-register it with
CUDA then (engine startup, not a request's first transfer); they copy between their GPU
blocks and their rank's section. Whichever side comes first creates the file
(`StagingRegion.open_or_create`), and the first side to shut down removes it. The region is engine-owned: the name derives from vLLM's
engine_id, unique per engine and DP rank on a host (the rule vLLM's own CPU-pool file has).

Quarantine (`SlotTable`). A slot is free only when nobody owns it (no lookup, load or store
refers to it) *and* no network transfer can still touch it. A transfer abandoned by a
deadline (its lookup answered MISS) gives up ownership at once, but the slot stays busy
until the transfer's thread has returned -- and, on a transport that can write late (RDMA),
until the grace period after it (memkv_vllm.transfers withholds the record) -- so a late
byte can never land in a slot that was handed to someone else.

Threading: SlotTable belongs to the scheduler thread (0.33: under the manager lock); transfer
threads only touch slot *bytes*, never the table. Completions reach the table through the
manager's drain of TransferPool records.
"""

from __future__ import annotations

import mmap
import os

PAGE_BYTES = mmap.PAGESIZE


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class StagingRegion:
    """A mapped staging file. `view` is a flat writable memoryview of the whole region."""

    def __init__(self, path: str, fd: int, nbytes: int, owner: bool) -> None:
        self.path = path
        self.nbytes = nbytes
        self.owner = owner
        self._mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self.view = memoryview(self._mmap)

    @classmethod
    def open_or_create(cls, path: str, nbytes: int, owner: bool) -> StagingRegion:
        """Map the engine's staging file, creating it if this side comes first (vLLM builds the
        workers before the scheduler). Both sides size it alike; an `owner` unlinks it at close
        (every side is one: whichever closes first removes the name, mappings stay valid, and a
        scheduler that failed to start leaves nothing behind). Old bytes of a file left by a crashed engine with the same engine_id are
        harmless: a slot is only ever read after this engine wrote it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < nbytes:
                os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, nbytes, owner=owner)

    def close(self) -> None:
        """Idempotent. Every view derived from `view` must be released first."""
        if self._mmap is None:
            return
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the last of them
            pass
        self._mmap = None
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class SlotTable:
    """Which slots are free, owned, or busy with a transfer (see the module docstring)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self._owned: set[int] = set()
        self._busy: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def quarantined(self) -> int:
        """Slots nobody owns any more whose transfer may still touch them."""
        return len(self._busy - self._owned)

    @property
    def in_use(self) -> int:
        return self.num_slots - len(self._free)

    def take(self, n: int) -> list[int] | None:
        """`n` slots, owned by the caller, or None (all or nothing)."""
        if n > len(self._free):
            return None
        slots = [self._free.pop() for _ in range(n)]
        self._owned.update(slots)
        return slots

    def mark_busy(self, slot: int) -> None:
        """A network transfer may touch `slot` from now until `transfer_done(slot)`."""
        assert slot in self._owned, f"slot {slot} is not owned"
        self._busy.add(slot)

    def transfer_done(self, slot: int) -> None:
        if slot in self._busy:
            self._busy.discard(slot)
            if slot not in self._owned:
                self._free.append(slot)

    def release(self, slot: int) -> None:
        """The owner no longer needs `slot`; it is free once no transfer touches it."""
        if slot in self._owned:
            self._owned.discard(slot)
            if slot not in self._busy:
                self._free.append(slot)

    def busy(self, slot: int) -> bool:
        return slot in self._busy
