"""A sweep: every arm at every concurrency, on the same programs, as one JSON-ready report."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from thunderctl.sim.arms import ArmName, SimSpec, run_arm

# Compared with the `sticky` arm (the engines alone, as agents use them) at each concurrency.
RATIO_FIGURES = ("steps_per_min", "hit_rate", "p50_s", "p90_s", "p99_s")
BASELINE = ArmName.STICKY

# (concurrency, arm, virtual seconds so far)
Progress = Callable[[int, ArmName, float], None]
# (concurrency, arm, its summary), when an arm has run
Finished = Callable[[int, ArmName, dict[str, Any]], None]


def ratios(arms: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each arm's figures divided by the baseline's (absent without a baseline arm)."""
    base = arms.get(BASELINE.value)
    if base is None:
        return {}
    return {
        name: {
            figure: arm[figure] / base[figure] if arm[figure] is not None and base[figure] else None
            for figure in RATIO_FIGURES
        }
        for name, arm in arms.items()
        if name != BASELINE.value
    }


def run_sweep(
    spec: SimSpec,
    concurrencies: Sequence[int],
    arms: Sequence[ArmName],
    workload: dict[str, Any],
    progress: Progress | None = None,
    finished: Finished | None = None,
) -> dict[str, Any]:
    started, cpu_started = time.monotonic(), time.process_time()
    points = []
    for concurrency in concurrencies:
        point_spec = replace(spec, concurrency=concurrency)
        summaries = {}
        for arm in arms:
            tick = None if progress is None else (lambda now, c=concurrency, a=arm: progress(c, a, now))
            summaries[arm.value] = run_arm(arm, point_spec, tick).summary(spec.warmup_s)
            if finished is not None:
                finished(concurrency, arm, summaries[arm.value])
        points.append({"concurrency": concurrency, "arms": summaries, "ratios": ratios(summaries)})
    return {
        "benchmark": "simulate",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "preset": spec.preset.name,
        "preset_summary": spec.preset.summary,
        "workload": workload,
        "parameters": {
            "workers": spec.workers,
            "duration_s": spec.duration_s,
            "warmup_s": spec.warmup_s,
            "seed": spec.seed,
            "host_kv_gib": spec.host_kv_gib,
            "host_kv_blocks": spec.host_blocks,
            "kv_capacity_tokens": spec.preset.engine.kv_capacity_tokens,
            "concurrency": list(concurrencies),
            "arms": [arm.value for arm in arms],
        },
        "points": points,
        "wall_s": time.monotonic() - started,
        "cpu_s": time.process_time() - cpu_started,
    }
