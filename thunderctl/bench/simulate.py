"""`thunderctl bench simulate`: the benchmark's workloads on simulated vLLM workers, every arm, in seconds.

Commands only: parse, build the workload and the spec, run the sweep (thunderctl.sim), render.
"""

from __future__ import annotations

import os
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from thunderctl.bench.long_tail import SYSTEM_PROMPT_TOKENS as LONG_TAIL_PREFIX
from thunderctl.bench.long_tail import LongTail
from thunderctl.bench.mixed import Mixed
from thunderctl.bench.recorded import recorded_swe_lite
from thunderctl.bench.replay import TraceWorkload
from thunderctl.bench.report import fmt, write_outputs
from thunderctl.bench.shapes import AgentShape
from thunderctl.bench.swe_lite import SHARED_PREFIX_TOKENS, SweLite
from thunderctl.bench.workloads import WorkloadChoice
from thunderctl.sim.agents import Client
from thunderctl.sim.arms import ArmName, SimSpec
from thunderctl.sim.presets import UnknownPreset, get_preset, preset_names
from thunderctl.sim.rollout import BATCH_MAX_S, Rollout
from thunderctl.sim.sweep import BASELINE, run_sweep
from thunderctl.terminal import fail
from thunderctl.traceformat import TraceFormatError


class WorkloadName(StrEnum):
    SWE_LITE = "swe-lite"  # the recorded runs, as `bench swe-lite` replays them
    SYNTHETIC = "swe-lite-synthetic"  # `bench swe-lite --synthetic`: the seeded generator, programs without end
    SHAPE = "shape"  # AgentShape's uniform ranges, the closed-loop benchmark's default
    LONG_TAIL = "long-tail"  # OpenHands-like: 30-90 steps, contexts to ~100k, heavy-tailed tool times
    MIXED = "mixed"  # the recorded runs with a quarter long-tail programs: sizes differ as real traffic's do


def parse_list(text: str, what: str, parse: type) -> list[Any]:
    try:
        values = [parse(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"{what}: {exc}; give a comma-separated list, e.g. 16,32,64") from exc
    if not values:
        raise typer.BadParameter(f"{what}: the list is empty; give e.g. 16,32,64")
    return values


def parse_arms(text: str) -> list[ArmName]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in ArmName.__members__.values()]
    if unknown or not names:
        choices = ", ".join(arm.value for arm in ArmName)
        raise typer.BadParameter(f"unknown arm(s) {', '.join(unknown) or '(none given)'}: choose from {choices}")
    return [ArmName(name) for name in names]


def build_workload(
    workload: WorkloadName, trace: Path | None, scale: float, shared_prefix: int | None, max_context: int
) -> SweLite | TraceWorkload | AgentShape | LongTail | Mixed:
    if trace is not None and workload is not WorkloadName.SWE_LITE:
        raise ValueError(f"--workload {workload} and --trace both name the programs: give one")
    if workload is WorkloadName.SHAPE:
        return AgentShape(max_context_tokens=max_context)
    if workload is WorkloadName.LONG_TAIL:
        return LongTail(scale, shared_prefix or LONG_TAIL_PREFIX, max_context)
    if workload is WorkloadName.MIXED:
        recorded = tuple(recorded_swe_lite())
        return Mixed(scale, shared_prefix or SHARED_PREFIX_TOKENS, max_context, recorded=recorded)
    choice = WorkloadChoice(trace, synthetic=workload is WorkloadName.SYNTHETIC)
    return choice.load(scale, shared_prefix or SHARED_PREFIX_TOKENS, max_context)


def describe(workload: SweLite | TraceWorkload | AgentShape | LongTail | Mixed) -> dict[str, Any]:
    if isinstance(workload, AgentShape):
        return {"name": "shape", "system_prompt_tokens": workload.system_prompt_tokens}
    return workload.describe()


