"""Sandbox pool benchmark on a real Docker engine (a measurement, not a test).

    python benchmarks/sandbox_pool.py --image IMAGE [--samples 20] [--programs 8]

1. Acquire latency, warm vs cold: time from `acquire` until the sandbox is ready, and until a
   first command (`true`) has run in it, one acquire at a time. Cold: no warm pool, so a
   container is created and started. Warm: the pool is topped up before each acquire (the hit
   path), so a ready one is handed out.
2. Preparation overlapped with a paused program's wait. Programs arrive paused (waiting for GPU
   memory) and resume one every `--resume-every` seconds in the scheduler's order, the reverse
   of their arrival. Each needs a sandbox whose setup takes `--setup-s`. Measured: how long
   each program still waits for its sandbox after it resumes, under three arms:
   - on resume: the sandbox is asked for only when the program resumes (no overlap);
   - queued, arrival order: asked for on arrival, prepared first come first served;
   - queued, resume order: asked for on arrival, and the pool is told the resume queue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable

from thunderctl.sandbox.config import SandboxConfig
from thunderctl.sandbox.pool import SandboxPool
from thunderctl.sandbox.stats import percentiles


async def time_to_ready_and_first_command(pool: SandboxPool, program_id: str) -> tuple[float, float]:
    started = time.monotonic()
    sandbox = await pool.wait_ready((await pool.acquire(program_id)).id, 60)
    ready = time.monotonic() - started
    await pool.exec(sandbox.id, "true")
    first_command = time.monotonic() - started
    await pool.program_ended(program_id)
    return ready, first_command


async def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the warm pool did not fill")
        await asyncio.sleep(0.02)


async def acquire_latency(config: SandboxConfig, samples: int, warm: bool) -> dict:
    pool = SandboxPool(config.model_copy(update={"warm": 2 if warm else 0}), cluster=f"bench-{secrets.token_hex(3)}")
    await pool.start()
    try:
        samples_s = []
        for n in range(samples):
            if warm:
                await wait_for(lambda: pool.stats()["warm"] == 2)
            samples_s.append(await time_to_ready_and_first_command(pool, f"p{n}"))
        return {"ready": percentiles(r for r, _ in samples_s), "first_command": percentiles(c for _, c in samples_s)}
    finally:
        await pool.shutdown()


async def overlapped_wait(
    config: SandboxConfig, programs: int, resume_every_s: float, setup_s: float, arm: str
) -> dict:
    pool = SandboxPool(
        config.model_copy(update={"warm": 0, "prepare_concurrency": 2}), cluster=f"bench-{secrets.token_hex(3)}"
    )
    await pool.start()
    arrivals = [f"p{n}" for n in range(programs)]
    resume_order = list(reversed(arrivals))  # e.g. shortest first: not arrival order
    setup = f"sleep {setup_s}"
    try:
        sandboxes = {}
        if arm == "queued, resume order":
            pool.program_queue(resume_order)  # the scheduler queued them as they were paused
        if arm != "on resume":
            for program_id in arrivals:
                sandboxes[program_id] = await pool.acquire(program_id, setup=setup)
        waits = []
        started = time.monotonic()
        for slot, program_id in enumerate(resume_order, start=1):
            await asyncio.sleep(max(0.0, started + slot * resume_every_s - time.monotonic()))
            resumed = time.monotonic()
            if arm == "on resume":
                sandboxes[program_id] = await pool.acquire(program_id, setup=setup)
            # A resumed program leaves the waiting queue: its sandbox is now needed at once.
            pool.program_queue(resume_order[slot:] if arm == "queued, resume order" else [])
            waits.append(asyncio.create_task(_after(resumed, pool.wait_ready(sandboxes[program_id].id, 120))))
        results = await asyncio.gather(*waits)
        return percentiles(results) | {"mean": round(sum(results) / len(results), 4)}
    finally:
        await pool.shutdown()


async def _after(since: float, ready: Awaitable[object]) -> float:
    await ready
    return time.monotonic() - since


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--programs", type=int, default=8)
    parser.add_argument("--resume-every", type=float, default=1.0, dest="resume_every_s")
    parser.add_argument("--setup-s", type=float, default=1.0)
    args = parser.parse_args()
    config = SandboxConfig(image=args.image, memory="256m", maintenance_interval_s=3600)

    report = {
        "acquire_latency_s": {
            "cold": await acquire_latency(config, args.samples, warm=False),
            "warm": await acquire_latency(config, args.samples, warm=True),
        },
        "wait_for_sandbox_after_resume_s": {
            arm: await overlapped_wait(config, args.programs, args.resume_every_s, args.setup_s, arm)
            for arm in ("on resume", "queued, arrival order", "queued, resume order")
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
