"""Paged KV cache with prefix caching, as vLLM V1's block pool keeps it, plus an optional host tier.

A block is an integer id; a full block of known tokens carries a hash, and a hash maps to the
block that holds it. Block hashes are plain integers supplied by the caller (the engine derives
them from a program's token stream), so no token ids are ever stored.

The free queue has vLLM's order. Blocks never used come first in id order; a freed block
without a hash goes to the front (reused first, LIFO), a freed block with a hash to the back,
so cached blocks are evicted least recently freed first. A cached free block that gets a hit
leaves the queue. With a host tier, a cached block evicted from the device lands there (LRU).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter


# Block hashes looked up at a time: a prefix that misses early is not looked up in full.
LOOKUP_RUN = 64


@dataclass
class HostTier:
    """vLLM's native CPU offloading seen from the scheduler: block hashes held in host memory, LRU."""

    capacity_blocks: int
    _held: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.capacity_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {self.capacity_blocks}")

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._held

    def __len__(self) -> int:
        return len(self._held)

    def store(self, block_hash: int) -> None:
        self._held[block_hash] = None
        self._held.move_to_end(block_hash)
        if len(self._held) > self.capacity_blocks:
            self._held.popitem(last=False)

    def hits(self, hashes: Sequence[int]) -> int:
        """How many of `hashes`, from the first, the host holds; those become most recent."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._held:
                break
            self._held.move_to_end(block_hash)
            count += 1
        return count


class BlockPool:
    """`num_blocks` blocks (None: as many as asked for, never evicting) and the prefix cache.

    A request's blocks are handled in bulk (a program's context is thousands of blocks, and
    every request of it looks them all up, adopts and frees them), so the common operations
    are set and dict operations rather than a loop per block.
    """

    def __init__(self, num_blocks: int | None, host: HostTier | None = None) -> None:
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.host = host
        self._fresh = 0  # ids below this have been handed out at least once
        self._front: list[int] = []  # freed blocks without a hash; the last is reused first
        self._back: OrderedDict[int, None] = OrderedDict()  # freed cached blocks, LRU first
        self._in_use: set[int] = set()
        self._extra_refs: dict[int, int] = {}  # blocks several requests hold: references beyond one
        self._hash_of: dict[int, int] = {}
        self.cached: dict[int, int] = {}  # block hash -> the block holding it
        self.evictions = 0

    @property
    def num_free(self) -> int:
        free = len(self._front) + len(self._back)
        return 2**62 if self.num_blocks is None else free + self.num_blocks - self._fresh

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    def cache_hits(self, hashes: Sequence[int]) -> list[int]:
        """The blocks holding `hashes`, from the first up to the first miss (looked up a run
        at a time, so that a prefix that misses early costs little)."""
        cached, hits, start = self.cached, [], 0
        while start < len(hashes):
            run = hashes[start : start + LOOKUP_RUN]
            if len(run) > 1:  # itemgetter of one key gives the value, not a tuple
                try:  # a run that hits in full, in one C call (it stops at the first miss)
                    hits += itemgetter(*run)(cached)
                    start += LOOKUP_RUN
                    continue
                except KeyError:
                    pass
            found = list(map(cached.get, run))
            if None in found:
                return hits + found[: found.index(None)]  # type: ignore[operator]
            hits += found
            start += LOOKUP_RUN
        return hits

    def held(self, hits: Sequence[int]) -> set[int]:
        """Those of `hits` other requests hold; the rest are free, and adopting them takes
        them out of the free queue."""
        return self._in_use.intersection(hits)

    def take(self, hits: Sequence[int], held: set[int]) -> None:
        """Reference cached blocks a request adopts as its prefix (`held`: from `held(hits)`)."""
        for block in held:
            self._extra_refs[block] = self._extra_refs.get(block, 0) + 1
        free = held.symmetric_difference(hits) if held else hits  # held is a subset of hits
        deque(map(self._back.__delitem__, free), maxlen=0)  # out of the free queue, at C speed
        self._in_use.update(hits)

    def allocate(self, count: int) -> list[int]:
        """`count` new blocks from the head of the free queue; the caller checked num_free."""
        front = self._front
        reused = min(count, len(front))
        blocks = front[len(front) - reused :][::-1]
        del front[len(front) - reused :]
        fresh = count - reused
        if self.num_blocks is not None:
            fresh = min(fresh, self.num_blocks - self._fresh)
        blocks += range(self._fresh, self._fresh + fresh)
        self._fresh += fresh
        if len(blocks) < count:
            blocks += self._evict(count - len(blocks))
        self._in_use.update(blocks)
        return blocks

    def register(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """New blocks became full of known tokens: they serve prefix hits from now on."""
        self._hash_of.update(zip(blocks, hashes))
        cached = self.cached
        if cached.keys().isdisjoint(hashes):
            cached.update(zip(hashes, blocks))
            return
        for block_hash, block in zip(hashes, blocks):  # the first block holding a hash keeps it
            if block_hash not in cached:
                cached[block_hash] = block

    def free(self, blocks: Sequence[int], hashed: int) -> None:
        """Drop a request's reference to its blocks (in its order; the first `hashed` carry a
        hash). They are evicted tail first, as vLLM frees them in reverse order."""
        extra = self._extra_refs
        shared = extra.keys() & blocks if extra else set()
        for block in shared:
            extra[block] -= 1
            if not extra[block]:
                del extra[block]
        with_hash, without_hash = list(blocks[:hashed]), blocks[hashed:]
        for block in shared:  # cached blocks others adopted too: few (a shared prompt), found early
            with_hash.remove(block)
        self._in_use.difference_update(with_hash, without_hash)
        self._back.update(dict.fromkeys(reversed(with_hash)))
        self._front.extend(without_hash)

    def _evict(self, count: int) -> list[int]:
        """Take the `count` least recently freed cached blocks out of the cache (to the host tier)."""
        back, hash_of, cached = self._back, self._hash_of, self.cached
        blocks = [back.popitem(last=False)[0] for _ in range(count)]
        hashes = list(map(hash_of.pop, blocks))
        for block_hash, block in zip(hashes, blocks):
            if cached.get(block_hash) == block:
                del cached[block_hash]
        self.evictions += count
        if self.host is not None:
            for block_hash in hashes:
                self.host.store(block_hash)
        return blocks
