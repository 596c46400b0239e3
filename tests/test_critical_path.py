"""A batch's critical path (its longest program with no wait) beside its makespan, in the simulator and measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from thunderctl.bench.results import CacheDelta, LoadResult, ProgramRun, StepRecord
from thunderctl.bench.rollout import batch_figures, measured_critical_path
from thunderctl.cli import app
from thunderctl.sim.cost import EngineShape, LinearStepCost, Preset, summed
from thunderctl.sim.rollout import SampleProgram, SampleStep, alone_seconds

# A step costs 10 ms and 1 ms per token it schedules; prefill chunks of 100 tokens, blocks of 16.
TOY = Preset(
    name="toy",
    summary="hand-made",
    cost=LinearStepCost(
        base_s=0.01, per_token_s=0.001, per_attention_pair_s=0.0, per_seq_s=0.0, per_context_token_s=0.0
    ),
    engine=EngineShape(
        num_gpu_blocks=1000, block_size=16, max_num_batched_tokens=100, max_num_seqs=8, max_model_len=10_000
    ),
    kv_bytes_per_token=1,
    host_link_bytes_per_s=1.0,
)
# Step 1: 150 prompt tokens, a 3-token answer, a 2 s tool; step 2: 17 tokens of observation more, a 1-token answer.
TWO_STEPS = (SampleStep(150, 3, 2.0), SampleStep(170, 1, 0.0))


def simulate(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "rollout.json"
    result = CliRunner().invoke(
        app, ["bench", "simulate", "--preset", "h100-tp4-32b", "--jobs", "1", "--out", str(out), *args]
    )
    assert result.exit_code == 0, result.output
    assert "critical path: program" in result.output and "÷ critical" in result.output
    return json.loads(out.read_text())["points"][0]


def test_no_arm_ends_a_batch_before_its_critical_path_and_no_group_after_the_last(tmp_path: Path) -> None:
    point = simulate(tmp_path, "--workers", "1", "--rollout", "4x2", "--scale", "0.3")
    path_s = point["critical_path"]["seconds"]
    assert path_s > 0
    for name, arm in point["arms"].items():
        assert arm["critical_path_s"] == path_s, name
        assert arm["critical_path_s"] <= arm["makespan_s"], name
        assert arm["makespan_to_critical_path"] == pytest.approx(arm["makespan_s"] / path_s), name
        assert arm["group_last_to_median"] >= 1, name


def test_a_batch_of_one_program_ends_at_its_critical_path(tmp_path: Path) -> None:
    point = simulate(tmp_path, "--workers", "1", "--rollout", "1x1")
    for name, arm in point["arms"].items():
        assert arm["makespan_to_critical_path"] == pytest.approx(1.0, abs=1e-6), name


def test_a_sum_of_step_times_over_contexts_is_exact_across_kinks() -> None:
    def step_s(context: int) -> float:
        return max(0.002 + 1e-6 * context, 1e-5 + 3e-6 * context) + 0.001

    assert summed(step_s, 100, 5_000) == pytest.approx(sum(step_s(c) for c in range(100, 5_001)), rel=1e-12)
    assert summed(step_s, 7, 7) == step_s(7)
    assert summed(step_s, 8, 7) == 0.0


def test_a_program_alone_prefills_only_what_its_last_prompt_and_answer_did_not_cache() -> None:
    # Step 1: chunks of 100 and 50 tokens (0.11 + 0.06 s), 2 decode steps (0.022 s); the 2 s tool;
    # step 2: 144 tokens cached (9 whole blocks of the 152 computed), 26 prefilled (0.036 s).
    assert alone_seconds(SampleProgram(TWO_STEPS), TOY, None) == pytest.approx(0.192 + 2.0 + 0.036)


def test_a_program_that_prepares_its_environment_finds_its_first_prompt_cached() -> None:
    # 5 s preparing, then step 1 prefills 6 tokens past 9 cached blocks (0.016 s) and decodes (0.022 s).
    program = SampleProgram(TWO_STEPS, env_prep_s=5.0)
    assert alone_seconds(program, TOY, None) == pytest.approx(5.0 + 0.038 + 2.0 + 0.036)


def record(
    program: str, index: int, step: int, start_s: float, latency_s: float, ttft_s: float, tokens: int
) -> StepRecord:
    return StepRecord(program, index, step, start_s, latency_s, True, 200, 100, tokens, ttft_s)


def two_programs() -> LoadResult:
    """Program a waits behind b: its first answer takes 10 s where b's pace (0.5 s to the first
    token, then 0.1125 s a token) gives 2.75 s. It prepares 1 s, and its tool takes 2 s."""
    records = [
        record("b", 1, 0, 0.0, 5.0, 0.5, 41),
        record("a", 0, 0, 1.0, 10.0, 6.0, 21),
        record("a", 0, 1, 13.0, 3.0, 2.0, 11),
    ]
    runs = [ProgramRun("b", 0.0, 5.0, 1, True), ProgramRun("a", 1.0, 15.0, 2, True)]
    return LoadResult(
        target="gateway", concurrency=2, salt="s", tokens_per_word=1.0, wall_s=16.0, window_s=16.0, steps_ok=3,
        steps_failed=0, steps_cancelled=0, steady_latencies_s=[], programs_started=2, programs_completed=2,
        engines=CacheDelta(), records=records, program_runs=runs,
    )  # fmt: skip


def test_the_measured_critical_path_prices_the_longest_programs_steps_at_the_fastest_pace_seen() -> None:
    # a: 1 s preparing, 2.75 s, the 2 s tool, then 0.5 + 10 × 0.1125 s (its 11-token answer sets no pace).
    assert measured_critical_path(two_programs()) == pytest.approx(1.0 + 2.75 + 2.0 + 1.625)


def test_a_measured_batch_reports_its_makespan_over_the_critical_path_and_its_last_group_over_the_median() -> None:
    figures = batch_figures("cluster", 0, two_programs(), programs=2, samples=1)
    assert figures.makespan_s == 16.0
    assert figures.makespan_to_critical_path == pytest.approx(16.0 / 7.375)
    assert figures.group_last_to_median == pytest.approx(16.0 / 10.5)  # groups end at 5 s and 16 s
