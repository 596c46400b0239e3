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
   `--api responses` or `--api messages` sends the same conversations through the OpenAI Responses
   or the Anthropic Messages API instead (`--api all`: all three, interleaved request by request, for a comparison in one run).
4. The gateway's CPU per streamed step (`--only stream-cpu`): agents' conversations at 8k- and
   32k-token histories, each step a streamed chat request carrying the history and the answer
   read before it, answered by a worker that writes one SSE chunk per token, each once the client
   has read the one before (so each reaches the gateway in a read of its own, as a real engine's
   tokens a step apart do, whatever the machine's load); the gateway process's CPU time (its
   threads' run time from /proc, its idle polls and probes meanwhile included) per step, for
   named clients (a program id, released at the conversation's end) and unchanged ones (no id:
   derived identity). One request at a time, arms interleaved step by step. `--baseline-tree DIR`
   adds the gateway of another checkout (the code before a change) as a second arm.
   `--callgrind` counts the gateway's instructions per step under valgrind instead: a figure the
   load of a shared machine does not move (its CPU time moves by 10 % or more with it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from thunderctl.bench.apis import SHAPES, Api
from thunderctl.gateway.auth import env_api_key
from thunderctl.gateway.identity import ConversationIndex, Turn
from thunderctl.gateway.process import ServeProcess
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
    """A worker that answers every generation API at once, in that API's shape."""

    async def chat(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({
            "id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
        })  # fmt: skip

    async def responses(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({
            "id": f"resp_{time.perf_counter_ns()}", "object": "response", "status": "completed", "model": "m",
            "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "ok", "annotations": []}]}],
            "usage": {"input_tokens": 12, "output_tokens": 1, "total_tokens": 13},
        })  # fmt: skip

    async def messages(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "stop_reason": "end_turn",
            "content": [{"type": "text", "text": "ok"}], "usage": {"input_tokens": 12, "output_tokens": 1},
        })  # fmt: skip

    async def ok(_: Request) -> PlainTextResponse:
        return PlainTextResponse("")

    async def metrics(_: Request) -> PlainTextResponse:
        return PlainTextResponse(METRICS)

    return Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
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
        claim = index.follow(Turn(messages=[{"role": "user", "content": f"task {i}"}]))
        assert claim is not None
        index.answered(claim, message={"role": "assistant", "content": "ok"})
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
            ("chat", Turn(messages=chat), lambda n: Turn(messages=[*chat, *TURN * n])),
            ("text", Turn(prompt=text), lambda n: Turn(prompt=text + " ok obs" * n)),
            ("ids", Turn(prompt=ids), lambda n: Turn(prompt=ids + [1, 2] * n)),
        ):  # fmt: skip
            claim = index.follow(first)
            durations = []
            for n in range(1, rounds + 1):
                assert claim is not None
                if kind == "chat":
                    index.answered(claim, message={"role": "assistant", "content": "ok"})
                else:
                    index.answered(claim, text=" ok", token_ids=[1] if kind == "ids" else None)
                body = step(n)
                started = time.perf_counter()
                continued = index.follow(body)
                assert continued is not None
                if kind == "chat":
                    index.answered(continued, message={"role": "assistant", "content": "ok"})
                else:
                    index.answered(continued, text=" ok", token_ids=[1] if kind == "ids" else None)
                durations.append(time.perf_counter() - started)
                if kind == "text":  # the completion is " ok"; the next prompt adds " obs" after it
                    assert continued.program_id == claim.program_id
                claim = continued
            report[f"{kind}_ms_remembering_{remembered}"] = statistics.median(durations) * 1e3
    return report


def derivation_latency(requests: int, apis: list[str], conversations: int = 8) -> list[dict[str, Any]]:
    """Unnamed 64k-token conversations sent one by one through each of `apis`, interleaved request by
    request (API by API, arm by arm): direct, a gateway without derivation, one with it. Returns, per
    API, the p50 of each arm and what derivation adds to the gateway's own."""
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
    arms = ("direct", "off", "on")
    chats = {(api, arm): [history(rng) for _ in range(conversations)] for api in apis for arm in arms}
    times: dict[tuple[str, str], list[float]] = {key: [] for key in chats}
    try:
        for url in gateways.values():
            wait_up(url)
        urls = {"direct": backend_url, **gateways}
        with httpx.Client(timeout=30, headers=bearer_headers(env_api_key())) as client:
            for i in range(requests):
                for api in apis:
                    shape = SHAPES[Api(api)]
                    for arm, url in urls.items():
                        messages = chats[api, arm][i % conversations]
                        body = json.dumps(shape.body("m", messages, 1))
                        started = time.perf_counter()
                        response = client.post(f"{url}{shape.path}", content=body)
                        times[api, arm].append(time.perf_counter() - started)
                        response.raise_for_status()
                        text, _ = shape.answer(response.json())
                        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"obs {i}"}]
            programs = httpx.get(f"{gateways['on']}/programs", headers=bearer_headers(env_api_key())).json()
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)
        worker.should_exit = True
    reports = []
    for api in apis:
        p50 = {arm: percentile(times[api, arm], 50) * 1e3 for arm in arms}
        reports.append({
            "api": api,
            "requests_per_arm": requests,
            "body_bytes": len(json.dumps(SHAPES[Api(api)].body("m", chats[api, "on"][0], 1))),
            "direct_p50_ms": p50["direct"],
            "gateway_off_p50_ms": p50["off"],
            "gateway_on_p50_ms": p50["on"],
            "gateway_off_added_p50_ms": p50["off"] - p50["direct"],
            "derivation_added_p50_ms": p50["on"] - p50["off"],
        })  # fmt: skip
    reports[0]["derived_programs"] = len(programs["programs"])  # of every API
    return reports


