"""thunderctl's command line: parse, call, render. The work happens in the components."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from thunderctl.bench.cli import bench_app
from thunderctl.cluster.nodes import Transports
from thunderctl.cluster.plan import plan_workers
from thunderctl.cluster.preflight import Check, preflight
from thunderctl.cluster.state import ClusterNotFound, ClusterState, find_cluster
from thunderctl.cluster.transport import TransportError
from thunderctl.cluster.workers import LaunchError, any_worker_alive, follow_lines
from thunderctl.daemon.client import control_client, fetch_status
from thunderctl.daemon.status import ClusterStatus
from thunderctl.engines.cli import engine_app
from thunderctl.gateway.command import SCHEDULER_HELP, serve
from thunderctl.integrations.cli import agents_app
from thunderctl.lifecycle.up_down import (
    daemon_trouble,
    existing_state,
    launch,
    reconcile,
    recover,
    supervisor_running,
    tear_down,
)
from thunderctl.profile import DEFAULT_PROFILE, Profile, ProfileError, load_profile, state_root
from thunderctl.status_screen import status_renderable
from thunderctl.terminal import err, fail, out
from thunderctl.weights_cli import pause, resume

app = typer.Typer(
    help="Program-aware agentic inference: schedule whole agent programs over vLLM workers.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)
app.add_typer(engine_app, name="engine")
app.add_typer(bench_app, name="bench")
app.add_typer(agents_app, name="agents")
app.command(epilog=SCHEDULER_HELP)(serve)
app.command()(pause)
app.command()(resume)


# ---- the cluster ------------------------------------------------------------------------

ClusterOption = Annotated[str | None, typer.Option("--cluster", "-c", help="Cluster name; default: the only one up.")]
ProfileOption = Annotated[
    Path | None, typer.Option("--file", "-f", help="Profile YAML; default: the embedded local one.")
]


def load_profile_or_exit(path: Path | None) -> tuple[Profile, Path]:
    try:
        return load_profile(path), path or DEFAULT_PROFILE
    except ProfileError as exc:
        raise fail(str(exc)) from exc


def cluster_or_exit(name: str | None) -> ClusterState:
    try:
        return find_cluster(state_root(), name)
    except ClusterNotFound as exc:
        raise fail(str(exc)) from exc


def render_checks(checks: list[Check]) -> None:

    table = Table(title="preflight", show_lines=False)
    for column in ("node", "check", "", "detail"):
        table.add_column(column)
    for check in checks:
        mark = "[red]FAIL[/]" if not check.ok else "[yellow]warn[/]" if check.warning else "[green]ok[/]"
        table.add_row(escape(check.node), escape(check.name), mark, escape(check.detail))
    out.print(table)
    # The fixes are sentences: below the table, one line each, they stay whole and readable.
    for check in checks:
        if not check.ok:
            print_fix("[red]FAIL[/]", check)
    render_warnings(checks)


def render_warnings(checks: list[Check]) -> None:
    for check in checks:
        if check.ok and check.warning:
            print_fix("[yellow]warn[/]", check)


def print_fix(mark: str, check: Check) -> None:
    out.print(
        f"{mark} {escape(check.node)} {escape(check.name)}: {escape(check.detail)}\n     fix: {escape(check.fix)}",
        soft_wrap=True,
        highlight=False,
    )


@app.command()
def doctor(file: ProfileOption = None) -> None:
    """Validate a profile and run the preflight checks; nothing is started."""
    # Imported here: the module's import block belongs to others (see docs/ssh.md).

    profile, _ = load_profile_or_exit(file)
    with Transports() as transports, out.status("checking the controller and the nodes"):
        checks = preflight(profile, plan_workers(profile), transports)
    render_checks(checks)
    if not all(c.ok for c in checks):
        raise fail("preflight failed: fix the rows marked FAIL")
    out.print("[green]ready[/]: `thunderctl up" + (f" -f {file}`" if file else "`"))


@app.command()
def up(
    file: ProfileOption = None,
    dry_run: Annotated[bool, typer.Option(help="Print the plan (the command per worker) and start nothing.")] = False,
    skip_preflight: Annotated[bool, typer.Option(help="Start without the preflight checks.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the workers' health.")] = 300.0,
) -> None:
    """Start a cluster: workers, then the daemon (gateway, scheduler, control socket) under a supervisor
    that holds the gateway's port and starts the daemon again whenever it dies.

    Idempotent: on a running cluster it starts again any worker that died and changes nothing else;
    a cluster whose supervisor died gets a new one.
    """

    profile, path = load_profile_or_exit(file)
    plans = plan_workers(profile)
    exposure = profile.gateway.exposure_problem()
    if dry_run:
        for plan in plans:
            where = f"{plan.host}:{plan.port}" + (" (through an SSH tunnel)" if plan.tunnel else "")
            out.print(f"[bold]{plan.id}[/] on {where}\n  {plan.shell_line()}", soft_wrap=True)
        out.print(f"gateway on http://{profile.gateway.host}:{profile.gateway.port}/v1")
        if exposure:
            err.print(f"[yellow]warning:[/] `up` would refuse this profile: {exposure}")
        return
    if exposure:
        raise fail(f"{exposure}; nothing was started")
    state = existing_state(profile)
    with Transports() as transports:
        if state is not None and supervisor_running(state):
            with out.status("the cluster is up: checking its workers") as status:
                try:
                    done = reconcile(state, plans, timeout, status.update, transports)
                except (LaunchError, TransportError, httpx.HTTPError) as exc:
                    raise fail(
                        f"{exc}\n`thunderctl logs` shows the worker's log; `thunderctl down` stops the cluster"
                    ) from exc
            out.print(f"cluster [bold]{state.cluster}[/] is already up at {state.endpoint}; {done.summary()}")
            return
        try:
            alive = state is not None and any_worker_alive(state, transports)
        except TransportError as exc:
            raise fail(
                f"{exc}\ncannot tell whether the workers still run; `thunderctl down` stops what it can reach"
            ) from exc
        if state is not None and alive:
            with out.status("the daemon's supervisor had died: restarting it and any worker that died") as status:
                try:
                    revived = recover(state, profile.gateway, plans, timeout, status.update, transports)
                except (LaunchError, TransportError) as exc:
                    raise fail(f"{exc}\n`thunderctl down` stops what is left") from exc
            again = f"; restarted {', '.join(revived)}" if revived else ""
            out.print(f"cluster [bold]{state.cluster}[/] recovered at [bold]{state.endpoint}[/]{again}")
            return
        if state is not None:
            out.print(f"cleaning up what a crashed cluster {state.cluster} left behind")
            cleanup = tear_down(state, drain_timeout=0, transports=transports)
            if cleanup.left:  # the new daemon's pool takes the sandbox record over; the rest is named here
                out.print(f"[yellow]{escape(cleanup.note(state))}[/]")
        if not skip_preflight:
            with out.status("preflight: checking the controller and the nodes"):
                checks = preflight(profile, plans, transports)
            if not all(c.ok for c in checks):
                render_checks(checks)
                raise fail("preflight failed; nothing was started (fix the FAIL rows, or --skip-preflight)")
            render_warnings(checks)
        with out.status("starting workers") as status:
            try:
                state = launch(profile, path, plans, timeout, status.update, transports)
            except LaunchError as exc:
                raise fail(str(exc)) from exc
    out.print(
        f"cluster [bold]{state.cluster}[/] up: {len(state.workers)} worker(s); endpoint [bold]{state.endpoint}[/]"
    )


def get_status(state: ClusterState) -> ClusterStatus:
    try:
        return fetch_status(state, timeout=10)
    except httpx.HTTPError as exc:
        raise fail(
            f"{daemon_trouble(state)}\n`thunderctl up` starts again what is not running; `thunderctl down` stops the cluster"
        ) from exc


@app.command()
def status(
    cluster: ClusterOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the status as JSON.")] = False,
    watch: Annotated[bool, typer.Option(help="Refresh live until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes with --watch.")] = 1.0,
) -> None:
    """Workers, programs, KV and sandboxes of a running cluster."""
    state = cluster_or_exit(cluster)
    if json_output:
        print(json.dumps(get_status(state).wire(), indent=2))
        return
    if not watch:
        out.print(status_renderable(get_status(state)))
        return
    with Live(status_renderable(get_status(state)), console=out, refresh_per_second=4) as live:
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(interval)
                live.update(status_renderable(get_status(state)))


def post_target(state: ClusterState, path: str, target: str) -> list[str]:
    with control_client(state) as client:
        response = client.post(path, json={"target": target})
    if response.status_code != 200:
        raise fail(response.json()["error"]["message"])
    return response.json()["workers"]


@app.command()
def drain(
    target: Annotated[str, typer.Argument(help="A worker id such as local/0, or a node name.")],
    cluster: ClusterOption = None,
    wait: Annotated[bool, typer.Option(help="Wait until nothing is in flight or reserved there.")] = False,
    stop: Annotated[bool, typer.Option(help="Stop the worker(s) once drained (implies --wait).")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait with --wait.")] = 600.0,
) -> None:
    """Take workers out of service without losing work.

    No new or resumed programs go there; ACTING programs pause now and resume elsewhere;
    REASONING programs pause at their next tool boundary; requests in flight finish.
    """
    state = cluster_or_exit(cluster)
    worker_ids = post_target(state, "/drain", target)
    out.print(f"draining {', '.join(worker_ids)}")
    if not (wait or stop):
        return
    deadline = time.monotonic() + timeout
    with out.status("draining") as progress:
        while True:
            busy = get_status(state).busy(worker_ids)
            if not busy:
                break
            if time.monotonic() > deadline:
                raise fail(f"still busy after {timeout:.0f} s: {', '.join(w.id for w in busy)}")
            progress.update(
                "draining: "
                + ", ".join(f"{w.id} in flight {w.requests_in_flight} programs {w.programs_active}" for w in busy)
            )
            time.sleep(0.5)
    out.print(f"[green]drained[/] {', '.join(worker_ids)}: safe to stop")
    if stop:
        post_target(state, "/workers/stop", target)
        out.print(f"stopped {', '.join(worker_ids)}")


@app.command()
def undrain(
    target: Annotated[str, typer.Argument(help="A worker id or node name.")],
    cluster: ClusterOption = None,
) -> None:
    """Return drained workers to service."""
    state = cluster_or_exit(cluster)
    out.print(f"in service: {', '.join(post_target(state, '/undrain', target))}")


@app.command()
def down(
    cluster: ClusterOption = None,
    timeout: Annotated[float, typer.Option(help="Seconds to let requests in flight finish.")] = 60.0,
) -> None:
    """Drain, release programs, stop workers and the daemon; leave nothing behind. Idempotent."""

    try:
        state = find_cluster(state_root(), cluster)
    except ClusterNotFound as exc:
        out.print(f"nothing to do: {exc}")
        return
    with Transports() as transports, out.status(f"stopping cluster {state.cluster}"):
        teardown = tear_down(state, timeout, transports)
    report, removed = teardown.report, teardown.sandboxes.removed
    if report is None:
        out.print(f"the daemon was not running; cleaned up from the state file ({removed} sandbox(es) removed)")
    else:
        drained = "drained" if report["drained"] else "drain timed out"
        after = f"; {removed} sandbox(es) it left removed" if removed else ""
        out.print(f"released {report['released']} program(s); {drained}{after}")
    nodes: dict[str, list[str]] = {}
    for stop_report in teardown.stops:
        mark = "" if stop_report.ok else "[red]FAIL[/] "
        nodes.setdefault(stop_report.node, []).append(f"{mark}{stop_report.worker_id} {stop_report.outcome}")
    for node, outcomes in nodes.items():
        out.print(f"  node {node}: " + "; ".join(outcomes))
    if teardown.left:
        raise fail(teardown.note(state))
    out.print(f"cluster [bold]{state.cluster}[/] is down")


@app.command()
def logs(
    target: Annotated[str, typer.Argument(help="A worker id such as local/0, or `daemon`.")],
    cluster: ClusterOption = None,
    follow: Annotated[bool, typer.Option("--follow", "-F", help="Keep printing new lines.")] = False,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines from the end.")] = 50,
) -> None:
    """Print a worker's or the daemon's log."""

    state = cluster_or_exit(cluster)
    if target == "daemon":
        path, node = str(state.daemon_log), None
    else:
        try:
            worker = state.worker(target)
        except KeyError:
            raise fail(
                f"no worker {target!r}; workers: {', '.join(w.id for w in state.workers)}, or `daemon`"
            ) from None
        path, node = worker.log_path, worker.ssh
    with Transports() as transports:
        transport = transports.to(node)
        try:
            start = transport.line_count(path)
            print(transport.tail(path, lines), end="", flush=True)
            if follow:
                with contextlib.suppress(KeyboardInterrupt):
                    for line in follow_lines(transport, path, start):
                        print(line, end="", flush=True)
        except TransportError as exc:
            raise fail(str(exc)) from exc


if __name__ == "__main__":  # `python -m thunderctl.cli` as well as `python -m thunderctl`
    app(prog_name="thunderctl")
