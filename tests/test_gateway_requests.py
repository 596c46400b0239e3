"""What the gateway reads off a request: program identity, prompt size, shared prefix."""

from __future__ import annotations

import pytest

from thunderctl.gateway.apis import CHAT, COMPLETIONS
from thunderctl.gateway.requests import (
    BadRequest,
    PromptShape,
    TokenEstimator,
    pop_program_id,
)
from thunderctl.gateway.server import parse_worker
from thunderctl.scheduler.front import BusyMeter


@pytest.mark.parametrize(
    ("body", "headers", "program_id", "left"),
    [
        ({"program_id": "p1", "model": "m"}, {}, "p1", {"model": "m"}),
        ({"extra_body": {"program_id": "p2"}}, {}, "p2", {}),
        ({"extra_body": {"program_id": "p3", "top_k": 5}}, {}, "p3", {"extra_body": {"top_k": 5}}),
        ({"model": "m"}, {"x-program-id": "p4"}, "p4", {"model": "m"}),
        ({"program_id": 7}, {}, "7", {}),
        ({"program_id": "body"}, {"x-program-id": "header"}, "body", {}),
        ({"model": "m", "unknown_field": [1]}, {}, None, {"model": "m", "unknown_field": [1]}),
    ],
)
def test_program_id_is_found_and_removed_from_the_body(body, headers, program_id, left) -> None:
    assert pop_program_id(body, headers) == program_id
    assert body == left


def test_program_id_of_the_wrong_type_is_a_bad_request() -> None:
    with pytest.raises(BadRequest, match="program_id must be a string"):
        pop_program_id({"program_id": {"nested": 1}}, {})


def test_shared_system_prompt_gets_the_same_prefix_key() -> None:
    system = {"role": "system", "content": "You are a careful software engineer."}
    a = prompt_shape({"messages": [system, {"role": "user", "content": "fix bug 1"}]})
    b = prompt_shape({"messages": [system, {"role": "user", "content": "fix bug 22"}]})
    assert a.prefix_key == b.prefix_key is not None
    assert a.prefix_chars == len(system["content"])
    assert (a.chars, b.chars) == (len(system["content"]) + 9, len(system["content"]) + 10)


@pytest.mark.parametrize(
    ("body", "shape"),
    [
        ({"messages": [{"role": "user", "content": "hello"}]}, PromptShape(5)),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}, PromptShape(3)),
        ({"prompt": "four"}, PromptShape(4)),
        ({"prompt": [5, 6, 7]}, PromptShape(0, tokens=3)),
        ({"prompt": ["ab", "cd"]}, PromptShape(4)),
    ],
)
def test_prompt_shape(body, shape) -> None:
    assert prompt_shape(body) == shape


@pytest.mark.parametrize("body", [{"messages": []}, {"messages": "hi"}, {"prompt": [1, "a"]}, {"prompt": {"a": 1}}])
def test_malformed_prompts_are_bad_requests_naming_the_field(body) -> None:
    with pytest.raises(BadRequest, match="^(messages|prompt) must be "):
        check_generation_fields(body)


def test_estimator_calibrates_from_engine_usage() -> None:
    estimator = TokenEstimator(tokens_per_char=0.25, smoothing=0.5)
    for _ in range(20):
        estimator.observe(PromptShape(1000), prompt_tokens=500)
    assert estimator.estimate(1000) == pytest.approx(500, abs=1)
    assert estimator.prompt_tokens(PromptShape(0, tokens=42)) == 42


@pytest.mark.parametrize(
    ("spec", "worker_id", "url"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("w1=http://127.0.0.1:8001/", "w1", "http://127.0.0.1:8001"),
    ],
)
def test_worker_spec(spec, worker_id, url) -> None:
    link = parse_worker(spec, 0)
    assert (link.id, link.url) == (worker_id, url)


def test_worker_spec_without_scheme_is_rejected_with_the_fix() -> None:
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        parse_worker("127.0.0.1:8000", 0)


@pytest.mark.parametrize(
    ("timeline", "expected"),
    [
        ([(0, 1), (5, 0)], 0.5),  # busy half of a 10 s period
        ([(0, 3), (2, 1), (8, 0)], 0.8),  # any request in flight counts as busy
        ([], 0.0),
    ],
)
def test_busy_meter_averages_utilisation_over_the_period(timeline, expected) -> None:
    meter = BusyMeter()
    meter.take(0.0)
    for at, in_flight in timeline:
        meter.set(in_flight, float(at))
    assert meter.take(10.0) == pytest.approx(expected)


def prompt_shape(body: dict) -> PromptShape:
    api = CHAT if "messages" in body else COMPLETIONS
    return api.shape(body, api.turn(body))


def check_generation_fields(body: dict) -> None:
    CHAT.check(body)
