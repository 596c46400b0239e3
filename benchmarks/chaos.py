"""Chaos: agents through the OpenAI SDK while workers and the daemon are killed with SIGKILL.

    python benchmarks/chaos.py                                   # 1,024 programs, 8 workers, 20 minutes
    python benchmarks/chaos.py --minutes 1 --workers 2 --programs 32 --worker-kill-every 20 --daemon-kill-every 40
    python benchmarks/chaos.py --out results/chaos.json --keep results/chaos   # and the daemon's log, every call

`thunderctl up` of a cluster of `thunderctl engine sim` workers (profiles/sim.yaml's preset, one
node per worker, on free ports, in a state directory of its own), then agents in asyncio tasks
over `--processes` load-generator processes, each process one `openai.AsyncOpenAI` client with the
SDK's defaults (2 retries, its timeouts and connection limits). The agents are unchanged clients:
they name no program, so the gateway derives each one's program from its conversation and says
which in the answer's `X-Program-Id` header. An agent loops: a chat request with its history and a
tool offered, the answer (a tool call) and a tool result appended, a tool wait, the next turn;
after its last turn (or a request the SDK gave up on) a new conversation starts.

Every `--worker-kill-every` seconds a random worker's process group is killed (-9), every
`--daemon-kill-every` seconds the daemon (its pid, not its supervisor's); a worker kill due with a
daemon kill gives way to it, and no fault comes within `--settle` seconds of the end. Per fault:
when it was back (the worker ready again in `status`, the next daemon answering its control
socket), the time to serving again (the first answer to a request sent after the kill, to a
program that was on the worker; or sent after the daemon's death, to any program), the requests
that failed as the client saw them (after the SDK's retries) and those the SDK retried (every
attempt counted by an httpx event hook), ending between this fault and the next, and the programs lost: of the conversations live at the
kill, those whose next request failed or was answered under another program id (the client's
view), and those whose program id, listed in `/programs` before the kill, was gone from it
`--settle` seconds later while the conversation went on (the gateway's view). The daemon's RSS
every 10 s (psutil, whichever daemon runs), against its value at 5 minutes (the target: at most
10 % above). `down` at the end, and a check that no process it started is left.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import contextvars
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
from soak import MODEL, Cluster, SoakSpec, soak_profile

from thunderctl.cluster.state import ClusterState
from thunderctl.daemon.client import daemon_answers, fetch_status
from thunderctl.processes import pid_alive

MIB = 2**20
RSS_EVERY_S = 10.0
RSS_REFERENCE_S = 300.0  # the daemon's RSS at 5 minutes is what the rest of the run is held to
RSS_GROWTH_ALLOWED = 0.10
BACK_TIMEOUT_S = 180.0  # how long a killed worker or daemon may take to come back before the run says so
POLL_S = 0.25
# After the deadline, requests in flight may finish for this long before their agents are cancelled.
GRACE_S = 120.0
# An agent's conversations: bounded in count as well as by the deadline.
MAX_CONVERSATIONS = 10_000
SYSTEM = "You are a coding agent. Run one shell command per turn with the bash tool and read its output. " * 8
BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
WORDS = "build test file error line module import function value result output pass fail".split()


@dataclass
class Attempts:
    """The HTTP requests one SDK call made, as its client's event hook saw them go."""

    count: int = 0
    last_s: float = 0.0  # when the last one went (monotonic)
    statuses: list[int] = field(default_factory=list)  # of the answers that came (an attempt cut off has none)

    def causes(self) -> list[str]:
        """What each attempt that did not succeed met: an error status, or no answer (refused, reset, timed out)."""
        errors = [f"HTTP {status}" for status in self.statuses if status >= 400]
        return errors + ["no answer"] * (self.count - len(self.statuses))

    def call(
        self, conversation: str, turn: int, sent_s: float, program: str | None, error: str | None, final: bool
    ) -> Call:
        """The call these were the attempts of, ended now."""
        return Call(
            conversation, turn, sent_s, time.monotonic(), self.count, self.last_s, self.causes(), program, error, final
        )


