"""Gateway relay throughput: streamed SSE chunks per second through `thunderctl serve` vs straight to the engine.

    python benchmarks/relay_throughput.py                          # 1, 64 and 512 streams, ~4 minutes
    python benchmarks/relay_throughput.py --streams 512 --slice-s 20 --slices 2
    python benchmarks/relay_throughput.py --client unchanged       # no program ids: programs found from the conversation
    python benchmarks/relay_throughput.py --streams 64 --turns 8 --observation-words 400 --answer-tokens 16
                                                                   # conversations: the per-request cost
    python benchmarks/relay_throughput.py --baseline-tree /tmp/main # a second gateway arm, another tree's code
    python benchmarks/relay_throughput.py --engine-arg=--stream-interval=4  # the workers' stream interval

A simulated engine (`thunderctl engine sim --time-scale 0`: every step as fast as Python can
take it, so its answer is paced by the machine, not by a model) and a gateway in front of it,
each a subprocess on loopback. Per concurrency, closed-loop streams (each sends a streamed chat
request, reads it to `[DONE]`, sends the next) go in two arms, `direct` (to the engine) and
`gateway` (through it), alternated in slices (direct, gateway, gateway, direct...) so that drift
of this shared machine lands on both alike; `--baseline-tree` adds a third, `baseline`, a gateway
run from another checkout (the code before a change), in the same rotation; `--proxy` adds
`proxy`, a pass-through proxy (passthrough.py): what any hop costs, beside what the gateway does.
The load comes from --clients processes, so that one client process's CPU is not the ceiling.

`--client named` sends a program id per stream; `unchanged` sends none, so the gateway finds each
request's program from its conversation. With `--turns N` each stream is an agent's conversation
of N requests: the next one carries the history, the answer it read (echoed back) and an
observation of `--observation-words` words, so the gateway's per-request work (the body, the
conversation's identity) grows with the history as an agent's does; then a new conversation.

Per arm: chunks/s (SSE `data:` lines the clients read, `[DONE]` not counted) and answer
tokens/s over the steady window, the p50 of the time to first token (the first chunk after the
role chunk) and of the whole request, and the CPU time each process spent per chunk,
with the load average around the slice; and the gateway's CPU per request (ms) and per answer
token (µs), its CPU time (utime + stime) over all it served in the slice divided by each. These
do not depend on what else shares the machine: 1 / (its CPU s per chunk) is what one gateway
process relays with a core of its own. The two divide one total: a load of short answers
(`--answer-tokens 4`) makes the per-request figure the per-request cost, a load of long ones
the per-token figure the per-token cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

import aiohttp
import psutil
from local_stack import cpu_seconds, passthrough
from rich.console import Console
from rich.table import Table

from thunderctl import aio
from thunderctl.engines.child import ChildServer
from thunderctl.engines.simulated.process import SimProcess
from thunderctl.gateway.process import ServeProcess

MODEL = "sim"
PROMPT = "relay throughput probe: answer with as many words as you are asked for"
CLIENTS = ("named", "unchanged")


@dataclass(frozen=True)
class ClientJob:
    """One load-generator process's share of a slice."""

    url: str
    headers: dict[str, str]
    streams: int
    first_stream: int
    answer_tokens: int
    start_at: float  # wall clock (time.time()): every client of a slice starts together
    warmup_s: float
    window_s: float
    program_ids: bool
    turns: int  # requests per conversation
    observation: str  # appended after each answer, as a tool's output


@dataclass
class ClientResult:
    chunks: int = 0  # read inside the window
    chunks_all: int = 0  # read over the whole slice, warm-up and the end included
    requests: int = 0  # finished inside the window
    requests_all: int = 0  # finished over the whole slice
    failed: int = 0
    ttft_s: list[float] = field(default_factory=list)  # of requests sent inside the window, first token inside it
    total_s: list[float] = field(default_factory=list)  # of requests sent and finished inside the window
    cpu_s: float = 0.0  # this process, over the whole slice
    errors: list[str] = field(default_factory=list)


def answer_text(line: bytes) -> str:
    """The content an SSE chunk adds to the answer."""
    choices = json.loads(line[len(b"data: ") :]).get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


