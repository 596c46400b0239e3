"""Paged KV cache with prefix caching, as vLLM V1's block pool keeps it, plus an optional host tier.

A full block of known tokens carries a hash, and a hash maps to the block that holds it (the
first block registered with it: a later one with the same hash is a duplicate, which never
hits). Block hashes are plain integers supplied by the caller, in runs of consecutive hashes
(`range`s, increasing along a request: the engine's `TokenStream` makes them so), so no token
ids are ever stored.

The free queue has vLLM's order. Blocks never used come first; a freed block without a hash
goes to the front (reused first), a freed block with a hash to the back, so cached blocks are
evicted least recently freed first, and a request frees its blocks tail first. A cached free
block that gets a hit leaves the queue. With a host tier, a cached block evicted from the
device lands there (LRU).

Blocks are not given ids: a block without a hash is only counted (which one a request gets
changes nothing), and a cached block is known by its hash. The cached blocks are kept as runs
of consecutive hashes in one state (held by n requests, or free since the k-th release), so a
request's thousands of blocks cost a few runs to look up, adopt, free and evict. The free runs
are ordered (release, top hash descending) in a heap; an entry whose run has since changed is
skipped when it comes up.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right, insort
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain

# What a free-queue entry stands for: a run of cached blocks, or of duplicates.
CACHED, DUPLICATE = 0, 1


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

    def store(self, hashes: Iterable[int]) -> None:
        """Blocks evicted from the device, in eviction order; the least recent beyond capacity go."""
        held = self._held
        for block_hash in hashes:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > self.capacity_blocks:  # trimming once at the end keeps the same newest ones
            held.popitem(last=False)

    def hits(self, hashes: Sequence[int]) -> int:
        """How many of `hashes`, from the first, the host holds; those become most recent."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._held:
                break
            self._held.move_to_end(block_hash)
            count += 1
        return count


@dataclass(slots=True)
class _BlockRun:
    """Cached blocks of hashes lo..hi-1, all in one state."""

    lo: int
    hi: int
    refs: int  # requests holding them; 0: free, in the queue since release `released`
    released: int = 0


