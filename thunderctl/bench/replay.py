"""Replay a workload in arms: through the gateway and straight to the engines, interleaved.

Arms run one at a time in slices, ABBA (the order flips every round), so slow drift of a
shared machine falls on both alike; between slices the engines and the gateway are left to
go quiet, so one slice's leftovers never load the next. Slice k of every arm replays the same
programs (the same seed) under its own salt, so no arm hits a prefix another arm cached.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx

from thunderctl.bench.closed_loop import LoadSpec, Observer, Target, run_load
from thunderctl.bench.results import LoadResult, combine_results
from thunderctl.bench.sandboxes import SandboxTools
from thunderctl.bench.swe_lite import ScaledWorkload
from thunderctl.engines.vllm import fetch_metrics
from thunderctl.jsonapi import bearer_headers
from thunderctl.prometheus import parse_samples
from thunderctl.scheduler import Phase
from thunderctl.traceformat import TraceProgram

GATEWAY_COUNTERS = (
    "thunderctl_pauses_total",
    "thunderctl_resumes_total",
    "thunderctl_forced_resumes_total",
    "thunderctl_programs_released_total",
)
QUIET_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TraceWorkload(ScaledWorkload):
    """A recorded trace as a workload: program `index` of seed `seed` is the trace's program at
    that position of a seeded shuffle, and the trace starts over (reshuffled) when used up."""

    programs: tuple[TraceProgram, ...] = field(default=(), kw_only=True)
    source: str = ""
    name: str = "trace"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.programs:
            raise ValueError("a trace workload needs at least one program")

    def program(self, seed: int, index: int) -> TraceProgram:
        count = len(self.programs)
        cycle, position = divmod(index, count)
        order = random.Random(f"trace/{seed}/{cycle}").sample(range(count), count)
        return self.programs[order[position]].scaled(self.scale)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "programs": len(self.programs),
            "scale": self.scale,
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "max_context_tokens": self.max_context_tokens,
        }


@dataclass(frozen=True)
class Arm:
    """One way of sending the load; `gateway_url` is set when a thunderctl gateway is in
    the path, whose counters (pauses, resumes) and open programs are read around slices."""

    name: str
    target: Target
    gateway_url: str | None = None


@dataclass
class ArmOutcome:
    slices: list[LoadResult] = field(default_factory=list)
    gateway_counters: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def combined(self) -> LoadResult:
        return combine_results(self.slices)

    def add_counters(self, before: dict[str, float], after: dict[str, float]) -> None:
        for name in GATEWAY_COUNTERS:
            delta = after.get(name, 0.0) - before.get(name, 0.0)
            self.gateway_counters[name] = self.gateway_counters.get(name, 0.0) + delta


class SliceObserver(Observer, Protocol):
    def slice_started(self, arm: str, round_index: int, spec: LoadSpec) -> None: ...

    def slice_finished(self, arm: str, result: LoadResult, warning: str) -> None: ...


def slice_order(arms: Sequence[str], rounds: int, flip: int = 0) -> list[tuple[str, int]]:
    """(arm, round) in ABBA order: each round reverses the previous round's order, so linear
    drift cancels; `flip` starts with the reversed order (alternate it between runs)."""
    order = []
    for round_index in range(rounds):
        names = list(arms)
        if (round_index + flip) % 2:
            names.reverse()
        order += [(name, round_index) for name in names]
    return order


def slice_spec(spec: LoadSpec, rounds: int, round_index: int) -> LoadSpec:
    """Round k's share of the run: its part of the duration and programs, its own seed."""
    return replace(
        spec,
        seed=spec.seed * 1000 + round_index,
        duration_s=None if spec.duration_s is None else spec.duration_s / rounds,
        programs=None if spec.programs is None else math.ceil(spec.programs / rounds),
    )


async def gateway_counters(client: httpx.AsyncClient, arm: Arm) -> dict[str, float]:
    response = await client.get(f"{arm.gateway_url}/metrics", headers=arm.target.headers)
    response.raise_for_status()
    return {s.name: s.value for s in parse_samples(response.text) if s.name in GATEWAY_COUNTERS}


async def wait_until_quiet(
    client: httpx.AsyncClient, engine_urls: Sequence[str], gateway: Arm | None, timeout: float = QUIET_TIMEOUT_S
) -> str:
    """Let the engines and the gateway drain what a slice left behind; returns a warning, or ""
    when quiet.

    Quiet is no request running or waiting anywhere. A program whose client is in its tool, or
    gone without a release (`--client unreleased|unchanged`), asks nothing more: it ends by
    the gateway's law in its own time, as it would in service, and waiting for that here would
    be a minute or more after every slice.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = await asyncio.gather(*(fetch_metrics(client, url) for url in engine_urls))
        busy = sum(m.requests_running + m.requests_waiting for m in metrics)
        programs = (
            (await client.get(f"{gateway.gateway_url}/programs", headers=gateway.target.headers)).json()["programs"]
            if gateway
            else []
        )
        if busy == 0 and not any(program["phase"] == Phase.REASONING.value for program in programs):
            return ""
        await asyncio.sleep(0.5)
    return f"engines or gateway still busy {timeout:.0f} s after a slice"


async def run_arms(
    arms: Sequence[Arm],
    spec: LoadSpec,
    engine_urls: list[str],
    *,
    rounds: int,
    flip: int = 0,
    observer: SliceObserver | None = None,
    engine_key: str | None = None,
    tools: SandboxTools | None = None,
) -> dict[str, ArmOutcome]:
    """Every arm runs `rounds` slices of `spec`, interleaved; returns each arm's outcome.
    `engine_key` is the API key of the engines at `engine_urls`; `tools` runs the tool steps in
    the cluster's sandboxes."""
    by_name = {arm.name: arm for arm in arms}
    outcomes = {arm.name: ArmOutcome() for arm in arms}
    gateways = list({arm.gateway_url: arm for arm in arms if arm.gateway_url}.values())
    async with httpx.AsyncClient(timeout=30.0, trust_env=False, headers=bearer_headers(engine_key)) as client:
        for name, round_index in slice_order(list(by_name), rounds, flip):
            arm = by_name[name]
            sliced = slice_spec(spec, rounds, round_index)
            if observer is not None:
                observer.slice_started(name, round_index, sliced)
            before = await gateway_counters(client, arm) if arm.gateway_url else {}
            result = await run_load(arm.target, sliced, engine_urls, observer, engine_key, tools)
            warnings = [await wait_until_quiet(client, engine_urls, gateway) for gateway in gateways or [None]]
            warning = "; ".join(w for w in warnings if w)
            if arm.gateway_url:
                outcomes[name].add_counters(before, await gateway_counters(client, arm))
            outcomes[name].slices.append(result)
            if warning:
                outcomes[name].warnings.append(warning)
            if observer is not None:
                observer.slice_finished(name, result, warning)
    return outcomes
