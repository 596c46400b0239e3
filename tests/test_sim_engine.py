"""The engine model against cases worked out by hand: prefix hits, LRU eviction, preemption,
chunked prefill and host-tier hits, on tiny caches (blocks of 4 tokens) and a linear cost."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from thunderctl.sim.clock import VirtualClock
from thunderctl.sim.cost import EngineShape, StepLoad
from thunderctl.sim.engine import Engine
from thunderctl.sim.kv import HostTier
from thunderctl.sim.requests import Request, RetokenizedAnswer, TokenStream
from thunderctl.sim.worker import SimWorker

BLOCK = 4


@dataclass
class LinearCost:
    """A fixed cost per step plus one per scheduled token; remembers every step's load."""

    per_step_s: float = 0.010
    per_token_s: float = 0.001
    loads: list[StepLoad] = field(default_factory=list)

    def step_seconds(self, load: StepLoad) -> float:
        self.loads.append(load)
        return self.per_step_s + self.per_token_s * load.scheduled_tokens


def shape(blocks: int = 64, budget: int = 64, seqs: int = 8) -> EngineShape:
    return EngineShape(
        num_gpu_blocks=blocks, block_size=BLOCK, max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=256
    )


def make_worker(engine: Engine) -> tuple[SimWorker, VirtualClock]:
    clock = VirtualClock()
    return SimWorker("w0", engine, clock), clock


def serve_one_by_one(engine: Engine, requests: list[Request]) -> None:
    """Each request is sent when the previous one has finished."""
    worker, clock = make_worker(engine)
    for request in requests:
        request.arrival_s = clock.now
        worker.submit(request)
        clock.run_until(clock.now + 1000)
        assert request.finished_s is not None


def req(uid: int, prompt: int, answer: int = 1, shared_blocks: int = 0) -> Request:
    return Request(TokenStream(uid, shared_blocks), prompt, answer)


@pytest.mark.parametrize(
    ("second_prompt", "hit_tokens"),
    [
        (14, 8),  # extends the first prompt (10 tokens: 2 whole blocks cached)
        (8, 4),  # exactly the 2 cached blocks: the last token is recomputed, so only 1 block hits
        (3, 0),  # shorter than a block
    ],
)
def test_a_prompt_extending_a_cached_one_hits_its_whole_blocks(second_prompt: int, hit_tokens: int) -> None:
    engine = Engine(shape(), LinearCost())
    second = req(1, second_prompt)
    serve_one_by_one(engine, [req(1, 10), second])
    c = engine.counters
    assert c.prefix_cache_queries == 10 + second_prompt
    assert c.prefix_cache_hits == hit_tokens
    assert c.prefill_tokens == 10 + second_prompt - hit_tokens