class BlockPool:
    """`num_blocks` blocks (None: as many as asked for, never evicting) and the prefix cache.

    With `keep_freed`, only held blocks count against `num_blocks`: a freed block stays cached
    for good, off the count (the simulator's capacity bound, not a real cache).

    A request hands its hashed blocks in as runs of hashes, in its order; what it holds beyond
    them is a count of blocks without a hash, and the runs among its own that were duplicates
    when it registered them (`register` returns those).
    """

    def __init__(self, num_blocks: int | None, host: HostTier | None = None, keep_freed: bool = False) -> None:
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.host = host
        self.keep_freed = keep_freed
        self._starts: list[int] = []  # every run's lo, sorted
        self._runs: dict[int, _BlockRun] = {}  # lo -> run
        self._queue: list[tuple[int, int, int]] = []  # (release, -top, CACHED or DUPLICATE)
        self._duplicates: dict[tuple[int, int], int] = {}  # (release, top) -> lo of freed duplicates
        self._releases = 0
        self._queued = 0  # free blocks with a hash
        self._in_use = 0
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return 2**62 if self.num_blocks is None else self.num_blocks - self._in_use

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def cached(self) -> dict[int, None]:
        """The hashes that hit, built on demand (to inspect the cache, not on the hot path)."""
        return dict.fromkeys(chain.from_iterable(range(run.lo, run.hi) for run in self._runs.values()))

    def cache_hits(self, runs: Sequence[range]) -> int:
        """How many blocks of `runs`, from the first, are cached (a lookup stops at a miss)."""
        count = 0
        for wanted in runs:
            position = wanted.start
            while position < wanted.stop and (run := self._run_at(position)) is not None:
                position = run.hi
            if position < wanted.stop:
                return count + position - wanted.start
            count += len(wanted)
        return count

    def held(self, runs: Sequence[range]) -> int:
        """How many of these cached blocks other requests hold; adopting the rest takes them
        out of the free queue."""
        return sum(
            min(run.hi, wanted.stop) - max(run.lo, wanted.start)
            for wanted in runs
            for run in self._overlapping(wanted.start, wanted.stop)
            if run.refs
        )

    def take(self, runs: Sequence[range]) -> None:
        """Reference cached blocks a request adopts as its prefix (all of `runs` cached)."""
        for wanted in runs:
            pieces = self._pieces(wanted.start, wanted.stop)
            for run in pieces:
                if not run.refs:
                    self._queued -= run.hi - run.lo
                    self._in_use += run.hi - run.lo
                run.refs += 1
            self._coalesce_over(pieces, wanted.stop)

    def allocate(self, count: int) -> None:
        """`count` new blocks from the head of the free queue; the caller checked num_free."""
        if self.num_blocks is not None and not self.keep_freed:
            short = count - (self.num_blocks - self._in_use - self._queued)
            if short > 0:
                self._evict(short)
        self._in_use += count

    def register(self, runs: Sequence[range]) -> list[range]:
        """A request's new blocks became full of known tokens: they serve prefix hits from now
        on, except those whose hash another block holds; returns those duplicates' runs."""
        duplicates: list[range] = []
        starts = self._starts
        for wanted in runs:
            # Most often a decoding request's next block, right after its own held alone: that run grows.
            index = bisect_right(starts, wanted.start)
            if index and (index == len(starts) or starts[index] >= wanted.stop):
                lower = self._runs[starts[index - 1]]
                if lower.hi == wanted.start and lower.refs == 1:
                    lower.hi = wanted.stop
                    continue
            position = wanted.start
            for run in self._overlapping(wanted.start, wanted.stop):
                lo, hi = max(run.lo, wanted.start), min(run.hi, wanted.stop)
                if lo > position:
                    self._add_held(position, lo)
                if duplicates and duplicates[-1].stop == lo:
                    lo = duplicates.pop().start
                duplicates.append(range(lo, hi))
                position = hi
            if position < wanted.stop:
                self._add_held(position, wanted.stop)
        return duplicates

    def free(self, runs: Sequence[range], duplicates: Sequence[range], unhashed: int) -> None:
        """Drop a request's reference to its blocks: its hashed blocks (`runs`, of which
        `duplicates` were duplicates) and `unhashed` more. The hashed ones join the back of
        the queue tail first, as vLLM frees them in reverse order."""
        self._releases += 1
        release = self._releases
        released = unhashed
        for wanted in runs:
            for lo, hi in _without(wanted, duplicates):
                pieces = self._pieces(lo, hi)
                for run in pieces:
                    run.refs -= 1
                    if not run.refs:
                        run.released = release
                        released += run.hi - run.lo
                        self._queued += run.hi - run.lo
                        heapq.heappush(self._queue, (release, -run.hi, CACHED))
                self._coalesce_over(pieces, hi)
        for duplicate in duplicates:
            self._duplicates[(release, duplicate.stop)] = duplicate.start
            heapq.heappush(self._queue, (release, -duplicate.stop, DUPLICATE))
            released += len(duplicate)
            self._queued += len(duplicate)
        self._in_use -= released

    # ---- runs -----------------------------------------------------------------------------

    def _run_at(self, block_hash: int) -> _BlockRun | None:
        index = bisect_right(self._starts, block_hash) - 1
        if index >= 0:
            run = self._runs[self._starts[index]]
            if block_hash < run.hi:
                return run
        return None

    def _overlapping(self, lo: int, hi: int) -> list[_BlockRun]:
        starts = self._starts
        first = max(0, bisect_right(starts, lo) - 1)
        runs = [self._runs[start] for start in starts[first : bisect_left(starts, hi)]]
        return runs if not runs or runs[0].hi > lo else runs[1:]

    def _pieces(self, lo: int, hi: int) -> list[_BlockRun]:
        """The runs that make up lo..hi-1 exactly (all cached), split where they stick out."""
        self._split(lo)
        self._split(hi)
        starts = self._starts
        return [self._runs[start] for start in starts[bisect_left(starts, lo) : bisect_left(starts, hi)]]

    def _split(self, at: int) -> None:
        run = self._run_at(at)
        if run is None or run.lo == at:
            return
        upper = _BlockRun(at, run.hi, run.refs, run.released)
        run.hi = at
        self._insert(upper)
        if not run.refs:  # the upper part keeps the entry for the old top
            heapq.heappush(self._queue, (run.released, -at, CACHED))

    def _add_held(self, lo: int, hi: int) -> None:
        run = _BlockRun(lo, hi, 1)
        self._insert(run)
        self._coalesce_over([run], hi)

    def _coalesce_over(self, pieces: list[_BlockRun], hi: int) -> None:
        """Merge neighbours in the same state at the bounds of `pieces` (which end at `hi`)."""
        for at in [run.lo for run in pieces] + [hi]:
            upper = self._runs.get(at)
            lower = self._run_at(at - 1)
            if upper is None or lower is None or lower.hi != at or lower.refs != upper.refs:
                continue
            if lower.refs or lower.released == upper.released:  # free runs: one release only
                lower.hi = upper.hi
                self._remove(upper)

    def _insert(self, run: _BlockRun) -> None:
        insort(self._starts, run.lo)
        self._runs[run.lo] = run

    def _remove(self, run: _BlockRun) -> None:
        del self._starts[bisect_left(self._starts, run.lo)]
        del self._runs[run.lo]

    def _evict(self, count: int) -> None:
        """Take the `count` least recently freed blocks with a hash out of the cache (to the host tier)."""
        self.evictions += count
        self._queued -= count
        queue = self._queue
        while count:
            release, negative_top, kind = queue[0]
            top = -negative_top
            run = None
            if kind == CACHED:
                run = self._run_at(top - 1)
                if run is None or run.hi != top or run.refs or run.released != release:
                    heapq.heappop(queue)  # the run changed since: another entry stands for it
                    continue
                lo = run.lo
            else:
                lo = self._duplicates.pop((release, top))
            new_top = max(lo, top - count)
            count -= top - new_top
            if self.host is not None:
                self.host.store(range(top - 1, new_top - 1, -1))
            if new_top == lo:
                heapq.heappop(queue)
                if run is not None:
                    self._remove(run)
                continue
            heapq.heapreplace(queue, (release, -new_top, kind))  # still the head: its release's highest
            if run is not None:
                run.hi = new_top
            else:
                self._duplicates[(release, new_top)] = lo


def _without(wanted: range, duplicates: Sequence[range]) -> list[tuple[int, int]]:
    """The parts of `wanted` outside `duplicates` (sorted, disjoint), as (lo, hi)."""
    parts, position = [], wanted.start
    for duplicate in duplicates:
        lo, hi = max(duplicate.start, wanted.start), min(duplicate.stop, wanted.stop)
        if lo >= hi:
            continue
        if lo > position:
            parts.append((position, lo))
        position = hi
    if position < wanted.stop:
        parts.append((position, wanted.stop))
    return parts
