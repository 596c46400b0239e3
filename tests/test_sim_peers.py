"""The peer arms' defining behaviours, each on a case small enough to check by hand: Continuum's
TTL pinning, Autellix's least-attained-service order, Dynamo's soft demotion and llm-d's
prefix-aware scoring."""

from __future__ import annotations

import pytest

from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.cost import EngineShape, LinearStepCost, Preset
from thunderctl.sim.engine import Engine, EngineMode
from thunderctl.sim.peers import (
    DYNAMO_DEMOTE_JUMP_S,
    AutellixPLAS,
    ContinuumTTL,
    DynamoQueue,
    DynamoRouter,
    PrefixAwareRouter,
    best_ttl,
)
from thunderctl.sim.requests import Request, TokenStream
from thunderctl.sim.worker import SimWorker

# 4,096 KV tokens; prefill at ~1,000 tokens/s, so re-prefilling a 1,000-token context costs ~1 s
# while holding it costs a quarter of the cache for as long as the tool runs.
SLOW_PREFILL = Preset(
    name="slow-prefill",
    summary="a test worker whose prefill is dear",
    cost=LinearStepCost(
        base_s=1e-3, per_token_s=1e-3, per_attention_pair_s=0.0, per_seq_s=0.0, per_context_token_s=0.0
    ),
    engine=EngineShape(
        num_gpu_blocks=256, block_size=16, max_num_batched_tokens=256, max_num_seqs=1, max_model_len=4096
    ),
    kv_bytes_per_token=1024,
    host_link_bytes_per_s=1e9,
)


def worker_with(mode: EngineMode | None, clock: VirtualClock | None = None) -> tuple[SimWorker, VirtualClock]:
    clock = clock or VirtualClock()
    return SimWorker("w0", Engine(SLOW_PREFILL.engine, SLOW_PREFILL.cost, mode=mode), clock), clock


def send(
    worker: SimWorker, clock: VirtualClock, program: str, uid: int, prompt: int, answer: int = 4, tool_call: bool = True
) -> Request:
    request = Request(TokenStream(uid), prompt, answer, arrival_s=clock.now, program=program, tool_call=tool_call)
    worker.submit(request)
    return request


def until_finished(clock: VirtualClock, request: Request) -> float:
    while request.finished_s is None:
        clock.run_until(clock.now + 0.01)
    return request.finished_s


def run_steps(worker: SimWorker, clock: VirtualClock, program: str, uid: int, tool_s: float, steps: int) -> None:
    """`steps` requests of a growing context, each sent `tool_s` after the previous answer."""
    for k in range(steps):
        request = send(worker, clock, program, uid, 1000 + 100 * k)
        clock.run_until(until_finished(clock, request) + tool_s)


def test_the_ttl_pays_for_a_short_tool_and_not_for_a_long_one() -> None:
    # 1 s saved against a tenth of the cache held: worth 1 s of holding, not 100 s.
    assert best_ttl([1.0, 1.0, 1.0], benefit_s=1.0, share=0.1) == 1.0
    assert best_ttl([100.0, 100.0, 100.0], benefit_s=1.0, share=0.1) == 0.0


def test_continuum_keeps_a_short_tool_programs_kv_and_drops_a_long_tool_ones() -> None:
    worker, clock = worker_with(ContinuumTTL(SLOW_PREFILL))
    run_steps(worker, clock, "long", uid=1, tool_s=100.0, steps=3)
    assert worker.engine.pool.in_use == 0  # dropped at once: cached, evictable
    run_steps(worker, clock, "short", uid=2, tool_s=0.5, steps=3)
    # Its ~1,200-token context is still held (pinned) after its answer.
    assert worker.engine.pool.in_use >= 1200 // 16
    assert worker.engine.counters.pins >= 1


def test_continuum_unpins_a_program_whose_tool_outlasts_its_ttl() -> None:
    worker, clock = worker_with(ContinuumTTL(SLOW_PREFILL))
    run_steps(worker, clock, "short", uid=2, tool_s=1.0, steps=3)
    assert worker.engine.pool.in_use > 0
    clock.run_until(clock.now + 60)
    until_finished(clock, send(worker, clock, "other", uid=3, prompt=100, tool_call=False))  # a step: the pin expires
    assert worker.engine.pool.in_use == 0


