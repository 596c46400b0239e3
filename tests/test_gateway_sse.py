"""The relayed SSE stream as bytes: events cut anywhere by the network come out whole, once, in order,
and the usage and the answer's tool are read from them as from whole lines. The gateway's relay over
a real HTTP hop is tests/test_gateway_vllm.py's."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

from thunderctl.gateway.apis.chat import OpenAIChunks
from thunderctl.gateway.sse import UNREAD_BYTES, EventFramer, StreamRelay

USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}


def event(chunk: dict, ending: str = "\n") -> bytes:
    return f"data: {json.dumps(chunk)}{ending}{ending}".encode()


def content(text: str) -> dict:
    return {"id": "c", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


STREAM = [
    event({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    event(content("```bash\n")),
    event(content("pytest -x tests/\n```")),
    event({"id": "c", "choices": [], "usage": USAGE}),
    b"data: [DONE]\n\n",
]


def relayed(pieces: list[bytes], relay: StreamRelay) -> bytes:
    return b"".join(relay.feed(piece) for piece in pieces) + relay.end()


def cut(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def test_events_cut_anywhere_come_out_whole_and_in_order() -> None:
    whole = b"".join(STREAM)
    for size in (1, 2, 7, 64, len(whole)):
        framer = EventFramer()
        events = [e for piece in cut(whole, size) for e in framer.feed(piece)]
        assert events == STREAM, size
        assert framer.rest() == b""


def test_crlf_events_and_an_unterminated_tail() -> None:
    framer = EventFramer()
    assert framer.feed(b"data: 1\r\n\r\ndata: 2\n\ndata: 3") == [b"data: 1\r\n\r\n", b"data: 2\n\n"]
    assert framer.rest() == b"data: 3"


def test_a_program_stream_passes_unchanged_and_its_usage_and_tool_are_read_across_cuts() -> None:
    whole = b"".join(STREAM)
    for size in (1, 5, len(whole)):
        answer = OpenAIChunks(sent_at=0.0)
        relay = StreamRelay(answer, client_wants_usage=True, clock=lambda: 1.0)
        assert relayed(cut(whole, size), relay) == whole
        assert relay.usage == USAGE
        assert answer.answer().tool == "pytest" and answer.ttft_s == 1.0


def test_a_client_that_did_not_ask_for_usage_gets_neither_the_usage_chunk_nor_usage_on_a_content_chunk() -> None:
    riding = content("done") | {"usage": USAGE}
    stream = [STREAM[0], event(riding, "\r\n"), STREAM[3], STREAM[4]]
    relay = StreamRelay(None, client_wants_usage=False, clock=lambda: 0.0)
    out = relayed(cut(b"".join(stream), 3), relay)
    compact = json.dumps(content("done"), separators=(",", ":"))
    assert out == STREAM[0] + f"data: {compact}\r\n\r\n".encode() + b"data: [DONE]\n\n"
    assert relay.usage == USAGE


def test_an_unscheduled_stream_without_usage_passes_as_it_came() -> None:
    stream = b"".join(STREAM[:3]) + b": a comment\n\n" + STREAM[4]
    relay = StreamRelay(None, client_wants_usage=False, clock=lambda: 0.0)
    assert relayed(cut(stream, 11), relay) == stream
    assert relay.usage is None


def ticking() -> Callable[[], float]:
    """A clock that reads one second later at every look."""
    ticks = itertools.count(1)
    return lambda: float(next(ticks))


def test_a_program_stream_read_an_event_at_a_time_times_its_first_token_and_reads_its_tool_at_the_end() -> None:
    answer = OpenAIChunks(sent_at=0.0)
    relay = StreamRelay(answer, client_wants_usage=True, clock=ticking())
    assert [relay.feed(e) for e in STREAM] == STREAM  # each read relayed as it came
    assert relay.end() == b""
    assert answer.ttft_s == 2.0  # the second event's read: the first with a token
    assert answer.answer().tool == "pytest" and relay.usage == USAGE


def test_a_long_answer_is_read_in_batches_and_its_first_tool_call_counts() -> None:
    def call(name: str) -> bytes:
        delta = {"tool_calls": [{"index": 0, "function": {"name": name, "arguments": ""}}]}
        return event({"id": "c", "choices": [{"index": 0, "delta": delta}]})

    filler = [event(content("word ")) for _ in range(2 * UNREAD_BYTES // len(event(content("word "))))]
    stream = [STREAM[0], event(content("thinking")), *filler, call("run_tests"), *filler, call("other"), STREAM[4]]
    answer = OpenAIChunks(sent_at=0.0)
    relay = StreamRelay(answer, client_wants_usage=True, clock=lambda: 1.0)
    assert b"".join(relay.feed(e) for e in stream) + relay.end() == b"".join(stream)
    assert answer.answer().tool == "run_tests"


def test_a_stream_cut_short_still_gives_the_tool_of_what_came() -> None:
    answer = OpenAIChunks(sent_at=0.0)
    relay = StreamRelay(answer, client_wants_usage=True, clock=lambda: 1.0)
    for piece in STREAM[:3]:
        relay.feed(piece)
    relay.settle()  # what the gateway does when the client or the engine goes away
    assert answer.answer().tool == "pytest" and relay.usage is None


def test_a_chunk_past_the_first_token_that_is_not_json_is_relayed_and_the_others_still_read() -> None:
    stream = [STREAM[0], STREAM[1], b"data: {not json\n\n", STREAM[2], STREAM[4]]
    answer = OpenAIChunks(sent_at=0.0)
    relay = StreamRelay(answer, client_wants_usage=True, clock=lambda: 1.0)
    assert relayed(stream, relay) == b"".join(stream)
    assert answer.answer().tool == "pytest"
