"""Tool steps in the cluster's sandboxes: each program's tool calls as commands in a sandbox of its own.

A program's sandbox is asked for when the program starts (the gateway answers at once while it is
prepared, as the pool does for a waiting program); each tool step is one exec that sleeps the
trace's tool time and appends the observation's bytes to a file, so that disk grows as a real
agent's workspace does. The trace keeps no observation sizes, so the bytes are the observation's
tokens (the next prompt's growth) times BYTES_PER_TOKEN. The gateway's `/metrics` is sampled for
containers alive and disk per host over the run.

The HTTP calls are `ClusterClient`'s (thunderctl.integrations.cluster), which is synchronous: they
run in a thread pool of their own, one thread per program at once, so a long exec holds up nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from thunderctl.bench.planning import ProgramPlan, StepPlan
from thunderctl.bench.results import SandboxSample, ToolRecord
from thunderctl.integrations.cluster import ClusterClient, ClusterError
from thunderctl.jsonapi import bearer_headers
from thunderctl.percentiles import percentile
from thunderctl.prometheus import parse_samples

# English text in BPE tokens averages about 4 characters (bytes) per token.
BYTES_PER_TOKEN = 4
# The test image is built FROM scratch (no /tmp): the workspace file sits at the root.
OBSERVATION_FILE = "/tool-observations"
# Room over a tool step's own time before the exec is cut off as a failure.
EXEC_TIMEOUT_MARGIN_S = 120.0
# A sandbox's owner when collection at release is off: an id the gateway never sees as a program,
# as with a harness that starts its sandboxes apart from its LLM calls.
DETACHED_SUFFIX = ".detached"
# States of the pool's containers that exist in Docker (a failed preparation leaves none). An
# adopted container is also counted as `bound` (it is ready and a program's): not added again.
ALIVE_STATES = ("warm", "bound", "preparing")
# After a run, the pool is sampled this often until the count of containers is the same this many
# times in a row, for at most SETTLE_S.
SETTLE_INTERVAL_S = 1.0
SETTLE_SAMPLES = 3
SETTLE_S = 60.0
# Distinct exec errors kept in the report: enough to tell one cause from several.
MAX_ERRORS_SHOWN = 5

Result = TypeVar("Result")


def tool_command(step: StepPlan, time_scale: float) -> str:
    """A busybox-compatible command that takes the step's tool time and writes its observation."""
    seconds = step.tool_seconds * time_scale
    return f"sleep {seconds:.3f}; head -c {step.observation_tokens * BYTES_PER_TOKEN} /dev/zero >> {OBSERVATION_FILE}"


def read_sandbox_sample(t_s: float, metrics_text: str) -> SandboxSample:
    containers = 0
    disk: dict[str, float] = {}
    ages: dict[str, float] = {}
    for sample in parse_samples(metrics_text):
        if sample.name == "thunderctl_sandboxes" and sample.labels.get("state") in ALIVE_STATES:
            containers += int(sample.value)
        elif sample.name == "thunderctl_sandbox_disk_bytes":
            disk[sample.labels.get("host", "")] = sample.value
        elif sample.name == "thunderctl_sandbox_disk_age_seconds":
            ages[sample.labels.get("host", "")] = sample.value
    return SandboxSample(t_s, containers, disk, ages)


