"""The load generator's retry rule, on a real simulated worker: a request that got no byte of its answer
is sent again (`retry_unanswered_s`), one cut mid-answer fails."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

from thunderctl.bench.closed_loop import LoadSpec, Target, run_load
from thunderctl.bench.results import LoadResult
from thunderctl.bench.shapes import AgentShape, Uniform
from thunderctl.engines.sim_process import sim_command
from thunderctl.processes import pick_free_port

ONE_STEP = AgentShape(
    system_prompt_tokens=50,
    task_tokens=Uniform(20, 20),
    observation_tokens=Uniform(20, 20),
    completion_tokens=Uniform(8, 8),
    steps=Uniform(1, 1),
    tool_seconds=Uniform(0, 0),
)


def load_in_background(url: str, spec: LoadSpec) -> tuple[threading.Thread, list[LoadResult]]:
    results: list[LoadResult] = []
    thread = threading.Thread(target=lambda: results.append(asyncio.run(run_load(Target.direct([url]), spec, []))))
    thread.start()
    return thread, results


def test_a_refused_request_is_sent_again_until_the_server_answers(tmp_path: Path) -> None:
    port = pick_free_port()
    spec = LoadSpec(concurrency=1, programs=1, shape=ONE_STEP, retry_unanswered_s=60)
    thread, results = load_in_background(f"http://127.0.0.1:{port}", spec)
    time.sleep(1)  # refused meanwhile: nothing listens yet
    with (tmp_path / "sim.log").open("wb") as log:
        sim = subprocess.Popen(sim_command(sys.executable, port, "127.0.0.1", ["--time-scale", "0"]), stdout=log,
                               stderr=subprocess.STDOUT)  # fmt: skip
    try:
        thread.join(timeout=120)
    finally:
        sim.terminate()
        sim.wait(timeout=10)
    (result,) = results
    assert result.steps_failed == 0 and result.programs_completed == 1
    assert result.unanswered_retries >= 2


def test_a_request_cut_mid_answer_fails_and_is_not_sent_again(start_sim) -> None:
    sim = start_sim("--time-scale", "40")  # each token ~0.6 s: the answer is still streaming when it dies
    spec = LoadSpec(concurrency=1, programs=1, shape=ONE_STEP, stream=True, retry_unanswered_s=60)
    thread, results = load_in_background(sim.url, spec)
    time.sleep(2)
    sim.process.kill()
    thread.join(timeout=60)
    (result,) = results
    assert result.steps_failed == 1 and result.unanswered_retries == 0
    assert result.records[0].error.startswith("AnswerCut: ")
    assert result.summary()["step_errors"] == {result.records[0].error[:160]: 1}  # what the report says failed