def point_table(report: dict[str, Any], point: dict[str, Any]) -> Table:
    table = Table(title=f"{report['preset']} × {report['parameters']['workers']}, concurrency {point['concurrency']}")
    columns = ("arm", "steps/min", "hit rate", "p50", "p90", "p99", "programs/min", "program p90", "preempt",
               "pauses/resumes", "KV spread >20%")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "arm" else "right")
    for name, arm in point["arms"].items():
        pauses = f"{arm['pauses']}/{arm['resumes']}" if "pauses" in arm else ""
        spread = arm["kv_imbalance"]
        table.add_row(
            name, fmt(arm["steps_per_min"], digits=1), fmt(arm["hit_rate"]), fmt(arm["p50_s"], " s"),
            fmt(arm["p90_s"], " s"), fmt(arm["p99_s"], " s"), fmt(arm["programs_per_min"], digits=2),
            fmt(arm["program_p90_s"], " s", 0), str(arm["preemptions"]), pauses,
            fmt(100 * spread["share_above"], " %", 0) if spread else "-",
        )  # fmt: skip
    if point["ratios"]:
        table.add_section()
        for name, r in point["ratios"].items():
            table.add_row(
                f"{name} ÷ {BASELINE.value}", fmt(r["steps_per_min"], "x"), fmt(r["hit_rate"], "x"),
                fmt(r["p50_s"], "x"), fmt(r["p90_s"], "x"), fmt(r["p99_s"], "x"), fmt(r["programs_per_min"], "x"),
                fmt(r["program_p90_s"], "x"), "", "", "",
            )  # fmt: skip
    return table


def rollout_table(report: dict[str, Any], point: dict[str, Any]) -> Table:
    """A batch's figures per arm: when it ended, how far above its critical path, when its median
    and last group did, and its pace."""
    rollout = report["parameters"]["rollout"]
    path = point["critical_path"]
    table = Table(
        title=f"{report['preset']} × {report['parameters']['workers']}, rollout {rollout} (tasks × samples)",
        caption=f"critical path: program {path['program_index']} alone, {path['steps']} steps, "
        f"{fmt(path['seconds'], ' s', 0)}",
    )
    columns = ("arm", "makespan", "÷ best other", "÷ sticky", "÷ critical", "median group", "last group",
               "last ÷ median", "progs/min", "hit rate", "preempt", "pauses/resumes")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "arm" else "right")
    arms = point["arms"]
    for name, arm in arms.items():
        others = [a["makespan_s"] for n, a in arms.items() if n not in (name, ArmName.LIMIT.value, ArmName.BOUND.value)]
        best_other = min((m for m in others if m is not None), default=None)
        sticky = arms.get(BASELINE.value, {}).get("makespan_s")
        makespan = arm["makespan_s"]
        table.add_row(
            name, fmt(makespan, " s", 0), fmt(makespan / best_other if makespan and best_other else None, "x"),
            fmt(makespan / sticky if makespan and sticky else None, "x"), fmt(arm["makespan_to_critical_path"], "x"),
            fmt(arm["group_median_s"], " s", 0),
            fmt(arm["group_last_s"], " s", 0), fmt(arm["group_last_to_median"], "x"),
            fmt(arm["programs_per_min"], digits=2), fmt(arm["hit_rate"]), str(arm["preemptions"]),
            f"{arm['pauses']}/{arm['resumes']}" if "pauses" in arm else "",
        )  # fmt: skip
    return table


