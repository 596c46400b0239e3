"""What an engine is given and what it counts: a program's tokens as block hashes, a request,
and the engine's counters (vLLM 0.32's)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol


@dataclass(frozen=True)
class TokenStream:
    """A program's tokens, seen as block hashes: block i of every program is the same while it
    lies inside the shared system prompt, and the program's own after that. Every prompt of a
    program is a prefix of its stream, and an answer continues it, so a program's next prompt
    extends its previous prompt and answer."""

    uid: int  # >= 1, unique per program in a run
    shared_blocks: int = 0
    # The samples of one task (a GRPO group) share their first prompt: blocks shared_blocks..
    # group_blocks-1 are the group's, (group_uid << 32) + 2^31 + index, the same for each sample.
    group_uid: int = 0
    group_blocks: int = 0

    def block_runs(self, start: int, stop: int) -> list[range]:
        """The hashes of blocks start..stop-1 as runs of consecutive hashes: small integers
        for the shared blocks, the group's first prompt, then the program's (uid << 32) + index."""
        shared, group, own = self.shared_blocks, max(self.group_blocks, self.shared_blocks), self.uid << 32
        group_own = (self.group_uid << 32) + (1 << 31)
        runs = [
            range(start, min(stop, shared)),
            range(group_own + max(start, shared), group_own + min(stop, group)),
            range(own + max(start, group), own + stop),
        ]
        return [run for run in runs if run]

    def block_hashes(self, start: int, stop: int) -> list[int]:
        """The hashes of blocks start..stop-1, one by one."""
        return list(chain.from_iterable(self.block_runs(start, stop)))


@dataclass(frozen=True)
class RetokenizedAnswer:
    """One request's blocks when its answer does not come back in the next prompt as generated
    (re-tokenized to other ids): the blocks wholly inside its prompt are the program's stream;
    from the block where the answer starts, hashes of this turn alone, which no later prompt
    of the program hits (the request itself does, recomputed after a preemption)."""

    stream: TokenStream
    prompt_blocks: int
    turn: int

    def block_runs(self, start: int, stop: int) -> list[range]:
        runs = self.stream.block_runs(start, min(stop, self.prompt_blocks))
        lo = max(start, self.prompt_blocks)
        if lo < stop:
            # Above every hash of a TokenStream: (uid, turn) in the high bits, the block index low.
            base = (1 << 96) + (self.stream.uid << 48) + (self.turn << 24)
            runs.append(range(base + lo, base + stop))
        return runs

    def block_hashes(self, start: int, stop: int) -> list[int]:
        return list(chain.from_iterable(self.block_runs(start, stop)))


class BlockHashes(Protocol):
    """What the engine knows of a request's tokens: the hashes of its blocks start..stop-1, as
    increasing runs of consecutive integers and one by one (a `TokenStream`, or the HTTP
    server's `ContentStream`, content-addressed over real token ids)."""

    def block_runs(self, start: int, stop: int) -> list[range]: ...

    def block_hashes(self, start: int, stop: int) -> list[int]: ...


@dataclass(eq=False)
class Request:
    stream: BlockHashes
    prompt_tokens: int
    max_tokens: int  # the answer's length: ignore_eos, so exactly this many tokens
    arrival_s: float = 0.0
    on_finish: Callable[[Request], None] | None = None
    output_tokens: int = 0
    computed_tokens: int = 0
    num_blocks: int = 0  # KV blocks it holds
    registered_blocks: int = 0  # leading blocks whose hash is in the prefix cache
    duplicate_runs: list[range] = field(default_factory=list)  # of those, hashes another block held first
    preemptions: int = 0
    finished_s: float | None = None
    # While decoding: computed tokens = base + the engine's step index.
    base: int = 0
    decoding: bool = False
    epoch: int = 0  # bumped when it leaves decoding, so its queued events go stale
    order: int = 0  # position in the running queue: admission order
    ready_s: float | None = None  # a host-tier load in flight until then
    program: str | None = None  # the agent program it belongs to (what peers in the engine key on)
    tool_call: bool = False  # its answer ends in a tool call: the program sends again after the tool
    priority: float = 0.0  # lower first, under an EngineMode that orders the queue
    scheduled_s: float | None = None  # first admitted to the running queue
    cached_tokens: int | None = None  # prompt tokens its first admission found cached (vLLM's num_cached_tokens)

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s


@dataclass
class EngineCounters:
    steps: int = 0
    busy_s: float = 0.0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    host_hit_tokens: int = 0
    transfer_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens computed, recompute included
    decode_tokens: int = 0
    finished: int = 0
    aborted: int = 0  # requests whose client went away (Engine.abort)
    pins: int = 0  # finished requests whose KV an EngineMode pinned
    pin_hits: int = 0  # of those, the program came back while pinned

    @property
    def hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