# The attempts of the SDK call the current task makes: the event hook counts into it.
ATTEMPTS: contextvars.ContextVar[Attempts] = contextvars.ContextVar("attempts")


@dataclass(frozen=True)
class ChaosSpec:
    minutes: float = 20.0
    workers: int = 8
    programs: int = 1024  # agents at once, each a closed loop of conversations
    worker_kill_every_s: float = 120.0
    daemon_kill_every_s: float = 300.0
    settle_s: float = 45.0  # after a kill, when /programs is read again (longer than a tool wait)
    processes: int = 4  # load-generator processes, one SDK client each
    turns: tuple[int, int] = (4, 12)  # per conversation, uniform
    tool_s: tuple[float, float] = (10.0, 30.0)  # the tool wait between turns, uniform
    observation_words: tuple[int, int] = (30, 90)
    answer_tokens: int = 16
    engine_time_scale: float = 2.0  # wall seconds per simulated engine second
    tick_interval_s: float = 2.0
    seed: int = 0


@dataclass(frozen=True)
class Call:
    """One SDK call as the agent saw it."""

    conversation: str  # the agent's own name for it (never sent)
    turn: int
    sent_s: float  # time.monotonic(), one clock for every process of this machine
    ended_s: float
    attempts: int  # HTTP requests the SDK made for it (1: not retried)
    last_attempt_s: float  # when the last of them went
    causes: list[str]  # what the attempts that did not succeed met
    program: str | None  # the answer's X-Program-Id
    error: str | None  # what the SDK raised once its retries were spent; None: answered
    final: bool  # the conversation's last turn


@dataclass
class Fault:
    kind: str  # "worker" or "daemon"
    at_s: float  # planned, seconds into the run
    target: str  # the worker's id, or the daemon's pid
    killed_s: float  # monotonic
    died_s: float | None = None  # the daemon's pid gone
    back_s: float | None = None  # seconds from the kill: the worker ready again, the next daemon answering
    before: dict[str, str | None] = field(default_factory=dict)  # /programs just before: id → worker
    after: set[str] = field(default_factory=set)  # /programs ids `settle_s` after
    after_read_s: float = 0.0


@dataclass(frozen=True)
class RssSample:
    t_s: float
    pid: int
    rss_mib: float


# --- the load: agents in load-generator processes ----------------------------------------------------


async def count_attempt(request: Any) -> None:
    """The SDK's HTTP client's request hook: one more attempt for the call in this task."""
    attempts = ATTEMPTS.get(None)
    if attempts is not None:
        attempts.count += 1
        attempts.last_s = time.monotonic()


async def note_answer(response: Any) -> None:
    """Its response hook: the status of the answer to the call's last attempt."""
    attempts = ATTEMPTS.get(None)
    if attempts is not None:
        attempts.statuses.append(response.status_code)


def words(rng: random.Random, span: tuple[int, int]) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*span)))


async def conversation(
    client: openai.AsyncOpenAI, name: str, spec: ChaosSpec, deadline: float, rng: random.Random, calls: list[Call]
) -> None:
    """One agent's conversation: a turn after each tool wait, until its last turn, a failed call or the deadline."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task {name}: {words(rng, spec.observation_words)}"},
    ]
    turns = rng.randint(*spec.turns)
    for turn in range(turns):
        if time.monotonic() >= deadline:
            return
        attempts = Attempts()
        ATTEMPTS.set(attempts)
        sent = time.monotonic()
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                tools=[BASH],  # type: ignore[list-item]
                max_tokens=spec.answer_tokens,
            )
            completion = raw.parse()
        except openai.OpenAIError as exc:
            calls.append(attempts.call(name, turn, sent, None, f"{type(exc).__name__}: {exc}", final=True))
            return  # the agent gives up on this task
        final = turn == turns - 1
        calls.append(attempts.call(name, turn, sent, raw.headers.get("x-program-id"), None, final))
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        observation = words(rng, spec.observation_words)
        calls_made = message.tool_calls or []
        messages += [{"role": "tool", "tool_call_id": c.id, "content": observation} for c in calls_made]
        if not calls_made:
            messages.append({"role": "user", "content": observation})
        if not final:
            await asyncio.sleep(rng.uniform(*spec.tool_s))


async def agent(
    client: openai.AsyncOpenAI, name: str, spec: ChaosSpec, deadline: float, rng: random.Random, calls: list[Call]
) -> None:
    """Conversations one after another until the deadline; the first starts within a tool wait, so
    that the agents' turns are spread out from the start."""
    await asyncio.sleep(rng.uniform(0, spec.tool_s[1]))
    for n in range(MAX_CONVERSATIONS):
        if time.monotonic() >= deadline:
            return
        await conversation(client, f"{name}-c{n}", spec, deadline, rng, calls)


