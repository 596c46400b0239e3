"""`thunderctl bench swe-lite --compare` at several concurrencies on a local vLLM-CPU engine.

Starts one engine with a 32,768-token KV cache (`--kv-blocks` for another; or uses `--engine-url`) and `thunderctl serve`
in front of it, runs the comparison at each concurrency (a JSON report and a PNG plot each),
then prints one table of both arms. See benchmarks/README.md.

    python benchmarks/swe_lite_compare.py                      # 8,16,32 at scale 0.25, ~12 min
    python benchmarks/swe_lite_compare.py --concurrency 16 --duration 60
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from local_stack import EngineSettings, local_stack
from rich.console import Console
from rich.table import Table

from thunderctl.bench.cli import bench_app
from thunderctl.bench.report import fmt


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
    parser.add_argument("--out-dir", type=Path, default=Path("results/swe_lite"))
    parser.add_argument("bench_args", nargs="*", help="More `swe-lite` options, after --.")
    return parser.parse_args(argv)


def run_one(concurrency: int, args: argparse.Namespace, engine_url: str, gateway_url: str) -> dict[str, Any]:
    out = args.out_dir / f"c{concurrency}.json"
    bench_app(
        [
            "swe-lite", "--endpoint", gateway_url, "--engine", engine_url, "--compare",
            "--concurrency", str(concurrency), "--duration", str(args.duration), "--warmup", str(args.warmup),
            "--scale", str(args.scale), "--out", str(out), *args.bench_args,
        ],
        standalone_mode=False,
    )  # fmt: skip
    return json.loads(out.read_text())


def summary_table(reports: dict[int, dict[str, Any]]) -> Table:
    table = Table(title="swe-lite: thunderctl (cluster) vs straight to vLLM (direct), one vLLM-CPU engine")
    for column in ("conc", "arm", "steps/min", "hit rate", "p50", "p90", "preempt", "pauses/resumes", "cluster/direct"):
        table.add_column(column, justify="left" if column == "arm" else "right")
    for concurrency, report in reports.items():
        for name, arm in report["arms"].items():
            pauses = "" if arm["pauses"] is None else f"{arm['pauses']:.0f}/{arm['resumes']:.0f}"
            ratio = fmt(report["ratios"]["steps_per_min"], "x") if name == "cluster" else ""
            table.add_row(
                str(concurrency), name, fmt(arm["steps_per_min"], digits=1), fmt(arm["hit_rate"]),
                fmt(arm["p50_s"], " s"), fmt(arm["p90_s"], " s"), str(arm["preemptions"]), pauses, ratio,
            )  # fmt: skip
        table.add_section()
    return table


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=140)
    log_dir = args.out_dir / "logs"
    with local_stack(EngineSettings(kv_blocks=args.kv_blocks), args.engine_url, args.gateway_arg, log_dir, console) as (
        engine_url,
        gateway_url,
    ):
        reports = {c: run_one(c, args, engine_url, gateway_url) for c in map(int, args.concurrency.split(","))}
    console.print(summary_table(reports))


if __name__ == "__main__":
    main()
