"""`thunderctl status` at 80 columns: every worker id, URL and number in full, no line wider."""

from __future__ import annotations

import time

import httpx
import pytest
from rich.cells import cell_len
from rich.console import Console

from thunderctl.daemon.control import build_control_app
from thunderctl.daemon.status import ClusterStatus, DaemonStatus
from thunderctl.status_screen import status_renderable

# What `/status` and `thunderctl status --json` have always answered: scripts read these keys.
WIRE_KEYS = {
    "cluster",
    "endpoint",
    "uptime_s",
    "daemon_pid",
    "gateway",
    "workers",
    "scheduler",
    "sandboxes",
}
WORKER_KEYS = {
    "id",
    "node",
    "url",
    "state",
    "kv_capacity_tokens",
    "kv_reserved_tokens",
    "programs_active",
    "requests_in_flight",
    "prefix_cache_hit_rate",
    "preemptions",
    "requests_running",
    "requests_waiting",
}
SCHEDULER_KEYS = {
    "programs", "pauses_total", "resumes_total", "forced_resumes_total", "acting_weight", "admission_gate_open",
    "utilization",
}  # fmt: skip


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def daemon_wire(daemon_of) -> dict:
    """The status a real daemon answers, as JSON (so the layout reads the fields the daemon sends)."""
    daemon = daemon_of()
    await daemon.gateway.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_control_app(daemon)), base_url="http://control"
        ) as control:
            return (await control.get("/status")).json()
    finally:
        await daemon.gateway.stop()


@pytest.fixture
def daemon_view(daemon_wire: dict) -> ClusterStatus:
    return ClusterStatus.model_validate(daemon_wire)


def busy_cluster(view: ClusterStatus) -> ClusterStatus:
    """The daemon's view with two busy workers, one of them with the longest figures a
    cluster of a few nodes shows."""
    template = view.workers[0]
    workers = [
        template.model_copy(update={"id": "local/0", "url": "http://127.0.0.1:8100", "state": "ready",
                                    "kv_capacity_tokens": 32_768, "kv_reserved_tokens": 30_125, "programs_active": 12,
                                    "requests_in_flight": 7, "prefix_cache_hit_rate": 0.8125, "preemptions": 1_234}),
        template.model_copy(update={"id": "gpu-node-12/3", "url": "http://127.0.0.1:41235", "state": "unhealthy",
                                    "kv_capacity_tokens": 1_048_576, "kv_reserved_tokens": 987_654,
                                    "programs_active": 128, "requests_in_flight": 256, "prefix_cache_hit_rate": None,
                                    "preemptions": 123_456}),
    ]  # fmt: skip
    programs = view.scheduler.programs.model_copy(
        update={"reasoning": 12, "acting": 30, "paused": 256, "derived": 1_024}
    )
    scheduler = view.scheduler.model_copy(
        update={"programs": programs, "pauses_total": 12_345, "resumes_total": 12_000, "forced_resumes_total": 3}
    )
    # A daemon its supervisor has started again often, the last time days ago.
    daemon = DaemonStatus(restarts=1_234, last_exit="killed by SIGKILL", last_exit_at=time.time() - 999_999)
    return view.model_copy(
        update={
            "uptime_s": 3725.3,
            "workers": workers,
            "scheduler": scheduler,
            "daemon_pid": 4_194_304,
            "daemon": daemon,
        }
    )


def rendered_at_80(view: ClusterStatus) -> list[str]:
    console = Console(width=80, record=True, color_system=None)
    console.print(status_renderable(view))
    return console.export_text().splitlines()


@pytest.mark.anyio
async def test_status_fits_80_columns_with_every_id_url_and_number_in_full(daemon_view) -> None:
    view = busy_cluster(daemon_view)
    lines = rendered_at_80(view)
    text = "\n".join(lines)
    assert max(map(cell_len, lines)) <= 80
    assert "…" not in text
    rows = {
        "local/0": ["ready", "30,125", "32,768", "12", "7", "0.81", "1,234"],
        "gpu-node-12/3": ["unhealthy", "987,654", "1,048,576", "128", "256", "-", "123,456"],
    }
    for worker in view.workers:
        row = next(line for line in lines if line.startswith(worker.id) and worker.url not in line)
        assert row.split()[1:] == rows[worker.id]
        assert any(line.split() == [worker.id, worker.url] for line in lines), worker.url
    assert view.endpoint in text
    assert "paused 256" in text and "pauses 12,345 · resumes 12,000 · forced 3" in text
    assert "derived 1,024" in text  # programs found from their conversation
    assert "daemon: pid 4194304 · restarts 1,234 · last: killed by SIGKILL, 999,999 s ago" in text


@pytest.mark.anyio
async def test_a_worker_without_a_capacity_yet_shows_a_dash(daemon_view) -> None:
    view = busy_cluster(daemon_view)
    view.workers[0] = view.workers[0].model_copy(update={"kv_capacity_tokens": None, "state": "starting"})
    row = next(line for line in rendered_at_80(view) if line.startswith("local/0 ") and "http" not in line)
    assert row.split()[1:4] == ["starting", "30,125", "-"]


@pytest.mark.anyio
async def test_the_status_on_the_wire_keeps_every_key_scripts_read_and_reads_back_as_it_was(daemon_wire) -> None:
    assert WIRE_KEYS <= set(daemon_wire)
    assert all(WORKER_KEYS <= set(worker) for worker in daemon_wire["workers"])
    assert SCHEDULER_KEYS <= set(daemon_wire["scheduler"])
    assert set(daemon_wire["scheduler"]["programs"]) == {"reasoning", "acting", "paused", "derived"}
    assert {"available", "warm", "bound", "preparing"} <= set(daemon_wire["sandboxes"])
    # What `thunderctl status --json` prints is the model's dump: the same answer, key for key.
    assert ClusterStatus.model_validate(daemon_wire).wire() == daemon_wire