async def agents(endpoint: str, names: list[str], spec: ChaosSpec, deadline: float) -> list[Call]:
    calls: list[Call] = []
    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [count_attempt], "response": [note_answer]})
    async with openai.AsyncOpenAI(base_url=endpoint, api_key="unused", http_client=http) as client:
        tasks = [
            asyncio.create_task(agent(client, name, spec, deadline, random.Random(f"{spec.seed}-{name}"), calls))
            for name in names
        ]
        _, late = await asyncio.wait(tasks, timeout=deadline + GRACE_S - time.monotonic())
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    return calls


def run_agents(endpoint: str, names: list[str], spec: ChaosSpec, deadline: float) -> list[dict[str, Any]]:
    """A load-generator process: its agents, and what they saw, as plain dicts (this runs in a spawned
    process, where this script's classes are another module's)."""
    return [asdict(call) for call in asyncio.run(agents(endpoint, names, spec, deadline))]


# --- the faults --------------------------------------------------------------------------------------


def plan(spec: ChaosSpec) -> list[tuple[float, str]]:
    """(seconds into the run, kind) of every fault, in order."""
    end = spec.minutes * 60 - spec.settle_s

    def every(interval: float) -> list[float]:
        return [round(k * interval, 3) for k in range(1, int(end // interval) + 1)]

    daemon = every(spec.daemon_kill_every_s)
    worker = [t for t in every(spec.worker_kill_every_s) if t not in daemon]
    return sorted([(t, "daemon") for t in daemon] + [(t, "worker") for t in worker])


class Chaos:
    """The cluster under fault: kills, waits for it back, reads /programs, samples the daemon's RSS."""

    def __init__(self, cluster: Cluster, state_dir: Path, spec: ChaosSpec) -> None:
        self.cluster = cluster
        self.state_dir = state_dir
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.started = time.monotonic()
        self.rss: list[RssSample] = []
        self.seen_pids: set[int] = set()
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)

    def state(self) -> ClusterState:
        return ClusterState.load(self.state_dir)

    def daemon_pid(self) -> int | None:
        """The supervisor's child: the daemon now running, if one is."""
        supervisor = self.state().supervisor_pid
        try:
            children = psutil.Process(supervisor).children() if supervisor else []
        except psutil.Error:
            return None
        return children[0].pid if children else None

    def programs(self) -> dict[str, str | None]:
        answer = httpx.get(f"{self.cluster.gateway}/programs", timeout=120).raise_for_status()
        return {p["program_id"]: p["backend"] for p in answer.json()["programs"]}

    def _sample_rss(self) -> None:
        while not self._stop.wait(RSS_EVERY_S):
            pid = self.daemon_pid()
            if pid is None:
                continue  # between a daemon's death and its successor's start
            with contextlib.suppress(psutil.Error):
                daemon = psutil.Process(pid)
                if time.time() - daemon.create_time() < RSS_EVERY_S:
                    continue  # a daemon still importing: its RSS says nothing yet
                rss = daemon.memory_info().rss / MIB
                if rss == 0:
                    continue  # a daemon dead and not yet reaped
                self.rss.append(RssSample(round(time.monotonic() - self.started, 1), pid, round(rss, 1)))

    def run(self) -> list[Fault]:
        self._sampler.start()
        faults = []
        try:
            for at_s, kind in plan(self.spec):
                time.sleep(max(0.0, self.started + at_s - time.monotonic()))
                fault = self.kill_daemon(at_s) if kind == "daemon" else self.kill_worker(at_s)
                print(
                    f"  {at_s / 60:5.1f} min: {kind} {fault.target} killed, back in {seconds(fault.back_s)}", flush=True
                )
                time.sleep(max(0.0, fault.killed_s + self.spec.settle_s - time.monotonic()))
                fault.after = set(self.programs())
                fault.after_read_s = time.monotonic()
                faults.append(fault)
        finally:
            self._stop.set()
        return faults

    def kill_worker(self, at_s: float) -> Fault:
        before = self.programs()
        victim = self.rng.choice(self.state().workers)
        self.seen_pids.add(victim.pid)
        fault = Fault("worker", at_s, victim.id, time.monotonic(), before=before)
        os.killpg(victim.pid, signal.SIGKILL)

        def back() -> bool:
            record = self.state().worker(victim.id)
            if record.pid == victim.pid:
                return False
            worker = next(w for w in fetch_status(self.state()).workers if w.id == victim.id)
            return worker.state == "ready"

        fault.back_s = self.until(back, fault.killed_s)
        return fault

    def kill_daemon(self, at_s: float) -> Fault:
        before = self.programs()
        pid = self.daemon_pid()
        if pid is None:
            raise RuntimeError(f"no daemon runs under the supervisor; its log: {self.state().daemon_log}")
        self.seen_pids.add(pid)
        fault = Fault("daemon", at_s, f"pid {pid}", time.monotonic(), before=before)
        os.kill(pid, signal.SIGKILL)
        while pid_alive(pid):  # its sockets close as the kernel tears it down, not at the signal
            time.sleep(0.002)
        fault.died_s = time.monotonic()
        fault.back_s = self.until(lambda: daemon_answers(self.state()) and self.daemon_pid() != pid, fault.killed_s)
        return fault

    def until(self, condition: Any, since: float) -> float | None:
        """Seconds from `since` until `condition()` held (errors read as not yet); None if it did not in time."""
        while time.monotonic() - since < BACK_TIMEOUT_S:
            with contextlib.suppress(httpx.HTTPError, StopIteration, KeyError, OSError, ValueError):
                if condition():
                    return time.monotonic() - since
            time.sleep(POLL_S)
        return None


# --- the figures -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FaultFigures:
    kind: str
    at_min: float
    target: str
    back_s: float | None
    serving_s: float | None
    failed: int  # calls the SDK gave up on, ending between this fault and the next
    retried: int  # calls the SDK retried, same window
    attempts_retried: int  # the retries themselves
    retry_causes: dict[str, int]  # what the attempts retried (or failed for good) met
    live: int  # conversations with a program, not at their end, at the kill
    judged: int  # of those, the ones that sent another request
    lost_client: int  # next request failed, or answered under another program id
    lost_gateway: int  # program id listed before, gone after, while its conversation went on
    errors: list[str]


def conversations(calls: list[Call]) -> dict[str, list[Call]]:
    by_name: dict[str, list[Call]] = {}
    for call in sorted(calls, key=lambda c: c.sent_s):
        by_name.setdefault(call.conversation, []).append(call)
    return by_name


def figures(fault: Fault, window_end: float, calls: list[Call], by_name: dict[str, list[Call]]) -> FaultFigures:
    in_window = [c for c in calls if fault.killed_s <= c.ended_s < window_end]
    # Answers to requests sent after the kill (the daemon's death): none of them was in a socket before.
    answered = [c for c in calls if c.error is None and c.last_attempt_s > (fault.died_s or fault.killed_s)]
    if fault.kind == "worker":
        on_victim = {p for p, worker in fault.before.items() if worker == fault.target}
        answered = [c for c in answered if c.program in on_victim]
    serving = min((c.ended_s for c in answered), default=None)
    live = judged = lost_client = lost_gateway = 0
    for turns in by_name.values():
        earlier = [c for c in turns if c.ended_s < fault.killed_s]
        later = [c for c in turns if c.ended_s >= fault.killed_s]
        if not earlier or earlier[-1].error is not None or earlier[-1].final:
            continue
        live += 1
        if not later:
            continue  # cut off by the deadline before its next request
        judged += 1
        program = earlier[-1].program
        lost_client += later[0].error is not None or later[0].program != program
        going_on = later[0].ended_s < fault.after_read_s < later[-1].ended_s
        lost_gateway += going_on and program in fault.before and program not in fault.after
    return FaultFigures(
        kind=fault.kind,
        at_min=fault.at_s / 60,
        target=fault.target,
        back_s=fault.back_s,
        serving_s=None if serving is None else serving - fault.killed_s,
        failed=sum(c.error is not None for c in in_window),
        retried=sum(c.attempts > 1 for c in in_window),
        attempts_retried=sum(c.attempts - 1 for c in in_window),
        retry_causes=dict(collections.Counter(cause for c in in_window for cause in c.causes).most_common()),
        live=live,
        judged=judged,
        lost_client=lost_client,
        lost_gateway=lost_gateway,
        errors=sorted({c.error[:200] for c in in_window if c.error}),
    )


def renamed_without_fault(by_name: dict[str, list[Call]], faults: list[Fault]) -> int:
    """Consecutive answers of one conversation under different program ids with no kill between: the
    gateway's own mistakes (or ends), apart from the faults."""
    kills = [f.killed_s for f in faults]
    count = 0
    for turns in by_name.values():
        for one, two in zip(turns, turns[1:]):
            if one.program and two.program and one.program != two.program:
                count += not any(one.ended_s < k <= two.ended_s for k in kills)
    return count


def rss_summary(samples: list[RssSample], faults: list[Fault]) -> dict[str, Any]:
    """The daemon's RSS at 5 minutes (the last sample before then, and before the first daemon kill),
    and how far above it the rest of the run went."""
    first_kill = min((f.at_s for f in faults if f.kind == "daemon"), default=RSS_REFERENCE_S)
    reference_s = min(RSS_REFERENCE_S, first_kill)
    before = [s for s in samples if s.t_s <= reference_s]
    if not before:
        return {"reference_s": reference_s, "reference_mib": None, "max_after_mib": None, "end_mib": None}
    reference = before[-1].rss_mib
    after = [s.rss_mib for s in samples if s.t_s > reference_s] or [reference]
    return {
        "reference_s": reference_s,
        "reference_mib": reference,
        "max_after_mib": max(after),
        "min_after_mib": min(after),
        "end_mib": after[-1],
        "max_growth": round(max(after) / reference - 1, 3),
        "within_target": max(after) <= reference * (1 + RSS_GROWTH_ALLOWED),
        "daemons": per_daemon(samples),
    }


def per_daemon(samples: list[RssSample]) -> list[dict[str, Any]]:
    """Each daemon's RSS in its life, in the order they ran: whether a daemon grows as it serves, and
    whether one restored from the journal holds more than the first did."""
    lives: dict[int, list[RssSample]] = {}
    for sample in samples:
        lives.setdefault(sample.pid, []).append(sample)
    return [
        {"pid": pid, "from_s": life[0].t_s, "to_s": life[-1].t_s, "first_mib": life[0].rss_mib,
         "max_mib": max(s.rss_mib for s in life), "last_mib": life[-1].rss_mib}
        for pid, life in lives.items()
    ]  # fmt: skip


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def table(report: dict[str, Any]) -> str:
    head = ("fault", "at", "target", "back", "serving", "failed", "retried (tries)", "live", "lost client", "lost gw")
    rows = [head]
    before = report["before_faults"]
    rows.append(("none", "0.0", "-", "-", "-", str(before["failed"]), f"{before['retried']} ({before['attempts_retried']})",
                 "-", "-", "-"))  # fmt: skip
    for f in report["faults"]:
        rows.append((f["kind"], f"{f['at_min']:.1f}", f["target"], seconds(f["back_s"]), seconds(f["serving_s"]),
                     str(f["failed"]), f"{f['retried']} ({f['attempts_retried']})", str(f["live"]),
                     f"{f['lost_client']}/{f['judged']}", f"{f['lost_gateway']}"))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(report: dict[str, Any]) -> str:
    totals, rss = report["totals"], report["rss"]
    growth = "-" if rss["reference_mib"] is None else f"{rss['max_growth']:+.1%}"
    return "\n".join(
        [
            f"{report['spec']['programs']} programs on {report['spec']['workers']} simulated workers for "
            f"{report['spec']['minutes']:g} min; tree {report['tree']}",
            f"calls: {totals['answered']:,} answered, {totals['failed']} failed (as the client saw them), "
            f"{totals['retried']} retried by the SDK ({totals['attempts_retried']} retries); "
            f"{totals['renamed_without_fault']} renamed with no fault between",
            table(report),
            f"daemon RSS: {rss['reference_mib']} MiB at {rss['reference_s'] / 60:.1f} min, after it "
            f"{rss.get('min_after_mib')}-{rss['max_after_mib']} MiB, {rss['end_mib']} MiB at the end: {growth} at most "
            f"(target ≤ {RSS_GROWTH_ALLOWED:+.0%})",
            *(
                f"  daemon {d['pid']} from {d['from_s'] / 60:.1f} to {d['to_s'] / 60:.1f} min: "
                f"{d['first_mib']} MiB first, {d['max_mib']} at most, {d['last_mib']} last"
                for d in rss.get("daemons", [])
            ),
            *(
                f"  {f['kind']} at {f['at_min']:.1f} min, retried: {f['retry_causes']}"
                for f in report["faults"]
                if f["retried"]
            ),
            *(
                f"  {f['kind']} at {f['at_min']:.1f} min, failed: {e}"
                for f in report["faults"]
                for e in f["errors"][:3]
            ),
            f"left running after down: {report['left_running'] or 'nothing'}",
        ]
    )


def tree() -> str:
    """The commit this script runs from, marked dirty when the tree has changes."""
    here = Path(__file__).resolve().parent
    git = ["git", "-C", str(here)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return commit + ("-dirty" if dirty.stdout.strip() else "")


def run_chaos(spec: ChaosSpec, workdir: Path) -> dict[str, Any]:
    """Up, load under faults, figures, down; the cluster is brought down whatever happens. Every call
    the agents made goes to `workdir`/calls.jsonl, for a look at when each retry or failure came."""
    source = tree()  # before the run: an edit meanwhile is not what ran
    soak = SoakSpec(
        workers=spec.workers, engine_time_scale=spec.engine_time_scale, tick_interval_s=spec.tick_interval_s
    )
    cluster = Cluster(workdir, soak_profile(soak, f"chaos-{random.Random(spec.seed).getrandbits(24):06x}"))
    cluster.cli("up", "-f", str(cluster.profile_path))
    chaos = Chaos(cluster, cluster.state_path.parent, spec)
    chaos.seen_pids |= {chaos.state().supervisor_pid or 0, *(w.pid for w in chaos.state().workers)}
    try:
        deadline = chaos.started + spec.minutes * 60
        names = [f"agent-{n}" for n in range(spec.programs)]
        shares = [names[i :: spec.processes] for i in range(spec.processes)]
        endpoint = f"{cluster.gateway}/v1"
        with ProcessPoolExecutor(spec.processes, mp_context=get_context("spawn")) as pool:
            running = [pool.submit(run_agents, endpoint, share, spec, deadline) for share in shares]
            faults = chaos.run()
            calls = [Call(**c) for future in running for c in future.result()]
        with (workdir / "calls.jsonl").open("w") as out:
            out.writelines(json.dumps(asdict(c)) + "\n" for c in calls)
        status = fetch_status(chaos.state())
        chaos.seen_pids |= {status.daemon_pid or 0, *(w.pid for w in chaos.state().workers)}
    finally:
        with contextlib.suppress(OSError):
            (workdir / "daemon.log").write_bytes(cluster.state_path.with_name("daemon.log").read_bytes())
        cluster.cli("down", "--cluster", cluster.name)
    by_name = conversations(calls)
    ends = [f.killed_s for f in faults[1:]] + [float("inf")]
    first_kill = faults[0].killed_s if faults else float("inf")
    quiet = [c for c in calls if c.ended_s < first_kill]
    return {
        "spec": asdict(spec),
        "tree": source,
        "faults": [asdict(figures(f, end, calls, by_name)) for f, end in zip(faults, ends)],
        "before_faults": {
            "failed": sum(c.error is not None for c in quiet),
            "retried": sum(c.attempts > 1 for c in quiet),
            "attempts_retried": sum(c.attempts - 1 for c in quiet),
        },
        "totals": {
            "answered": sum(c.error is None for c in calls),
            "failed": sum(c.error is not None for c in calls),
            "retried": sum(c.attempts > 1 for c in calls),
            "attempts_retried": sum(c.attempts - 1 for c in calls),
            "conversations": len(by_name),
            "renamed_without_fault": renamed_without_fault(by_name, faults),
            "daemon_restarts": status.daemon.restarts if status.daemon else None,
        },
        "rss": rss_summary(chaos.rss, faults),
        "rss_series": [asdict(s) for s in chaos.rss],
        "left_running": sorted(pid for pid in chaos.seen_pids if pid and pid_alive(pid)),
        "load_average": os.getloadavg(),
    }


def parse_args() -> tuple[ChaosSpec, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ChaosSpec()
    parser.add_argument("--minutes", type=float, default=d.minutes, help="minutes of load")
    parser.add_argument("--workers", type=int, default=d.workers)
    parser.add_argument("--programs", type=int, default=d.programs, help="agents at once")
    parser.add_argument("--worker-kill-every", type=float, default=d.worker_kill_every_s, metavar="S")
    parser.add_argument("--daemon-kill-every", type=float, default=d.daemon_kill_every_s, metavar="S")
    parser.add_argument("--settle", type=float, default=d.settle_s, metavar="S",
                        help="seconds after a kill when /programs is read again")  # fmt: skip
    parser.add_argument("--processes", type=int, default=d.processes, help="load-generator processes")
    parser.add_argument("--turns", type=int, nargs=2, default=d.turns, metavar=("LOW", "HIGH"))
    parser.add_argument("--tool-s", type=float, nargs=2, default=d.tool_s, metavar=("LOW", "HIGH"))
    parser.add_argument("--answer-tokens", type=int, default=d.answer_tokens)
    parser.add_argument("--engine-time-scale", type=float, default=d.engine_time_scale)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    parser.add_argument("--keep", type=Path, help="keep the profile and the daemon's log in this directory")
    args = parser.parse_args()
    if args.processes < 1 or args.programs < args.processes:
        parser.error(f"--processes must be between 1 and --programs ({args.programs}); got {args.processes}")
    spec = replace(
        d,
        minutes=args.minutes,
        workers=args.workers,
        programs=args.programs,
        worker_kill_every_s=args.worker_kill_every,
        daemon_kill_every_s=args.daemon_kill_every,
        settle_s=args.settle,
        processes=args.processes,
        turns=tuple(args.turns),
        tool_s=tuple(args.tool_s),
        answer_tokens=args.answer_tokens,
        engine_time_scale=args.engine_time_scale,
        seed=args.seed,
    )
    return spec, args


def main() -> int:
    spec, args = parse_args()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        report = run_chaos(spec, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="thunderctl-chaos-") as workdir:
            report = run_chaos(spec, Path(workdir))
    print(summary(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
