"""What a benchmark run reports: per-arm figures, ratios, figures over time, a table and a plot.

The JSON report is the source of the table and the plot, so a saved report can be drawn again.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from thunderctl.bench.closed_loop import LoadSpec
from thunderctl.bench.replay import ArmOutcome
from thunderctl.bench.results import CacheDelta, CounterSample, LoadResult, StepRecord, per_minute
from thunderctl.bench.sandboxes import sandbox_summary

# Compared between arms as cluster ÷ direct (above 1 is better for steps/min, hit rate and programs/min only).
RATIO_FIGURES = (
    "steps_per_min", "hit_rate", "p50_s", "p90_s", "p99_s", "ttft_p50_s", "program_p50_s", "program_p90_s",
    "programs_per_min",
)  # fmt: skip


@dataclass(frozen=True)
class TimelinePoint:
    t_s: float  # end of the interval, in the arm's own time (its slices back to back)
    steps_per_min: float
    hit_rate: float | None


def timeline(samples: Sequence[CounterSample], records: Sequence[StepRecord]) -> list[TimelinePoint]:
    """Steps/min and hit rate over each sampling interval of one slice (steps counted where
    they end).

    A slice's last interval, from its last periodic sample to its end, is partial: typically a
    fraction of a second after the deadline, in which in-flight steps were cancelled and no step
    can end. On its own it would draw a drop to 0 steps/min (or a spike, if one step ended
    there), so it is counted with the interval before it.
    """
    intervals = list(samples)
    if len(intervals) >= 2:
        *intervals, before, last = intervals
        intervals.append(CounterSample(last.t_s, before.engines + last.engines))
    points = []
    start = 0.0
    for sample in intervals:
        ended = sum(1 for r in records if r.ok and start < r.end_s <= sample.t_s)
        points.append(TimelinePoint(sample.t_s, per_minute(ended, sample.t_s - start), sample.engines.hit_rate))
        start = sample.t_s
    return points


def arm_timeline(slices: Sequence[LoadResult]) -> list[TimelinePoint]:
    """Each slice's timeline, the slices back to back in the arm's own time."""
    offsets = itertools.accumulate((result.wall_s for result in slices[:-1]), initial=0.0)
    return [
        replace(point, t_s=point.t_s + offset)
        for result, offset in zip(slices, offsets)
        for point in timeline(result.samples, result.records)
    ]


def arm_summary(outcome: ArmOutcome) -> dict[str, Any]:
    """The arm's pooled figures (`LoadResult.summary`, the hit rate as `hit_rate`), the gateway's
    counters, and per-slice figures, timeline and sandboxes."""
    combined = outcome.combined()
    counters = outcome.gateway_counters
    figures = combined.summary()
    figures["hit_rate"] = figures.pop("prefix_cache_hit_rate")
    return {
        **figures,
        "pauses": counters.get("thunderctl_pauses_total") if counters else None,
        "resumes": counters.get("thunderctl_resumes_total") if counters else None,
        "forced_resumes": counters.get("thunderctl_forced_resumes_total") if counters else None,
        "programs_released": counters.get("thunderctl_programs_released_total") if counters else None,
        "warnings": outcome.warnings,
        "slices": [result.summary() for result in outcome.slices],
        "timeline": [vars(point) for point in arm_timeline(outcome.slices)],
        "sandboxes": sandbox_summary(combined.tool_records, combined.sandbox_samples, combined.sandbox_create_failures),
    }


def ratios(arms: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    if "cluster" not in arms or "direct" not in arms:
        return {}
    cluster, direct = arms["cluster"], arms["direct"]
    return {
        figure: cluster[figure] / direct[figure] if cluster[figure] is not None and direct[figure] else None
        for figure in RATIO_FIGURES
    }


def build_report(
    workload: dict[str, Any], parameters: dict[str, Any], outcomes: dict[str, ArmOutcome], wall_s: float
) -> dict[str, Any]:
    arms = {name: arm_summary(outcome) for name, outcome in outcomes.items()}
    return {
        "benchmark": workload.get("name"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": wall_s,
        "workload": workload,
        "parameters": parameters,
        "arms": arms,
        "ratios": ratios(arms),
    }


# --- rendering -----------------------------------------------------------------------


def fmt(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def report_table(report: dict[str, Any]) -> Table:
    parameters = report["parameters"]
    # The API the agents spoke (`--api`); a report saved before bench had the option names none.
    api = f" over the {parameters['api']} API" if parameters.get("api") else ""
    table = Table(title=f"{report['benchmark']} at concurrency {parameters['concurrency']}{api}")
    columns = (
        "arm",
        "steps/min",
        "hit rate",
        "p50",
        "p90",
        "p99",
        "TTFT p50",
        "prog p90",
        "progs/min",
        "preempt",
        "pauses/resumes",
        "failed",
    )
    table.add_column(columns[0], no_wrap=True)  # the ratio row's name, cluster/direct, is never cut
    for column in columns[1:]:
        table.add_column(column, justify="right")
    for name, arm in report["arms"].items():
        pauses = "" if arm["pauses"] is None else f"{arm['pauses']:.0f}/{arm['resumes']:.0f}"
        table.add_row(
            name, fmt(arm["steps_per_min"], digits=1), fmt(arm["hit_rate"]), fmt(arm["p50_s"], " s"),
            fmt(arm["p90_s"], " s"), fmt(arm["p99_s"], " s"), fmt(arm["ttft_p50_s"], " s"),
            fmt(arm["program_p90_s"], " s", 1), fmt(arm["programs_per_min"], digits=1),
            str(arm["preemptions"]), pauses, str(arm["steps_failed"]),
        )  # fmt: skip
    if report["ratios"]:
        r = report["ratios"]
        table.add_section()
        table.add_row(
            "cluster/direct", fmt(r["steps_per_min"], "x"), fmt(r["hit_rate"], "x"), fmt(r["p50_s"], "x"),
            fmt(r["p90_s"], "x"), fmt(r["p99_s"], "x"), fmt(r["ttft_p50_s"], "x"), fmt(r["program_p90_s"], "x"),
            fmt(r["programs_per_min"], "x"), "", "", "",
        )  # fmt: skip
    return table


def verdict(report: dict[str, Any]) -> str | None:
    """The comparison in one line a person reads without the table (None without both arms)."""
    arms, r = report["arms"], report["ratios"]
    if not r:
        return None

    def shown(value: float | None) -> str:
        return "unknown" if value is None else f"{value:.2f}"

    steps = (
        "steps/min not comparable (a figure is missing or 0)"
        if r["steps_per_min"] is None
        else f"{r['steps_per_min']:.2f}× the steps/min of vLLM alone"
    )
    hit = f"hit rate {shown(arms['cluster']['hit_rate'])} vs {shown(arms['direct']['hit_rate'])}"
    p90 = "p90 not comparable" if r["p90_s"] is None else f"p90 {r['p90_s']:.2f}×"
    return f"thunderctl: {steps}, {hit}, {p90}"


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Steps/min and hit rate over each arm's time, one line per arm, as a PNG; with sandboxes,
    the pool's containers alive and disk used below them."""
    import matplotlib  # imported here: only a finished run draws, and it is slow to import

    matplotlib.use("Agg")  # no display: write files only
    from matplotlib import pyplot

    sandboxed = {name: arm["sandboxes"] for name, arm in report["arms"].items() if arm.get("sandboxes")}
    rows = 3 if sandboxed else 2
    figure, axes = pyplot.subplots(rows, 1, sharex=True, figsize=(8, 3 * rows))
    steps_axis, hit_axis = axes[0], axes[1]
    for name, arm in report["arms"].items():
        points = arm["timeline"]
        times = [p["t_s"] for p in points]
        hit_rates = [p["hit_rate"] if p["hit_rate"] is not None else float("nan") for p in points]
        steps_axis.plot(times, [p["steps_per_min"] for p in points], marker=".", label=name)
        hit_axis.plot(times, hit_rates, marker=".", label=name)
    if sandboxed:
        plot_sandboxes(sandboxed, axes[2])
    # Where a slice ends and the next (with its warm-up) begins.
    first_arm = next(iter(report["arms"].values()), {"slices": []})
    for boundary in itertools.accumulate(s["wall_s"] for s in first_arm["slices"][:-1]):
        for axis in axes:
            axis.axvline(boundary, color="grey", linestyle=":", linewidth=1)
    steps_axis.set_ylabel("steps/min")
    hit_axis.set_ylabel("prefix-cache hit rate")
    hit_axis.set_ylim(0, 1)
    axes[-1].set_xlabel("time in arm (s; slices back to back)")
    steps_axis.legend()
    steps_axis.set_title(f"{report['benchmark']}, concurrency {report['parameters']['concurrency']}")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def plot_sandboxes(sandboxed: dict[str, dict[str, Any]], axis: Any) -> None:
    """Containers alive (solid, left) and disk used over all hosts (dashed, right), per arm."""
    disk_axis = axis.twinx()
    for name, summary in sandboxed.items():
        points = summary["timeline"]
        times = [p["t_s"] for p in points]
        axis.plot(times, [p["containers"] for p in points], label=f"{name} containers")
        disk_axis.plot(
            times, [sum(p["disk_bytes"].values()) / 1e6 for p in points], linestyle="--", label=f"{name} disk"
        )
    axis.set_ylabel("sandbox containers alive")
    disk_axis.set_ylabel("sandbox disk (MB)")
    axis.set_ylim(bottom=0)
    disk_axis.set_ylim(bottom=0)
    axis.legend(loc="upper left")
    disk_axis.legend(loc="upper right")


