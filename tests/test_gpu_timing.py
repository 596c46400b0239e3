"""benchmarks/gpu_timing.py on CPU with tiny shapes, run by the engine virtualenv's interpreter (it
has torch): it writes the efficiencies the GPU presets use, and --check compares them."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from thunderctl.engines.local import EngineHome
from thunderctl.sim.cost import RooflineCost
from thunderctl.sim.presets import get_preset

ROOT = Path(__file__).resolve().parent.parent
GPU_TIMING = ROOT / "benchmarks" / "gpu_timing.py"

pytestmark = pytest.mark.engine


def run_gpu_timing(engine_home: EngineHome, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [str(engine_home.python), str(GPU_TIMING), *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_gpu_timing_on_cpu_writes_each_gpu_presets_efficiencies(engine_home: EngineHome, tmp_path: Path) -> None:
    out = tmp_path / "timing.json"
    run_gpu_timing(engine_home, "--tiny", "--device", "cpu", "--repeats", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert set(result["presets"]) == {"h100-tp4-32b", "h100x8-tp8-glm46"}
    for measured in result["presets"].values():
        assert 0 < measured["compute_efficiency"] < 1
        assert 0 < measured["memory_efficiency"] < 1
        assert {p["kind"] for p in measured["points"]} == {"prefill", "decode"}


def test_gpu_timing_check_gives_measured_over_assumed(engine_home: EngineHome, tmp_path: Path) -> None:
    out = tmp_path / "timing.json"
    run_gpu_timing(
        engine_home, "--tiny", "--device", "cpu", "--repeats", "1", "--presets", "h100-tp4-32b", "--out", str(out)
    )
    saved = json.loads(out.read_text())["presets"]["h100-tp4-32b"]
    lines = run_gpu_timing(engine_home, "--from", str(out), "--check").splitlines()
    line = next(line for line in lines if "memory_efficiency: measured" in line)
    ratio = float(re.search(r"ratio (\S+)", line).group(1))  # type: ignore[union-attr]
    cost = get_preset("h100-tp4-32b").cost
    assert isinstance(cost, RooflineCost)
    assert ratio == pytest.approx(saved["memory_efficiency"] / cost.memory_efficiency, rel=1e-2)
