"""The arms of a simulation, all on the same programs, and what each one measures.

`sticky` and `least-loaded` are the engines alone; `reference` and `thunderctl` put the
project's Scheduler in front (the paper's policy, `SchedulerConfig.reference()`, and the default);
`limit` is the engines alone with a KV cache that never evicts, so nothing is recomputed;
`bound` charges only running requests to the cache and keeps the rest off it for free.
The peers (`prefix-aware`, `dynamo-ta`, `continuum`, `autellix`) are in sim/peers.py.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from thunderctl.percentiles import percentile
from thunderctl.scheduler import SchedulerConfig
from thunderctl.scheduler.config import merged, nested
from thunderctl.sim.agents import Client, ProgramRun, Router, SimStep, VirtualAgents, Workload
from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.completions import makespan, program_figures
from thunderctl.sim.cost import Preset
from thunderctl.sim.engine import Engine, EngineCounters, EngineMode
from thunderctl.sim.kv import HostTier
from thunderctl.sim.peers import (
    AutellixPLAS,
    AutellixRouter,
    ContinuumTTL,
    DynamoQueue,
    DynamoRouter,
    PrefixAwareRouter,
)
from thunderctl.sim.rollout import Rollout, SampledWorkload, batch_figures
from thunderctl.sim.routing import LeastLoadedRouter, PolicyRouter, StickyRouter
from thunderctl.sim.waits import program_fairness, waits_by_class
from thunderctl.sim.worker import SimWorker

GIB = 2**30
PRICED_CONTEXT_TOKENS = 16_384  # an agent's context mid-run, at which re-prefill is priced


class ArmName(StrEnum):
    STICKY = "sticky"
    LEAST_LOADED = "least-loaded"
    REFERENCE = "reference"
    THUNDERCTL = "thunderctl"
    LIMIT = "limit"
    BOUND = "bound"
    PREFIX_AWARE = "prefix-aware"
    DYNAMO_TA = "dynamo-ta"
    CONTINUUM = "continuum"
    AUTELLIX = "autellix"

    @property
    def engine_bounded(self) -> bool:
        """Its engines keep the preset's KV cache and may have a host tier."""
        return self not in (ArmName.LIMIT, ArmName.BOUND)


