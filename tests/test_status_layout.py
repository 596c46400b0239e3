"""`thunderctl status` at 80 columns: every worker id, URL and number in full, no line wider."""

from __future__ import annotations

import httpx
import pytest
from rich.cells import cell_len
from rich.console import Console

from thunderctl.cli import status_renderable
from thunderctl.daemon.control import build_control_app


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def daemon_view(daemon_of) -> dict:
    """The status a real daemon answers (so the layout reads the fields the daemon sends)."""
    daemon = daemon_of()
    await daemon.gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_control_app(daemon)),
                                     base_url="http://control") as control:
            return (await control.get("/status")).json()
    finally:
        await daemon.gateway.stop()


def busy_cluster(view: dict) -> dict:
    """The daemon's view with two busy workers, one of them with the longest figures a
    cluster of a few nodes shows."""
    template = view["workers"][0]
    workers = [
        template | {"id": "local/0", "url": "http://127.0.0.1:8100", "state": "ready", "kv_capacity_tokens": 32_768,
                    "kv_reserved_tokens": 30_125, "programs_active": 12, "requests_in_flight": 7,
                    "prefix_cache_hit_rate": 0.8125, "preemptions": 1_234},
        template | {"id": "gpu-node-12/3", "url": "http://127.0.0.1:41235", "state": "unhealthy",
                    "kv_capacity_tokens": 1_048_576, "kv_reserved_tokens": 987_654, "programs_active": 128,
                    "requests_in_flight": 256, "prefix_cache_hit_rate": None, "preemptions": 123_456},
    ]  # fmt: skip
    scheduler = view["scheduler"] | {"programs": {"reasoning": 12, "acting": 30, "paused": 256},
                                     "pauses_total": 12_345, "resumes_total": 12_000, "forced_resumes_total": 3}
    return view | {"uptime_s": 3725.3, "workers": workers, "scheduler": scheduler}


def rendered_at_80(view: dict) -> list[str]:
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
    for worker in view["workers"]:
        row = next(line for line in lines if line.startswith(worker["id"]) and worker["url"] not in line)
        assert row.split()[1:] == rows[worker["id"]]
        assert any(line.split() == [worker["id"], worker["url"]] for line in lines), worker["url"]
    assert view["endpoint"] in text
    assert "paused 256" in text and "pauses 12,345 · resumes 12,000 · forced 3" in text


@pytest.mark.anyio
async def test_a_worker_without_a_capacity_yet_shows_a_dash(daemon_view) -> None:
    view = busy_cluster(daemon_view)
    view["workers"][0] |= {"kv_capacity_tokens": None, "state": "starting"}
    row = next(line for line in rendered_at_80(view) if line.startswith("local/0 ") and "http" not in line)
    assert row.split()[1:4] == ["starting", "30,125", "-"]
