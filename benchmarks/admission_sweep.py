"""Admission sweep (issue 7): vLLM alone, the reference policy, the adaptive policy and the
no-recompute limit, at each concurrency, in one run.

    python benchmarks/admission_sweep.py                         # 8..64 on 131,072 tokens
    python benchmarks/admission_sweep.py --kv-blocks 64          # a small cache (8,192 tokens)
    python benchmarks/admission_sweep.py --quick                 # 8,32, one 40 s slice per arm

The report ends with the overhead figures of benchmarks/overhead.py: what the gateway adds
per request against an instant worker, and the tick's cost at 10,000 programs x 64 workers.

Engine A has the cache under test; the `direct`, `reference` (`serve --policy reference`: the paper's policy) and
`adaptive` arms share it, interleaved in slices so machine drift falls on all three. Engine B
has a cache four times larger than anything the load can fill (`--limit-kv-blocks`): the
`limit` arm, straight to it, is the same load with no recompute. Each slice has its own salt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from local_stack import ENGINE_START_TIMEOUT_S, EngineSettings, start_engine
from overhead import gateway_latency, tick_cost
from rich.console import Console
from rich.table import Table

from thunderctl.bench.closed_loop import LoadSpec, Target, run_load
from thunderctl.bench.replay import Arm, run_arms
from thunderctl.bench.report import LiveProgress, fmt
from thunderctl.bench.results import LoadResult
from thunderctl.bench.shapes import AgentShape, Uniform
from thunderctl.gateway.auth import env_api_key
from thunderctl.gateway.process import ServeProcess

ARMS = ("direct", "reference", "adaptive", "limit")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="8,16,32,48,64")
    parser.add_argument("--kv-blocks", type=int, default=1024, help="Engine A's KV blocks (x --block-size tokens).")
    parser.add_argument("--limit-kv-blocks", type=int, default=4096, help="Engine B's: large enough never to evict.")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--slices", type=int, default=2, help="Slices per arm and concurrency.")
    parser.add_argument("--slice-s", type=float, default=60.0)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--tick-interval", type=float, default=1.0)
    parser.add_argument("--adapt-window", type=float, default=10.0, help="The adaptive arm's seconds per move.")
    parser.add_argument("--out", type=Path, default=Path("results/admission_sweep.json"))
    parser.add_argument("--log-dir", type=Path, default=Path("results/logs-sweep"))
    parser.add_argument(
        "--overhead-requests", type=int, default=2000, help="Requests timed for the gateway's overhead (0: skip)."
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.slices, args.slice_s, args.warmup_s = "8,32", 1, 40.0, 10.0
    return args


def workload(max_context_tokens: int) -> AgentShape:
    """Contexts growing to several thousand tokens, 0.5-3 s tools: the testbed of the issue."""
    return AgentShape(
        system_prompt_tokens=1000, task_tokens=Uniform(300, 800), observation_tokens=Uniform(150, 500),
        completion_tokens=Uniform(30, 100), steps=Uniform(8, 16), tool_seconds=Uniform(0.5, 3.0),
        max_context_tokens=max_context_tokens,
    )  # fmt: skip


async def sweep_point(
    args: argparse.Namespace, concurrency: int, index: int, urls: dict[str, str], console: Console
) -> dict[str, LoadResult]:
    max_context = int(min(16384, (args.kv_blocks - 1) * args.block_size) * 0.85)
    spec = LoadSpec(
        concurrency=concurrency, shape=workload(max_context), duration_s=args.slice_s * args.slices,
        seed=concurrency, warmup_s=args.warmup_s, age_initial_programs=True,
    )  # fmt: skip
    arms = [
        Arm("direct", Target.direct([urls["engine"]])),
        # The gateways started with the key of this environment, if any.
        Arm("reference", Target.gateway(urls["reference"], api_key=env_api_key()), urls["reference"]),
        Arm("adaptive", Target.gateway(urls["adaptive"], api_key=env_api_key()), urls["adaptive"]),
    ]
    with LiveProgress(len(arms) * args.slices, console) as live:
        outcomes = await run_arms(arms, spec, [urls["engine"]], rounds=args.slices, flip=index, observer=live)
    results = {name: outcome.combined() for name, outcome in outcomes.items()}
    results["limit"] = await run_load(Target.direct([urls["limit"]]), spec, [urls["limit"]])
    return results


def table(points: dict[int, dict[str, LoadResult]], capacity: int) -> Table:
    view = Table(title=f"admission sweep, {capacity:,}-token KV cache (ratios against vLLM alone)")
    for column in ("conc", "arm", "steps/min", "× direct", "× limit", "hit rate", "p90"):
        view.add_column(column, justify="left" if column == "arm" else "right")
    for concurrency, results in points.items():
        direct, limit = results["direct"].steps_per_min, results["limit"].steps_per_min
        for arm in ARMS:
            r = results[arm]
            view.add_row(
                str(concurrency), arm, f"{r.steps_per_min:.1f}",
                fmt(r.steps_per_min / direct if direct else None), fmt(r.steps_per_min / limit if limit else None),
                fmt(r.prefix_cache_hit_rate), fmt(r.p90_s, " s"),
            )  # fmt: skip
        view.add_section()
    return view


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=140)
    started = time.monotonic()
    # vLLM refuses to start unless one request of max_model_len fits (one block is kept back).
    max_model_len = min(16384, (args.kv_blocks - 1) * args.block_size)
    engines = [
        start_engine(EngineSettings(blocks, args.block_size, max_model_len), args.log_dir, console)
        for blocks in (args.kv_blocks, args.limit_kv_blocks)
    ]
    gateways = {
        name: ServeProcess(
            [engines[0].url],
            ["--scheduler", f"tick_interval_s={args.tick_interval}", *extra],
            args.log_dir / f"{name}.log",
        )
        for name, extra in (
            ("reference", ["--policy", "reference"]),
            ("adaptive", ["--scheduler", f"adaptive.window_s={args.adapt_window}", "--verbose"]),
        )
    }
    points: dict[int, dict[str, LoadResult]] = {}
    try:
        for gateway in gateways.values():
            gateway.wait_healthy(timeout=ENGINE_START_TIMEOUT_S)
        urls = {"engine": engines[0].url, "limit": engines[1].url} | {n: g.url for n, g in gateways.items()}
        for index, concurrency in enumerate(int(c) for c in args.concurrency.split(",")):
            console.print(f"[bold]concurrency {concurrency}[/]")
            points[concurrency] = asyncio.run(sweep_point(args, concurrency, index, urls, console))
    finally:
        for gateway in gateways.values():
            gateway.stop()
        for engine in engines:
            engine.stop()
    capacity = args.kv_blocks * args.block_size
    console.print(table(points, capacity))
    overhead = {}
    if args.overhead_requests:
        with console.status("measuring the gateway's overhead and the tick's cost"):
            overhead = {"gateway": gateway_latency(args.overhead_requests), "tick": tick_cost()}
        gateway, tick = overhead["gateway"], overhead["tick"]
        console.print(
            f"gateway adds {gateway['added_p50_ms']:.2f} ms p50 / {gateway['added_p99_ms']:.2f} ms p99 per request; "
            f"tick at {tick['programs']:,} programs x {tick['workers']} workers: {tick['tick_p50_ms']:.1f} ms p50"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "admission_sweep", "kv_capacity_tokens": capacity, "wall_s": time.monotonic() - started,
        "points": {c: {arm: r.summary() for arm, r in results.items()} for c, results in points.items()},
        "overhead": overhead,
    }  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
