"""Scale and soak: 2,048 closed-loop programs through the daemon onto 8 simulated workers, 10 minutes.

    python benchmarks/sim_soak.py                          # the full soak (~13 minutes with up and down)
    python benchmarks/sim_soak.py --minutes 60 --series results/soak.jsonl --plot results/soak.png
    python benchmarks/sim_soak.py --programs 512 --duration 120 --workers 4
    python benchmarks/sim_soak.py --out results/soak.json

`thunderctl up` of a cluster of `thunderctl engine sim` workers (profiles/sim.yaml's preset,
h100-tp4-32b, one node per worker), closed-loop agents (thunderctl/bench/closed_loop.py) through
its gateway for --duration seconds, then `down`. Printed: failed requests, programs left in the
gateway after every program was released, the daemon's RSS at the start, peak and end, the p99
of the scheduler tick and of the admission wait (the gateway's own histograms), steps/min, hit
rate, pauses and resumes; the RSS every 10 minutes. Every 10 s the daemon's RSS and the p99 of
its tick and of its event loop's lateness over those 10 s are sampled (--series: JSON lines as
they come; --plot: a PNG of the three over time). It exits 1 if a request failed, a program was
left, a process outlived `down`, or (in a run of 20 minutes or more) the RSS grew more than 10 %
after the first 10 minutes. --engine-time-scale slows the simulated engines (and with them the whole
closed loop) so that the machine's CPU, not the model, is the margin.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from soak import SOAK_SHAPE, ErrorGroup, SoakResult, SoakSpec, run_soak
from soak_series import plot, rss_checkpoints

from thunderctl.bench.shapes import Uniform


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = SoakSpec()
    parser.add_argument("--programs", type=int, default=defaults.programs, help="programs at once (closed loop)")
    parser.add_argument("--workers", type=int, default=defaults.workers)
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--duration", type=float, default=defaults.duration_s, help="seconds of load")
    length.add_argument("--minutes", type=float, help="minutes of load (instead of --duration)")
    parser.add_argument("--preset", default=defaults.preset)
    parser.add_argument("--kv-blocks", type=int, default=None, help="per worker (default: the preset's)")
    parser.add_argument("--engine-time-scale", type=float, default=defaults.engine_time_scale)
    parser.add_argument("--tool-time-scale", type=float, default=defaults.tool_time_scale)
    parser.add_argument(
        "--tool-s",
        type=float,
        nargs=2,
        default=(SOAK_SHAPE.tool_seconds.low, SOAK_SHAPE.tool_seconds.high),
        metavar=("LOW", "HIGH"),
        help="tool seconds per step, uniform",
    )
    parser.add_argument("--tick-interval", type=float, default=defaults.tick_interval_s)
    parser.add_argument("--stream", action="store_true", help="stream the answers (more work for the gateway)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--retry-unanswered",
        type=float,
        default=defaults.retry_unanswered_s,
        metavar="S",
        help="send a request that got no byte of its answer again for up to S seconds (0: fail it at once)",
    )
    parser.add_argument(
        "--client-keepalive",
        type=float,
        default=defaults.client_keepalive_s,
        metavar="S",
        help="seconds the agents' client keeps an idle connection to the gateway",
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument(
        "--series", type=Path, help="write the samples (RSS, tick p99, loop lag p99 every 10 s) here as JSON lines"
    )
    parser.add_argument("--plot", type=Path, help="draw RSS, tick p99 and loop lag p99 over time to this PNG")
    parser.add_argument(
        "--keep", type=Path, help="keep the profile and the daemon's log (daemon.log) in this directory"
    )
    return parser.parse_args()


def summary(result: SoakResult) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"

    def groups(title: str, found: list[ErrorGroup]) -> list[str]:
        return [
            f"  {title}: {g.count} x {g.error} (from {g.first_s:.0f} s to {g.last_s:.0f} s into the run)" for g in found
        ]

    drift = "run too short to tell" if result.rss_drift is None else f"{result.rss_drift:+.1%}"
    hit = "-" if result.hit_rate is None else f"{result.hit_rate:.2f}"
    overflows = "-" if result.listen_overflows is None else f"{result.listen_overflows:,}"
    return "\n".join(
        [
            f"programs {result.spec['programs']} on {result.spec['workers']} workers for {result.spec['duration_s']:g} s "
            f"(wall {result.wall_s:.0f} s)",
            f"requests: {result.steps_ok:,} ok, {result.steps_failed} failed, {result.steps_cancelled} cut off at the end; "
            f"{result.steps_per_min:,.0f} steps/min; hit rate {hit}; preemptions {result.preemptions}",
            f"sent again (no byte of an answer came; requests and releases): {result.resent:,}",
            *groups("failed", result.failures),
            *groups("sent again", result.resends),
            f"programs: {result.programs_started:,} started, {result.programs_completed:,} completed, "
            f"{result.programs_left} left in the gateway after release ({result.release_failures} releases failed)",
            *(f"  release failed: {n} x {error}" for error, n in result.release_errors.items()),
            *(f"  left: {n} x {why}" for why, n in result.left_why.items()),
            f"scheduler: {result.pauses:,.0f} pauses, {result.resumes:,.0f} resumes; tick p99 {seconds(result.tick_p99_s)} "
            f"over {result.ticks} ticks",
            f"admission wait: p50 {seconds(result.admission_wait_p50_s)}, p99 {seconds(result.admission_wait_p99_s)} "
            f"over {result.admissions:,} requests",
            f"event loops late: daemon p99 {seconds(result.daemon_loop_lag_p99_s)}, p99.9 "
            f"{seconds(result.daemon_loop_lag_p999_s)}; load generators p99 {seconds(result.load_loop_lag_p99_s)}, "
            f"max {seconds(result.load_loop_lag_max_s)}; listen-queue overflows on this host {overflows}",
            f"daemon RSS: {result.daemon_rss_start_mib:.0f} MiB at start, {result.daemon_rss_peak_mib:.0f} MiB peak, "
            f"{result.daemon_rss_end_mib:.0f} MiB at end; {result.daemon_cpu_s:.0f} CPU s",
            "daemon RSS over time: "
            + ", ".join(f"{rss:.0f} MiB at {minute:.0f} min" for minute, rss in rss_checkpoints(result.series, 600)),
            f"daemon RSS after the first 10 minutes: {drift}",
        ]
    )


def main() -> int:
    args = parse_args()
    spec = SoakSpec(
        programs=args.programs,
        workers=args.workers,
        duration_s=args.duration if args.minutes is None else args.minutes * 60,
        preset=args.preset,
        kv_blocks=args.kv_blocks,
        engine_time_scale=args.engine_time_scale,
        tool_time_scale=args.tool_time_scale,
        tick_interval_s=args.tick_interval,
        stream=args.stream,
        seed=args.seed,
        shape=replace(SOAK_SHAPE, tool_seconds=Uniform(*args.tool_s)),
        retry_unanswered_s=args.retry_unanswered,
        client_keepalive_s=args.client_keepalive,
    )
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        result = run_soak(spec, args.keep, args.series)
    else:
        with tempfile.TemporaryDirectory(prefix="thunderctl-soak-") as workdir:
            result = run_soak(spec, Path(workdir), args.series)
    print(summary(result))
    if args.plot:
        title = f"{spec.programs:,} programs on {spec.workers} simulated workers, {spec.duration_s / 60:g} minutes"
        plot(result.series, args.plot, title)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(asdict(result), indent=2))
    problems = result.problems()
    for problem in problems:
        print(f"FAIL: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
