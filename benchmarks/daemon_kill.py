"""The daemon killed with SIGKILL under closed-loop agent load, as an OpenAI SDK client sees it.

Brings up a cluster of simulated workers (profiles/sim.yaml's, on free ports, in a temporary state
directory), runs PROGRAMS named programs through the OpenAI SDK (default retries: 2), each a loop
of a chat request and a tool call, kills the daemon after KILL_AFTER_S, lets the load run on, and
reports: the time from the kill to the next daemon answering and to the first answer after it;
the requests the SDK gave up on (errors its caller saw) and the attempts it retried (by how they
ended); the programs the new daemon holds under their ids, with the steps it lost (answered before
the kill, after the journal's last write). Then `down`.

`python benchmarks/daemon_kill.py [--programs 48] [--workers 4] [--duration 40] [--kill-after 15]`
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import yaml

from thunderctl.cluster.state import ClusterState
from thunderctl.daemon.client import daemon_answers, fetch_status
from thunderctl.processes import pick_free_port, pick_free_ports, pid_alive
from thunderctl.profile import PROFILES_DIR

MODEL = "qwen3-32b"  # profiles/sim.yaml's served name


class CountingTransport(httpx.AsyncHTTPTransport):
    """Each attempt the SDK makes, by how it ended."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: Counter[str] = Counter()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await super().handle_async_request(request)
        except httpx.ConnectError:
            self.outcomes["refused"] += 1
            raise
        except httpx.TransportError as exc:
            self.outcomes[f"cut ({type(exc).__name__})"] += 1
            raise
        self.outcomes[f"HTTP {response.status_code}"] += 1
        return response


class Load:
    def __init__(self, endpoint: str, programs: int, tick_s: float) -> None:
        self.transport = CountingTransport()
        http = httpx.AsyncClient(transport=self.transport, timeout=httpx.Timeout(600, connect=60))
        self.client = openai.AsyncOpenAI(base_url=endpoint, api_key="unused", http_client=http)
        self.programs = programs
        # Each answer's (sending, end), by program.
        self.answered: dict[str, list[tuple[float, float]]] = {f"agent-{n}": [] for n in range(programs)}
        self.errors: list[str] = []
        self.stop = False

    async def agent(self, program: str) -> None:
        messages = [{"role": "user", "content": f"task of {program}"}]
        while not self.stop:
            sent_at = time.monotonic()
            try:
                answer = await self.client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=32, extra_body={"program_id": program}
                )  # fmt: skip
            except openai.OpenAIError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            self.answered[program].append((sent_at, time.monotonic()))
            messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                         {"role": "user", "content": "observation " * random.randint(20, 60)}]  # fmt: skip
            await asyncio.sleep(random.uniform(0.5, 2.0))  # its tool call


def cli(env: dict[str, str], *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "thunderctl", *args], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"thunderctl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


async def run(args: argparse.Namespace, state: ClusterState) -> None:
    endpoint = fetch_status(state).endpoint
    gateway = endpoint.removesuffix("/v1")
    load = Load(endpoint, args.programs, args.tick)
    agents = [asyncio.create_task(load.agent(p)) for p in load.answered]
    await asyncio.sleep(args.kill_after)
    pid = fetch_status(state).daemon_pid
    assert pid is not None
    written = fetch_status(state).daemon.journal
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    before = {p: len(ends) for p, ends in load.answered.items()}
    while pid_alive(pid):
        await asyncio.sleep(0.002)
    died_at = time.monotonic()
    while not await asyncio.to_thread(daemon_answers, state):
        await asyncio.sleep(0.05)
    back_s = time.monotonic() - killed_at
    restored = fetch_status(state).daemon.journal
    await asyncio.sleep(max(0.0, args.duration - args.kill_after))
    load.stop = True
    await asyncio.gather(*agents)
    # The first answer to a request sent once the daemon was dead: how long a client waited for service.
    first_after = min((e for ends in load.answered.values() for s, e in ends if s > died_at), default=None)
    programs = {p["program_id"]: p for p in httpx.get(f"{gateway}/programs", timeout=60).json()["programs"]}
    kept = [p for p in load.answered if p in programs]
    # Steps the new daemon lost: the client's answers minus the scheduler's count (0 where nothing was lost).
    lost = sum(len(load.answered[p]) - programs[p]["steps"] for p in kept)
    attempts = sum(load.transport.outcomes.values())
    answers = sum(len(ends) for ends in load.answered.values())
    print(
        f"programs {args.programs} on {args.workers} simulated workers, journal written every {args.tick:g} s "
        f"(last write {written.write_ms:.1f} ms on its thread, {written.capture_ms:.1f} ms on the loop)"
    )
    print(f"kill -9 of the daemon after {args.kill_after:g} s ({sum(before.values())} answers by then)")
    print(
        f"next daemon answering {back_s:.2f} s after the kill; the first request sent after the daemon's death answered "
        f"{(first_after - killed_at) if first_after else float('nan'):.2f} s after the kill; "
        f"{restored.restored_programs} programs restored"
    )
    print(
        f"client: {answers} answers, {len(load.errors)} failed requests (errors the SDK raised) in {attempts} "
        f"attempts: {dict(load.transport.outcomes)}; retried: {attempts - answers - len(load.errors)}"
    )
    print(
        f"programs under their ids after the restart: {len(kept)} of {args.programs}; steps lost "
        f"(answered after the journal's last write): {lost}"
    )
    for error in load.errors[:5]:
        print("  error:", error)
    for program in load.answered:
        httpx.post(f"{gateway}/programs/release", json={"program_id": program}, timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", type=int, default=48)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--kill-after", type=float, default=15.0)
    parser.add_argument("--tick", type=float, default=5.0, help="the scheduler's tick_interval_s")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        name = f"kill-{os.getpid()}"
        profile = yaml.safe_load((PROFILES_DIR / "sim.yaml").read_text())
        profile["cluster"] = name
        profile["nodes"] = [
            {"name": f"sim-{i}", "transport": "local", "replicas": 1, "base_port": port}
            for i, port in enumerate(pick_free_ports(args.workers))
        ]
        profile["gateway"]["port"] = pick_free_port()
        profile["scheduler"] = {"tick_interval_s": args.tick}
        path = Path(directory) / "profile.yaml"
        path.write_text(yaml.safe_dump(profile))
        env = os.environ | {"THUNDERCTL_STATE_DIR": str(Path(directory) / "state")}
        cli(env, "up", "-f", str(path))
        try:
            asyncio.run(run(args, ClusterState.load(Path(directory) / "state" / name)))
        finally:
            cli(env, "down")


if __name__ == "__main__":
    main()
