"""How long the gateway's own work takes, as Prometheus histograms on its `/metrics`: each scheduler
tick, and each scheduled request's wait for admission (from its arrival to its backend being
chosen: the scheduler's decision, plus the wait of a paused program for its resume)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.samples import Sample

TICK_SECONDS = "thunderctl_scheduler_tick_seconds"
ADMISSION_WAIT_SECONDS = "thunderctl_admission_wait_seconds"


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
            "Time from a scheduled request's arrival to its backend being chosen.",
            buckets=log_buckets(1e-5, 3600),
            registry=self.registry,
        )

    def render(self) -> str:
        return generate_latest(self.registry).decode()


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
