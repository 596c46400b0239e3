"""The soak, bounded: hundreds of closed-loop programs through the real daemon onto simulated workers
(benchmarks/sim_soak.py runs 2,048 onto 8 for 10 minutes), asserting the same wants."""

from __future__ import annotations

from pathlib import Path

import pytest

from thunderctl.bench.soak import SoakSpec, run_soak

pytestmark = pytest.mark.slow


def test_hundreds_of_programs_fail_nothing_and_leave_nothing(tmp_path: Path) -> None:
    spec = SoakSpec(programs=512, workers=4, duration_s=90.0, engine_time_scale=2.0)
    result = run_soak(spec, tmp_path)
    print(
        f"\nSOAK {spec.programs} programs: {result.steps_ok} ok, {result.steps_failed} failed, {result.programs_left} "
        f"left; {len(result.resends)} kinds of resends {[(g.error, g.count) for g in result.resends]}; tick p99 "
        f"{result.tick_p99_s}, admission wait p99 {result.admission_wait_p99_s}, daemon loop lag p99 "
        f"{result.daemon_loop_lag_p99_s}; RSS {result.daemon_rss_start_mib:.0f} -> {result.daemon_rss_end_mib:.0f} MiB"
    )
    assert result.problems() == []
    assert result.steps_failed == 0 and result.programs_left == 0 and result.left_running == []
    assert result.programs_started >= spec.programs and result.steps_ok > spec.programs
    assert result.admissions >= result.steps_ok  # every request of a program went through admission
    assert result.ticks >= spec.duration_s / spec.tick_interval_s / 2
    assert result.tick_p99_s is not None and result.admission_wait_p99_s is not None
    assert result.daemon_loop_lag_p99_s is not None and result.load_loop_lag_p99_s is not None
    assert result.failures == [] and result.release_errors == {} and result.left_why == {}
    assert result.daemon_rss_end_mib > 0
