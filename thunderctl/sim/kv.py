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

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


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
    """`num_blocks` blocks (None: as many as asked for, never evicting) and the prefix cache."""

    def __init__(self, num_blocks: int | None, host: HostTier | None = None) -> None:
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.host = host
        self._fresh = 0  # ids below this have been handed out at least once
        self._front: list[int] = []  # freed blocks without a hash; the last is reused first
        self._back: OrderedDict[int, None] = OrderedDict()  # freed cached blocks, LRU first
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self.cached: dict[int, int] = {}  # block hash -> the block holding it
        self.in_use = 0  # blocks with a reference: what vLLM reports as KV cache usage
        self.evictions = 0

    @property
    def num_free(self) -> int:
        fresh = float("inf") if self.num_blocks is None else self.num_blocks - self._fresh
        return int(min(fresh, 2**62)) + len(self._front) + len(self._back)

    @property
    def usage(self) -> float:
        """Share of the device blocks in use (0-1); 0 for an unbounded pool."""
        return self.in_use / self.num_blocks if self.num_blocks else 0.0

    def cache_hits(self, hashes: Sequence[int]) -> list[int]:
        """The blocks holding `hashes`, from the first up to the first miss."""
        blocks = []
        for block_hash in hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def blocks_to_take(self, hits: Iterable[int]) -> int:
        """Free blocks that adopting `hits` removes from the free queue."""
        return sum(1 for block in hits if self._refs.get(block, 0) == 0)

    def take(self, hits: Iterable[int]) -> None:
        """Reference cached blocks a request adopts as its prefix."""
        for block in hits:
            refs = self._refs.get(block, 0)
            if refs == 0:
                del self._back[block]
                self.in_use += 1
            self._refs[block] = refs + 1

    def allocate(self, count: int) -> list[int]:
        """`count` new blocks from the head of the free queue; the caller checked num_free."""
        blocks = [self._pop_free() for _ in range(count)]
        self.in_use += count
        return blocks

    def register(self, block: int, block_hash: int) -> None:
        """A block became full of known tokens: it can serve prefix hits from now on."""
        if block in self._hash_of:
            return
        self._hash_of[block] = block_hash
        self.cached.setdefault(block_hash, block)

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block, in eviction order (the first is evicted first)."""
        for block in blocks:
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            self.in_use -= 1
            if block in self._hash_of:
                self._back[block] = None
            else:
                self._front.append(block)

    def _pop_free(self) -> int:
        if self._front:
            block = self._front.pop()
        elif self.num_blocks is None or self._fresh < self.num_blocks:
            block = self._fresh
            self._fresh += 1
        else:
            block, _ = self._back.popitem(last=False)
            self._evict(block)
        self._refs[block] = 1
        return block

    def _evict(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is None:
            return
        self.evictions += 1
        if self.cached.get(block_hash) == block:
            del self.cached[block_hash]
        if self.host is not None:
            self.host.store(block_hash)