@dataclass(frozen=True)
class SimSpec:
    """One simulated run: the cluster, the load, and how long it is measured."""

    preset: Preset
    workload: Workload
    concurrency: int
    duration_s: float
    workers: int = 1
    warmup_s: float = 0.0
    seed: int = 0
    host_kv_gib: float = 0.0
    sample_interval_s: float = 10.0
    age_initial_programs: bool = False  # as `thunderctl bench` runs: the first programs start part-way
    # SchedulerConfig settings the thunderctl arm runs with instead of the defaults (dotted keys, or
    # sections as dicts): a variant measured
    policy: dict[str, Any] = field(default_factory=dict)
    client: Client = Client.NAMED  # whether agents name and release their programs
    tool_calls: bool = False  # whether their answers show the tool they call (VirtualAgents.tool_calls)
    # A batch of `concurrency` programs in groups (sim/rollout.py), all started at 0 and none after:
    # the run ends when the last one does (or at `duration_s`), and is measured whole.
    rollout: Rollout | None = None

    def __post_init__(self) -> None:
        if self.rollout is not None and (self.concurrency != self.rollout.programs or self.warmup_s):
            raise ValueError(f"a rollout of {self.rollout} runs {self.rollout.programs} programs with no warm-up")
        if self.concurrency < 1 or self.workers < 1:
            raise ValueError(f"concurrency ({self.concurrency}) and workers ({self.workers}) must be at least 1")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warm-up ({self.warmup_s:g} s) must be shorter than the run ({self.duration_s:g} s)")
        if self.host_kv_gib < 0:
            raise ValueError(f"host KV must not be negative, got {self.host_kv_gib} GiB")

    @property
    def host_blocks(self) -> int:
        block_bytes = self.preset.kv_bytes_per_token * self.preset.engine.block_size
        return int(self.host_kv_gib * GIB // block_bytes)


@dataclass(frozen=True)
class OccupancySample:
    t_s: float
    usage: tuple[float, ...]  # per worker: share of its KV blocks in use


@dataclass
class ArmResult:
    arm: str
    workers: int
    window_s: float
    records: list[SimStep]
    window: EngineCounters  # summed over workers, steady window only
    occupancy: list[OccupancySample]
    programs_started: int
    programs_completed: int
    steps_cut: int
    scheduler_counters: dict[str, int] = field(default_factory=dict)
    completed: list[ProgramRun] = field(default_factory=list)
    sent: dict[int, float] = field(default_factory=dict)  # first request of each program that started at step 0
    first_wave: int = 0  # programs that started together at 0 from step 0 (none when aged)
    rollout: Rollout | None = None

    def steady(self, warmup_s: float) -> list[SimStep]:
        end = warmup_s + self.window_s
        return [r for r in self.records if r.start_s >= warmup_s and r.end_s <= end]

    def summary(self, warmup_s: float) -> dict[str, Any]:
        steady = self.steady(warmup_s)
        latencies = [r.latency_s for r in steady]
        w = self.window
        return {
            "steps_per_min": 60.0 * len(latencies) / self.window_s,
            "hit_rate": w.hit_rate,
            "p50_s": percentile(latencies, 50),
            "p90_s": percentile(latencies, 90),
            "p99_s": percentile(latencies, 99),
            "preemptions": w.preemptions,
            "steady_steps": len(latencies),
            "steps_answered": sum(r.end_s <= warmup_s + self.window_s for r in self.records),  # warm-up included
            "programs_started": self.programs_started,
            "programs_completed": self.programs_completed,
            "steps_cut": self.steps_cut,
            **program_figures(self.completed, self.sent, warmup_s, warmup_s + self.window_s),
            "makespan_s": makespan(self.completed, self.first_wave) if self.first_wave else None,
            **(batch_figures(self.completed, self.rollout) if self.rollout else {}),
            "prefill_tokens": w.prefill_tokens,
            "decode_tokens": w.decode_tokens,
            "host_hit_tokens": w.host_hit_tokens,
            "transfer_s": w.transfer_s,
            "engine_steps": w.steps,
            "engine_busy": w.busy_s / self.window_s / self.workers,
            "kv_imbalance": imbalance(self.occupancy),
            "admission_waits": waits_by_class(steady),
            "fairness": program_fairness(steady),
            **self.scheduler_counters,
            "occupancy": [[s.t_s, list(s.usage)] for s in self.occupancy],
        }


def imbalance(samples: list[OccupancySample], threshold: float = 0.2) -> dict[str, float] | None:
    """Cross-worker KV occupancy spread (max - min): its mean, peak and share of time above threshold."""
    spreads = [max(s.usage) - min(s.usage) for s in samples if len(s.usage) > 1]
    if not spreads:
        return None
    return {
        "mean": statistics.fmean(spreads),
        "peak": max(spreads),
        "share_above": sum(spread > threshold for spread in spreads) / len(spreads),
        "threshold": threshold,
    }


def add_counters(counters: list[EngineCounters]) -> EngineCounters:
    total = EngineCounters()
    for c in counters:
        for name, value in vars(c).items():
            setattr(total, name, getattr(total, name) + value)
    return total


def subtract_counters(after: EngineCounters, before: EngineCounters) -> EngineCounters:
    return EngineCounters(**{name: value - getattr(before, name) for name, value in vars(after).items()})


def engine_mode(arm: ArmName, preset: Preset, clock: VirtualClock) -> EngineMode | None:
    """The peer scheduling inside the engines of an arm, shared by its workers (None: vLLM's)."""
    match arm:
        case ArmName.CONTINUUM:
            return ContinuumTTL(preset)
        case ArmName.AUTELLIX:
            return AutellixPLAS()
        case ArmName.DYNAMO_TA:
            return DynamoQueue(clock)
    return None


def build_router(
    arm: ArmName,
    workers: list[SimWorker],
    clock: VirtualClock,
    preset: Preset,
    host_kv_tokens: int = 0,
    mode: EngineMode | None = None,
    policy: dict[str, Any] | None = None,
) -> tuple[Router, PolicyRouter | None]:
    match arm:
        case ArmName.STICKY | ArmName.LIMIT | ArmName.BOUND | ArmName.CONTINUUM:
            return StickyRouter(workers), None
        case ArmName.PREFIX_AWARE:
            return PrefixAwareRouter(workers), None
        case ArmName.AUTELLIX:
            return AutellixRouter(workers), None
        case ArmName.DYNAMO_TA:
            assert isinstance(mode, DynamoQueue)
            dynamo = DynamoRouter(workers, clock, mode)
            return dynamo, dynamo
        case ArmName.LEAST_LOADED:
            return LeastLoadedRouter(workers), None
        case ArmName.REFERENCE:
            router = PolicyRouter(workers, clock, SchedulerConfig.reference())
            return router, router
        case ArmName.THUNDERCTL:
            # What the gateway measures from usage and time to first token, from the cost model;
            # a host tier's transfer rate from the preset's link.
            prefill_rate = preset.prefill_tokens_per_s(min(PRICED_CONTEXT_TOKENS, preset.engine.max_model_len))
            retention = {
                "prefill_tokens_per_s": prefill_rate,
                "host_transfer_tokens_per_s": 1.0 / preset.transfer_seconds(1),
            }
            config = SchedulerConfig.model_validate(merged({"retention": retention}, nested(policy or {})))
            router = PolicyRouter(workers, clock, config, host_kv_tokens)
            return router, router


def run_arm(arm: ArmName, spec: SimSpec, progress: Callable[[float], None] | None = None) -> ArmResult:
    """Simulate one arm for `spec.duration_s` of virtual time; `progress` sees the clock now and then."""
    clock = VirtualClock()
    preset = spec.preset
    workers = []
    mode = engine_mode(arm, preset, clock)
    for index in range(spec.workers):
        host = HostTier(spec.host_blocks) if spec.host_blocks and arm.engine_bounded else None
        engine = Engine(
            preset.engine, preset.cost, host=host, transfer_seconds=preset.transfer_seconds,
            unbounded_kv=arm is ArmName.LIMIT, running_only_kv=arm is ArmName.BOUND, mode=mode,
            frontend=preset.frontend,
        )  # fmt: skip
        workers.append(SimWorker(f"w{index}", engine, clock))
    router, policy = build_router(
        arm, workers, clock, preset, spec.host_blocks * preset.engine.block_size, mode, spec.policy
    )
    samples = spec.rollout.samples if spec.rollout else 0
    loop = VirtualAgents(
        SampledWorkload(spec.workload, samples) if samples else spec.workload, spec.seed, spec.concurrency, clock,
        router, preset.engine.block_size, age_initial_programs=spec.age_initial_programs, client=spec.client,
        tool_calls=spec.tool_calls, samples=samples, answer_retokenized_ratio=preset.answer_retokenized_ratio,
    )  # fmt: skip
    occupancy: list[OccupancySample] = []
    at_warmup: list[EngineCounters] = []
    policy_at_warmup: dict[str, int] = {}

    def policy_counters() -> dict[str, int]:
        if policy is None:
            return {}
        c = policy.scheduler.counters
        return {
            "pauses": c.pauses, "resumes": c.resumes, "forced_resumes": c.forced_resumes, "expired": c.expired,
            "priced_pauses": c.priced_pauses, "ended_pauses": c.ended_pauses, "bound_pauses": c.bound_pauses, "gpu_waits": c.gpu_waits,
        }  # fmt: skip

    def sample() -> None:
        if clock.now >= spec.warmup_s:
            occupancy.append(OccupancySample(clock.now, tuple(w.engine.kv_usage for w in workers)))
        clock.after(spec.sample_interval_s, sample)

    def snapshot() -> None:
        at_warmup.append(add_counters([replace(w.engine.counters) for w in workers]))
        policy_at_warmup.update(policy_counters())

    clock.at(spec.warmup_s, snapshot)
    clock.after(0.0, sample)
    loop.start()
    chunks = max(1, math.ceil(spec.duration_s / 60.0))
    for chunk in range(1, chunks + 1):
        clock.run_until(min(spec.duration_s, chunk * 60.0))
        if progress is not None:
            progress(clock.now)
        if samples and loop.programs_completed == spec.concurrency:
            break  # the batch is over: measured up to its last answer
    ended = samples and loop.programs_completed == spec.concurrency
    end_s = max(r.done_s for r in loop.completed) if ended else spec.duration_s
    window = subtract_counters(add_counters([w.engine.counters for w in workers]), at_warmup[0])
    scheduler_counters = {name: value - policy_at_warmup[name] for name, value in policy_counters().items()}
    return ArmResult(
        arm=arm.value, workers=spec.workers, window_s=end_s - spec.warmup_s, records=loop.records, window=window,
        occupancy=occupancy, programs_started=loop.programs_started, programs_completed=loop.programs_completed,
        steps_cut=loop.steps_cut, scheduler_counters=scheduler_counters, completed=loop.completed, sent=loop.sent,
        first_wave=0 if spec.age_initial_programs else spec.concurrency, rollout=spec.rollout,
    )  # fmt: skip
