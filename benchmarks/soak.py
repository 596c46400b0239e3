"""Scale and soak: many closed-loop programs through a real daemon onto simulated workers, for a while.

`up` of a profile of `engine.kind: sim` workers (real processes, real HTTP, the real daemon),
closed-loop agent load through its gateway, then the figures that say whether it held: failed
requests, programs left in the gateway once all are released, the daemon's RSS at the start and
the end, and the p99 of the scheduler's tick and of the admission wait (the gateway's histograms).
`down` at the end, and a check that none of the processes it started is left.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml
from soak_series import RSS_DRIFT_ALLOWED, SeriesRecorder, SoakSample, rss_drift

from thunderctl.bench.closed_loop import LoadSpec, Target, run_load
from thunderctl.bench.results import LoadResult
from thunderctl.bench.shapes import AgentShape, Uniform
from thunderctl.daemon.status import ClusterStatus
from thunderctl.gateway.gateway import AGENT_KEEPALIVE_S
from thunderctl.gateway.timings import (
    ADMISSION_WAIT_SECONDS,
    LOOP_LAG_SECONDS,
    TICK_SECONDS,
    histogram_quantile,
    watch_loop_lag,
)
from thunderctl.percentiles import percentile
from thunderctl.processes import pick_free_port, pick_free_ports, pid_alive
from thunderctl.prometheus import parse_samples

MIB = 2**20
MODEL = "sim"
# How long the gateway may take to finish requests cut off at the deadline before its programs are counted.
SETTLE_TIMEOUT_S = 120.0
# How long `up`, `status` or `down` may take: on this shared machine at a load average of 40, `up`
# of eight workers and the daemon took over 300 s (Python's imports alone, at the lowest priority).
CLI_TIMEOUT_S = 900.0
# How often the daemon's RSS, tick and loop lag are sampled (soak_series.py).
SAMPLE_S = 10.0
# Programs per HTTP client of the load: httpcore's pool scans every connection it has for each
# request, so one client of 2,048 connections spends the load generator's CPU on its own pool
# (connects then time out, and the load, not the cluster, is what fails).
PROGRAMS_PER_CLIENT = 128
# Programs per load-generator process: one process's event loop did not get 2,048 programs'
# first connects done on this machine's share of a core (0 admissions after 2 minutes).
PROGRAMS_PER_PROCESS = 512

# Agents of a few thousand tokens by the end, with tools of seconds: thousands of them overbook
# eight simulated 4×H100 workers' KV caches (891,728 tokens each) and keep the scheduler busy.
SOAK_SHAPE = AgentShape(
    system_prompt_tokens=1000,
    task_tokens=Uniform(300, 800),
    observation_tokens=Uniform(150, 500),
    completion_tokens=Uniform(20, 60),
    steps=Uniform(8, 16),
    tool_seconds=Uniform(5, 25),
)


@dataclass(frozen=True)
class SoakSpec:
    programs: int = 2048  # programs at once (closed loop: when one ends the next starts)
    workers: int = 8
    duration_s: float = 600.0
    preset: str = "h100-tp4-32b"
    kv_blocks: int | None = None  # per worker; default: the preset's
    engine_time_scale: float = 2.0  # wall seconds per simulated engine second
    tool_time_scale: float = 1.0  # multiplies the shape's tool times
    tick_interval_s: float = 2.0
    stream: bool = False
    seed: int = 0
    shape: AgentShape = SOAK_SHAPE
    # An agent's client sends again a request that got no byte of its answer (LoadSpec.retry_unanswered_s);
    # each resend is reported by its error. 0: the first such error fails the request.
    retry_unanswered_s: float = 60.0
    # Agents' idle connections are kept through their tool calls (5-25 s), as the gateway keeps them
    # (AGENT_KEEPALIVE_S) and for less than it does, so that the client closes one first. With httpx's
    # 5 s nearly every step connected anew, and 2,048 programs' connects are what a starved load
    # generator's event loop timed out on.
    client_keepalive_s: float = AGENT_KEEPALIVE_S / 2


@dataclass(frozen=True)
class ErrorGroup:
    """Requests (or resends) that met one error: how many, and when the first and the last started
    (seconds into the run)."""

    error: str
    count: int
    first_s: float
    last_s: float


def error_groups(events: list[tuple[str, float]]) -> list[ErrorGroup]:
    """`(error, start_s)` pairs grouped by the error's first 160 characters, the most frequent first."""
    by_error: dict[str, list[float]] = collections.defaultdict(list)
    for error, start_s in events:
        by_error[error[:160]].append(start_s)
    groups = [ErrorGroup(error, len(starts), min(starts), max(starts)) for error, starts in by_error.items()]
    return sorted(groups, key=lambda group: -group.count)


