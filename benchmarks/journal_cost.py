"""What a journal write costs (daemon/journal.py): a gateway holding PROGRAMS programs, each with its
tool times, and REMEMBERED derived conversations, written whole (a daemon's first write) and then by a
tick's changes (each program one step further, then one in 20: its conversation continued and
answered), and each answer's own write before its end reaches the client, alone and many at once.

`python benchmarks/journal_cost.py [PROGRAMS] [REMEMBERED] [TICKS]`
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from thunderctl.daemon.journal import Journal
from thunderctl.gateway import Gateway, WorkerLink
from thunderctl.gateway.identity import IdentityConfig, Turn
from thunderctl.scheduler import SchedulerConfig
from thunderctl.sim.clock import VirtualClock


def loaded_gateway(programs: int, remembered: int) -> tuple[Gateway, VirtualClock]:
    clock = VirtualClock(0.0)
    links = [WorkerLink(f"w{i}", "http://127.0.0.1:9") for i in range(4)]
    gateway = Gateway(links, SchedulerConfig(), clock, identity=IdentityConfig(remembered_conversations=remembered))
    for link in links:
        gateway.scheduler.add_worker(link.id, 2_000_000)
    index = gateway.derived.conversations
    assert index is not None
    for n in range(remembered):  # conversations of programs that ended long ago, and the live ones last
        claim = index.follow(Turn(messages=[{"role": "user", "content": f"task {n}"}]))
        assert claim is not None
        index.answered(claim, message={"content": f"answer {n}"})
    for n in range(programs):
        step(gateway, clock, f"p{n}", 30)
    return gateway, clock


def step(gateway: Gateway, clock: VirtualClock, program: str, steps: int = 1) -> None:
    scheduler = gateway.scheduler
    for _ in range(steps):
        scheduler.on_request(program, 4000 + 300 * scheduler.programs.get(program, _Zero).steps, group=program[:3])
        clock.now += 0.01
        scheduler.on_response(program, 4000, 50, tool="bash")
        clock.now += 0.01


class _Zero:
    steps = 0


async def measure(programs: int, remembered: int, ticks: int) -> None:
    gateway, clock = loaded_gateway(programs, remembered)
    index = gateway.derived.conversations
    assert index is not None
    with tempfile.TemporaryDirectory() as directory:
        journal = Journal(Path(directory) / "journal.sqlite")
        journal.follow(gateway)
        started = time.perf_counter()
        await journal.write(gateway)
        whole = journal.stats
        print(f"whole write: {1000 * (time.perf_counter() - started):.0f} ms (on the loop {whole.capture_ms:.1f} ms, "
              f"thread {whole.write_ms:.0f} ms): {whole.programs} programs, {whole.conversations} conversations")  # fmt: skip
        live = [await claim_of(gateway, n) for n in range(programs)]
        for every, which in ((1, "every program"), (20, "one program in 20")):
            loop_ms, thread_ms = await tick_writes(gateway, clock, journal, live, ticks, every)
            print(f"a tick's write, {which} one step on ({ticks} ticks): on the loop median "
                  f"{statistics.median(loop_ms):.1f} ms (max {max(loop_ms):.1f}), on the thread median "
                  f"{statistics.median(thread_ms):.1f} ms (max {max(thread_ms):.1f})")  # fmt: skip
        # An answer's own write (Journal.keep), awaited before its end reaches the client: one answer at
        # a time (each its own transaction), then every program's answer at once (they share writes).
        alone_ms = []
        for n, program in enumerate(list(gateway.scheduler.programs)):
            step(gateway, clock, program)
            index.answered(live[n], message={"content": f"kept {clock.now}"})
            started = time.perf_counter()
            await journal.keep(gateway, program)
            alone_ms.append(1000 * (time.perf_counter() - started))
        alone_ms.sort()
        print(f"an answer kept alone ({len(alone_ms)} answers): median {statistics.median(alone_ms):.2f} ms, "
              f"p99 {alone_ms[int(0.99 * len(alone_ms))]:.2f} ms")  # fmt: skip
        for n, program in enumerate(list(gateway.scheduler.programs)):
            step(gateway, clock, program)
            index.answered(live[n], message={"content": f"together {clock.now}"})
        started = time.perf_counter()
        await asyncio.gather(*(journal.keep(gateway, p) for p in list(gateway.scheduler.programs)))
        print(f"{programs} answers kept at once: {1000 * (time.perf_counter() - started):.0f} ms for all")
        size = sum(f.stat().st_size for f in Path(directory).iterdir())
        print(f"journal on disk: {size / 1e6:.1f} MB")
        journal.close()
        reader = Journal(Path(directory) / "journal.sqlite")
        started = time.perf_counter()
        restored = reader.load()
        assert restored is not None
        fresh = Gateway([WorkerLink(f"w{i}", "http://127.0.0.1:9") for i in range(4)], SchedulerConfig(), clock,
                        identity=IdentityConfig(remembered_conversations=remembered))  # fmt: skip
        for link in fresh.links.values():
            fresh.scheduler.add_worker(link.id, 2_000_000)
        fresh._restore(restored)
        print(f"read back and restored: {1000 * (time.perf_counter() - started):.0f} ms")
        reader.close()
        await gateway.stop()
        await fresh.stop()


async def tick_writes(
    gateway: Gateway, clock: VirtualClock, journal: Journal, live: list, ticks: int, every: int
) -> tuple[list[float], list[float]]:
    """`ticks` writes, each after one program in `every` took a step (the others in a tool call
    through the tick); each write's milliseconds on the loop and on the journal's thread."""
    index = gateway.derived.conversations
    assert index is not None
    loop_ms, thread_ms = [], []
    for tick in range(ticks):
        for n, program in enumerate(list(gateway.scheduler.programs)):
            if n % every == tick % every:
                step(gateway, clock, program)
                index.answered(live[n], message={"content": f"step {clock.now}"})
        await journal.write(gateway)
        loop_ms.append(journal.stats.capture_ms)
        thread_ms.append(journal.stats.write_ms)
    return loop_ms, thread_ms


async def claim_of(gateway: Gateway, n: int):
    claim = await gateway.relay.follow(Turn(messages=[{"role": "user", "content": f"live {n}"}]))
    assert claim is not None
    return claim


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    asyncio.run(measure(*(args + [1000, 65_536, 5][len(args) :])))