def test_a_retokenized_answer_is_missed_from_the_block_where_it_starts() -> None:
    # The first turn's prompt is 10 tokens (2 whole blocks), its answer 8; the next prompt, 20
    # tokens, holds the answer re-tokenized: only the first turn's whole prompt blocks hit.
    engine = Engine(shape(), LinearCost())
    stream = TokenStream(1)
    first = Request(RetokenizedAnswer(stream, 10 // BLOCK, turn=0), 10, 8)
    second = Request(RetokenizedAnswer(stream, 20 // BLOCK, turn=1), 20, 1)
    serve_one_by_one(engine, [first, second])
    assert second.cached_tokens == 2 * BLOCK


def test_an_answer_that_round_trips_is_hit_by_the_next_prompt() -> None:
    engine = Engine(shape(), LinearCost())
    first, second = req(1, 10, answer=8), req(1, 20)
    serve_one_by_one(engine, [first, second])
    assert second.cached_tokens == 4 * BLOCK  # the 17 tokens computed: 4 whole blocks


def test_programs_share_the_system_prompt_blocks_only() -> None:
    engine = Engine(shape(), LinearCost())
    # 2 shared blocks (8 tokens); the second program's own tokens after them never hit.
    serve_one_by_one(engine, [req(1, 20, shared_blocks=2), req(2, 20, shared_blocks=2)])
    assert engine.counters.prefix_cache_hits == 8


def test_the_least_recently_freed_cached_block_is_evicted_first() -> None:
    engine = Engine(shape(blocks=4), LinearCost())
    # A and B fill the 4 blocks and are freed, each tail block first, so the free queue is
    # a1 a0 b1 b0; C needs one block and takes a1, the least recently freed.
    serve_one_by_one(engine, [req(1, 8), req(2, 8), req(3, 4)])
    cached = engine.pool.cached
    (a0, a1), b_blocks = TokenStream(1).block_hashes(0, 2), TokenStream(2).block_hashes(0, 2)
    assert a1 not in cached
    assert {a0, *b_blocks} <= cached.keys()
    hits_before = engine.counters.prefix_cache_hits
    serve_one_by_one(engine, [req(1, 9)])
    assert engine.counters.prefix_cache_hits - hits_before == 4, "A's first block still hits, its second does not"
    assert engine.pool.evictions >= 1


def test_a_decode_without_a_free_block_preempts_the_last_running_request() -> None:
    engine = Engine(shape(blocks=4), LinearCost())
    worker, clock = make_worker(engine)
    first, second = req(1, 4, answer=6), req(2, 4, answer=6)
    engine.submit(first)  # both wait when the first step is scheduled
    worker.submit(second)
    clock.run_until(100)
    c = engine.counters
    # Both prefill 4 tokens, take a second block at their first decode, and at the 5th
    # decode step the first needs a third block: the second (last) is preempted.
    assert c.preemptions == 1
    assert (first.preemptions, second.preemptions) == (0, 1)
    assert first.finished_s is not None and second.finished_s is not None
    assert second.finished_s > first.finished_s
    assert second.output_tokens == 6
    # Back in the queue with 5 tokens sampled: 9 tokens looked up again, its first block
    # still cached (its second was evicted for the first request's block).
    assert (c.preempted_queries, c.preempted_hits) == (9, 4)
    assert c.prefix_cache_queries == 8, "the lookup after a preemption is counted apart, as vLLM 0.32 does"
    # Recompute: 4 + 4 prompt tokens, then the second's 9 tokens minus its cached block.
    assert c.prefill_tokens == 8 + 5


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    cost = LinearCost()
    engine = Engine(shape(budget=8), cost)
    worker, clock = make_worker(engine)
    long, short = req(1, 20), req(2, 4)
    engine.submit(long)  # both wait when the first step is scheduled
    worker.submit(short)
    clock.run_until(100)
    # 8 + 8 + 4 tokens of the long prompt; the short one waits for budget left in step 3.
    assert [load.scheduled_tokens for load in cost.loads] == [8, 8, 8]
    assert [load.num_seqs for load in cost.loads] == [1, 1, 2]
    # (query, key) pairs: a chunk of n at offset c adds n*c + n(n+1)/2.
    assert [load.attention_pairs for load in cost.loads] == [36, 8 * 8 + 36, (4 * 16 + 10) + 10]
    assert long.finished_s == short.finished_s == pytest.approx(3 * 0.018)


def test_decode_steps_read_the_whole_context() -> None:
    cost = LinearCost()
    engine = Engine(shape(), cost)
    serve_one_by_one(engine, [req(1, 6, answer=4)])
    # Prefill 6 (samples token 1), then 3 decode steps of one token at offsets 6, 7, 8.
    assert [(load.scheduled_tokens, load.context_tokens) for load in cost.loads] == [(6, 6), (1, 7), (1, 8), (1, 9)]


def test_a_host_tier_hit_costs_a_transfer_instead_of_a_prefill() -> None:
    per_token = 0.01
    cost = LinearCost()
    engine = Engine(shape(blocks=4), cost, host=HostTier(16), transfer_seconds=lambda tokens: tokens * per_token)
    # A's 2 blocks are evicted by B (which needs all 4) and land in the host tier.
    serve_one_by_one(engine, [req(1, 8), req(2, 16)])
    prefilled = engine.counters.prefill_tokens
    again = req(1, 9)
    serve_one_by_one(engine, [again])
    c = engine.counters
    assert c.prefix_cache_hits == 0, "nothing of A is left on the device"
    assert c.host_hit_tokens == 8
    assert c.prefill_tokens - prefilled == 1
    assert again.latency_s == pytest.approx(8 * per_token + cost.per_step_s + cost.per_token_s)


def test_without_a_host_tier_the_evicted_prompt_is_prefilled_again() -> None:
    engine = Engine(shape(blocks=4), LinearCost())
    serve_one_by_one(engine, [req(1, 8), req(2, 16)])
    prefilled = engine.counters.prefill_tokens
    serve_one_by_one(engine, [req(1, 9)])
    assert engine.counters.prefill_tokens - prefilled == 9


def test_an_unbounded_cache_never_evicts_or_preempts() -> None:
    engine = Engine(shape(blocks=4), LinearCost(), unbounded_kv=True)
    worker, clock = make_worker(engine)
    for uid in range(1, 9):
        worker.submit(req(uid, 12, answer=10))
    clock.run_until(100)
    assert engine.counters.preemptions == 0 and engine.pool.evictions == 0
    assert engine.counters.finished == 8


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(max_num_seqs=100, max_num_batched_tokens=64), "max_num_seqs"),
    ],
)
def test_a_shape_vllm_would_reject_is_refused(change: dict, message: str) -> None:
    bad = EngineShape(**(vars(shape()) | change))
    with pytest.raises(ValueError, match=message):
        Engine(bad, LinearCost())


def test_a_request_larger_than_the_cache_is_refused_with_the_fix() -> None:
    engine = Engine(shape(blocks=4), LinearCost())
    with pytest.raises(ValueError, match="does not fit a KV cache of 4 blocks"):
        engine.submit(req(1, 30))


def step(engine: Engine, now: float) -> float:
    """One whole step at `now`; returns when it ended."""
    seconds = engine.begin_step(now)
    assert seconds is not None
    now += seconds
    engine.end_step(now)
    return now


def test_an_aborted_request_leaves_between_steps_and_frees_its_blocks_while_the_others_go_on() -> None:
    engine = Engine(shape(blocks=16), LinearCost())
    gone, kept = req(1, 8, answer=12), req(2, 8, answer=12)
    engine.submit(gone)
    engine.submit(kept)
    now = 0.0
    for _ in range(4):  # the prefill and three decode steps
        now = step(engine, now)
    in_use, its_blocks = engine.pool.in_use, gone.num_blocks
    assert gone.decoding and its_blocks > 0

    assert engine.abort(gone)
    assert gone not in engine.running and engine.pool.in_use == in_use - its_blocks
    while kept.finished_s is None:
        now = step(engine, now)
    assert gone.finished_s is None and kept.output_tokens == 12 and engine.pool.in_use == 0
    assert engine.counters.aborted == 1 and engine.counters.finished == 1
    assert not engine.abort(gone) and not engine.abort(kept)  # gone already, finished


def test_a_request_aborted_while_it_waits_never_runs() -> None:
    engine = Engine(shape(), LinearCost())
    waiting = req(1, 8, answer=4)
    engine.submit(waiting)
    assert engine.abort(waiting)
    assert engine.begin_step(0.0) is None and engine.waiting == [] and engine.pool.in_use == 0
