"""The scheduler tick at the soak's scale, in virtual time: no daemon, no HTTP, no real clock.

    python benchmarks/tick_profile.py                              # 2,048 programs on 8 workers, 10 simulated minutes
    python benchmarks/tick_profile.py --profile results/tick.prof   # and where a tick's time goes (cProfile)
    python benchmarks/tick_profile.py --programs 512 --workers 4 --minutes 5

The simulator's `thunderctl` arm (thunderctl/sim/arms.py) on the soak's agents
(benchmarks/soak.py's SOAK_SHAPE) drives the real policy as the gateway does, one `beat` (adapt
and tick) every tick interval of virtual time. Each beat's wall time is measured (perf_counter),
as the gateway's `thunderctl_scheduler_tick_seconds` measures it, and its CPU time (process_time:
what a loaded machine's other processes do not inflate); printed are the p50, p99 and max over
the beats after the first simulated minute (the programs have arrived by then), the
programs the policy held, and the arm's summary (the same seed gives the same decisions, so two
versions of the policy can be compared on it).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from soak import SOAK_SHAPE

from thunderctl.percentiles import percentile
from thunderctl.scheduler import Scheduler
from thunderctl.sim import routing
from thunderctl.sim.arms import ArmName, SimSpec, run_arm
from thunderctl.sim.presets import get_preset

SETTLE_S = 60.0  # simulated seconds before beats are counted: the first programs' arrival


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=2048, help="programs at once (closed loop)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--preset", default="h100-tp4-32b")
    parser.add_argument("--minutes", type=float, default=10.0, help="simulated minutes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, help="write cProfile's stats of the beats here (pstats format)")
    parser.add_argument("--out", type=Path, help="write the figures and the arm's summary as JSON here")
    return parser.parse_args()


class TimedBeats:
    """Wraps the simulator's `beat`: each call's wall time and the programs then held, profiled if asked."""

    def __init__(self, beat: Callable[[Scheduler, float], None], profiler: cProfile.Profile | None) -> None:
        self.beat = beat
        self.profiler = profiler
        self.beats: list[tuple[float, float, float, int]] = []  # (virtual time, wall s, CPU s, programs)

    def __call__(self, scheduler: Scheduler, utilization: float) -> None:
        if self.profiler is not None:
            self.profiler.enable()
        start, start_cpu = time.perf_counter(), time.process_time()
        self.beat(scheduler, utilization)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if self.profiler is not None:
            self.profiler.disable()
        self.beats.append((scheduler.clock(), elapsed, cpu, len(scheduler.programs)))


def main() -> None:
    args = parse_args()
    spec = SimSpec(
        preset=get_preset(args.preset), workload=SOAK_SHAPE, concurrency=args.programs,
        duration_s=args.minutes * 60, workers=args.workers, seed=args.seed,
    )  # fmt: skip
    profiler = cProfile.Profile() if args.profile else None
    timed = TimedBeats(routing.beat, profiler)
    routing.beat = timed  # the router's tick calls the module's `beat`: every beat goes through the timer
    wall = time.perf_counter()
    result = run_arm(ArmName.THUNDERCTL, spec)
    wall = time.perf_counter() - wall
    counted = [seconds for at, seconds, _, _ in timed.beats if at >= SETTLE_S]
    cpu = [seconds for at, _, seconds, _ in timed.beats if at >= SETTLE_S]
    held = [programs for at, _, _, programs in timed.beats if at >= SETTLE_S]
    figures: dict[str, Any] = {
        "beats": len(counted),
        "tick_p50_ms": round(1000 * (percentile(counted, 50) or 0), 2),
        "tick_p99_ms": round(1000 * (percentile(counted, 99) or 0), 2),
        "tick_max_ms": round(1000 * max(counted, default=0), 2),
        "ticks_s": round(sum(counted), 2),
        "tick_cpu_p99_ms": round(1000 * (percentile(cpu, 99) or 0), 2),
        "ticks_cpu_s": round(sum(cpu), 2),
        "run_wall_s": round(wall, 1),
        "programs_held": [min(held, default=0), max(held, default=0)],
        "summary": result.summary(0.0),
        "scheduler_counters": result.scheduler_counters,
    }
    print(
        f"{args.programs} programs on {args.workers} workers, {args.minutes:g} simulated minutes "
        f"(wall {wall:.0f} s): {figures['beats']} beats after the first minute, tick p50 {figures['tick_p50_ms']} ms, "
        f"p99 {figures['tick_p99_ms']} ms, max {figures['tick_max_ms']} ms ({figures['ticks_s']} s in ticks); "
        f"CPU: p99 {figures['tick_cpu_p99_ms']} ms, {figures['ticks_cpu_s']} s in ticks; "
        f"programs held {figures['programs_held'][0]}-{figures['programs_held'][1]}"
    )
    print(f"scheduler counters: {result.scheduler_counters}")
    if profiler is not None:
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(args.profile))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