def listen_overflows() -> int | None:
    """This host's count of connections dropped because a listen queue was full (Linux), else None."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            counters = dict(zip(names.split()[1:], values.split()[1:]))
            return int(counters["ListenOverflows"]) if "ListenOverflows" in counters else None
    return None


@dataclass
class SoakResult:
    spec: dict[str, Any]
    wall_s: float
    steps_ok: int
    steps_failed: int
    steps_cancelled: int  # in flight at the deadline: cut off, not failed
    failures: list[ErrorGroup]
    resent: int  # requests and releases sent again because no byte of an answer came (the load generator's count)
    resends: list[ErrorGroup]  # the same sends again, by error
    programs_started: int
    programs_completed: int
    release_failures: int
    release_errors: dict[str, int]
    programs_left: int  # in the gateway after every program was released
    left_why: dict[str, int]  # the programs left, by what the load saw of them and their state in the gateway
    steps_per_min: float
    hit_rate: float | None
    preemptions: int
    pauses: float
    resumes: float
    daemon_rss_start_mib: float
    daemon_rss_end_mib: float
    daemon_rss_peak_mib: float
    daemon_cpu_s: float
    tick_p99_s: float | None
    ticks: int
    admission_wait_p99_s: float | None
    admission_wait_p50_s: float | None
    admissions: int
    daemon_loop_lag_p99_s: float | None
    daemon_loop_lag_p999_s: float | None
    load_loop_lag_p99_s: float | None  # the load generators' own event loops: late, their timeouts fire late
    load_loop_lag_max_s: float | None
    listen_overflows: int | None  # connections this host dropped from a full listen queue during the load
    left_running: list[int] = field(default_factory=list)  # pids started by `up` still alive (not zombies) after `down`
    series: list[SoakSample] = field(default_factory=list)  # RSS, tick and loop lag every SAMPLE_S
    rss_drift: float | None = None  # RSS growth after the warm-up (soak_series.rss_drift); None: run too short

    def problems(self) -> list[str]:
        """What went wrong, against the wants: no failed request, no program left, nothing left running."""
        found = []
        if self.steps_failed:
            reasons = "; ".join(f"{g.count} {g.error}" for g in self.failures[:3])
            found.append(f"{self.steps_failed} failed requests: {reasons}")
        if self.programs_left:
            found.append(f"{self.programs_left} programs left in the gateway after all were released")
        if self.release_failures:
            found.append(f"{self.release_failures} releases failed")
        if self.left_running:
            found.append(f"processes left running after down: {self.left_running}")
        if self.rss_drift is not None and self.rss_drift > RSS_DRIFT_ALLOWED:
            found.append(f"daemon RSS grew {self.rss_drift:+.0%} after the warm-up (want ≤ {RSS_DRIFT_ALLOWED:+.0%})")
        return found


def soak_profile(spec: SoakSpec, cluster: str) -> dict[str, Any]:
    """A sim cluster of `spec.workers` workers, one node each (so no two ports need to be adjacent)."""
    engine: dict[str, Any] = {"kind": "sim", "preset": spec.preset, "time_scale": spec.engine_time_scale}
    if spec.kv_blocks is not None:
        engine["kv_blocks"] = spec.kv_blocks
    nodes = [
        {"name": f"sim-{i}", "transport": "local", "replicas": 1, "base_port": port}
        for i, port in enumerate(pick_free_ports(spec.workers))
    ]
    return {
        "cluster": cluster,
        "model": {"path": spec.preset, "served_name": MODEL},
        "engine": engine,
        "nodes": nodes,
        "gateway": {"host": "127.0.0.1", "port": pick_free_port()},
        "scheduler": {"tick_interval_s": spec.tick_interval_s},
    }


class Cluster:
    """The soak's cluster, driven through the real CLI in subprocesses."""

    def __init__(self, workdir: Path, profile: dict[str, Any]) -> None:
        self.name = profile["cluster"]
        self.profile_path = workdir / f"{self.name}.yaml"
        self.profile_path.write_text(yaml.safe_dump(profile))
        self.env = {**os.environ, "THUNDERCTL_STATE_DIR": str(workdir / "state")}
        self.state_path = workdir / "state" / self.name / "state.json"
        self.gateway = f"http://127.0.0.1:{profile['gateway']['port']}"

    def cli(self, *args: str, timeout: float = CLI_TIMEOUT_S) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "thunderctl", *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"thunderctl {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def state(self) -> dict[str, Any]:
        return json.loads(self.state_path.read_text())

    def status(self) -> ClusterStatus:
        return ClusterStatus.model_validate_json(self.cli("status", "--json", "--cluster", self.name))


