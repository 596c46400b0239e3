"""How long the gateway's own work takes, as Prometheus histograms on its `/metrics`: each scheduler
tick, each scheduled request's wait for admission (from its arrival to its worker being
chosen: the scheduler's decision, plus the wait of a paused program for its resume), and how
late its event loop runs (the time it was blocked, in which it accepted and answered nothing)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.samples import Sample

TICK_SECONDS = "thunderctl_scheduler_tick_seconds"
ADMISSION_WAIT_SECONDS = "thunderctl_admission_wait_seconds"
LOOP_LAG_SECONDS = "thunderctl_event_loop_lag_seconds"
# How often the loop's lateness is measured: a stall shorter than this may go unseen.
LOOP_LAG_PROBE_S = 0.1


def log_buckets(low: float, high: float, per_decade: int = 10) -> list[float]:
    """Upper bounds from `low` to at least `high`, `per_decade` to a factor of ten, so that a
    quantile read from them is off by at most a factor of 10 ** (1 / per_decade) (26 %)."""
    bounds, k = [], 0
    while not bounds or bounds[-1] < high:
        bounds.append(float(f"{low * 10 ** (k / per_decade):.3g}"))
        k += 1
    return bounds


class GatewayTimings:
    def __init__(self) -> None:
        # The page's names are the ones bench and the docs read: no extra `_created` series.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        self.tick = Histogram(
            TICK_SECONDS,
            "Wall time of one scheduler tick (adapt and tick).",
            buckets=log_buckets(1e-5, 10),
            registry=self.registry,
        )
        self.admission_wait = Histogram(
            ADMISSION_WAIT_SECONDS,
            "Time from a scheduled request's arrival to its worker being chosen.",
            buckets=log_buckets(1e-5, 3600),
            registry=self.registry,
        )

        self.loop_lag = Histogram(
            LOOP_LAG_SECONDS,
            f"How late the event loop ran a timer due every {LOOP_LAG_PROBE_S:g} s (time it was blocked).",
            buckets=log_buckets(1e-4, 100),
            registry=self.registry,
        )

    def render(self) -> str:
        return generate_latest(self.registry).decode()


async def watch_loop_lag(observe: Callable[[float], None], interval_s: float = LOOP_LAG_PROBE_S) -> None:
    """Until cancelled: how late each timer due every `interval_s` ran, told to `observe`."""
    while True:
        due = time.monotonic() + interval_s
        await asyncio.sleep(interval_s)
        observe(max(0.0, time.monotonic() - due))


def histogram_quantile(samples: Iterable[Sample], name: str, q: float) -> float | None:
    """The q-quantile (0-1) of a histogram on a scraped page, as Prometheus' histogram_quantile
    reads it (linear within the bucket it falls in); None without observations."""
    buckets = sorted((float(s.labels["le"]), s.value) for s in samples if s.name == f"{name}_bucket")
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound
