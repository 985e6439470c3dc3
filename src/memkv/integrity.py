"""Per-value checksums: computed by the writer, stored with the value, verified by the reader.

Threat model (docs/protocol.md, "Threat model", has the long form): the frame MAC authenticates everything
except the value bytes; the checksum in the MACed meta covers the value bytes.

* `xxh3` (default, xxh3-128): detects corruption (a flipped bit in memory, a torn write,
  a truncated transfer) at memory speed (~35 GB/s here). It does not stop an attacker who can
  rewrite bytes on the wire and recompute xxh3 -- use TLS or `blake3` for that.
* `blake3` (keyed BLAKE3-256 with a key derived from the auth key): a value whose bytes were
  changed by anyone without the auth key fails verification. Costs ~4 GB/s of one core.

Both hash functions release the GIL, so checksums of different values run in parallel.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Protocol

import blake3
import xxhash

from memkv.errors import ConfigError
from memkv.protocol import CHECKSUM_BYTES, ChecksumAlgo

_PAD16 = bytes(CHECKSUM_BYTES - 16)

Buffer = bytes | bytearray | memoryview


class Hasher(Protocol):
    """A streaming hash (xxhash.xxh3_128, blake3.blake3)."""

    def update(self, data: Buffer, /) -> object: ...

    def digest(self) -> bytes: ...


INTEGRITY_NAMES = {"xxh3": ChecksumAlgo.XXH3_128, "blake3": ChecksumAlgo.BLAKE3_KEYED}


def parse_integrity(name: str, setting: str = "integrity") -> ChecksumAlgo:
    try:
        return INTEGRITY_NAMES[name]
    except KeyError:
        raise ConfigError(
            f"{setting}: unknown integrity mode {name!r}; choose one of {sorted(INTEGRITY_NAMES)}"
        ) from None


class Checksummer:
    """Computes and verifies value checksums for one auth key. Thread-safe (stateless)."""

    def __init__(self, auth_key: bytes, algo: ChecksumAlgo = ChecksumAlgo.XXH3_128) -> None:
        self.algo = ChecksumAlgo(algo)
        # A separate key for values, so a value digest never doubles as a handshake proof.
        self._value_key = hmac.new(auth_key, b"memkv/1 value checksum", hashlib.sha256).digest()

    def compute(self, value: Buffer, algo: ChecksumAlgo | None = None) -> bytes:
        algo = self.algo if algo is None else algo
        if algo == ChecksumAlgo.XXH3_128:
            return xxhash.xxh3_128_digest(value) + _PAD16
        if algo == ChecksumAlgo.BLAKE3_KEYED:
            return blake3.blake3(value, key=self._value_key).digest()
        raise ValueError(f"unknown checksum algorithm {algo}")

    def hasher(self, algo: int) -> Hasher:
        """A streaming hasher (update/digest) for `algo`: lets a reader hash each chunk right
        after receiving it, while it is still in cache. `finish(hasher)` gives the checksum."""
        algo = ChecksumAlgo(algo)
        if algo == ChecksumAlgo.XXH3_128:
            return xxhash.xxh3_128()
        return blake3.blake3(key=self._value_key)

    @staticmethod
    def finish(hasher: Hasher) -> bytes:
        return Checksummer.padded(hasher.digest())

    @staticmethod
    def padded(digest: bytes) -> bytes:
        """The checksum field for a digest: xxh3-128's 16 bytes are zero-padded to 32."""
        return digest + _PAD16 if len(digest) == 16 else digest

    def verify(self, value: Buffer, algo: int, checksum: bytes) -> bool:
        try:
            algo = ChecksumAlgo(algo)
        except ValueError:
            return False
        return hmac.compare_digest(self.compute(value, algo), checksum)