async def one_stream(session: aiohttp.ClientSession, job: ClientJob, index: int, result: ClientResult) -> None:
    loop_start = time.perf_counter() - (time.time() - job.start_at)
    window = (loop_start + job.warmup_s, loop_start + job.warmup_s + job.window_s)
    headers = {"content-type": "application/json", **job.headers}
    messages: list[dict[str, str]] = []
    conversations = 0
    while time.perf_counter() < window[1]:
        if len(messages) // 2 % job.turns == 0:  # a new conversation
            conversations += 1
            messages = [{"role": "user", "content": f"{PROMPT} {index}-{conversations}"}]
        body: dict[str, object] = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": job.answer_tokens,
            "stream": True,
        }
        if job.program_ids:
            body["program_id"] = f"relay-{index}-{conversations}"
        payload = json.dumps(body).encode()
        answer: list[str] = []
        sent = time.perf_counter()
        data_lines = 0
        try:
            async with session.post(f"{job.url}/v1/chat/completions", data=payload, headers=headers) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]!r}")
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    data_lines += 1
                    if job.turns > 1:
                        answer.append(answer_text(line))
                    now = time.perf_counter()
                    if data_lines == 2 and window[0] <= sent and now < window[1]:  # the first after the role chunk
                        result.ttft_s.append(now - sent)
                    result.chunks_all += 1
                    if window[0] <= now < window[1]:
                        result.chunks += 1
        except (TimeoutError, aiohttp.ClientError, RuntimeError) as exc:
            result.failed += 1
            if len(result.errors) < 5:
                result.errors.append(repr(exc))
            continue
        done = time.perf_counter()
        result.requests_all += 1
        messages = [
            *messages,
            {"role": "assistant", "content": "".join(answer)},
            {"role": "user", "content": job.observation},
        ]
        if window[0] <= done < window[1]:
            result.requests += 1
            if sent >= window[0]:
                result.total_s.append(done - sent)


async def client_load(job: ClientJob) -> ClientResult:
    result = ClientResult()
    await asyncio.sleep(max(0.0, job.start_at - time.time()))
    # aiohttp, not httpx: its C parser reads a chunk for a fraction of httpx's CPU, and its pool
    # does not scan every connection per request, so the client is not what is measured.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(one_stream(session, job, job.first_stream + i, result) for i in range(job.streams)))
    return result


def run_client(job: ClientJob) -> ClientResult:
    """A load-generator process: its streams, then its own CPU time."""
    started = time.process_time()
    result = aio.run(client_load(job))
    result.cpu_s = time.process_time() - started
    return result


@dataclass
class SliceResult:
    arm: str
    streams: int
    window_s: float
    chunks: int  # inside the window
    chunks_all: int  # over the slice, what the CPU seconds were spent on
    requests: int
    requests_all: int  # over the slice, as chunks_all
    failed: int
    ttft_s: list[float]
    total_s: list[float]
    cpu_s: dict[str, float]  # engine, gateway, clients
    load_average: tuple[float, float]  # 1-minute, at the start and at the end
    errors: list[str]


