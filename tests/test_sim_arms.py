"""The arms on a small simulated cluster: bounds between them, determinism, and the CLI around them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from thunderctl.bench.shapes import AgentShape, Uniform
from thunderctl.cli import app
from thunderctl.sim.arms import ArmName, SimSpec, run_arm
from thunderctl.sim.cost import EngineShape, LinearStepCost, Preset
from thunderctl.sim.sweep import run_sweep

# Programs of ~1-3k tokens: 16 of them per worker want far more than the 16k-token cache.
WORKLOAD = AgentShape(
    system_prompt_tokens=200,
    task_tokens=Uniform(300, 600),
    observation_tokens=Uniform(100, 300),
    completion_tokens=Uniform(20, 60),
    steps=Uniform(6, 12),
    tool_seconds=Uniform(1.0, 4.0),
    max_context_tokens=4096,
)
SMALL = Preset(
    name="small",
    summary="a test worker: 16k KV tokens, a linear step cost",
    cost=LinearStepCost(
        base_s=5e-3, per_token_s=20e-6, per_attention_pair_s=1e-9, per_seq_s=1e-4, per_context_token_s=0.0
    ),
    engine=EngineShape(
        num_gpu_blocks=1024, block_size=16, max_num_batched_tokens=512, max_num_seqs=64, max_model_len=4096
    ),
    kv_bytes_per_token=1024,
    host_link_bytes_per_s=1e9,
)
PRESSURE = SimSpec(SMALL, WORKLOAD, concurrency=48, duration_s=90, workers=2, warmup_s=20)


@pytest.fixture(scope="module")
def under_pressure() -> dict[str, dict]:
    return {arm.value: run_arm(arm, PRESSURE).summary(PRESSURE.warmup_s) for arm in ArmName}


@pytest.mark.slow
def test_the_engines_alone_thrash_under_pressure(under_pressure: dict[str, dict]) -> None:
    # vLLM admits a request only when its whole sequence fits, so a full engine queues rather
    # than preempts: its thrash is the contexts evicted while their programs are in a tool.
    never_evicts = under_pressure["limit"]["hit_rate"]
    assert under_pressure["sticky"]["hit_rate"] < never_evicts / 2
    assert under_pressure["least-loaded"]["hit_rate"] < never_evicts / 2


# The bound is the limit where the running requests fit the cache, as here: a closed loop that
# meets a preemption or two in another order may come out a step ahead of the limit.
BOUNDED = [a.value for a in ArmName if a not in (ArmName.LIMIT, ArmName.BOUND)]


@pytest.mark.parametrize("arm", BOUNDED)
def test_the_limit_makes_at_least_as_many_steps_as_any_arm(under_pressure: dict[str, dict], arm: str) -> None:
    assert under_pressure["limit"]["steps_per_min"] >= under_pressure[arm]["steps_per_min"]
    assert under_pressure["limit"]["preemptions"] == 0


@pytest.mark.parametrize("arm", BOUNDED)
def test_the_bound_makes_at_least_as_many_steps_as_any_arm_with_a_bounded_cache(
    under_pressure: dict[str, dict], arm: str
) -> None:
    assert under_pressure["bound"]["steps_per_min"] >= under_pressure[arm]["steps_per_min"]


@pytest.mark.parametrize("engine_alone", ["sticky", "least-loaded"])
def test_the_reference_policy_preempts_no_more_than_the_engine_alone(
    under_pressure: dict[str, dict], engine_alone: str
) -> None:
    assert under_pressure["reference"]["preemptions"] <= under_pressure[engine_alone]["preemptions"]
    assert under_pressure["reference"]["pauses"] > 0, "the policy held programs back: it is in the loop"


def test_a_policy_that_holds_programs_back_reports_their_admission_waits(under_pressure: dict[str, dict]) -> None:
    reference = under_pressure["reference"]
    waits = reference["admission_waits"]["<=8k"]
    assert waits["requests"] == reference["steady_steps"], "every prompt of this workload is in the first class"
    assert waits["max_s"] > 0 and waits["p99_s"] <= waits["max_s"]
    assert reference["fairness"]["longest_s"] == waits["max_s"]


@pytest.mark.parametrize("engine_alone", ["sticky", "least-loaded", "limit"])
def test_the_engines_alone_admit_every_request_at_once(under_pressure: dict[str, dict], engine_alone: str) -> None:
    assert under_pressure[engine_alone]["admission_waits"]["<=8k"]["max_s"] == 0
    assert under_pressure[engine_alone]["fairness"]["ratio"] is None


def test_where_nobody_waits_thunderctl_keeps_each_program_on_one_worker_as_sticky_does() -> None:
    # 6 programs of at most 4k tokens on two 16k-token caches: the scheduler holds nobody back. A new
    # program starts where the shared prefix is (scheduler.md), not always at its hash home as in sticky.
    spec = replace(PRESSURE, concurrency=6, duration_s=60, warmup_s=10)
    run = run_arm(ArmName.THUNDERCTL, spec)
    assert run.scheduler_counters["pauses"] == 0
    workers_of: dict[int, set[str]] = {}
    for record in run.records:
        workers_of.setdefault(record.program_index, set()).add(record.worker)
    assert all(len(workers) == 1 for workers in workers_of.values())
    assert len(set.union(*workers_of.values())) == 2


def test_the_same_seed_gives_the_same_report_and_another_seed_another() -> None:
    spec = replace(PRESSURE, duration_s=40, warmup_s=10)
    arms = [ArmName.STICKY, ArmName.THUNDERCTL]
    first = run_sweep(spec, [8, 24], arms, {"name": "shape"})
    second = run_sweep(spec, [8, 24], arms, {"name": "shape"})
    other = run_sweep(replace(spec, seed=1), [8, 24], arms, {"name": "shape"})
    assert first["points"] == second["points"]
    assert first["points"] != other["points"]


def test_runs_in_parallel_processes_give_the_serial_report() -> None:
    spec = replace(PRESSURE, duration_s=40, warmup_s=10)
    arms = [ArmName.STICKY, ArmName.REFERENCE, ArmName.LIMIT]
    finished: list[tuple[int, str]] = []
    serial = run_sweep(spec, [8, 24], arms, {"name": "shape"})
    parallel = run_sweep(
        spec, [8, 24], arms, {"name": "shape"}, finished=lambda c, a, _: finished.append((c, a.value)), jobs=2
    )
    assert parallel["points"] == serial["points"]
    assert sorted(finished) == sorted((c, a.value) for c in (8, 24) for a in arms)


def test_a_host_tier_turns_evictions_into_transfers() -> None:
    spec = replace(PRESSURE, concurrency=24, duration_s=80, warmup_s=20, host_kv_gib=0.25)
    with_host = run_arm(ArmName.STICKY, spec).summary(spec.warmup_s)
    without = run_arm(ArmName.STICKY, replace(spec, host_kv_gib=0.0)).summary(spec.warmup_s)
    assert with_host["host_hit_tokens"] > 0
    assert with_host["prefill_tokens"] < without["prefill_tokens"]


def test_bench_simulate_writes_the_report_the_table_and_the_plot(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(
        app,
        ["bench", "simulate", "--preset", "cpu-tiny", "--concurrency", "4,8", "--duration", "60", "--scale", "0.1",
         "--arms", "sticky,thunderctl,limit", "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [p["concurrency"] for p in report["points"]] == [4, 8]
    for point in report["points"]:
        assert set(point["arms"]) == {"sticky", "thunderctl", "limit"}
        for figures in point["arms"].values():
            assert {"steps_per_min", "hit_rate", "p50_s", "p90_s", "p99_s", "preemptions"} <= figures.keys()
            assert figures["steps_per_min"] > 0
        assert set(point["ratios"]) == {"thunderctl", "limit"}
    assert report["preset"] == "cpu-tiny" and report["workload"]["name"] == "swe-lite"
    assert out.with_suffix(".png").stat().st_size > 0
    assert "thunderctl ÷ sticky" in result.output


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--preset", "h200"], "unknown preset 'h200': choose one of"),
        (["--arms", "sticky,fastest"], "unknown arm(s) fastest"),
        (["--concurrency", "8,many"], "--concurrency"),
        (["--duration", "60", "--warmup", "60"], "warm-up (60 s) must be shorter than the run (60 s)"),
    ],
)
def test_bench_simulate_names_what_is_wrong(options: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["bench", "simulate", *options])
    assert result.exit_code != 0
    assert message in result.output


@pytest.mark.parametrize("arm", [a.value for a in ArmName])
def test_every_arm_reports_whole_programs_consistently_with_its_steps(
    under_pressure: dict[str, dict], arm: str
) -> None:
    figures = under_pressure[arm]
    assert figures["programs_done"] > 0, "programs of 6-12 steps end inside a 70 s window"
    quantiles = [figures[f"program_{q}_s"] for q in ("p50", "p90", "p99")]
    reached = [q for q in quantiles if q is not None]
    assert figures["program_p50_s"] is not None and reached == sorted(reached)
    assert quantiles[: len(reached)] == reached, "a quantile the run cannot reach leaves the higher ones unreached"
    window_min = (PRESSURE.duration_s - PRESSURE.warmup_s) / 60
    assert figures["programs_per_min"] == pytest.approx(figures["programs_done"] / window_min)
    assert figures["programs_done"] <= figures["programs_completed"]
    # Every step of a finished program was answered and counted, in the window or the warm-up.
    assert figures["program_steps"] <= figures["steps_answered"]
    assert figures["steady_steps"] <= figures["steps_answered"]


def test_a_finished_program_runs_from_its_first_request_to_its_last_answer() -> None:
    result = run_arm(ArmName.THUNDERCTL, PRESSURE)
    assert result.completed
    for program in result.completed:
        own = sorted((r for r in result.records if r.program_index == program.program_index), key=lambda r: r.step)
        assert [r.step for r in own] == list(range(program.steps))
        assert (program.sent_s, program.done_s) == (own[0].start_s, own[-1].end_s)


def test_a_program_that_started_part_way_has_no_completion_time_and_no_makespan() -> None:
    spec = replace(PRESSURE, age_initial_programs=True)
    result = run_arm(ArmName.STICKY, spec)
    started = {r.program_index for r in result.records if r.step == 0}
    part_way = {r.program_index for r in result.records} - started
    assert part_way and not part_way & {p.program_index for p in result.completed}
    assert result.programs_completed > len(result.completed), "some of them ran to their end, uncounted"
    assert result.summary(spec.warmup_s)["makespan_s"] is None


def test_bench_simulate_runs_the_long_tail_and_reports_whole_programs(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(
        app,
        ["bench", "simulate", "--workload", "long-tail", "--concurrency", "4", "--duration", "120",
         "--arms", "sticky,thunderctl", "--out", str(out), "--plot", str(tmp_path / "sim.png")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["workload"]["name"] == "long-tail"
    assert report["workload"]["shared_prefix_tokens"] == 5_000
    figures = report["points"][0]["arms"]["thunderctl"]
    assert {"program_p50_s", "program_p90_s", "program_p99_s", "programs_per_min", "makespan_s"} <= figures.keys()
    assert figures["programs_done"] == 0, "30-90 steps with tools of seconds to minutes: none ends in two minutes"
    assert "programs/min" in result.output


@pytest.mark.slow
def test_cpu_tiny_with_a_host_tier_at_its_cache_knee_runs_to_the_end(tmp_path: Path) -> None:
    # Re-tokenized answers and a host tier once left a preempted head behind requests holding
    # loaded blocks with nothing running: the engine stopped with a wake in the past.
    out = tmp_path / "knee.json"
    args = "--preset cpu-tiny --workers 1 --concurrency 48 --duration 600 --host-kv-gib 1 --arms thunderctl"
    result = CliRunner().invoke(app, ["bench", "simulate", *args.split(), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file()
