"""Weighted rendezvous (highest random weight) hashing: which node owns a key.

Each (node, key) pair gets a pseudo-random score; the node with the highest score owns the key.
Adding or removing a node moves only the keys that node wins or owned (about 1/N of them), and
every client with the same server list computes the same owner without talking to anyone.

With weights, the score is -weight / ln(h) for h uniform in (0, 1) (the logarithmic method of
Schindelhauer and Schomaker), so a node of weight 2 owns twice the keys of a node of weight 1.
When all weights are equal the raw 64-bit hash orders nodes the same way, so the fast path
skips the logarithm. Ties (astronomically rare) go to the lower index, deterministically.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash

_SCALE = 1.0 / 18446744073709551616.0  # 2**-64


class RendezvousRing:
    """Owners of keys over a fixed, ordered list of node names. Immutable and thread-safe."""

    def __init__(self, names: Sequence[str], weights: Sequence[float] | None = None, seed: int = 0) -> None:
        if not names:
            raise ValueError("RendezvousRing needs at least one node")
        weights = list(weights) if weights is not None else [1.0] * len(names)
        if len(weights) != len(names) or any(not w > 0 for w in weights):
            raise ValueError("one positive weight per node is required")
        self.names = tuple(names)
        self.weights = tuple(float(w) for w in weights)
        # A per-node hash seed derived from its name: the score of (node, key) is
        # xxh3_64(key, seed=node_seed), so no key+name concatenation is built per lookup.
        self._seeds = tuple(xxhash.xxh3_64_intdigest(name.encode(), seed=seed) for name in names)
        self._uniform = len(set(self.weights)) == 1

    def score(self, index: int, key: bytes) -> float:
        h = xxhash.xxh3_64_intdigest(key, seed=self._seeds[index])
        if self._uniform:
            return float(h)
        u = (h + 0.5) * _SCALE  # in (0, 1)
        return -self.weights[index] / math.log(u)

    def owner(self, key: bytes) -> int:
        """Index of the node that owns `key`."""
        if len(self._seeds) == 1:
            return 0
        if self._uniform:
            digest = xxhash.xxh3_64_intdigest
            hashes = [digest(key, s) for s in self._seeds]
            return hashes.index(max(hashes))  # first maximum: ties go to the lower index
        scores = [self.score(i, key) for i in range(len(self._seeds))]
        return max(range(len(scores)), key=lambda i: (scores[i], -i))

    def owners(self, keys: Sequence[bytes]) -> list[int]:
        """Owners of many keys (the batch path: one pass, no per-key method call)."""
        n = len(self._seeds)
        if n == 1:
            return [0] * len(keys)
        if not self._uniform:
            return [self.owner(k) for k in keys]
        digest = xxhash.xxh3_64_intdigest
        seeds = self._seeds
        out = []
        for key in keys:
            scores = [digest(key, s) for s in seeds]
            out.append(scores.index(max(scores)))
        return out