def plot_sweep(report: dict[str, Any], path: Path) -> None:
    """Steps/min and hit rate against concurrency per arm; KV occupancy over time per worker."""
    import matplotlib  # imported here: slow, and only a finished run draws

    matplotlib.use("Agg")  # no display: write files only
    from matplotlib import pyplot

    points = report["points"]
    arms = list(points[0]["arms"])
    figure, (steps_axis, hit_axis, kv_axis) = pyplot.subplots(3, 1, figsize=(8, 10))
    concurrencies = [p["concurrency"] for p in points]
    for arm in arms:
        steps = [p["arms"][arm]["steps_per_min"] for p in points]
        hits = [p["arms"][arm]["hit_rate"] if p["arms"][arm]["hit_rate"] is not None else float("nan") for p in points]
        steps_axis.plot(concurrencies, steps, marker="o", label=arm)
        hit_axis.plot(concurrencies, hits, marker="o", label=arm)
    for axis in (steps_axis, hit_axis):
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axis.set_xlabel("programs (concurrency)")
    steps_axis.set_ylabel("steps/min")
    hit_axis.set_ylabel("prefix-cache hit rate")
    hit_axis.set_ylim(0, 1)
    steps_axis.legend()
    steps_axis.set_title(
        f"{report['preset']} × {report['parameters']['workers']} workers, {report['workload']['name']}"
    )
    last = points[-1]
    for arm in [a for a in (BASELINE.value, ArmName.THUNDERCTL.value) if a in last["arms"]] or arms[:1]:
        samples = last["arms"][arm]["occupancy"]
        times = [t for t, _ in samples]
        for worker in range(len(samples[0][1]) if samples else 0):
            kv_axis.plot(times, [usage[worker] for _, usage in samples], label=f"{arm} w{worker}")
    kv_axis.set_xlabel("simulated time (s)")
    kv_axis.set_ylabel(f"KV blocks in use, concurrency {last['concurrency']}")
    kv_axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def simulate(
    preset: Annotated[str, typer.Option(help=f"The simulated worker: {', '.join(preset_names())}.")] = "h100-tp4-32b",
    workers: Annotated[int, typer.Option(min=1, help="Workers (DP replicas) of the preset.")] = 2,
    concurrency: Annotated[
        str, typer.Option(help="Programs running at once, comma-separated: one point each.")
    ] = "16,32,64,128",
    workload: Annotated[
        WorkloadName,
        typer.Option(
            help="The programs, unless --trace: the recorded SWE-bench Lite runs, their seeded generator, "
            "long-tail (OpenHands-like: 30-90 steps, contexts to ~100k tokens, lognormal tool times), mixed (the "
            "recorded runs with a quarter long-tail programs among them: sizes differ by 10×, as real traffic's), or shape."
        ),
    ] = WorkloadName.SWE_LITE,
    trace: Annotated[Path | None, typer.Option(help="Replay this trace (JSONL, docs/trace-format.md) instead.")] = None,
    scale: Annotated[float, typer.Option(min=0.001, help="Multiply every token count of swe-lite or the trace.")] = 1.0,
    shared_prefix: Annotated[
        int | None,
        typer.Option(
            min=1,
            help=f"Prompt tokens all programs share (before --scale); default: the workload's own "
            f"({SHARED_PREFIX_TOKENS} for swe-lite and mixed, {LONG_TAIL_PREFIX:,} for long-tail).",
        ),
    ] = None,
    duration: Annotated[
        float | None,
        typer.Option(
            min=1,
            help="Simulated seconds per arm and point (default 1800); with --rollout, the most a batch may "
            "take (default 6 h: a batch not over by then has no makespan).",
        ),
    ] = None,
    rollout: Annotated[
        str | None,
        typer.Option(
            help="TASKSxSAMPLES, e.g. 32x8: instead of --concurrency, one RL batch of TASKS tasks × SAMPLES samples "
            "(GRPO groups), every program started at 0, each sample with its own answers; reports the "
            "makespan (key makespan_s) and its ratio to the critical path (the longest program alone), the median "
            "and last group's finish and their ratio, programs/min and hit rate per arm.",
        ),
    ] = None,
    warmup: Annotated[
        float | None, typer.Option(min=0, help="Simulated seconds not measured (default: a sixth).")
    ] = None,
    host_kv_gib: Annotated[
        float, typer.Option(min=0, help="Host KV tier per worker (vLLM CPU offloading), GiB.")
    ] = 0.0,
    arms: Annotated[str, typer.Option(help="Arms, comma-separated.")] = ",".join(arm.value for arm in ArmName),
    seed: Annotated[int, typer.Option(help="Which programs (the same seed gives the same report).")] = 0,
    client: Annotated[
        Client,
        typer.Option(
            help="The agents' client: named (ids and a release at the end), unreleased (ids, never released: "
            "programs end by the learnt law), unchanged (no id: programs as the gateway derives them, never released)."
        ),
    ] = Client.NAMED,
    tool_calls: Annotated[
        bool,
        typer.Option(
            "--tool-calls",
            help="Answers call their tools as an OpenAI tool-calling loop's do, so the gateway sees what each calls, "
            "and a program's last answer calls nothing (default: answers that tell nothing of what follows, "
            "as text agents' may).",
        ),
    ] = False,
    out: Annotated[Path | None, typer.Option(help="Write the JSON report here (and the plot beside it).")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write the PNG plot here (default: --out with .png).")] = None,
    jobs: Annotated[
        int | None,
        typer.Option(min=1, help="Runs (arm × concurrency) at once, each in its own process (default: the CPU count)."),
    ] = None,
) -> None:
    """Simulate every arm on the same programs at each concurrency: steps/min, hit rate, latency, KV balance."""
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        chosen = get_preset(preset)
        batch = Rollout.parse(rollout) if rollout is not None else None
        if batch is not None and warmup:
            raise ValueError("--warmup: a rollout batch is measured whole, from its start; leave --warmup out")
        concurrencies = [batch.programs] if batch else parse_list(concurrency, "--concurrency", int)
        duration = duration or (BATCH_MAX_S if batch else 1800.0)
        arm_names = parse_arms(arms)
        programs = build_workload(workload, trace, scale, shared_prefix, chosen.engine.max_model_len)
        spec = SimSpec(
            chosen, programs, concurrencies[0], duration, workers=workers,
            warmup_s=0.0 if batch else duration / 6 if warmup is None else warmup,
            seed=seed, host_kv_gib=host_kv_gib, client=client, tool_calls=tool_calls, rollout=batch,
        )  # fmt: skip
    except (UnknownPreset, OSError, TraceFormatError, ValueError) as exc:
        raise fail(str(exc)) from exc
    if any(c < 1 for c in concurrencies):
        raise typer.BadParameter("--concurrency: every value must be at least 1")
    console.print(
        f"{chosen.name}: {chosen.summary}; {workers} workers of {chosen.engine.kv_capacity_tokens:,} KV tokens"
    )
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console)
    total = duration * len(concurrencies) * len(arm_names)
    task = bar.add_task("simulating", total=total)
    runs: dict[tuple[int, str], float] = {}

    def progress(point: int, arm: ArmName, now: float) -> None:
        runs[(point, arm.value)] = now
        bar.update(task, completed=sum(runs.values()), description=f"concurrency {point}, {arm.value}")

    def finished(point: int, arm: ArmName, summary: dict[str, Any]) -> None:
        bar.console.print(
            f"{time.strftime('%H:%M:%S')} concurrency {point}, {arm.value}: {summary['steps_per_min']:.1f} steps/min, "
            f"hit rate {fmt(summary['hit_rate'])}, p90 {fmt(summary['p90_s'], ' s')}, {summary['preemptions']} preemptions"
            + (f", makespan {fmt(summary['makespan_s'], ' s', 0)}" if batch else "")
        )

    with bar:
        report = run_sweep(
            spec, concurrencies, arm_names, describe(programs), progress, finished, jobs=jobs or os.cpu_count() or 1
        )
    for point in report["points"]:
        console.print(rollout_table(report, point) if batch else point_table(report, point))
    console.print(f"simulated in {report['wall_s']:.1f} s wall, {report['cpu_s']:.1f} s CPU")
    write_outputs(report, out, plot, console, draw=plot_sweep)