ANSWER = ["THOUGHT:", *[f" word{i}" for i in range(200)], "\n```bash\n", "ls", " -la", "\n```"]


@dataclass
class Lockstep:
    """The chunks the client has read of the answer under way. The worker sends each chunk only once
    the client has read the one before, so that every chunk reaches the gateway in a read of its
    own (as a real engine's tokens do, a step apart), however slowly the gateway runs."""

    read: int = 0

    async def wait_for(self, count: int) -> None:
        while self.read < count:
            await asyncio.sleep(0.0005)


def streaming_backend(lockstep: Lockstep) -> Starlette:
    """A worker that streams each answer as vLLM does, one chunk per token, in lockstep with the
    client; the answer has `max_tokens` tokens."""

    def chunk(choices: list[dict], **extra: object) -> bytes:
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": choices, **extra}  # fmt: skip
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    async def events(tokens: list[str], usage: bool) -> AsyncIterator[bytes]:
        yield chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )
        for i, token in enumerate(tokens):
            await lockstep.wait_for(i + 1)
            finish = "stop" if i == len(tokens) - 1 else None
            yield chunk([{"index": 0, "delta": {"content": token}, "logprobs": None, "finish_reason": finish}])
        if usage:
            yield chunk([], usage={"prompt_tokens": 1000, "completion_tokens": len(tokens), "total_tokens": 1000})
        yield b"data: [DONE]\n\n"

    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        count = body.get("max_tokens") or 16
        tokens = [*ANSWER[: count - 4], *ANSWER[-4:]]  # the bash block last: the answer names its tool
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(events(tokens, usage), media_type="text/event-stream")

    backend = fast_backend()
    backend.router.routes[0] = Route("/v1/chat/completions", chat, methods=["POST"])
    return backend


