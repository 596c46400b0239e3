"""The frontend cost (vLLM's API-server process) on cases worked out by hand: it delays a request's
entry and its answer, and never the engine's batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.cost import EngineShape, FrontendCost, StepLoad
from thunderctl.sim.engine import Engine
from thunderctl.sim.requests import Request, TokenStream
from thunderctl.sim.worker import SimWorker

STEP_S = 0.1  # every step costs this, whatever it computes


@dataclass
class FixedCost:
    loads: list[StepLoad] = field(default_factory=list)

    def step_seconds(self, load: StepLoad) -> float:
        self.loads.append(load)
        return STEP_S


def serve(frontend: FrontendCost, requests: list[Request], seqs: int = 8) -> tuple[FixedCost, list[Request]]:
    """All `requests` sent at time 0; returns the steps' loads and the requests as the client saw them."""
    shape = EngineShape(
        num_gpu_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=seqs, max_model_len=256
    )
    cost = FixedCost()
    clock = VirtualClock()
    worker = SimWorker("w0", Engine(shape, cost, frontend=frontend), clock)
    answered: list[Request] = []
    for request in requests:
        request.on_finish = answered.append
        worker.submit(request)
    clock.run_until(100.0)
    return cost, answered


def request(uid: int, prompt: int = 8, answer: int = 3) -> Request:
    return Request(TokenStream(uid), prompt, answer)


def test_a_frontend_delays_the_answer_by_its_time_and_leaves_the_batch_as_it_was() -> None:
    frontend = FrontendCost(per_request_s=0.05, per_prompt_token_s=0.01, per_output_token_s=0.02)
    plain_cost, _ = serve(FrontendCost(), [request(1)])
    cost, answered = serve(frontend, [request(1)])
    # Engine: 3 steps (the prompt, then 2 decodes) after 0.05 + 8 × 0.01 of frontend. Each token is
    # framed (0.02) while the next step runs: the answer waits only for its last token's.
    assert answered[0].finished_s == pytest.approx(0.13 + 3 * STEP_S + 0.02)
    assert cost.loads == plain_cost.loads


def test_a_zero_frontend_cost_leaves_the_engine_times_exact() -> None:
    # The first request steps at once (prefill, 2 decodes); the second joins at the next step boundary.
    _, answered = serve(FrontendCost(), [request(1), request(2)])
    assert [r.finished_s for r in answered] == pytest.approx([3 * STEP_S, 4 * STEP_S])


def test_an_answer_in_the_frontend_does_not_hold_its_batch_slot() -> None:
    # One sequence slot: the second request runs as soon as the engine is done with the first,
    # while the frontend is still framing the first's tokens (1 s each, from 0.1 s on).
    frontend = FrontendCost(per_output_token_s=1.0)
    _, answered = serve(frontend, [request(1, answer=2), request(2, answer=2)], seqs=1)
    first, second = answered
    assert second.scheduled_s == pytest.approx(2 * STEP_S)
    assert first.finished_s == pytest.approx(STEP_S + 2.0)
    # The frontend works on one token after another: the second's wait behind the first's.
    assert second.finished_s == pytest.approx(STEP_S + 4.0)


def test_a_frontend_on_shared_cores_slows_the_steps_that_start_while_it_works() -> None:
    # Request 1 enters at 0.35 s, while the frontend tokenizes request 2 (until 0.70 s): its step
    # gets half the CPU and lasts 0.2 s. Request 2's step starts with the frontend idle: 0.1 s.
    frontend = FrontendCost(per_prompt_token_s=0.35 / 8, engine_cpu_share=0.5)
    _, answered = serve(frontend, [request(1, answer=1), request(2, answer=1)])
    assert [r.finished_s for r in answered] == pytest.approx([0.35 + 2 * STEP_S, 0.70 + STEP_S])


def test_streaming_on_shared_cores_slows_the_next_step_while_the_frontend_works() -> None:
    # The first token (at 0.1 s) keeps the frontend busy 0.05 s into the decode step, which runs
    # at half speed meanwhile: 0.1 + 0.05 × 0.5 = 0.125 s. The last token is framed by 0.275 s.
    frontend = FrontendCost(per_output_token_s=0.05, engine_cpu_share=0.5)
    _, answered = serve(frontend, [request(1, answer=2)])
    assert answered[0].finished_s == pytest.approx(STEP_S + 0.125 + 0.05)


def test_a_negative_frontend_cost_is_refused_with_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        FrontendCost(per_request_s=-1.0)
