"""Cross-node KV imbalance (the paper's Fig. 2a) from a `thunderctl bench simulate` report.

    thunderctl bench simulate --workers 2 --concurrency 144 --arms sticky,thunderctl --out results/sim-144.json
    python benchmarks/sim_imbalance.py results/sim-144.json            # writes results/sim-144-imbalance.png

For each arm of the report's last point (or --concurrency N): the difference of the two
workers' KV occupancy over time, its peak and the share of the measured time it exceeds 20 %.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from thunderctl.bench.report import fmt


def differences(samples: list[list]) -> tuple[list[float], list[float]]:
    """Times and |KV occupancy of worker 0 - worker 1| of an arm's occupancy samples."""
    times = [t for t, _ in samples]
    return times, [abs(usage[0] - usage[1]) for _, usage in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path)
    parser.add_argument("--concurrency", type=int, help="The point to draw (default: the last).")
    parser.add_argument("--threshold", type=float, default=0.2)
    parser.add_argument("--plot", type=Path, help="Default: the report's name with -imbalance.png.")
    args = parser.parse_args()
    report = json.loads(args.report.read_text())
    if report["parameters"]["workers"] != 2:
        raise SystemExit(
            f"{args.report}: the figure compares two workers; this report has {report['parameters']['workers']}"
        )
    points = {p["concurrency"]: p for p in report["points"]}
    point = points[args.concurrency] if args.concurrency else report["points"][-1]

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    table = Table(title=f"{report['preset']} × 2, concurrency {point['concurrency']}: KV occupancy difference")
    for column in ("arm", "mean", "peak", f"time > {args.threshold:.0%}", "steps/min"):
        table.add_column(column, justify="left" if column == "arm" else "right")
    figure, axis = pyplot.subplots(figsize=(8, 4))
    for name, arm in point["arms"].items():
        times, diffs = differences(arm["occupancy"])
        if not diffs:
            continue
        above = sum(d > args.threshold for d in diffs) / len(diffs)
        table.add_row(
            name, fmt(100 * sum(diffs) / len(diffs), " %", 1), fmt(100 * max(diffs), " %", 1),
            fmt(100 * above, " %", 0), fmt(arm["steps_per_min"], digits=1),
        )  # fmt: skip
        axis.plot([t / 60 for t in times], [100 * d for d in diffs], label=name)
    axis.axhline(100 * args.threshold, color="grey", linestyle=":", linewidth=1)
    axis.set_xlabel("simulated time (min)")
    axis.set_ylabel("|KV occupancy w0 - w1| (%)")
    axis.legend()
    figure.tight_layout()
    plot = args.plot or args.report.with_name(f"{args.report.stem}-imbalance.png")
    figure.savefig(plot, dpi=100)
    Console().print(table)
    print(f"plot: {plot}")


if __name__ == "__main__":
    main()