def cpu_ns(pid: int) -> int:
    """CPU time a process's threads have run, in ns (the scheduler's own count, not /proc/stat's
    10 ms ticks): one step's cost is a few ms."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError):  # a thread that just ended
            total += int(stat.read_text().split()[0])
    return total


@dataclass
class StepArm:
    """One gateway and one kind of client: its conversations and the CPU of its steps."""

    name: str
    url: str
    headers: dict[str, str]
    pid: int
    named: bool
    conversation: list[dict[str, Any]] = field(default_factory=list)
    turn: int = 0
    started: int = 0
    cpu_ms: list[float] = field(default_factory=list)


def stream_step(client: httpx.Client, arm: StepArm, args: argparse.Namespace, tokens: int, lockstep: Lockstep) -> None:
    """One step of the arm's current conversation: the request, its stream read to the end, the
    answer and an observation kept for the next; a new conversation every `--stream-turns` steps."""
    rng = random.Random(arm.started)
    if arm.turn == 0:
        arm.conversation = history(rng, tokens=tokens, turns=16)
        arm.started += 1
    body: dict[str, Any] = {
        "model": "m",
        "messages": arm.conversation,
        "stream": True,
        "max_tokens": args.stream_tokens,
    }
    program_id = f"{arm.name}-{arm.started}"
    if arm.named:
        body["program_id"] = program_id
    payload = json.dumps(body)
    answer = []
    lockstep.read = 0
    before = cpu_ns(arm.pid)
    with client.stream("POST", f"{arm.url}/v1/chat/completions", content=payload, headers=arm.headers) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                lockstep.read += 1
                choices = json.loads(line[len("data: ") :])["choices"]
                answer.append(choices[0]["delta"].get("content") or "" if choices else "")
    time.sleep(0.01)  # the gateway's accounting after the last byte
    arm.cpu_ms.append((cpu_ns(arm.pid) - before) / 1e6)
    observation = " ".join(f"line{i % 97}" for i in range(args.observation_words))
    arm.conversation = [*arm.conversation, {"role": "assistant", "content": "".join(answer)},
                        {"role": "user", "content": observation}]  # fmt: skip
    arm.turn = (arm.turn + 1) % args.stream_turns
    if arm.turn == 0 and arm.named:
        client.post(f"{arm.url}/programs/release", json={"program_id": program_id}, headers=arm.headers)


def idle_rate(pid: int, seconds: float = 4.0) -> float:
    """A gateway's CPU with nothing to serve (its polls, tick and probes), in ms per second."""
    before = cpu_ns(pid)
    time.sleep(seconds)
    return (cpu_ns(pid) - before) / 1e6 / seconds


CALLGRIND = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]


def callgrind_count(pid: int, out: Path, action: Callable[[], None]) -> int:
    """Instructions a gateway under callgrind ran during `action` (counters zeroed, then dumped)."""
    subprocess.run(["callgrind_control", "--zero", str(pid)], check=True, capture_output=True)
    action()
    before = set(out.parent.glob(f"{out.name}*"))
    subprocess.run(["callgrind_control", "--dump", str(pid)], check=True, capture_output=True)
    (dump,) = set(out.parent.glob(f"{out.name}*")) - before
    totals = [line for line in dump.read_text().splitlines() if line.startswith(("totals:", "summary:"))]
    return int(totals[0].split()[1])


def counted_steps(
    client: httpx.Client, arm: StepArm, args: argparse.Namespace, tokens: int, lockstep: Lockstep, out: Path
) -> float:
    """Instructions per step over `--stream-steps` steps of one arm (after two to warm up), less
    what the gateway runs idle (its polls and probes) over as long a wait right after."""

    def steps() -> None:
        for _ in range(args.stream_steps):
            stream_step(client, arm, args, tokens, lockstep)

    for _ in range(2):
        stream_step(client, arm, args, tokens, lockstep)
    started = time.perf_counter()
    count = callgrind_count(arm.pid, out, steps)
    wall = time.perf_counter() - started
    return (count - callgrind_count(arm.pid, out, lambda: time.sleep(wall))) / args.stream_steps


def timed_arms(
    client: httpx.Client, gateways: dict[str, ServeProcess], args: argparse.Namespace, lockstep: Lockstep
) -> dict[str, Any]:
    """CPU time per step of each gateway and kind of client, arms interleaved step by step; its idle
    polls and probes included, which interleaved arms share alike (the idle rate is reported apart)."""
    report: dict[str, Any] = {"idle_ms_per_s": {tree: idle_rate(g.process.pid) for tree, g in gateways.items()}}
    for tokens in args.stream_histories:
        arms = [
            StepArm(f"{tree}-{kind}-{tokens}", g.url, g.headers, g.process.pid, kind == "named")
            for kind in ("named", "unchanged")
            for tree, g in gateways.items()
        ]
        for step in range(args.stream_steps + 2):  # the first two warm each arm up
            for arm in arms if step % 2 == 0 else reversed(arms):
                stream_step(client, arm, args, tokens, lockstep)
                if step < 2:
                    arm.cpu_ms.clear()
        for arm in arms:
            report[arm.name] = {
                "cpu_ms_per_step_mean": statistics.fmean(arm.cpu_ms),
                "cpu_ms_per_step_p50": statistics.median(arm.cpu_ms),
                "body_kb_last": len(json.dumps(arm.conversation)) / 1024,
            }
    return report


