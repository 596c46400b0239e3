"""Priced retention: whether an ACTING program's KV is worth its room while others wait (docs/admission.md)."""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from thunderctl.scheduler.config import SchedulerConfig
from thunderctl.scheduler.program import Program, Worker


@dataclass
class GapSamples:
    """The last `limit` tool times of one key (a program, a tool kind, the cluster), kept sorted
    so that the remaining time given the time already spent is a tail mean.

    A tick asks the cluster's samples about every program it holds (thousands), between two
    samples added: each tail's sum is kept until the next `add`, so that a question costs a
    bisection, not a sum over the window. The sum is the one `sum` gives over the same tail, so
    the answers are the same to the last bit."""

    limit: int
    _recent: deque[float] = field(default_factory=deque)
    _sorted: list[float] = field(default_factory=list)
    _tail_sums: dict[int, float] = field(default_factory=dict, repr=False, compare=False)

    def add(self, gap_s: float) -> None:
        self._recent.append(gap_s)
        bisect.insort(self._sorted, gap_s)
        if len(self._recent) > self.limit:
            del self._sorted[bisect.bisect_left(self._sorted, self._recent.popleft())]
        self._tail_sums.clear()

    def remaining(self, elapsed_s: float, min_samples: int) -> float | None:
        """E[T − a | T > a] over the samples longer than a, or None if fewer than `min_samples` are."""
        start = bisect.bisect_right(self._sorted, elapsed_s)
        count = len(self._sorted) - start
        if count < min_samples:
            return None
        total = self._tail_sums.get(start)
        if total is None:
            total = self._tail_sums[start] = sum(self._sorted[start:])
        return total / count - elapsed_s

    def survival(self, elapsed_s: float) -> float:
        """The share of the samples longer than `elapsed_s` (non-empty)."""
        return 1.0 - bisect.bisect_right(self._sorted, elapsed_s) / len(self._sorted)

    def quantile(self, q: float) -> float:
        """The q-th quantile (0-1) of the samples, the nearest one at or above it (non-empty)."""
        return self._sorted[min(len(self._sorted) - 1, max(0, math.ceil(q * len(self._sorted)) - 1))]

    def __len__(self) -> int:
        return len(self._recent)

    def samples(self) -> list[float]:
        """Its samples, the oldest first: what `restored` takes back."""
        return list(self._recent)

    @classmethod
    def restored(cls, limit: int, samples: list[float]) -> GapSamples:
        """Samples as `samples` gave them (the newest `limit` of them kept)."""
        gaps = cls(limit)
        gaps._recent.extend(samples[-limit:])
        gaps._sorted = sorted(gaps._recent)
        return gaps


# Tool kinds whose tool times are kept. A bash agent's tool kind is its command's first word, a
# script path of each task among them: a gateway up for weeks sees unboundedly many. Kinds called
# again keep their place; a thousand is more than the tools of any agent's working set.
MAX_TOOL_KINDS = 1024


