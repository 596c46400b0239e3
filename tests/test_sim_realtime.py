"""The pieces under `thunderctl engine sim`: word tokens, the chat template, chained block hashes,
and the engine's count of a request's sampled tokens, which the server streams from."""

from __future__ import annotations

import json

from thunderctl.engines.simulated.tokens import BlockIds, ContentStream, answer_words, render_chat, token_ids
from thunderctl.sim.cost import EngineShape, LinearStepCost
from thunderctl.sim.engine import Engine, Request

BLOCK = 16


def stream(text: str, ids: BlockIds) -> list[int]:
    content = ContentStream.of(token_ids(text), BLOCK, ids)
    return content.block_hashes(0, sum(map(len, content.runs)))


def test_a_shared_text_prefix_gives_the_same_block_hashes_up_to_the_first_differing_block() -> None:
    ids = BlockIds(capacity=1000)
    common = " ".join(f"w{i}" for i in range(40))
    first, second = stream(f"{common} apple pear plum", ids), stream(f"{common} fig kiwi lime", ids)
    assert len(first) == len(second) == 2 and first == second  # 43 tokens: the difference is in the partial block
    longer_a, longer_b = (
        stream(f"{common} " + " ".join(["a"] * 20), ids),
        stream(f"{common} " + " ".join(["b"] * 20), ids),
    )
    assert longer_a[:2] == longer_b[:2] == first and longer_a[2] != longer_b[2]
    assert all(b > a for a, b in zip(longer_b, longer_b[1:]))  # increasing runs, as the block pool wants them


def test_a_block_hash_stands_for_everything_before_it() -> None:
    ids = BlockIds(capacity=1000)
    words = [f"w{i}" for i in range(48)]
    a, b = stream(" ".join(words), ids), stream(" ".join(["other", *words[1:]]), ids)
    assert not set(a) & set(b)  # block 2 is the same text, not the same prefix
    content = ContentStream.of(token_ids(" ".join(words)), BLOCK, ids)
    assert content.block_hashes(1, 3) == a[1:3] and content.block_runs(0, 3) == [range(a[0], a[0] + 3)]


def test_an_answer_sent_back_as_history_tokenizes_to_what_was_sampled() -> None:
    system, task = {"role": "system", "content": "You are an agent."}, {"role": "user", "content": "fix the bug"}
    prompt = token_ids(render_chat([system, task]))
    answer = answer_words(prompt, 25)
    assert answer == answer_words(prompt, 25) and len(answer) == 25
    generated = prompt + token_ids(" ".join(answer))
    history = [system, task, {"role": "assistant", "content": " ".join(answer)}, {"role": "user", "content": "ok"}]
    assert token_ids(render_chat(history))[: len(generated)] == generated


def test_a_tool_call_sent_back_as_history_tokenizes_to_the_words_that_were_sampled() -> None:
    task = {"role": "user", "content": "fix the bug"}
    prompt = token_ids(render_chat([task]))
    answer = " ".join(answer_words(prompt, 12))
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"input": answer})}}
    history = [task, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "ok"}]
    assert token_ids(render_chat(history))[: len(prompt) + 12] == prompt + token_ids(answer)
    other = {**call, "function": {"name": "bash", "arguments": '{"command": "ls -la", "timeout": 5}'}}
    assert render_chat([{"role": "assistant", "tool_calls": [other]}]).split()[2:5] == ["ls", "-la", "5"]


def test_words_are_tokens_and_text_parts_count() -> None:
    assert len(token_ids("one two\nthree\tfour  five")) == 5
    parts = [{"type": "text", "text": "look at"}, {"type": "image_url"}, {"type": "text", "text": "this"}]
    assert render_chat([{"role": "user", "content": parts}]) == render_chat(
        [{"role": "user", "content": "look at this"}]
    )


def engine(blocks: int) -> Engine:
    shape = EngineShape(
        num_gpu_blocks=blocks,
        block_size=BLOCK,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        max_model_len=blocks * BLOCK,
    )
    return Engine(
        shape, LinearStepCost(base_s=1e-3, per_token_s=0, per_attention_pair_s=0, per_seq_s=0, per_context_token_s=0)
    )


def run_steps(sim: Engine, requests: list[Request], now: float = 0.0) -> dict[int, list[int]]:
    """Step until every request is done; each request's sampled-token count after every step."""
    seen: dict[int, list[int]] = {id(r): [] for r in requests}
    while any(r.finished_s is None for r in requests):
        seconds = sim.begin_step(now)
        assert seconds is not None
        now += seconds
        sim.end_step(now)
        for request in requests:
            seen[id(request)].append(sim.sampled_tokens(request))
    return seen


def test_sampled_tokens_count_one_per_decode_step_up_to_the_answer() -> None:
    sim = engine(blocks=16)
    request = Request(ContentStream.of(list(range(100)), BLOCK, BlockIds(1000)), prompt_tokens=40, max_tokens=12)
    sim.submit(request)
    counts = run_steps(sim, [request])[id(request)]
    assert counts == list(range(1, 13))  # the prefill samples the first token, each decode one more


def test_sampled_tokens_survive_a_preemption() -> None:
    ids = BlockIds(1000)
    sim = engine(blocks=8)  # 128 tokens: two requests of 60 + 60 cannot both finish without a preemption
    requests = [Request(ContentStream.of([k] * 120, BLOCK, ids), prompt_tokens=60, max_tokens=60) for k in (1, 2)]
    for request in requests:
        sim.submit(request)
    seen = run_steps(sim, requests)
    assert sim.counters.preemptions >= 1
    for request in requests:
        counts = seen[id(request)]
        assert counts[-1] == 60 and request.output_tokens == 60
        assert all(b >= a for a, b in zip(counts, counts[1:]))  # a preempted request keeps what it sampled