def run_shards(gateway_url: str, loads: list[LoadSpec], workers: list[str]) -> tuple[list[LoadResult], list[float]]:
    """One load-generator process: its shards at once, each its own closed loop and client; and how
    late its event loop ran meanwhile."""
    lags: list[float] = []

    async def run_all() -> list[LoadResult]:
        watch = asyncio.create_task(watch_loop_lag(lags.append))
        try:
            return list(await asyncio.gather(*(run_load(Target.gateway(gateway_url), ld, workers) for ld in loads)))
        finally:
            watch.cancel()

    return asyncio.run(run_all()), lags


def load_sampled(
    spec: SoakSpec, cluster: Cluster, workers: list[str], series: SeriesRecorder
) -> tuple[list[LoadResult], list[float]]:
    """The programs in shards of PROGRAMS_PER_CLIENT over processes of PROGRAMS_PER_PROCESS, all at once;
    the daemon sampled meanwhile."""
    sizes = [min(PROGRAMS_PER_CLIENT, spec.programs - start) for start in range(0, spec.programs, PROGRAMS_PER_CLIENT)]
    loads = [
        LoadSpec(
            concurrency=size,
            shape=spec.shape,
            duration_s=spec.duration_s,
            seed=spec.seed * 1000 + shard,
            model=MODEL,
            stream=spec.stream,
            time_scale=spec.tool_time_scale,
            request_timeout_s=1800.0,
            retry_unanswered_s=spec.retry_unanswered_s,
            keepalive_s=spec.client_keepalive_s,
            sample_interval_s=spec.duration_s,
        )
        for shard, size in enumerate(sizes)
    ]
    per_process = max(1, PROGRAMS_PER_PROCESS // PROGRAMS_PER_CLIENT)
    groups = [loads[i : i + per_process] for i in range(0, len(loads), per_process)]
    with ProcessPoolExecutor(len(groups), mp_context=get_context("spawn")) as pool:
        running = [pool.submit(run_shards, cluster.gateway, group, workers) for group in groups]
        while wait(running, timeout=SAMPLE_S).not_done:
            series.sample()
        outcomes = [future.result() for future in running]
    return [result for results, _ in outcomes for result in results], [lag for _, lags in outcomes for lag in lags]


def settled_programs(cluster: Cluster) -> list[dict[str, Any]]:
    """The gateway's programs once nothing is in flight (requests cut off at the deadline finish first)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while any(w.requests_in_flight for w in cluster.status().workers) and time.monotonic() < deadline:
        time.sleep(1)
    return httpx.get(f"{cluster.gateway}/programs", timeout=60).json()["programs"]


def gateway_figures(cluster: Cluster) -> dict[str, float | None]:
    samples = parse_samples(httpx.get(f"{cluster.gateway}/metrics", timeout=60).text)
    totals = {s.name: s.value for s in samples if not s.labels}
    return {
        "tick_p99_s": histogram_quantile(samples, TICK_SECONDS, 0.99),
        "ticks": totals.get(f"{TICK_SECONDS}_count", 0),
        "admission_wait_p99_s": histogram_quantile(samples, ADMISSION_WAIT_SECONDS, 0.99),
        "admission_wait_p50_s": histogram_quantile(samples, ADMISSION_WAIT_SECONDS, 0.5),
        "admissions": totals.get(f"{ADMISSION_WAIT_SECONDS}_count", 0),
        "loop_lag_p99_s": histogram_quantile(samples, LOOP_LAG_SECONDS, 0.99),
        "loop_lag_p999_s": histogram_quantile(samples, LOOP_LAG_SECONDS, 0.999),
        "pauses": totals.get("thunderctl_pauses_total", 0),
        "resumes": totals.get("thunderctl_resumes_total", 0),
    }


def why_left(left: list[dict[str, Any]], results: list[LoadResult]) -> dict[str, int]:
    """The programs left in the gateway, counted by what the load saw of each (its release failed, a
    request of it failed, neither) and the state the gateway holds it in."""
    release_failed = {f.program_id for r in results for f in r.release_errors}
    request_failed = {rec.program_id for r in results for rec in r.records if not rec.ok}

    def seen(program_id: str) -> str:
        if program_id in release_failed:
            return "release failed"
        return "a request failed" if program_id in request_failed else "released"

    return dict(
        collections.Counter(
            f"{seen(p['program_id'])}; {p['status']} {p['phase']} after {p['steps']} steps" for p in left
        ).most_common()
    )


def run_soak(spec: SoakSpec, workdir: Path, series_path: Path | None = None) -> SoakResult:
    """Up, load, figures, down; the cluster is brought down whatever happens. The samples over time
    go to `series_path` (JSON lines) as they are taken."""
    cluster = Cluster(workdir, soak_profile(spec, f"soak-{secrets.token_hex(3)}"))
    cluster.cli("up", "-f", str(cluster.profile_path))
    started = cluster.state()
    daemon_pid = cluster.status().daemon_pid
    pids = [started["supervisor_pid"], daemon_pid, *(w["pid"] for w in started["workers"])]
    try:
        daemon = psutil.Process(daemon_pid)
        series = SeriesRecorder(cluster.gateway, daemon, series_path)
        rss_start = series.sample().rss_mib
        workers = [w["url"] for w in started["workers"]]
        overflows_before = listen_overflows()
        results, load_lags = load_sampled(spec, cluster, workers, series)
        series.sample()
        overflows_after = listen_overflows()
        left = settled_programs(cluster)
        figures = gateway_figures(cluster)
        rss_end = daemon.memory_info().rss / MIB
        cpu = daemon.cpu_times()
    finally:
        # `down` removes the state directory; the daemon's log stays in `workdir` for a look afterwards.
        # A log that cannot be copied must not keep the cluster up.
        with contextlib.suppress(OSError):
            shutil.copyfile(cluster.state_path.with_name("daemon.log"), workdir / "daemon.log")
        cluster.cli("down", "--cluster", cluster.name)
    wall_s = max(r.wall_s for r in results)
    steps_ok = sum(r.steps_ok for r in results)
    # Every shard reads all the engines' counters over the same run: one shard's reading is the run's.
    engines = max((r.engines for r in results), key=lambda e: e.prefix_cache_queries)
    return SoakResult(
        spec={**asdict(spec), "shape": asdict(spec.shape)},
        wall_s=wall_s,
        steps_ok=steps_ok,
        steps_failed=sum(r.steps_failed for r in results),
        steps_cancelled=sum(r.steps_cancelled for r in results),
        failures=error_groups(
            [(r.error or f"HTTP {r.status}", r.start_s) for result in results for r in result.records if not r.ok]
        ),
        resent=sum(r.unanswered_retries for r in results),
        resends=error_groups([(e.error, e.t_s) for result in results for e in result.resends]),
        programs_started=sum(r.programs_started for r in results),
        programs_completed=sum(r.programs_completed for r in results),
        release_failures=sum(r.release_failures for r in results),
        release_errors=dict(collections.Counter(f.error[:160] for r in results for f in r.release_errors)),
        programs_left=len(left),
        left_why=why_left(left, results),
        steps_per_min=steps_ok / wall_s * 60 if wall_s else 0.0,
        hit_rate=engines.hit_rate,
        preemptions=engines.preemptions,
        pauses=figures["pauses"] or 0,
        resumes=figures["resumes"] or 0,
        daemon_rss_start_mib=rss_start,
        daemon_rss_end_mib=rss_end,
        daemon_rss_peak_mib=max(rss_end, *(s.rss_mib for s in series.samples)),
        daemon_cpu_s=cpu.user + cpu.system,
        tick_p99_s=figures["tick_p99_s"],
        ticks=int(figures["ticks"] or 0),
        admission_wait_p99_s=figures["admission_wait_p99_s"],
        admission_wait_p50_s=figures["admission_wait_p50_s"],
        admissions=int(figures["admissions"] or 0),
        daemon_loop_lag_p99_s=figures["loop_lag_p99_s"],
        daemon_loop_lag_p999_s=figures["loop_lag_p999_s"],
        load_loop_lag_p99_s=percentile(load_lags, 99),
        load_loop_lag_max_s=max(load_lags, default=None),
        listen_overflows=None if None in (overflows_before, overflows_after) else overflows_after - overflows_before,
        left_running=[pid for pid in pids if pid_alive(pid)],
        series=series.samples,
        rss_drift=rss_drift(series.samples),
    )
