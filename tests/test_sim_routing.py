"""The arms' routers on the virtual clock: where requests go, and the policy router waiting on
the scheduler's events as the gateway does."""

from __future__ import annotations

from thunderctl.scheduler import SchedulerConfig, Status
from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.cost import EngineShape, LinearStepCost
from thunderctl.sim.engine import Engine
from thunderctl.sim.routing import LeastLoadedRouter, PolicyRouter, StickyRouter
from thunderctl.sim.worker import SimWorker

COST = LinearStepCost(base_s=0.01, per_token_s=0.0, per_attention_pair_s=0.0, per_seq_s=0.0, per_context_token_s=0.0)


def workers(clock: VirtualClock, count: int = 2, blocks: int = 64) -> list[SimWorker]:
    shape = EngineShape(
        num_gpu_blocks=blocks, block_size=16, max_num_batched_tokens=256, max_num_seqs=8, max_model_len=1024
    )
    return [SimWorker(f"w{i}", Engine(shape, COST), clock) for i in range(count)]


def test_sticky_sends_every_request_of_a_program_to_one_worker() -> None:
    router = StickyRouter(workers(VirtualClock(), count=4))
    chosen: dict[str, set[str]] = {}
    for program in ("a", "b", "c", "d", "e"):
        for _ in range(3):
            router.send(program, 100, 0, lambda w, p=program: chosen.setdefault(p, set()).add(w.id))
    assert all(len(ids) == 1 for ids in chosen.values())
    assert len(set().union(*chosen.values())) > 1, "programs spread over the workers"


def test_least_loaded_sends_to_the_worker_with_fewest_in_flight() -> None:
    pool = workers(VirtualClock(), count=2)
    router = LeastLoadedRouter(pool)
    sent: list[str] = []
    for program in ("a", "b", "c"):
        router.send(program, 100, 0, lambda w: sent.append(w.id))
    assert sent == ["w0", "w1", "w0"]
    router.done("b", pool[1], 100, 10)
    router.done("a", pool[0], 100, 10)
    router.done("c", pool[0], 100, 10)
    router.send("d", 100, 0, lambda w: sent.append(w.id))
    assert sent[-1] == "w0"


def test_a_paused_programs_request_waits_for_its_resume_then_goes_to_its_backend() -> None:
    clock = VirtualClock()
    pool = workers(clock, count=1, blocks=64)  # 1024 tokens: one 700-token program at a time
    config = SchedulerConfig(**{"adaptive.enabled": False, "admission.buffer_tokens": 0}, tick_interval_s=5.0)
    router = PolicyRouter(pool, clock, config)
    sent: list[tuple[str, float]] = []
    router.send("first", 700, 0, lambda w: sent.append(("first", clock.now)))
    router.send("second", 700, 0, lambda w: sent.append(("second", clock.now)))
    assert [name for name, _ in sent] == ["first"], "the second does not fit beside the first"
    assert router.scheduler.programs["second"].status is Status.PAUSED
    clock.run_until(3.0)
    router.done("first", pool[0], 700, 20)
    router.release("first")  # its room goes to the waiting program, on the loop's next turn
    assert [name for name, _ in sent] == ["first"]
    clock.run_until(3.0)
    assert sent == [("first", 0.0), ("second", 3.0)]
    assert router.in_flight["w0"] == 1


def test_the_policy_router_ticks_at_the_configured_interval() -> None:
    clock = VirtualClock()
    router = PolicyRouter(workers(clock, count=1), clock, SchedulerConfig(tick_interval_s=2.0))
    ticks: list[float] = []
    router.scheduler.tick = lambda: ticks.append(clock.now)  # type: ignore[method-assign]
    clock.run_until(9.0)
    assert ticks == [2.0, 4.0, 6.0, 8.0]
