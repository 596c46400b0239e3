"""The block pool, which keeps cached blocks as runs of hashes, against vLLM's block pool kept
one block at a time (ids, one free queue, a hash map), on random sequences of requests that
look up, adopt, allocate, register and free: the same hits, evictions, occupancy and host tier."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunderctl.sim.kv import BlockPool, HostTier
from thunderctl.sim.requests import TokenStream


class PerBlockPool:
    """The free queue as one list, head first: freed blocks without a hash at the head, blocks
    never used in id order, freed cached blocks at the tail; allocation evicts from the head."""

    def __init__(self, num_blocks: int, host_blocks: int) -> None:
        self.queue: list[int] = list(range(num_blocks))
        self.refs: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.host: list[int] = []  # LRU first
        self.host_blocks = host_blocks
        self.evictions = 0

    def lookup(self, hashes: list[int]) -> list[int]:
        hits = []
        for block_hash in hashes:
            if block_hash not in self.cached:
                break
            hits.append(self.cached[block_hash])
        return hits

    def take(self, blocks: list[int]) -> None:
        for block in blocks:
            if not self.refs.get(block):
                self.queue.remove(block)
            self.refs[block] = self.refs.get(block, 0) + 1

    def allocate(self, count: int) -> list[int]:
        blocks = [self.queue.pop(0) for _ in range(count)]
        for block in blocks:
            if block in self.hash_of:
                block_hash = self.hash_of.pop(block)
                if self.cached.get(block_hash) == block:
                    del self.cached[block_hash]
                self.evictions += 1
                if self.host_blocks:
                    if block_hash in self.host:
                        self.host.remove(block_hash)
                    self.host.append(block_hash)
                    del self.host[: -self.host_blocks]
            self.refs[block] = 1
        return blocks

    def register(self, blocks: list[int], hashes: list[int]) -> None:
        for block, block_hash in zip(blocks, hashes):
            self.hash_of[block] = block_hash
            self.cached.setdefault(block_hash, block)

    def free(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self.refs[block] -= 1
            if not self.refs[block]:
                if block in self.hash_of:
                    self.queue.append(block)
                else:
                    self.queue.insert(0, block)

    @property
    def in_use(self) -> int:
        return sum(1 for refs in self.refs.values() if refs)


@dataclass
class Holder:
    """One request in both pools: its block ids in one, its counts and duplicates in the other."""

    stream: TokenStream
    ids: list[int] = field(default_factory=list)
    num_blocks: int = 0
    registered: int = 0
    duplicates: list[range] = field(default_factory=list)


@dataclass
class Pools:
    runs: BlockPool
    blocks: PerBlockPool
    holders: list[Holder] = field(default_factory=list)

    def admit(self, stream: TokenStream, length: int, registered: int) -> None:
        """Look up `length` blocks, adopt the hits, allocate the rest, register `registered` of them."""
        hits = self.blocks.lookup(stream.block_hashes(0, length))
        assert self.runs.cache_hits(stream.block_runs(0, length)) == len(hits)
        held = sum(1 for block in hits if self.blocks.refs.get(block))
        assert self.runs.held(stream.block_runs(0, len(hits))) == held
        if length - held > self.runs.num_free:
            return
        holder = Holder(stream, num_blocks=len(hits), registered=len(hits))
        self.blocks.take(hits)
        self.runs.take(stream.block_runs(0, len(hits)))
        holder.ids = hits
        self.holders.append(holder)
        self.grow(holder, length - len(hits), max(registered, len(hits)))

    def grow(self, holder: Holder, count: int, registered: int) -> None:
        """Allocate `count` more blocks, then register the holder's blocks up to `registered`."""
        if count > self.runs.num_free:
            return
        holder.ids += self.blocks.allocate(count)
        self.runs.allocate(count)
        holder.num_blocks += count
        registered = min(registered, holder.num_blocks)
        if registered > holder.registered:
            done = holder.registered
            self.blocks.register(holder.ids[done:registered], holder.stream.block_hashes(done, registered))
            holder.duplicates += self.runs.register(holder.stream.block_runs(done, registered))
            holder.registered = registered

    def free(self, holder: Holder) -> None:
        self.holders.remove(holder)
        self.blocks.free(holder.ids)
        self.runs.free(
            holder.stream.block_runs(0, holder.registered), holder.duplicates, holder.num_blocks - holder.registered
        )

    def check(self) -> None:
        assert self.runs.num_free == len(self.blocks.queue)
        assert self.runs.in_use == self.blocks.in_use
        assert self.runs.evictions == self.blocks.evictions
        assert self.runs.cached.keys() == self.blocks.cached.keys()
        assert list(self.runs.host._held if self.runs.host else []) == self.blocks.host


operation = st.tuples(
    st.sampled_from(["admit", "grow", "free"]),
    st.integers(0, 3),  # which program (admit) or which holder (grow, free)
    st.integers(0, 12),  # blocks wanted
    st.integers(0, 12),  # blocks registered
)


HISTORY = {
    "num_blocks": st.integers(4, 24),
    "host_blocks": st.sampled_from([0, 3, 8]),
    "shared_blocks": st.integers(0, 3),
    "operations": st.lists(operation, max_size=60),
}


def runs_of_hashes_match_blocks_one_by_one(
    num_blocks: int, host_blocks: int, shared_blocks: int, operations: list[tuple[str, int, int, int]]
) -> None:
    pools = Pools(
        BlockPool(num_blocks, HostTier(host_blocks) if host_blocks else None), PerBlockPool(num_blocks, host_blocks)
    )
    streams = [TokenStream(uid, shared_blocks) for uid in range(1, 5)]
    for kind, which, wanted, registered in operations:
        if kind == "admit":
            pools.admit(streams[which], min(wanted, num_blocks), registered)
        elif pools.holders:
            holder = pools.holders[which % len(pools.holders)]
            if kind == "grow":
                pools.grow(holder, min(wanted, 3), holder.registered + registered)
            else:
                pools.free(holder)
        pools.check()
    for holder in list(pools.holders):
        pools.free(holder)
        pools.check()
    assert pools.runs.in_use == 0 and pools.runs.num_free == num_blocks


# Four hundred histories are the slow tier's; a hundred of them keep the fast tier's check.
@pytest.mark.parametrize(
    "histories", [pytest.param(100, id="a-hundred"), pytest.param(400, marks=pytest.mark.slow, id="four-hundred")]
)
def test_runs_of_hashes_behave_as_blocks_one_by_one(histories: int) -> None:
    settings(max_examples=histories, deadline=None)(given(**HISTORY)(runs_of_hashes_match_blocks_one_by_one))()
