"""The chaos run, small: agents through the OpenAI SDK onto two simulated workers for a minute, one
worker killed and then the daemon (benchmarks/chaos.py runs 1,024 agents on 8 workers for 20 minutes,
with a fault every few minutes). The benchmark is run as its users run it, a script, and its figures
read from the JSON it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHAOS = Path(__file__).resolve().parent.parent / "benchmarks" / "chaos.py"
PROGRAMS = 32
FAULT_FIELDS = {"kind", "at_min", "target", "back_s", "serving_s", "failed", "retried", "attempts_retried",
                "retry_causes", "live", "judged", "lost_client", "lost_gateway", "errors"}  # fmt: skip


def test_a_killed_worker_and_a_killed_daemon_fail_no_request_the_sdk_client_sees(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    args = ["--minutes", "1", "--workers", "2", "--programs", str(PROGRAMS), "--processes", "1",
            "--worker-kill-every", "20", "--daemon-kill-every", "40", "--settle", "15", "--tool-s", "2", "6"]  # fmt: skip
    run = subprocess.run([sys.executable, str(CHAOS), *args, "--keep", str(tmp_path), "--out", str(out)],
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    print(f"\nCHAOS\n{run.stdout}")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())

    faults = report["faults"]
    assert [(f["kind"], round(f["at_min"] * 60)) for f in faults] == [("worker", 20), ("daemon", 40)]
    for fault in faults:
        assert set(fault) == FAULT_FIELDS
        assert fault["back_s"] is not None and fault["serving_s"] is not None, fault
        assert 0 < fault["judged"] <= fault["live"] <= PROGRAMS, fault
    totals = report["totals"]
    assert totals["failed"] == 0, [f["errors"] for f in faults]
    assert totals["answered"] > 2 * PROGRAMS and totals["daemon_restarts"] == 1
    # A worker's death moves its programs: none of them starts anew under another id.
    assert faults[0]["lost_client"] == 0 and faults[0]["lost_gateway"] == 0, faults[0]
    assert report["rss"]["reference_mib"] is not None and len(report["rss_series"]) >= 4
    assert report["left_running"] == []
