"""`thunderctl bench`: replay agent workloads through the cluster and straight to its engines.

Commands only: parse, find the endpoint, call the replayer, render the report.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from thunderctl.bench.apis import Api
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
from thunderctl.bench.importers import import_runs
from thunderctl.bench.replay import run_arms
from thunderctl.bench.report import (
    LiveProgress,
    build_report,
    report_table,
    verdict,
    write_outputs,
)
from thunderctl.bench.rollout_cli import rollout
from thunderctl.bench.sandboxes import SandboxTools, sandbox_line
from thunderctl.bench.simulate import simulate
from thunderctl.bench.swe_lite import (
    SHARED_PREFIX_TOKENS,
    TOOL_SECONDS,
)
from thunderctl.bench.workloads import WorkloadChoice
from thunderctl.integrations.cluster import ClusterClient
from thunderctl.sim.agents import Client
from thunderctl.terminal import fail
from thunderctl.traceformat import TraceFormatError, write_trace

bench_app = typer.Typer(
    help="Benchmarks: replay agent workloads through thunderctl and straight to the engines.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


@bench_app.command("swe-lite")
def swe_lite(
    cluster: ClusterOption = None,
    endpoint: Annotated[str | None, typer.Option(help="Any OpenAI-compatible endpoint instead of a cluster.")] = None,
    engine: EngineOption = None,
    target: Annotated[TargetArm, typer.Option(help="Where the load goes, unless --compare.")] = TargetArm.CLUSTER,
    compare: Annotated[bool, typer.Option(help="Run both arms, interleaved in slices, and print the ratios.")] = False,
    concurrency: Annotated[
        int,
        typer.Option(
            min=1,
            help="Programs running at once (closed loop): when one ends the next starts. Past the trace's "
            "programs (93 recorded runs) they start over in a new order, each replay with its own program id "
            "and its own text, so any concurrency works and replays share only the system prompt.",
        ),
    ] = 16,
    programs: Annotated[
        int | None, typer.Option(min=1, help="Programs per arm (ends the run); past the trace's programs they repeat.")
    ] = None,
    duration: Annotated[
        float | None,
        typer.Option(
            min=1,
            help="Seconds per arm (ends the run; default 120): programs start until then, repeating the trace "
            "when it is used up, and steps still running are cut off.",
        ),
    ] = None,
    warmup: Annotated[float, typer.Option(min=0, help="Seconds at the start of each slice not counted.")] = 15.0,
    slices: Annotated[
        int | None, typer.Option(min=1, help="Slices per arm (default: 2 with --compare, else 1).")
    ] = None,
    scale: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="Multiply every token count, keeping step counts and times, to fit a small engine (the recorded "
            "runs end at 20k prompt tokens p50, 35k p90, 65k max; a program stops before 90% of max_model_len).",
        ),
    ] = 1.0,
    time_scale: Annotated[
        float,
        typer.Option(min=0, help="Multiply every slept time: the tool times (the trace's or drawn) and preparation."),
    ] = 1.0,
    synthetic: Annotated[
        bool,
        typer.Option(
            help="Replay the seeded generator shaped like the runs (docs/bench.md) instead of the recorded ones: "
            "programs without end, all distinct, for long or scaled workloads."
        ),
    ] = False,
    tool_median: Annotated[
        float | None,
        typer.Option(min=0.001, help=f"--synthetic tool seconds: lognormal median (default {TOOL_SECONDS.median:g})."),
    ] = None,
    tool_sigma: Annotated[
        float | None,
        typer.Option(min=0.001, help=f"--synthetic tool seconds: lognormal sigma (default {TOOL_SECONDS.sigma:g})."),
    ] = None,
    tool_cap: Annotated[
        float | None, typer.Option(min=0.001, help=f"--synthetic tool seconds: cap (default {TOOL_SECONDS.cap:g}).")
    ] = None,
    shared_prefix: Annotated[
        int, typer.Option(min=1, help="Prompt tokens all programs share (before --scale).")
    ] = SHARED_PREFIX_TOKENS,
    trace: Annotated[
        Path | None,
        typer.Option(
            help="Replay this trace (JSONL, or .jsonl.gz; docs/trace-format.md) instead of the recorded runs."
        ),
    ] = None,
    routing: RoutingOption = Routing.STICKY,
    stream: Annotated[bool, typer.Option(help="Stream responses (needed for time to first token).")] = True,
    api: Annotated[
        Api,
        typer.Option(
            help="The API the agents speak, in both arms: chat (completions), responses (OpenAI Responses, as "
            "Codex sends it) or messages (Anthropic Messages, as Claude Code sends it): the same runs, history and "
            "answer lengths in its request shape (Messages cannot force the length: an answer may end early)."
        ),
    ] = Api.CHAT,
    seed: Annotated[
        int, typer.Option(help="The trace's order, or the programs drawn (the same seed replays the same ones).")
    ] = 0,
    out: Annotated[Path | None, typer.Option(help="Write the JSON report here (and the plot beside it).")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write the PNG plot here (default: --out with .png).")] = None,
    api_key: ApiKeyOption = None,
    engine_api_key: EngineApiKeyOption = None,
    sandboxes: Annotated[
        bool,
        typer.Option(
            help="Run each tool step in the program's sandbox on the cluster (/v1/sandboxes): a command that "
            "sleeps the tool time and appends the observation's bytes to a file, instead of sleeping here."
        ),
    ] = False,
    collect: Annotated[
        bool,
        typer.Option(
            help="With --sandboxes: tie each sandbox to its program, so the program's release removes it. "
            "--no-collect gives sandboxes an owner the gateway never releases: they stay until idle expiry or `down`.",
        ),
    ] = True,
    sandbox_image: Annotated[
        str | None, typer.Option(help="With --sandboxes: the sandboxes' image (default: the cluster profile's).")
    ] = None,
    client: Annotated[
        Client,
        typer.Option(
            help="How the agents talk to a thunderctl gateway: named (a program id in every request and a release "
            "at the end), unreleased (ids, never released: programs end by themselves), unchanged (no id, no "
            "release: as harnesses ship; the gateway derives the programs). The direct arm names nothing anyway."
        ),
    ] = Client.NAMED,
) -> None:
    """Replay mini-swe-agent's recorded SWE-bench Lite runs (closed loop) and report steps/min, hit rate, latency."""
    console = Console() if sys.stdout.isatty() else Console(width=140)
    choice = WorkloadChoice(trace, synthetic, tool_median, tool_sigma, tool_cap)
    if problem := choice.problem():
        raise fail(problem)
    arms = [TargetArm.CLUSTER, TargetArm.DIRECT] if compare else [target]
    rounds = slices or (2 if compare else 1)
    if programs is None and duration is None:
        duration = 120.0
    if duration is not None and warmup >= duration / rounds:
        raise fail(f"--warmup {warmup:g} s leaves nothing of a {duration / rounds:g} s slice")
    given = given_endpoints(endpoint, engine, api_key, engine_api_key)
    endpoints, info = find_endpoints(cluster, given, TargetArm.DIRECT in arms)
    max_context = int(info.max_model_len * CONTEXT_HEADROOM) if info.max_model_len else None
    try:
        workload = choice.load(scale, shared_prefix, max_context)
    except (OSError, TraceFormatError) as exc:
        raise fail(str(exc)) from exc
    spec = LoadSpec(
        concurrency=concurrency, shape=workload, programs=programs, duration_s=duration, seed=seed, model=info.model,
        warmup_s=warmup, stream=stream, api=api, age_initial_programs=True, time_scale=time_scale, client=client,
    )  # fmt: skip
    console.print(
        f"{' vs '.join(arms)}: {endpoints.endpoint} ({'thunderctl' if info.thunderctl else 'plain endpoint'}), "
        f"engines {', '.join(endpoints.engines) or 'unknown (no hit rate)'}, model {info.model}, API {api}"
    )
    if sandboxes and not info.thunderctl:
        raise fail(f"--sandboxes needs a thunderctl cluster's /v1/sandboxes; {endpoints.endpoint} is a plain endpoint")
    if not collect and not sandboxes:
        raise fail("--no-collect is about sandboxes: give --sandboxes too")
    started = time.monotonic()
    tools = (
        SandboxTools(
            ClusterClient(endpoints.endpoint, endpoints.api_key),
            time_scale,
            collect,
            sandbox_image,
            threads=concurrency + 4,
        )
        if sandboxes
        else None
    )
    try:
        with LiveProgress(rounds * len(arms), console) as live:
            arm_list = build_arms(endpoints, info, arms, routing)
            outcomes = asyncio.run(
                run_arms(
                    arm_list,
                    spec,
                    endpoints.engines,
                    rounds=rounds,
                    observer=live,
                    engine_key=endpoints.engine_key,
                    tools=tools,
                )
            )
    finally:
        if tools is not None:
            tools.close()
    parameters = {
        "concurrency": concurrency, "programs": programs, "duration_s": duration, "warmup_s": warmup,
        "slices": rounds, "seed": seed, "stream": stream, "api": api, "arms": arms, "routing": routing,
        "time_scale": time_scale, "endpoint": endpoints.endpoint, "engines": endpoints.engines,
        "model": info.model, "max_model_len": info.max_model_len, "thunderctl": info.thunderctl,
        "sandboxes": sandboxes, "collect_at_release": collect, "sandbox_image": sandbox_image, "client": client,
    }  # fmt: skip
    report = build_report(workload.describe(), parameters, outcomes, time.monotonic() - started)
    console.print(report_table(report))
    for name, arm in report["arms"].items():
        if arm["sandboxes"] is not None:
            console.print(sandbox_line(name, arm["sandboxes"]))
        for error, count in arm["step_errors"].items():
            console.print(f"[yellow]{name}: {count} step(s) failed:[/] {escape(error)}")
    write_outputs(report, out, plot, console)
    if line := verdict(report):
        console.print(line)
    check_served(outcomes)


@bench_app.command("import")
def import_command(
    sources: Annotated[list[Path], typer.Argument(help="mini-swe-agent .traj.json files and/or step tables (JSONL).")],
    out: Annotated[Path, typer.Option(help="The trace to write (JSONL).")],
    lite_only: Annotated[bool, typer.Option(help="From step tables, only runs marked lite.")] = False,
    decode_tokens_per_s: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="The recorded model's decode rate: each gap between calls loses its answer's generation at this "
            "rate (default: nothing subtracted, so tool_s also holds the model's time).",
        ),
    ] = None,
) -> None:
    """Convert agent logs into a trace that `swe-lite --trace` replays (docs/trace-format.md)."""
    console = Console()
    try:
        runs = import_runs(sources, lite_only=lite_only)
        count = write_trace((run.program(decode_tokens_per_s) for run in runs), out)
    except (OSError, ValueError) as exc:
        raise fail(str(exc)) from exc
    console.print(f"{count} programs written to {out}")


bench_app.command("simulate")(simulate)
bench_app.command("rollout")(rollout)
