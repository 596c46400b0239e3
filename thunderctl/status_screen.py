"""How `thunderctl status` lays a cluster's status out on a terminal (80 columns and up)."""

from __future__ import annotations

import time

from rich.console import Group
from rich.table import Table

from thunderctl.daemon.status import (
    ClusterStatus,
    DaemonStatus,
    GatewayStatus,
    GroupCounts,
    PauseStatus,
    RelayStatus,
    SandboxStatus,
)


def status_renderable(view: ClusterStatus) -> Group:
    """The status view laid out for an 80-column terminal: numbers in full, each worker's URL on
    a line of its own below the table, where a long one cannot squeeze the numbers."""
    workers = Table(
        title=f"cluster {view.cluster} · {view.endpoint} · up {view.uptime_s:.0f} s",
        box=None,
        pad_edge=False,
        title_justify="left",
    )
    workers.add_column("worker", no_wrap=True)
    workers.add_column("state", no_wrap=True)
    for column in ("KV\nreserved", "KV\ncapacity", "programs", "in\nflight", "hit\nrate", "preempted"):
        workers.add_column(column, justify="right")
    urls = Table.grid(padding=(0, 2))
    for w in view.workers:
        hit = "-" if w.prefix_cache_hit_rate is None else f"{w.prefix_cache_hit_rate:.2f}"
        capacity = "-" if w.kv_capacity_tokens is None else f"{w.kv_capacity_tokens:,}"
        workers.add_row(
            w.id,
            w.state,
            f"{w.kv_reserved_tokens:,}",
            capacity,
            f"{w.programs_active:,}",
            f"{w.requests_in_flight:,}",
            hit,
            f"{w.preemptions:,}",
        )
        urls.add_row(w.id, w.url)
    sched = view.scheduler
    programs = sched.programs
    return Group(
        workers,
        "",
        urls,
        "",
        f"programs: reasoning {programs.reasoning:,} · acting {programs.acting:,} · paused {programs.paused:,}"
        f" · derived {programs.derived:,}",
        *([groups_line(sched.groups)] if sched.groups else []),
        f"scheduler: pauses {sched.pauses_total:,} · resumes {sched.resumes_total:,}"
        f" · forced {sched.forced_resumes_total:,}",
        "admission: open gate (the engines admit by their own KV cache)"
        if sched.admission_gate_open
        else f"admission: ACTING weight {sched.acting_weight:.2f} · workers busy {sched.utilization:.0%}",
        f"sandboxes: {sandbox_line(view.sandboxes)}",
        *([pause_line(view.pause)] if view.pause and (view.pause.paused or view.pause.last_end) else []),
        *([daemon_line(view.daemon_pid, view.daemon)] if view.daemon else []),
        *([relays_line(view.gateway.relays)] if view.gateway.relays else []),
        gateway_key_line(view.gateway),
    )


def groups_line(groups: list[GroupCounts], shown: int = 3) -> str:
    """How many groups, how many of them finished, and the nearest done of the others."""
    running = [g for g in groups if g.done < g.total]
    nearest = " · ".join(f"{g.group_id} {g.done}/{g.total}" for g in running[:shown])
    line = f"groups: {len(groups):,} · finished {len(groups) - len(running):,}"
    return line + (f" · nearest done: {nearest}" if nearest else "")


def sandbox_line(boxes: SandboxStatus) -> str:
    if not boxes.available:
        return f"unavailable ({boxes.reason or ''})"
    return f"warm {boxes.warm} · bound {boxes.bound} · preparing {boxes.preparing}"


def pause_line(pause: PauseStatus) -> str:
    if pause.paused:
        return (
            f"[bold]paused[/] ({pause.mode}) for {pause.paused_for_s or 0:.0f} s: requests wait at the gateway; "
            f"it ends by itself in {pause.ends_by_itself_in_s or 0:.0f} s (`thunderctl resume` ends it now)"
        )
    ended = "ended by itself after admin.max_pause_s" if pause.last_end == "timed out" else pause.last_end
    return f"last pause: {ended}, {pause.last_duration_s or 0:.1f} s"


def gateway_key_line(gateway: GatewayStatus) -> str:
    if not gateway.api_key_set:
        return "gateway key: none (any client that reaches the endpoint is served)"
    return "gateway key: set (clients send Authorization: Bearer KEY)" + (
        "; /metrics is public" if gateway.metrics_public else ""
    )


def relays_line(relays: list[RelayStatus]) -> str:
    """Each relay process: its pid, the requests it relayed, those open now, its CPU so far."""
    shown = [
        f"{r.relay} pid {r.pid} · {r.requests:,} requests ({r.open:,} open)"
        + (f" · CPU {r.cpu_s:,.1f} s" if r.cpu_s is not None else "")
        for r in sorted(relays, key=lambda r: r.relay or 0)
    ]
    return "relays: " + " | ".join(shown)


def daemon_line(pid: int | None, daemon: DaemonStatus) -> str:
    """The daemon's process and what its supervisor has seen: restarts, and its last end."""
    line = f"daemon: pid {pid} · restarts {daemon.restarts:,}"
    if daemon.last_exit is None or daemon.last_exit_at is None:
        return line
    return f"{line} · last: {daemon.last_exit}, {time.time() - daemon.last_exit_at:,.0f} s ago"
