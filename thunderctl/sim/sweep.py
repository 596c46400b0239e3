"""A sweep: every arm at every concurrency, on the same programs, as one JSON-ready report."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from typing import Any

from thunderctl.sim.arms import ArmName, SimSpec, run_arm
from thunderctl.sim.rollout import critical_figures, critical_path

# Compared with the `sticky` arm (the engines alone, as agents use them) at each concurrency.
RATIO_FIGURES = ("steps_per_min", "hit_rate", "p50_s", "p90_s", "p99_s", "programs_per_min", "program_p90_s")
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


def summarise_arm(
    arm: ArmName, spec: SimSpec, progress: Callable[[float], None] | None = None
) -> tuple[dict[str, Any], float]:
    """One arm's summary and the CPU seconds it took (in whichever process ran it)."""
    cpu_started = time.process_time()
    summary = run_arm(arm, spec, progress).summary(spec.warmup_s)
    return summary, time.process_time() - cpu_started


def run_sweep(
    spec: SimSpec,
    concurrencies: Sequence[int],
    arms: Sequence[ArmName],
    workload: dict[str, Any],
    progress: Progress | None = None,
    finished: Finished | None = None,
    jobs: int = 1,
) -> dict[str, Any]:
    """Every arm at every concurrency; with `jobs` > 1 the runs go to that many processes.

    Each run is independent and seeded, so the report is the same whatever `jobs` is. Run in
    other processes, a run reports `progress` once, when it has finished.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    started = time.monotonic()
    runs = [(concurrency, arm) for concurrency in concurrencies for arm in arms]
    results: dict[tuple[int, ArmName], tuple[dict[str, Any], float]] = {}

    def record(concurrency: int, arm: ArmName, result: tuple[dict[str, Any], float]) -> None:
        results[(concurrency, arm)] = result
        if finished is not None:
            finished(concurrency, arm, result[0])

    if jobs == 1 or len(runs) == 1:
        for concurrency, arm in runs:
            tick = None if progress is None else (lambda now, c=concurrency, a=arm: progress(c, a, now))
            record(concurrency, arm, summarise_arm(arm, replace(spec, concurrency=concurrency), tick))
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(runs))) as pool:
            pending = {
                pool.submit(summarise_arm, arm, replace(spec, concurrency=concurrency)): (concurrency, arm)
                for concurrency, arm in runs
            }
            for future in as_completed(pending):
                concurrency, arm = pending[future]
                if progress is not None:
                    progress(concurrency, arm, spec.duration_s)
                record(concurrency, arm, future.result())
    # The same programs on the same engines in every arm: one bound for all.
    path = critical_path(spec.workload, spec.seed, spec.rollout, spec.preset) if spec.rollout else None
    points = []
    for concurrency in concurrencies:
        summaries = {arm.value: results[(concurrency, arm)][0] for arm in arms}
        if path is not None:
            for summary in summaries.values():
                summary.update(critical_figures(summary["makespan_s"], path.seconds))
        point = {"concurrency": concurrency, "arms": summaries, "ratios": ratios(summaries)}
        points.append(point | ({"critical_path": asdict(path)} if path is not None else {}))
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
            "client": spec.client.value,
            "tool_calls": spec.tool_calls,
            "host_kv_gib": spec.host_kv_gib,
            "host_kv_blocks": spec.host_blocks,
            "kv_capacity_tokens": spec.preset.engine.kv_capacity_tokens,
            "concurrency": list(concurrencies),
            "arms": [arm.value for arm in arms],
            "rollout": str(spec.rollout) if spec.rollout else None,
        },
        "points": points,
        "wall_s": time.monotonic() - started,
        "cpu_s": sum(cpu_s for _, cpu_s in results.values()),
    }