def write_outputs(
    report: dict[str, Any],
    out: Path | None,
    plot: Path | None,
    console: Console,
    draw: Callable[[dict[str, Any], Path], None] = plot_report,
) -> None:
    """The JSON report to `out`, and its plot (by `draw`) to `plot` or beside `out`."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"report: {out}")
    plot = plot or (out.with_suffix(".png") if out is not None else None)
    if plot is not None:
        draw(report, plot)
        console.print(f"plot: {plot}")


class LiveProgress:
    """A live rich display while slices run: the slice's time, steps, failures and hit rate
    so far, and a line per finished slice. Use as a context manager around the run. `unit`
    names a slice on screen (`bench rollout` runs batches)."""

    def __init__(self, total_slices: int, console: Console, unit: str = "slice", units: str = "slices") -> None:
        self.unit = unit
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"),
            console=console,
        )
        self.overall = self.bar.add_task(f"all {units}", total=total_slices, stats="")
        self.current = self.bar.add_task("starting", total=None, stats="")
        self.timed = False
        self.steps_ok = self.steps_failed = 0
        self.cache = CacheDelta()

    def __enter__(self) -> Self:
        self.bar.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.bar.stop()

    def slice_started(self, arm: str, round_index: int, spec: LoadSpec) -> None:
        self.timed = spec.duration_s is not None
        self.steps_ok = self.steps_failed = 0
        self.cache = CacheDelta()
        self.bar.reset(
            self.current, total=spec.duration_s, description=f"{arm} {self.unit} {round_index + 1}", stats=""
        )

    def step(self, record: StepRecord) -> None:
        if record.ok:
            self.steps_ok += 1
        else:
            self.steps_failed += 1
        self.refresh(record.end_s)

    def sample(self, sample: CounterSample) -> None:
        self.cache = self.cache + sample.engines
        self.refresh(sample.t_s)

    def refresh(self, now_s: float) -> None:
        stats = (
            f"{self.steps_ok} steps ({per_minute(self.steps_ok, now_s):.0f}/min), "
            f"{self.steps_failed} failed, hit rate {fmt(self.cache.hit_rate)}"
        )
        self.bar.update(self.current, completed=now_s if self.timed else None, stats=stats)

    def slice_finished(self, arm: str, result: LoadResult, warning: str) -> None:
        self.bar.advance(self.overall)
        self.bar.console.print(
            f"{time.strftime('%H:%M:%S')} {arm} slice done: {result.steps_per_min:.1f} steps/min, hit rate {fmt(result.prefix_cache_hit_rate)}, "
            f"p90 {fmt(result.p90_s, ' s')}, {result.programs_completed} programs done, {result.steps_failed} failed"
            + (f" [yellow]{warning}[/]" if warning else "")
        )
