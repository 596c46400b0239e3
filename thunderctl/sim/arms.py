"""The arms of a simulation, all on the same programs, and what each one measures.

`sticky` and `least-loaded` are the engines alone; `reference` and `thunderctl` put the
project's Scheduler in front (the reference policy, and the default with its admission law);
`limit` is the engines alone with a KV cache that never evicts, so nothing is recomputed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from thunderctl.scheduler import PauseOrder, PlacementRule, SchedulerConfig
from thunderctl.sim.agents import Client, Router, SimStep, VirtualAgents, Workload
from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.cost import Preset
from thunderctl.sim.engine import Engine, EngineCounters
from thunderctl.sim.kv import HostTier
from thunderctl.sim.routing import LeastLoadedRouter, PolicyRouter, StickyRouter
from thunderctl.sim.waits import percentile, program_fairness, waits_by_class
from thunderctl.sim.worker import SimWorker

GIB = 2**30
PRICED_CONTEXT_TOKENS = 16_384  # an agent's context mid-run, at which re-prefill is priced


class ArmName(StrEnum):
    STICKY = "sticky"
    LEAST_LOADED = "least-loaded"
    REFERENCE = "reference"
    THUNDERCTL = "thunderctl"
    LIMIT = "limit"


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
    client: Client = Client.NAMED  # whether agents name and release their programs

    def __post_init__(self) -> None:
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
            "programs_started": self.programs_started,
            "programs_completed": self.programs_completed,
            "steps_cut": self.steps_cut,
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


def build_router(
    arm: ArmName, workers: list[SimWorker], clock: VirtualClock, preset: Preset, host_kv_tokens: int = 0
) -> tuple[Router, PolicyRouter | None]:
    match arm:
        case ArmName.STICKY | ArmName.LIMIT:
            return StickyRouter(workers), None
        case ArmName.LEAST_LOADED:
            return LeastLoadedRouter(workers), None
        case ArmName.REFERENCE:
            reference = SchedulerConfig(
                adaptive=False, retention=False, resume_aging_tokens_per_s=None, pause_target=0.85,
                pause_order=PauseOrder.SHORTEST, wait_bound_s=None, placement=PlacementRule.ROOMIEST,
            )  # fmt: skip
            router = PolicyRouter(workers, clock, reference)
            return router, router
        case ArmName.THUNDERCTL:
            # What the gateway measures from usage and time to first token, from the cost model;
            # a host tier's transfer rate from the preset's link.
            prefill_rate = preset.prefill_tokens_per_s(min(PRICED_CONTEXT_TOKENS, preset.engine.max_model_len))
            config = SchedulerConfig(
                prefill_tokens_per_s=prefill_rate, host_transfer_tokens_per_s=1.0 / preset.transfer_seconds(1)
            )
            router = PolicyRouter(workers, clock, config, host_kv_tokens)
            return router, router


def run_arm(arm: ArmName, spec: SimSpec, progress: Callable[[float], None] | None = None) -> ArmResult:
    """Simulate one arm for `spec.duration_s` of virtual time; `progress` sees the clock now and then."""
    clock = VirtualClock()
    preset = spec.preset
    workers = []
    for index in range(spec.workers):
        host = HostTier(spec.host_blocks) if spec.host_blocks and arm is not ArmName.LIMIT else None
        engine = Engine(
            preset.engine, preset.cost, host=host, transfer_seconds=preset.transfer_seconds,
            unbounded_kv=arm is ArmName.LIMIT,
        )  # fmt: skip
        workers.append(SimWorker(f"w{index}", engine, clock))
    router, policy = build_router(arm, workers, clock, preset, spec.host_blocks * preset.engine.block_size)
    loop = VirtualAgents(
        spec.workload, spec.seed, spec.concurrency, clock, router, preset.engine.block_size,
        age_initial_programs=spec.age_initial_programs, client=spec.client,
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
    window = subtract_counters(add_counters([w.engine.counters for w in workers]), at_warmup[0])
    scheduler_counters = {name: value - policy_at_warmup[name] for name, value in policy_counters().items()}
    return ArmResult(
        arm=arm.value, workers=spec.workers, window_s=spec.duration_s - spec.warmup_s, records=loop.records, window=window,
        occupancy=occupancy, programs_started=loop.programs_started, programs_completed=loop.programs_completed,
        steps_cut=loop.steps_cut, scheduler_counters=scheduler_counters,
    )  # fmt: skip