def counted_arms(
    client: httpx.Client, gateways: dict[str, ServeProcess], args: argparse.Namespace, lockstep: Lockstep, out: Path
) -> dict[str, Any]:
    """Instructions per step of each gateway (under callgrind) and kind of client, arm after arm."""
    report: dict[str, Any] = {}
    for gateway in gateways.values():
        subprocess.run(["callgrind_control", "--instr=on", str(gateway.process.pid)], check=True, capture_output=True)
    for tokens in args.stream_histories:
        for kind in ("named", "unchanged"):
            for tree, g in gateways.items():
                arm = StepArm(f"{tree}-{kind}-{tokens}", g.url, g.headers, g.process.pid, kind == "named")
                instructions = counted_steps(client, arm, args, tokens, lockstep, out / f"{tree}.callgrind")
                report[arm.name] = {"instructions_per_step_M": instructions / 1e6,
                                    "body_kb_last": len(json.dumps(arm.conversation)) / 1024}  # fmt: skip
                print(arm.name, report[arm.name], file=sys.stderr)
    return report


def stream_cpu(args: argparse.Namespace) -> dict[str, Any]:
    """The gateway's CPU per streamed step (part 4), by history size, client kind and gateway (this
    tree, and the baseline tree's): its CPU time, or with `--callgrind` its instructions, which no
    other load on the machine changes (its CPU time moves with it, through caches and wake-ups)."""
    lockstep = Lockstep()
    backend_port = pick_free_port()
    worker = serve_in_thread(streaming_backend(lockstep), backend_port)
    trees = {"this": None, **({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})}
    report: dict[str, Any] = {"steps_per_arm": args.stream_steps, "answer_tokens": args.stream_tokens,
                              "load_average": [os.getloadavg()[0]]}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="thunderctl-overhead-") as workdir:
        out = Path(workdir)
        gateways = {
            tree: ServeProcess([f"http://127.0.0.1:{backend_port}"], [], out / f"{tree}.log", pythonpath=path,
                               prefix=[*CALLGRIND, f"--callgrind-out-file={out / tree}.callgrind"] if args.callgrind else [])
            for tree, path in trees.items()
        }  # fmt: skip
        try:
            for gateway in gateways.values():
                gateway.wait_healthy(timeout=900 if args.callgrind else 300)  # valgrind starts Python slowly
            with httpx.Client(timeout=600) as client:
                if args.callgrind:
                    report |= counted_arms(client, gateways, args, lockstep, out)
                else:
                    report |= timed_arms(client, gateways, args, lockstep)
        finally:
            for gateway in gateways.values():
                gateway.stop()
            worker.should_exit = True
    report["load_average"].append(os.getloadavg()[0])
    return report


PARTS = ("gateway", "tick", "derivation-index", "derivation-gateway", "stream-cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--history-requests", type=int, default=200, help="64k-token requests per arm")
    parser.add_argument("--only", choices=PARTS, help="run one part")
    parser.add_argument("--api", choices=[*Api, "all"], default="chat", help="the API of part 3b")
    parser.add_argument("--stream-steps", type=int, default=60, help="streamed steps per arm (part 4)")
    parser.add_argument("--stream-histories", type=lambda s: [int(t) for t in s.split(",")], default=[8192, 32768],
                        help="history sizes in tokens, comma-separated (part 4)")  # fmt: skip
    parser.add_argument("--stream-tokens", type=int, default=96, help="answer tokens, one chunk each (part 4)")
    parser.add_argument("--stream-turns", type=int, default=8, help="steps per conversation (part 4)")
    parser.add_argument("--observation-words", type=int, default=300, help="a tool's output after each answer")
    parser.add_argument("--baseline-tree", type=Path, help="a second gateway arm: this checkout's code (part 4)")
    parser.add_argument(
        "--callgrind", action="store_true", help="part 4 counts instructions under valgrind's callgrind"
    )
    args = parser.parse_args()
    parts = {
        "gateway": lambda: gateway_latency(args.requests),
        "tick": tick_cost,
        "derivation-index": index_cost,
        "derivation-gateway": lambda: derivation_latency(
            args.history_requests, list(Api) if args.api == "all" else [args.api]
        ),
        "stream-cpu": lambda: stream_cpu(args),
    }
    report: dict[str, Any] = {name: run() for name, run in parts.items() if args.only in (None, name)}
    report["load_average"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
