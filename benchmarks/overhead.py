"""What thunderctl costs: latency the gateway adds per request, and the scheduler tick's cost.

    python benchmarks/overhead.py              # both, ~1 minute
    python benchmarks/overhead.py --requests 5000

1. Gateway latency: a minimal OpenAI-style worker on loopback answers at once (so the
   worker's own time is ~0); the same sequential requests go to it directly and through
   `thunderctl serve`, interleaved one by one, and the difference of the percentiles is what
   the gateway adds.
2. Tick cost: the pure policy with 10,000 programs over 64 workers on a fake clock — the
   mix of reasoning, acting and paused programs of a loaded cluster — timed over many ticks.
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    report = {"gateway": gateway_latency(args.requests), "tick": tick_cost()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
