"""What a closed-loop run recorded: its steps, the engines' counters, and the figures drawn from them (pure)."""

from __future__ import annotations

import collections
import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, replace
from enum import Enum
from typing import Any

from thunderctl.engines.vllm import EngineMetrics
from thunderctl.percentiles import percentile


@dataclass(frozen=True)
class ToolRecord:
    """One tool step's exec: `wait_s` is its latency minus the command's own duration, the time the
    step waited for its sandbox (readiness on a first exec, then the round trip)."""

    program_id: str
    step: int
    start_s: float
    latency_s: float
    command_s: float | None
    ok: bool
    error: str | None = None

    @property
    def wait_s(self) -> float | None:
        return None if self.command_s is None else max(0.0, self.latency_s - self.command_s)


@dataclass(frozen=True)
class SandboxSample:
    """The pool's containers and disk at `t_s`, from the gateway's `/metrics`."""

    t_s: float
    containers: int
    disk_bytes: dict[str, float]  # per host; measured by the pool's maintenance round
    disk_age_s: dict[str, float] = field(default_factory=dict)  # per host: how long before t_s

    def disk_measured_since(self, t_s: float) -> bool:
        """Every host's disk figure was measured at or after `t_s` (as far as the gateway says)."""
        return all(self.t_s - age >= t_s for age in self.disk_age_s.values())


@dataclass(frozen=True)
class StepRecord:
    program_id: str
    program_index: int
    step: int
    start_s: float  # since the start of the run
    latency_s: float
    ok: bool
    status: int  # HTTP status; 0 when no response arrived
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None  # streaming only
    error: str | None = None

    @property
    def end_s(self) -> float:
        return self.start_s + self.latency_s


@dataclass(frozen=True)
class ProgramRun:
    """A program that completed: its first request of the run sent at `start_s`, its last answer
    received `latency_s` later."""

    program_id: str
    start_s: float  # since the start of the run
    latency_s: float
    steps: int  # its steps sent in this run
    whole: bool  # it ran from its first step (not one of an aged run's programs that start part-way)

    @property
    def end_s(self) -> float:
        return self.start_s + self.latency_s


def steady_programs(runs: Sequence[ProgramRun], warmup_s: float, window_end_s: float) -> list[ProgramRun]:
    """Programs that completed inside the steady window."""
    return [run for run in runs if warmup_s <= run.end_s <= window_end_s]


@dataclass(frozen=True)
class ReleaseFailure:
    """A program's release that failed even when sent again: the gateway may still hold the program."""

    program_id: str
    t_s: float  # since the start of the run
    error: str


@dataclass(frozen=True)
class Resend:
    """A request or release sent again after an error that left it unanswered."""

    t_s: float  # since the start of the run
    error: str


def steady_steps(records: Sequence[StepRecord], warmup_s: float, window_end_s: float) -> list[StepRecord]:
    """Successful steps that started after the warm-up and finished inside the window."""
    return [r for r in records if r.ok and r.start_s >= warmup_s and r.end_s <= window_end_s]


def per_minute(count: int, window_s: float) -> float:
    return 60.0 * count / window_s if window_s > 0 else 0.0


@dataclass(frozen=True)
class CacheDelta:
    """Change of the engines' counters over a run, summed over the engines."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0

    @classmethod
    def between(cls, before: Sequence[EngineMetrics], after: Sequence[EngineMetrics]) -> CacheDelta:
        return cls(
            prefix_cache_queries=sum(a.prefix_cache_queries - b.prefix_cache_queries for b, a in zip(before, after)),
            prefix_cache_hits=sum(a.prefix_cache_hits - b.prefix_cache_hits for b, a in zip(before, after)),
            preemptions=sum(a.preemptions - b.preemptions for b, a in zip(before, after)),
        )

    def __add__(self, other: CacheDelta) -> CacheDelta:
        return CacheDelta(
            self.prefix_cache_queries + other.prefix_cache_queries,
            self.prefix_cache_hits + other.prefix_cache_hits,
            self.preemptions + other.preemptions,
        )

    def __sub__(self, other: CacheDelta) -> CacheDelta:
        return CacheDelta(
            self.prefix_cache_queries - other.prefix_cache_queries,
            self.prefix_cache_hits - other.prefix_cache_hits,
            self.preemptions - other.preemptions,
        )

    @property
    def hit_rate(self) -> float | None:
        if self.prefix_cache_queries <= 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


@dataclass(frozen=True)
class CounterSample:
    """The engines' counters over one sampling interval that ended at `t_s`."""

    t_s: float
    engines: CacheDelta


class Pooling(Enum):
    """How slices of one arm pool a field of their results (`combine_results`)."""

    FIRST = "first"  # the same in every slice
    JOINED = "joined"  # strings, comma-separated
    SUMMED = "summed"  # counts, times and counters add up
    CONCATENATED = "concatenated"  # pooled samples
    SHIFTED = "shifted"  # timed items, moved to the slices' back-to-back time


def pooled(how: Pooling, *, default: Any = MISSING, default_factory: Any = MISSING, clock: str = "") -> Any:
    """A LoadResult field and how slices pool it; `clock` names a SHIFTED item's time field."""
    return field(default=default, default_factory=default_factory, metadata={"pooling": how, "clock": clock})


def listed(how: Pooling, clock: str = "") -> Any:
    return pooled(how, default_factory=list, clock=clock)


