"""The gateway's own timings on its /metrics: scheduler ticks and admission waits, as histograms."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.samples import Sample

from thunderctl.gateway import Gateway, WorkerLink, build_app
from thunderctl.gateway.identity import IdentityConfig
from thunderctl.gateway.timings import (
    ADMISSION_WAIT_SECONDS,
    LOOP_LAG_SECONDS,
    TICK_SECONDS,
    histogram_quantile,
    log_buckets,
    watch_loop_lag,
)
from thunderctl.prometheus import parse_samples
from thunderctl.scheduler import SchedulerConfig


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def buckets(name: str, counts: dict[float, float]) -> list[Sample]:
    return [Sample(f"{name}_bucket", {"le": "+Inf" if le == float("inf") else str(le)}, n) for le, n in counts.items()]


def test_a_quantile_is_read_off_the_buckets_as_prometheus_reads_it() -> None:
    samples = buckets("t", {0.1: 50, 0.2: 90, 0.4: 100, float("inf"): 100})
    assert histogram_quantile(samples, "t", 0.5) == pytest.approx(0.1)
    assert histogram_quantile(samples, "t", 0.7) == pytest.approx(0.15)
    assert histogram_quantile(samples, "t", 0.99) == pytest.approx(0.38)
    assert histogram_quantile(buckets("t", {0.1: 0, float("inf"): 0}), "t", 0.99) is None


def test_buckets_are_ten_a_decade_and_reach_the_top() -> None:
    bounds = log_buckets(1e-3, 1)
    assert bounds[0] == 1e-3 and bounds[-1] >= 1 and len(bounds) == 31
    assert all(1.2 < b / a < 1.33 for a, b in zip(bounds, bounds[1:]))


@pytest.mark.anyio
async def test_each_scheduled_request_and_each_tick_is_timed(fake_backend) -> None:
    worker = fake_backend()
    unscheduled = IdentityConfig(derive_programs=False)  # a request that names no program is not admitted
    gateway = Gateway([WorkerLink("fake", worker.url)], SchedulerConfig(tick_interval_s=0.2), identity=unscheduled)
    await gateway.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(gateway)), base_url="http://gw"
        ) as client:
            for step in range(3):
                body = {
                    "model": "fake",
                    "program_id": "timed",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"step {step}"}],
                }
                assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            unscheduled = {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "no program"}]}
            assert (await client.post("/v1/chat/completions", json=unscheduled)).status_code == 200
            deadline = time.monotonic() + 30
            while True:  # ticks come every 0.2 s once the gateway runs; a loaded machine may take longer
                samples = parse_samples((await client.get("/metrics")).text)
                counts = {s.name: s.value for s in samples if s.name.endswith("_count")}
                if counts[f"{TICK_SECONDS}_count"] >= 1 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
    finally:
        await gateway.stop()
    assert counts[f"{ADMISSION_WAIT_SECONDS}_count"] == 3  # the program's requests, not the unscheduled one
    assert counts[f"{TICK_SECONDS}_count"] >= 1
    wait = histogram_quantile(samples, ADMISSION_WAIT_SECONDS, 0.99)
    assert wait is not None and 0 < wait < 1  # an idle cluster admits at once


@pytest.mark.anyio
async def test_a_blocked_event_loop_is_measured_as_lag() -> None:
    lags: list[float] = []
    watch = asyncio.create_task(watch_loop_lag(lags.append, interval_s=0.01))
    await asyncio.sleep(0.05)
    time.sleep(0.3)  # blocks the loop, as synchronous work in a handler would
    await asyncio.sleep(0.05)
    watch.cancel()
    assert max(lags) >= 0.25  # the timer due in the blocked spell ran that much late


@pytest.mark.anyio
async def test_the_gateway_reports_its_event_loop_lag(fake_backend) -> None:
    gateway = Gateway([WorkerLink("fake", fake_backend().url)], SchedulerConfig(tick_interval_s=0.2))
    await gateway.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(gateway)), base_url="http://gw"
        ) as client:
            deadline = time.monotonic() + 30
            while True:
                samples = parse_samples((await client.get("/metrics")).text)
                count = next(s.value for s in samples if s.name == f"{LOOP_LAG_SECONDS}_count")
                if count >= 3 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
    finally:
        await gateway.stop()
    assert count >= 3 and histogram_quantile(samples, LOOP_LAG_SECONDS, 0.99) is not None