def served_and_new(mode: EngineMode | None) -> tuple[float, float]:
    """When a program served once and a new one finish, both sent together (the served one first)
    to an engine that runs one sequence at a time."""
    worker, clock = worker_with(mode)
    run_steps(worker, clock, "served", uid=1, tool_s=0.0, steps=1)
    served = send(worker, clock, "served", uid=1, prompt=1200)
    new = send(worker, clock, "new", uid=2, prompt=1000)
    return until_finished(clock, served), until_finished(clock, new)


def test_autellix_runs_the_least_served_program_first() -> None:
    served_s, new_s = served_and_new(AutellixPLAS())
    assert new_s < served_s


def test_autellix_preempts_a_more_served_program_for_a_less_served_one() -> None:
    worker, clock = worker_with(AutellixPLAS())
    run_steps(worker, clock, "served", uid=1, tool_s=0.0, steps=1)
    served = send(worker, clock, "served", uid=1, prompt=1200, answer=2000)
    clock.run_until(clock.now + 2)  # it is decoding
    new = send(worker, clock, "new", uid=2, prompt=200)
    clock.run_until(clock.now + 60)
    assert served.preemptions == 1
    assert new.finished_s is not None and served.finished_s is not None
    assert new.finished_s < served.finished_s


def test_vllm_alone_serves_the_same_pair_first_come_first_served() -> None:
    served_s, new_s = served_and_new(None)
    assert served_s < new_s


@pytest.mark.parametrize(("charged", "demoted"), [(0.50, False), (0.85, True)])
def test_dynamo_demotes_the_programs_of_a_worker_in_its_soft_band(charged: float, demoted: bool) -> None:
    worker, clock = worker_with(None)
    queue = DynamoQueue(clock)
    router = DynamoRouter([worker], clock, queue)
    prompt = int(charged * worker.engine.shape.kv_capacity_tokens)
    router.send("p", prompt, 0, lambda _: None)  # charged, reasoning; its request never ends
    clock.run_until(router.scheduler.config.tick_interval_s + 0.1)
    assert (queue.demoted_until.get("p", 0.0) > clock.now) is demoted


def test_a_demoted_request_queues_behind_one_that_arrives_up_to_two_seconds_later() -> None:
    clock = VirtualClock()
    worker, _ = worker_with(DynamoQueue(clock, demoted_until={"hot": 100.0}), clock)
    busy = send(worker, clock, "busy", uid=1, prompt=1000)  # holds the only sequence slot
    hot = send(worker, clock, "hot", uid=2, prompt=100)
    clock.run_until(DYNAMO_DEMOTE_JUMP_S / 2)
    cold = send(worker, clock, "cold", uid=3, prompt=100)
    clock.run_until(60)
    assert busy.finished_s is not None and hot.finished_s is not None and cold.finished_s is not None
    assert cold.finished_s < hot.finished_s


def idle_pair() -> tuple[list[SimWorker], VirtualClock]:
    clock = VirtualClock()
    return [SimWorker(f"w{i}", Engine(SLOW_PREFILL.engine, SLOW_PREFILL.cost), clock) for i in range(2)], clock


def test_prefix_aware_sends_a_program_back_to_the_worker_holding_its_prefix() -> None:
    workers, _ = idle_pair()
    router = PrefixAwareRouter(workers, seed=1)
    chosen: list[str] = []
    for prompt in (1000, 1100, 1200):
        router.send("p", prompt, 0, lambda worker: chosen.append(worker.id))
    assert len(set(chosen)) == 1


def test_prefix_aware_sends_a_new_program_to_the_shorter_queue_over_a_shared_prompt() -> None:
    workers, clock = idle_pair()
    router = PrefixAwareRouter(workers, seed=1)
    first: list[SimWorker] = []
    router.send("p", 1000, 100, first.append)  # the system prompt (100 tokens) is now indexed there
    for uid in range(3):  # three requests wait on it
        first[0].engine.submit(Request(TokenStream(10 + uid), 100, 1, arrival_s=clock.now))
    chosen: list[SimWorker] = []
    router.send("q", 1000, 100, chosen.append)
    assert chosen[0] is not first[0]