@dataclass
class ToolTimes:
    """Tool times learnt online from observed gaps (response end → the program's next request).

    The remaining time of a program in its tool is read from the most specific evidence that
    has seen tools last longer than this one has so far: its tool kind, then the program, then
    the cluster. Elapsed time enters only through that conditional tail: under a heavy tail a
    long wait predicts a longer one, for near-deterministic tools a shorter one. Past every
    sample (no evidence at all), the remaining time is taken equal to the time spent, the
    median of a scale-free tail.
    """

    window: int
    min_samples: int
    # The cluster's gaps over a longer window, for the tail that ending waits for (ending.py): a
    # busy cluster sees `window` gaps in seconds, too few to hold its rare long tools.
    tail_window: int = 4096
    cluster: GapSamples = field(init=False)
    tail: GapSamples = field(init=False)
    by_program: dict[str, GapSamples] = field(default_factory=dict)
    by_tool: dict[str, GapSamples] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cluster = GapSamples(self.window)
        self.tail = GapSamples(self.tail_window)

    def observe(self, program_id: str, tool: str | None, gap_s: float) -> None:
        keys: list[GapSamples] = [
            self.cluster, self.tail, self.by_program.setdefault(program_id, GapSamples(self.window))
        ]  # fmt: skip
        if tool is not None:
            keys.append(self._tool(tool))
        for samples in keys:
            samples.add(gap_s)

    def _tool(self, tool: str) -> GapSamples:
        """The tool kind's samples, now its most recently called; beyond MAX_TOOL_KINDS kinds the
        least recently called is forgotten."""
        samples = self.by_tool.pop(tool, None)
        if samples is None:
            samples = GapSamples(self.window)
        self.by_tool[tool] = samples  # dicts keep insertion order: the first key is the least recent
        if len(self.by_tool) > MAX_TOOL_KINDS:
            del self.by_tool[next(iter(self.by_tool))]
        return samples

    def forget(self, program_id: str) -> None:
        self.by_program.pop(program_id, None)

    def snapshot(self) -> dict[str, Any]:
        """The cluster's and each tool kind's samples (each program's go with the program)."""
        return {
            "cluster": self.cluster.samples(),
            "tail": self.tail.samples(),
            "by_tool": {tool: samples.samples() for tool, samples in self.by_tool.items()},
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.cluster = GapSamples.restored(self.window, snapshot["cluster"])
        self.tail = GapSamples.restored(self.tail_window, snapshot["tail"])
        by_tool = list(snapshot["by_tool"].items())[-MAX_TOOL_KINDS:]  # the least recently called first
        self.by_tool = {tool: GapSamples.restored(self.window, samples) for tool, samples in by_tool}

    def restore_program(self, program_id: str, samples: list[float]) -> None:
        if samples:
            self.by_program[program_id] = GapSamples.restored(self.window, samples)

    def remaining(self, program_id: str, tool: str | None, elapsed_s: float) -> float:
        # Asked of every held program in a tick that prices retention: a tuple, not a generator.
        by_tool = self.by_tool.get(tool) if tool is not None else None
        for samples in (by_tool, self.by_program.get(program_id), self.cluster):
            estimate = samples.remaining(elapsed_s, self.min_samples) if samples is not None else None
            if estimate is not None:
                return estimate
        return elapsed_s


@dataclass
class Returns:
    """How often a tool call ends in the program's next request rather than its end."""

    returned: int = 0
    ended: int = 0

    @property
    def chance(self) -> float:
        # Laplace's rule: a program is expected to return before anything is known.
        return (self.returned + 1) / (self.returned + self.ended + 2)


@dataclass
class PrefillRate:
    """Uncached prompt tokens per second of time to first token, a running mean of measurements."""

    tokens_per_s: float
    weight: float = 0.1  # of each new measurement: a rate that follows load within tens of requests

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.tokens_per_s += self.weight * (tokens / seconds - self.tokens_per_s)

    def seconds(self, tokens: int) -> float:
        return tokens / self.tokens_per_s


@dataclass(frozen=True)
class Holding:
    """An ACTING program's KV on its worker, as the law prices it."""

    program_id: str
    tokens: int  # private tokens: what a re-prefill recomputes (a shared prefix stays cached)
    remaining_s: float  # expected remaining tool time
    capacity: int  # of its worker, tokens: GPU and host tier
    return_tokens_per_s: float  # how fast its KV comes back once dropped: prefill, or a host tier's transfer


def keep_cost(holding: Holding, demand_tokens: float, price_scale: float) -> float:
    """Engine-seconds of work the room would have done for the waiting demand meanwhile.

    A KV-bound engine does work in proportion to the KV its running requests hold: `tokens` of
    a cache of `capacity` are that share of the engine, for `remaining_s`. Only the part of the
    room the queue would fill counts, so the price is 0 while nobody waits and grows with the
    waiting demand up to the room held.
    """
    useful = min(holding.tokens, max(demand_tokens, 0.0))
    return price_scale * useful * holding.remaining_s / holding.capacity


def drop_cost(holding: Holding, return_chance: float) -> float:
    """Engine-seconds the program costs if it returns to a cache that lost it: a re-prefill,
    or, where a host tier keeps a paused program's KV, a transfer."""
    return return_chance * holding.tokens / holding.return_tokens_per_s


def priced_drops(
    holdings: Iterable[Holding], demand_tokens: float, return_chance: float, price_scale: float = 1.0
) -> list[str]:
    """The programs whose KV costs more to keep than to drop, longest expected tool time first.

    Each drop serves part of the demand, so the demand left prices the next: the law frees no
    more room than the queue waits for.
    """
    dropped = []
    for holding in sorted(holdings, key=lambda h: (-h.remaining_s, h.program_id)):
        if demand_tokens <= 0:
            break
        if keep_cost(holding, demand_tokens, price_scale) > drop_cost(holding, return_chance):
            dropped.append(holding.program_id)
            demand_tokens -= holding.tokens
    return dropped


@dataclass
class RetentionLaw:
    """What the scheduler learns and decides for priced retention, fed by its events."""

    price_scale: float
    min_samples: int
    tool_times: ToolTimes
    prefill: PrefillRate
    transfer_tokens_per_s: float  # a host tier's load back to the GPU
    returns: Returns = field(default_factory=Returns)

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> RetentionLaw:
        return cls(
            config.retention.price_scale, config.retention.tool_time_min_samples,
            ToolTimes(config.retention.tool_time_window, config.retention.tool_time_min_samples, config.ending.gap_window),
            PrefillRate(config.retention.prefill_tokens_per_s),
            config.retention.host_transfer_tokens_per_s,
        )  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        return {
            "tool_times": self.tool_times.snapshot(),
            "prefill_tokens_per_s": self.prefill.tokens_per_s,
            "returns": [self.returns.returned, self.returns.ended],
        }

    def restore(self, learnt: dict[str, Any]) -> None:
        self.tool_times.restore(learnt["tool_times"])
        self.prefill.tokens_per_s = learnt["prefill_tokens_per_s"]
        self.returns = Returns(*learnt["returns"])

    def on_request(self, program: Program, now: float) -> None:
        """The program's next request: the gap since its response was a tool call."""
        if program.responded_at is not None:
            self.tool_times.observe(program.id, program.tool, now - program.responded_at)
            self.returns.returned += 1
            program.responded_at = None

    def on_end(self, program: Program) -> None:
        if program.responded_at is not None:
            self.returns.ended += 1
        self.tool_times.forget(program.id)

    def expected_tool_s(self, program: Program, now: float) -> float:
        since = program.responded_at if program.responded_at is not None else program.acting_since
        return self.tool_times.remaining(program.id, program.tool, max(now - since, 0.0))

    def return_tokens_per_s(self, worker: Worker) -> float:
        """A paused program's KV is expected in the host tier where there is one: it comes back by
        a transfer, not a re-prefill."""
        return self.transfer_tokens_per_s if worker.host_capacity else self.prefill.tokens_per_s

    def drops(self, held: Iterable[tuple[Program, Worker]], demand_tokens: float, now: float) -> list[str]:
        """Of the ACTING programs held (each with its worker, which has a capacity), those to pause.

        A tick asks this of thousands of programs of which few, often none, cost more to keep:
        the keep price is at most `price_scale · remaining_s / capacity` a token, and the drop
        price `chance / rate` a token, so a program whose expected tool time is under their
        break-even is kept at any demand and is not priced (nor sorted) at all.
        """
        chance = self.returns.chance
        holdings = []
        for program, worker in held:
            remaining_s, capacity, rate = (
                self.expected_tool_s(program, now),
                worker.kv_capacity,
                self.return_tokens_per_s(worker),
            )
            if self.price_scale * remaining_s * rate > chance * capacity:
                holdings.append(Holding(program.id, program.private_tokens, remaining_s, capacity, rate))
        return priced_drops(holdings, demand_tokens, chance, self.price_scale)

    def pays(self, workers: Iterable[Worker]) -> bool:
        """Whether a typical tool call, at the full price of KV, costs less held than dropped on
        every worker: its mean (cluster-wide) under the time to bring back the worker's whole
        cache, times the chance of return."""
        mean_tool_s = self.tool_times.cluster.remaining(0.0, self.min_samples)
        priced = [b for b in workers if b.capacity]
        if mean_tool_s is None or not priced:
            return False
        return all(
            self.price_scale * mean_tool_s / b.kv_capacity < self.returns.chance / self.return_tokens_per_s(b)
            for b in priced
        )