@dataclass
class LoadResult:
    """One run's outcome. Each field says how slices pool it; `summary` holds every scalar field
    and every figure (property), so a field added here reaches both without more code."""

    target: str = pooled(Pooling.FIRST)
    concurrency: int = pooled(Pooling.FIRST)
    salt: str = pooled(Pooling.JOINED)
    tokens_per_word: float = pooled(Pooling.FIRST)
    wall_s: float = pooled(Pooling.SUMMED)
    window_s: float = pooled(Pooling.SUMMED)  # length of the steady window (after warm-up)
    steps_ok: int = pooled(Pooling.SUMMED)
    steps_failed: int = pooled(Pooling.SUMMED)
    steps_cancelled: int = pooled(Pooling.SUMMED)  # in flight when the run's time was up
    steady_latencies_s: list[float] = pooled(Pooling.CONCATENATED)
    programs_started: int = pooled(Pooling.SUMMED)
    programs_completed: int = pooled(Pooling.SUMMED)
    engines: CacheDelta = pooled(Pooling.SUMMED)
    release_failures: int = pooled(Pooling.SUMMED, default=0)
    records: list[StepRecord] = listed(Pooling.SHIFTED, clock="start_s")
    steady_ttfts_s: list[float] = listed(Pooling.CONCATENATED)  # streaming only
    samples: list[CounterSample] = listed(Pooling.SHIFTED, clock="t_s")
    steps_cut: int = pooled(Pooling.SUMMED, default=0)  # steps of started programs left out to fit the context limit
    unanswered_retries: int = pooled(Pooling.SUMMED, default=0)  # requests and releases sent again (LoadSpec)
    resends: list[Resend] = listed(Pooling.SHIFTED, clock="t_s")  # when and why each was sent again
    release_errors: list[ReleaseFailure] = listed(Pooling.SHIFTED, clock="t_s")
    # With tool steps in sandboxes (`bench swe-lite --sandboxes`):
    tool_records: list[ToolRecord] = listed(Pooling.SHIFTED, clock="start_s")
    sandbox_samples: list[SandboxSample] = listed(Pooling.SHIFTED, clock="t_s")
    sandbox_create_failures: int = pooled(Pooling.SUMMED, default=0)
    # Programs completed (every step answered), and those that completed in the steady window:
    program_runs: list[ProgramRun] = listed(Pooling.SHIFTED, clock="start_s")
    steady_programs_completed: int = pooled(Pooling.SUMMED, default=0)
    steady_program_s: list[float] = listed(Pooling.CONCATENATED)  # whole programs only: first request → last answer

    @property
    def steady_steps(self) -> int:
        return len(self.steady_latencies_s)

    @property
    def steps_per_min(self) -> float:
        return per_minute(self.steady_steps, self.window_s)

    @property
    def p50_s(self) -> float | None:
        return percentile(self.steady_latencies_s, 50)

    @property
    def p90_s(self) -> float | None:
        return percentile(self.steady_latencies_s, 90)

    @property
    def p99_s(self) -> float | None:
        return percentile(self.steady_latencies_s, 99)

    @property
    def program_p50_s(self) -> float | None:
        return percentile(self.steady_program_s, 50)

    @property
    def program_p90_s(self) -> float | None:
        return percentile(self.steady_program_s, 90)

    @property
    def program_p99_s(self) -> float | None:
        return percentile(self.steady_program_s, 99)

    @property
    def programs_per_min(self) -> float:
        return per_minute(self.steady_programs_completed, self.window_s)

    @property
    def ttft_p50_s(self) -> float | None:
        return percentile(self.steady_ttfts_s, 50)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.engines.hit_rate

    @property
    def preemptions(self) -> int:
        return self.engines.preemptions

    @property
    def step_errors(self) -> dict[str, int]:
        """Why steps failed: each error (its first 160 characters) and how many steps it failed."""
        return dict(collections.Counter(r.error[:160] for r in self.records if r.error).most_common())

    def summary(self) -> dict[str, Any]:
        """The headline figures, JSON-ready: the scalar fields, the engines' counters as
        `engine_*`, and every figure below; the per-step lists are left out."""
        figures: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, CacheDelta):
                figures |= {f"engine_{key}": count for key, count in asdict(value).items()}
            elif not isinstance(value, list):
                figures[item.name] = value
        return figures | {name: getattr(self, name) for name in FIGURES}


# The figures drawn from a result's fields, in the order they are declared.
FIGURES = tuple(name for name, value in vars(LoadResult).items() if isinstance(value, property))


def combine_results(results: Sequence[LoadResult]) -> LoadResult:
    """Pool the slices of one arm, each field as it says: windows and counts add up, latencies
    are pooled, and records and samples follow each other in time as if the slices had run back
    to back."""
    if not results:
        raise ValueError("nothing to combine")
    offsets = list(itertools.accumulate((r.wall_s for r in results[:-1]), initial=0.0))
    return LoadResult(**{item.name: pool_field(item, results, offsets) for item in fields(LoadResult)})


def pool_field(item: Field[Any], results: Sequence[LoadResult], offsets: Sequence[float]) -> Any:
    values = [getattr(result, item.name) for result in results]
    match item.metadata["pooling"]:
        case Pooling.FIRST:
            return values[0]
        case Pooling.JOINED:
            return ",".join(values)
        case Pooling.SUMMED:
            return functools.reduce(operator.add, values)
        case Pooling.CONCATENATED:
            return [x for value in values for x in value]
        case Pooling.SHIFTED:
            clock = item.metadata["clock"]
            return [
                replace(x, **{clock: getattr(x, clock) + offset})
                for value, offset in zip(values, offsets)
                for x in value
            ]