def run_slice(
    pool: ProcessPoolExecutor,
    arm: str,
    url: str,
    headers: dict[str, str],
    streams: int,
    args: argparse.Namespace,
    servers: dict[str, psutil.Process],
) -> SliceResult:
    clients = min(args.clients, streams)
    shares = [streams // clients + (i < streams % clients) for i in range(clients)]
    start_at = time.time() + 1.0  # time for every client process to be scheduled
    jobs = [
        ClientJob(
            url=url,
            headers=headers,
            streams=share,
            first_stream=sum(shares[:i]),
            answer_tokens=args.answer_tokens,
            start_at=start_at,
            warmup_s=args.warmup_s,
            window_s=args.slice_s,
            program_ids=arm not in ("direct", "proxy") and args.client == "named",
            turns=args.turns,
            observation=" ".join(f"line{i % 97}" for i in range(args.observation_words)),
        )
        for i, share in enumerate(shares)
    ]
    load_before = os.getloadavg()[0]
    before = {name: cpu_seconds(p) for name, p in servers.items()}
    results = list(pool.map(run_client, jobs))
    after = {name: cpu_seconds(p) for name, p in servers.items()}
    return SliceResult(
        arm=arm,
        streams=streams,
        window_s=args.slice_s,
        chunks=sum(r.chunks for r in results),
        chunks_all=sum(r.chunks_all for r in results),
        requests=sum(r.requests for r in results),
        requests_all=sum(r.requests_all for r in results),
        failed=sum(r.failed for r in results),
        ttft_s=[t for r in results for t in r.ttft_s],
        total_s=[t for r in results for t in r.total_s],
        cpu_s={**{name: after[name] - before[name] for name in servers}, "clients": sum(r.cpu_s for r in results)},
        load_average=(load_before, os.getloadavg()[0]),
        errors=[e for r in results for e in r.errors][:5],
    )


@dataclass
class ArmFigures:
    arm: str
    streams: int
    chunks_per_s: float
    tokens_per_s: float
    ttft_p50_ms: float | None
    total_p50_ms: float | None
    failed: int
    cpu_us_per_chunk: dict[str, float]
    gateway_ms_per_request: float | None  # the serving process's CPU over the requests it served
    gateway_us_per_token: float | None
    load_average: tuple[float, float]  # lowest and highest seen around its slices


def pooled(slices: list[SliceResult], answer_tokens: int) -> ArmFigures:
    seconds = sum(s.window_s for s in slices)
    chunks = sum(s.chunks for s in slices)
    chunks_all = sum(s.chunks_all for s in slices)
    ttft = [t for s in slices for t in s.ttft_s]
    total = [t for s in slices for t in s.total_s]
    cpu = {name: sum(s.cpu_s.get(name, 0.0) for s in slices) for name in slices[0].cpu_s}
    loads = [value for s in slices for value in s.load_average]
    requests_all = sum(s.requests_all for s in slices)
    served = cpu.get("gateway") if slices[0].arm != "direct" else None
    return ArmFigures(
        arm=slices[0].arm,
        streams=slices[0].streams,
        chunks_per_s=chunks / seconds,
        tokens_per_s=sum(s.requests for s in slices) * answer_tokens / seconds,
        ttft_p50_ms=statistics.median(ttft) * 1e3 if ttft else None,
        total_p50_ms=statistics.median(total) * 1e3 if total else None,
        failed=sum(s.failed for s in slices),
        cpu_us_per_chunk={name: 1e6 * value / max(chunks_all, 1) for name, value in cpu.items()},
        gateway_ms_per_request=None if served is None else 1e3 * served / max(requests_all, 1),
        gateway_us_per_token=None if served is None else 1e6 * served / max(requests_all * answer_tokens, 1),
        load_average=(min(loads), max(loads)),
    )


def arm_order(arms: tuple[str, ...], slices: int, flip: bool) -> list[str]:
    """direct, gateway, gateway, direct, ... (ABBA; ABCCBA with three arms), reversed when `flip`."""
    first = arms[::-1] if flip else arms
    return [arm for i in range(slices) for arm in (first if i % 2 == 0 else first[::-1])]


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(points: list[dict[str, ArmFigures]], console: Console) -> None:
    table = Table(title="relay throughput: direct to the sim engine vs through thunderctl serve")
    columns = ("streams", "arm", "chunks/s", "tokens/s", "TTFT p50 ms", "total p50 ms", "failed")
    for column in (*columns, "CPU µs/chunk: engine / gateway / clients", "gateway CPU ms/request",
                   "gateway CPU µs/token", "load avg", "÷ direct"):  # fmt: skip
        table.add_column(column, justify="left" if column == "arm" else "right")
    for point in points:
        direct = point["direct"]
        for name, figures in point.items():
            cpu = figures.cpu_us_per_chunk
            ratio = figures.chunks_per_s / direct.chunks_per_s if direct.chunks_per_s else 0.0
            table.add_row(
                str(figures.streams), name, f"{figures.chunks_per_s:,.0f}", f"{figures.tokens_per_s:,.0f}",
                ms(figures.ttft_p50_ms), ms(figures.total_p50_ms), str(figures.failed),
                " / ".join(f"{cpu[k]:.0f}" if k in cpu else "-" for k in ("engine", "gateway", "clients")),
                ms(figures.gateway_ms_per_request),
                "-" if figures.gateway_us_per_token is None else f"{figures.gateway_us_per_token:.0f}",
                f"{figures.load_average[0]:.1f}-{figures.load_average[1]:.1f}",
                f"{ratio:.2f}x" if name != "direct" else "",
            )  # fmt: skip
            if name == "direct":
                continue
            added = {
                what: ms(b - a if a is not None and b is not None else None)
                for what, a, b in (
                    ("TTFT", direct.ttft_p50_ms, figures.ttft_p50_ms),
                    ("request", direct.total_p50_ms, figures.total_p50_ms),
                )
            }
            console.print(
                f"{direct.streams} streams: {name} adds {added['TTFT']} ms to the p50 TTFT "
                f"and {added['request']} ms to the p50 request"
            )
    console.print(table)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,64,512", help="concurrent streams, comma-separated")
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    parser.add_argument("--answer-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--slices", type=int, default=2, help="slices per arm and concurrency (ABBA order)")
    parser.add_argument("--slice-s", type=float, default=20.0, help="measured seconds per slice")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="seconds of load before each slice's window")
    parser.add_argument("--engine-arg", action="append", default=[], help="one more `engine sim` option")
    parser.add_argument("--gateway-arg", action="append", default=[], help="one more `thunderctl serve` option")
    parser.add_argument("--client", choices=CLIENTS, default="named",
                        help="named: a program id per conversation through the gateway; unchanged: none, the gateway "
                        "finds the program from the conversation (with --gateway-arg=--no-derive-programs: unscheduled)")  # fmt: skip
    parser.add_argument("--turns", type=int, default=1, help="requests per conversation, each carrying the history")
    parser.add_argument("--observation-words", type=int, default=200,
                        help="with --turns: words of the observation after each answer")  # fmt: skip
    parser.add_argument("--baseline-tree", type=Path,
                        help="a checkout of thunderctl whose gateway runs as a third arm, `baseline` (the code before a change)")  # fmt: skip
    parser.add_argument("--baseline-arg", action="append", default=[],
                        help="one more `thunderctl serve` option for the baseline only (with --baseline-tree)")  # fmt: skip
    parser.add_argument("--proxy", action="store_true",
                        help="one more arm, `proxy`: the engine behind a pass-through proxy (passthrough.py), no gateway")  # fmt: skip
    parser.add_argument("--profile", type=Path,
                        help="record the gateway with py-spy: a flame graph (.svg) or collapsed stacks (other names)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("results/relay_throughput.json"))
    args = parser.parse_args()
    if args.turns < 1:
        parser.error("--turns must be at least 1")
    if args.baseline_tree is not None and not (args.baseline_tree / "thunderctl" / "__init__.py").is_file():
        parser.error(f"--baseline-tree {args.baseline_tree}: no thunderctl package there; give a checkout's root")
    return args


def main() -> None:
    args = parse_args()
    console = Console(width=170)
    concurrencies = [int(s) for s in args.streams.split(",")]
    engine_options = ["--time-scale", "0", "--served-model-name", MODEL, *args.engine_arg]
    trees = {"gateway": None, **({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})}
    arms = ("direct", *(("proxy",) if args.proxy else ()), *trees)
    with tempfile.TemporaryDirectory(prefix="thunderctl-relay-") as workdir, contextlib.ExitStack() as stack:
        engine = SimProcess(engine_options, Path(workdir) / "engine.log")
        gateways: dict[str, ServeProcess] = {}
        hops: dict[str, ChildServer] = {}
        profiler = None
        try:
            engine.wait_healthy(timeout=300)
            if args.proxy:
                hops["proxy"] = stack.enter_context(passthrough(engine.url, Path(workdir)))
            for arm, tree in trees.items():
                options = [*args.gateway_arg, *(args.baseline_arg if arm == "baseline" else [])]
                gateways[arm] = ServeProcess([engine.url], options, Path(workdir) / f"{arm}.log", pythonpath=tree)
                gateways[arm].wait_healthy(timeout=300)  # a loaded machine starts Python slowly
            if args.profile:
                profiler = subprocess.Popen(
                    ["py-spy", "record", "--pid", str(gateways["gateway"].process.pid), "--output", str(args.profile),
                     "--format", "flamegraph" if args.profile.suffix == ".svg" else "raw", "--rate", "200",
                     "--nonblocking"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
            engine_process = psutil.Process(engine.process.pid)
            # Each arm counts the CPU of the engine and of the gateway it goes through.
            # The proxy's CPU is counted where a gateway's is: it is the process the arm goes through.
            servers = {"direct": {"engine": engine_process}} | {
                arm: {"engine": engine_process, "gateway": psutil.Process(g.process.pid)}
                for arm, g in (hops | gateways).items()
            }
            targets = (
                {"direct": (engine.url, {})}
                | {arm: (hop.url, {}) for arm, hop in hops.items()}
                | {arm: (g.url, g.headers) for arm, g in gateways.items()}
            )
            points = []
            with ProcessPoolExecutor(max_workers=args.clients, mp_context=get_context("spawn")) as pool:
                for n, streams in enumerate(concurrencies):
                    slices: dict[str, list[SliceResult]] = {arm: [] for arm in arms}
                    for arm in arm_order(arms, args.slices, flip=n % 2 == 1):
                        url, headers = targets[arm]
                        with console.status(f"{streams} streams, {arm}"):
                            result = run_slice(pool, arm, url, headers, streams, args, servers[arm])
                        slices[arm].append(result)
                        console.print(
                            f"{streams:>4} {arm:<8} {result.chunks / result.window_s:>9,.0f} chunks/s "
                            f"({result.failed} failed{'; ' + result.errors[0] if result.errors else ''}), "
                            f"load {result.load_average[0]:.1f}"
                        )
                    points.append({arm: pooled(slices[arm], args.answer_tokens) for arm in arms})
        finally:
            if profiler is not None:
                profiler.send_signal(2)  # SIGINT: py-spy writes its profile and exits
                profiler.wait(timeout=60)
            for gateway in gateways.values():
                gateway.stop()
            engine.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"settings": {k: str(v) for k, v in vars(args).items()}, "points": [
        {arm: asdict(figures) for arm, figures in point.items()} for point in points
    ]}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2))
    render(points, console)
    console.print(f"written {args.out}")


if __name__ == "__main__":
    sys.exit(main())
