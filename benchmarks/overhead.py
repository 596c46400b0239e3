"""What thunderctl costs: latency the gateway adds per request, the scheduler tick's cost, and
what finding an unnamed request's program from its conversation costs.

    python benchmarks/overhead.py              # all three, a few minutes
    python benchmarks/overhead.py --requests 5000

1. Gateway latency: a minimal OpenAI-style worker on loopback answers at once (so the
   worker's own time is ~0); the same sequential requests go to it directly and through
   `thunderctl serve`, interleaved one by one, and the difference of the percentiles is what
   the gateway adds.
2. Tick cost: the pure policy with 10,000 programs over 64 workers on a fake clock — the
   mix of reasoning, acting and paused programs of a loaded cluster — timed over many ticks.
3. Derived identity at 64k-token histories: (a) the conversation index alone, a request and its
   answer (chat, completions as text and as token ids) with 1,000 and 65,536 conversations
   remembered; (b) end to end, unnamed chat requests carrying 64k-token histories sent one by one,
   interleaved, straight to the worker, through a gateway with derivation off (the baseline: served
   unscheduled) and through one with it on (each request continues its conversation's program).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from thunderctl.gateway.auth import env_api_key
from thunderctl.gateway.identity import ConversationIndex
from thunderctl.jsonapi import bearer_headers
from thunderctl.percentiles import percentile
from thunderctl.processes import pick_free_port
from thunderctl.scheduler import Scheduler, SchedulerConfig
from thunderctl.sim.clock import VirtualClock

METRICS = (
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="65536",engine="0"} 1.0\n'
    'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
)


def fast_backend() -> Starlette:
    async def chat(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({
            "id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
        })  # fmt: skip

    async def ok(_: Request) -> PlainTextResponse:
        return PlainTextResponse("")

    async def metrics(_: Request) -> PlainTextResponse:
        return PlainTextResponse(METRICS)

    return Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", ok), Route("/metrics", metrics),
    ])  # fmt: skip


def serve_in_thread(app: Starlette, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


def wait_up(url: str) -> None:
    for _ in range(200):
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def gateway_latency(requests: int) -> dict[str, float]:
    backend_port, gateway_port = pick_free_port(), pick_free_port()
    worker = serve_in_thread(fast_backend(), backend_port)
    backend_url, gateway_url = f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{gateway_port}"
    gateway = subprocess.Popen(
        [sys.executable, "-m", "thunderctl", "serve", "--worker", backend_url, "--port", str(gateway_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_up(gateway_url)
        direct, through = [], []
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
        with httpx.Client(timeout=10) as client:
            for i in range(requests):
                for url, sink, extra, headers in (
                    (backend_url, direct, {}, {}),
                    # The gateway started with the key of this environment, if any.
                    (gateway_url, through, {"program_id": f"p{i % 64}"}, bearer_headers(env_api_key())),
                ):
                    started = time.perf_counter()
                    client.post(f"{url}/v1/chat/completions", json=body | extra, headers=headers).raise_for_status()
                    sink.append(time.perf_counter() - started)
    finally:
        gateway.terminate()
        gateway.wait(timeout=10)
        worker.should_exit = True
    return {
        "requests": requests,
        "direct_p50_ms": percentile(direct, 50) * 1e3,
        "gateway_p50_ms": percentile(through, 50) * 1e3,
        "added_p50_ms": (percentile(through, 50) - percentile(direct, 50)) * 1e3,
        "added_p99_ms": (percentile(through, 99) - percentile(direct, 99)) * 1e3,
    }


def tick_cost(programs: int = 10_000, workers: int = 64, ticks: int = 50) -> dict[str, float]:
    rng = random.Random(0)
    clock = VirtualClock()
    sched = Scheduler(SchedulerConfig(), clock)
    for b in range(workers):
        sched.add_worker(f"b{b}", 600_000)
    for i in range(programs):
        pid = f"p{i}"
        tokens = rng.randint(2_000, 40_000)
        sched.on_request(pid, tokens, prefix_key="system", prefix_tokens=1_500)
        if rng.random() < 0.7:
            sched.on_response(pid, tokens, rng.randint(50, 500))
    durations = []
    for _ in range(ticks):
        clock.now += 5
        for pid in rng.sample(list(sched.programs), 200):  # a tick's worth of traffic
            sched.on_request(pid, sched.programs[pid].tokens + 300)
            if sched.programs[pid].status.value == "active":
                sched.on_response(pid, sched.programs[pid].tokens, 100)
        started = time.perf_counter()
        sched.tick()
        durations.append(time.perf_counter() - started)
    return {
        "programs": programs, "backends": workers, "paused": len(sched.paused()),
        "tick_p50_ms": statistics.median(durations) * 1e3, "tick_max_ms": max(durations) * 1e3,
    }  # fmt: skip


HISTORY_TOKENS = 65_536
CHARS_PER_TOKEN = 4  # of English text, about


def history(rng: random.Random, tokens: int = HISTORY_TOKENS, turns: int = 64) -> list[dict[str, str]]:
    """A chat of about `tokens` tokens: a system prompt, a task, then turns of answer and observation."""
    words = ["file", "test", "change", "function", "value", "line", "error", "patch", "output", "case"]
    per_message = tokens * CHARS_PER_TOKEN // (2 * turns + 2)

    def text() -> str:
        return " ".join(rng.choice(words) for _ in range(per_message // 6))

    messages = [{"role": "system", "content": text()}, {"role": "user", "content": text()}]
    for _ in range(turns):
        messages += [{"role": "assistant", "content": text()}, {"role": "user", "content": text()}]
    return messages


def filled_index(remembered: int) -> ConversationIndex:
    """An index holding `remembered` short conversations."""
    index = ConversationIndex(remembered)
    for i in range(remembered):
        claim = index.claim({"messages": [{"role": "user", "content": f"task {i}"}]})
        assert claim is not None
        index.answered_chat(claim, {"role": "assistant", "content": "ok"})
    return index


TURN = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "obs"}]


def index_cost(rounds: int = 30) -> dict[str, float]:
    """Milliseconds per request and its answer, at 64k-token histories, by how many are remembered."""
    rng = random.Random(0)
    chat = history(rng)
    text = " ".join(m["content"] for m in chat)[: HISTORY_TOKENS * CHARS_PER_TOKEN]
    ids = [rng.randrange(150_000) for _ in range(HISTORY_TOKENS)]
    report: dict[str, float] = {"history_tokens": HISTORY_TOKENS}
    for remembered in (1_000, 65_536):
        index = filled_index(remembered)
        for kind, first, step in (
            ("chat", {"messages": chat}, lambda n: {"messages": [*chat, *TURN * n]}),
            ("text", {"prompt": text}, lambda n: {"prompt": text + " ok obs" * n}),
            ("ids", {"prompt": ids}, lambda n: {"prompt": ids + [1, 2] * n}),
        ):  # fmt: skip
            claim = index.claim(first)
            durations = []
            for n in range(1, rounds + 1):
                assert claim is not None
                if kind == "chat":
                    index.answered_chat(claim, {"role": "assistant", "content": "ok"})
                else:
                    index.answered_completion(claim, " ok", [1] if kind == "ids" else None)
                body = step(n)
                started = time.perf_counter()
                continued = index.claim(body)
                assert continued is not None
                if kind == "chat":
                    index.answered_chat(continued, {"role": "assistant", "content": "ok"})
                else:
                    index.answered_completion(continued, " ok", [1] if kind == "ids" else None)
                durations.append(time.perf_counter() - started)
                if kind == "text":  # the completion is " ok"; the next prompt adds " obs" after it
                    assert continued.program_id == claim.program_id
                claim = continued
            report[f"{kind}_ms_remembering_{remembered}"] = statistics.median(durations) * 1e3
    return report


def derivation_latency(requests: int, conversations: int = 8) -> dict[str, float]:
    """Unnamed 64k-token chats sent one by one, interleaved: direct, a gateway without derivation,
    one with it. Returns the p50 of each and what derivation adds to the gateway's own."""
    backend_port = pick_free_port()
    worker = serve_in_thread(fast_backend(), backend_port)
    backend_url = f"http://127.0.0.1:{backend_port}"
    gateways = {}
    processes = []
    for arm, options in (("off", ["--no-derive-programs"]), ("on", [])):
        port = pick_free_port()
        command = [sys.executable, "-m", "thunderctl", "serve", "--worker", backend_url, "--port", str(port)]
        processes.append(subprocess.Popen([*command, *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        gateways[arm] = f"http://127.0.0.1:{port}"
    rng = random.Random(1)
    chats = {arm: [history(rng) for _ in range(conversations)] for arm in ("direct", "off", "on")}
    times: dict[str, list[float]] = {arm: [] for arm in chats}
    try:
        for url in gateways.values():
            wait_up(url)
        urls = {"direct": backend_url, **gateways}
        with httpx.Client(timeout=30, headers=bearer_headers(env_api_key())) as client:
            for i in range(requests):
                for arm, url in urls.items():
                    messages = chats[arm][i % conversations]
                    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 1})
                    started = time.perf_counter()
                    response = client.post(f"{url}/v1/chat/completions", content=body)
                    times[arm].append(time.perf_counter() - started)
                    response.raise_for_status()
                    messages += [response.json()["choices"][0]["message"], {"role": "user", "content": f"obs {i}"}]
            programs = httpx.get(f"{gateways['on']}/programs", headers=bearer_headers(env_api_key())).json()
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)
        worker.should_exit = True
    p50 = {arm: percentile(values, 50) * 1e3 for arm, values in times.items()}
    return {
        "requests_per_arm": requests,
        "body_bytes": len(json.dumps(chats["on"][0])),
        "derived_programs": len(programs["programs"]),
        "direct_p50_ms": p50["direct"],
        "gateway_off_p50_ms": p50["off"],
        "gateway_on_p50_ms": p50["on"],
        "gateway_off_added_p50_ms": p50["off"] - p50["direct"],
        "derivation_added_p50_ms": p50["on"] - p50["off"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--history-requests", type=int, default=200, help="64k-token requests per arm")
    args = parser.parse_args()
    report = {
        "gateway": gateway_latency(args.requests),
        "tick": tick_cost(),
        "derivation_index": index_cost(),
        "derivation_gateway": derivation_latency(args.history_requests),
        "load_average": os.getloadavg(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
