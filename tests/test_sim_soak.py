"""The soak, bounded: hundreds of closed-loop programs through the real daemon onto simulated workers
(benchmarks/sim_soak.py runs 2,048 onto 8 for 10 minutes), asserting the same wants. The benchmark is
run as its users run it, a script, and its figures read from the JSON it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SIM_SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "sim_soak.py"


def test_hundreds_of_programs_fail_nothing_and_leave_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = ["--programs", "512", "--workers", "4", "--duration", "90", "--engine-time-scale", "2"]
    run = subprocess.run([sys.executable, str(SIM_SOAK), *args, "--keep", str(tmp_path), "--out", str(out)],
                         capture_output=True, text=True, timeout=1200)  # fmt: skip
    print(f"\nSOAK\n{run.stdout}")
    assert run.returncode == 0, run.stdout + run.stderr  # 1: a failed request, a program left, a process left
    result = json.loads(out.read_text())
    assert result["steps_failed"] == 0 and result["programs_left"] == 0 and result["left_running"] == []
    assert result["programs_started"] >= 512 and result["steps_ok"] > 512
    assert result["admissions"] >= result["steps_ok"]  # every request of a program went through admission
    assert result["ticks"] >= result["spec"]["duration_s"] / result["spec"]["tick_interval_s"] / 2
    assert result["tick_p99_s"] is not None and result["admission_wait_p99_s"] is not None
    assert result["daemon_loop_lag_p99_s"] is not None and result["load_loop_lag_p99_s"] is not None
    assert result["failures"] == [] and result["release_errors"] == {} and result["left_why"] == {}
    # No fault is injected: "0 failed" must not lean on the agents' clients sending requests again.
    assert result["resent"] == 0 and result["resends"] == [], result["resends"]
    assert result["daemon_rss_end_mib"] > 0