@dataclass
class SandboxTools:
    """The sandboxes of one run. `collect`: tie each sandbox to its program, so that the program's
    release removes it; off, sandboxes stay until idle expiry or `down` (the paper's third failure
    mode)."""

    client: ClusterClient
    time_scale: float = 1.0
    collect: bool = True
    image: str | None = None
    threads: int = 16
    # The pool's gauges are cheap to read: sampled more often than the engines' counters.
    sample_interval_s: float = 2.0
    records: list[ToolRecord] = field(default_factory=list)
    samples: list[SandboxSample] = field(default_factory=list)
    create_failures: int = 0

    def __post_init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="bench-sandbox")

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.client.close()

    async def _call(self, function: Callable[..., Result], *args: Any) -> Result:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def open(self, plan: ProgramPlan) -> str | None:
        """Ask for the program's sandbox (prepared while the program runs or waits); its id."""
        owner = plan.program_id if self.collect else f"{plan.program_id}{DETACHED_SUFFIX}"
        try:
            return (await self._call(self.client.create_sandbox, owner, self.image))["id"]
        except ClusterError:
            self.create_failures += 1
            return None

    async def run_step(
        self, sandbox_id: str | None, plan: ProgramPlan, step_index: int, step: StepPlan, now: Callable[[], float]
    ) -> None:
        """The step's tool in the sandbox; the exec waits for the sandbox to be ready."""
        start = now()
        command_s: float | None = None
        error = "no sandbox (its creation failed)" if sandbox_id is None else None
        if sandbox_id is not None:
            timeout = step.tool_seconds * self.time_scale + EXEC_TIMEOUT_MARGIN_S
            try:
                result = await self._call(self.client.exec, sandbox_id, tool_command(step, self.time_scale), timeout)
                command_s = result["duration_s"]
                if result["exit_code"] != 0:
                    error = f"exit {result['exit_code']}: {result['output'][-200:]}"
            except ClusterError as exc:
                error = str(exc)[:300]
        self.records.append(
            ToolRecord(plan.program_id, step_index, start, now() - start, command_s, error is None, error)
        )

    async def finish(self, sandbox_id: str | None, released: bool) -> None:
        """At the program's end. `released`: the program is released through the gateway, which
        collects its sandbox; a program of a target without program ids is not, so its sandbox is
        deleted here."""
        if sandbox_id is not None and self.collect and not released:
            try:
                await self._call(self.client.delete_sandbox, sandbox_id)
            except ClusterError:
                pass  # left to the pool's idle expiry

    async def sample(self, http: httpx.AsyncClient, t_s: float) -> None:
        try:
            response = await http.get(f"{self.client.url}/metrics", headers=bearer_headers(self.client.api_key))
            response.raise_for_status()
        except httpx.HTTPError:
            return  # a busy gateway answers late; the next interval covers this one
        self.samples.append(read_sandbox_sample(t_s, response.text))

    async def settle(self, http: httpx.AsyncClient, now: Callable[[], float]) -> None:
        """Sample after the run until the count of containers holds still (releases collect in the
        background) and then until the disk was measured since (the pool measures it at its
        maintenance rounds), for at most SETTLE_S: the report's end figures are the last sample."""
        deadline = now() + SETTLE_S
        steady = 0
        settled_at: float | None = None
        while now() < deadline:
            if settled_at is not None and self.samples[-1].disk_measured_since(settled_at):
                return
            before = self.samples[-1].containers if self.samples else None
            await asyncio.sleep(SETTLE_INTERVAL_S)
            await self.sample(http, now())
            steady = steady + 1 if self.samples and self.samples[-1].containers == before else 0
            if steady < SETTLE_SAMPLES:
                settled_at = None
            elif settled_at is None:
                settled_at = self.samples[-1].t_s

    def drain(self) -> tuple[list[ToolRecord], list[SandboxSample], int]:
        """This run's records, samples and failed creations; the next run starts afresh."""
        drained = (self.records, self.samples, self.create_failures)
        self.records, self.samples, self.create_failures = [], [], 0
        return drained

    async def sample_every(self, http: httpx.AsyncClient, now: Callable[[], float]) -> None:
        while True:
            await self.sample(http, now())
            await asyncio.sleep(self.sample_interval_s)


def sandbox_summary(
    records: Sequence[ToolRecord], samples: Sequence[SandboxSample], create_failures: int = 0
) -> dict[str, Any] | None:
    """The report's sandbox figures of one arm, or None when it ran no tool in a sandbox."""
    if not records and not samples:
        return None
    waits = [r.wait_s for r in records if r.wait_s is not None]
    last = samples[-1] if samples else None
    return {
        "execs": len(records),
        "exec_failures": sum(not r.ok for r in records),
        "exec_errors": sorted({r.error for r in records if r.error})[:MAX_ERRORS_SHOWN],
        "create_failures": create_failures,
        "wait_p50_s": percentile(waits, 50),
        "wait_p90_s": percentile(waits, 90),
        "wait_max_s": max(waits, default=None),
        "containers_peak": max((s.containers for s in samples), default=None),
        "containers_end": last.containers if last else None,
        "disk_bytes_end": sum(last.disk_bytes.values()) if last else None,
        "timeline": [{"t_s": s.t_s, "containers": s.containers, "disk_bytes": s.disk_bytes} for s in samples],
    }


def sandbox_line(arm: str, summary: dict[str, Any]) -> str:
    """One arm's sandbox figures as a line under the report's table."""

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    disk = summary["disk_bytes_end"]
    errors = summary["exec_errors"]
    return (
        f"{arm} sandboxes: {summary['execs']} tool execs ({summary['exec_failures']} failed), wait after resume "
        f"p50 {seconds(summary['wait_p50_s'])} p90 {seconds(summary['wait_p90_s'])}, containers peak "
        f"{summary['containers_peak']} end {summary['containers_end']}, disk at end "
        f"{'-' if disk is None else f'{disk / 1e6:.1f} MB'}"
        + (f"; first exec error: {errors[0][:160]}" if errors else "")
    )
