"""The control API's `/status`: a running cluster's workers, scheduler and sandboxes, as one typed model.

The daemon builds it, `thunderctl status` renders it (and prints it as `--json`), `bench` and
`drain --wait` read it. Every model keeps keys it does not declare (`extra="allow"`), so a client
passes on whatever a newer daemon adds, and `--json` is always the whole answer.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from thunderctl.gateway.links import WorkerState

# States in which a worker has nothing left it will finish: `drain --wait` waits for one.
IDLE_STATES = (WorkerState.DRAINED, WorkerState.STOPPED, WorkerState.UNHEALTHY, WorkerState.STALLED)


class StatusPart(BaseModel):
    model_config = ConfigDict(extra="allow")


class WorkerStatus(StatusPart):
    id: str
    node: str
    url: str
    state: WorkerState
    kv_capacity_tokens: int | None  # None until the worker has answered /metrics
    kv_reserved_tokens: int
    programs_active: int
    requests_in_flight: int
    prefix_cache_hit_rate: float | None
    preemptions: int
    requests_running: int
    requests_waiting: int
    restarts: int  # times the daemon started the worker again after its process died


class RelayStatus(StatusPart):
    """A relay process connected to the daemon (profile: gateway.relays)."""

    relay: int | None  # its number under the supervisor; None before its hello
    pid: int | None
    requests: int  # admitted through it since it connected
    messages: int = 0  # it sent the daemon since it connected (gateway/wire.py)
    open: int  # its requests whose answer has not ended
    cpu_s: float | None  # its process's CPU time so far (None: not readable)


class GatewayStatus(StatusPart):
    """Whether a key is asked for, never the key itself; the relay processes, if any."""

    api_key_set: bool
    metrics_public: bool
    relays: list[RelayStatus] = []  # none: the daemon relays in its own process


class ProgramCounts(StatusPart):
    reasoning: int
    acting: int
    paused: int
    derived: int = 0  # of them, those found from their conversation (their requests named none)


class GroupCounts(StatusPart):
    """A group of programs (the samples of one task): how many ended of all it has seen."""

    group_id: str
    done: int
    total: int


class SchedulerStatus(StatusPart):
    programs: ProgramCounts
    pauses_total: int
    resumes_total: int
    forced_resumes_total: int
    acting_weight: float
    admission_gate_open: bool
    utilization: float  # mean share of time the workers in service were busy
    groups: list[GroupCounts] = []  # the nearest done first, groups whose programs all ended last


class SandboxStatus(StatusPart):
    """The sandbox pool's counts; the pool's other figures (hosts, disk, timings) ride along as extras."""

    available: bool
    reason: str | None = None  # why not available
    warm: int
    bound: int
    preparing: int


class PauseStatus(StatusPart):
    """The cluster-wide pause for a weight update (POST /admin/pause), or how the last one ended."""

    paused: bool
    mode: str | None
    paused_for_s: float | None
    ends_by_itself_in_s: float | None  # admin.max_pause_s from its start
    max_pause_s: float
    pauses_total: int
    timed_out_total: int  # pauses nobody resumed, ended by the bound
    last_end: str | None  # resumed, timed out, failed
    last_duration_s: float | None


class JournalStatus(StatusPart):
    """The daemon's journal (daemon/journal.py): what it last wrote, and at what cost."""

    writes: int
    written_at: float | None  # wall-clock seconds of the state last written; None before the first write
    capture_ms: float  # the last write's time on the event loop
    write_ms: float  # and on the journal's thread
    failures: int
    restored_programs: int  # programs this daemon took back from the journal at its start
    programs: int
    conversations: int
    responses: int
    programs_written: int = 0  # the programs the last tick's write wrote: those changed since the write before


class DaemonStatus(StatusPart):
    """What the daemon's supervisor has seen of it: how often it was started again, and why it last ended;
    and its journal."""

    restarts: int
    last_exit: str | None  # "killed by SIGKILL", "exit code 1"; None while it never ended
    last_exit_at: float | None  # wall-clock seconds
    journal: JournalStatus | None = None  # None from a daemon older than the journal


class ClusterStatus(StatusPart):
    cluster: str
    endpoint: str
    uptime_s: float
    daemon_pid: int | None
    daemon: DaemonStatus | None = None  # None from a daemon older than its supervisor
    gateway: GatewayStatus
    workers: list[WorkerStatus]
    scheduler: SchedulerStatus
    sandboxes: SandboxStatus
    pause: PauseStatus | None = None  # None from a daemon older than the pause

    def busy(self, worker_ids: list[str]) -> list[WorkerStatus]:
        """Those of the workers that still have work to finish."""
        return [worker for worker in self.workers if worker.id in worker_ids and worker.state not in IDLE_STATES]

    def ready_urls(self) -> list[str]:
        """The workers in service and answering: the engines a benchmark reads."""
        return [worker.url for worker in self.workers if worker.state is WorkerState.READY]

    def wire(self) -> dict:
        """As JSON-ready values, the shape on the wire and of `thunderctl status --json`."""
        return self.model_dump(mode="json")
