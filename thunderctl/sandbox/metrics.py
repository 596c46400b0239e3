"""The pool's status as Prometheus text, for the daemon to append to the gateway's /metrics."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from thunderctl.prometheus import exposition

STATES = ("warm", "bound", "preparing", "failed", "adopted")
QUANTILES = (50, 90, 99)


def render_sandbox_metrics(stats: dict) -> str:
    """`stats` is `SandboxPool.stats()`; values not known yet (no sample) are left out."""
    return exposition(sandbox_families(stats))


def sandbox_families(stats: dict) -> Iterator[Metric]:
    yield GaugeMetricFamily("thunderctl_sandboxes_available", "1 while sandboxes can be made.", int(stats["available"]))
    sandboxes = GaugeMetricFamily("thunderctl_sandboxes", "Sandboxes by state.", labels=["state"])
    for state in STATES:
        sandboxes.add_metric([state], stats[state])
    yield sandboxes
    for name, key, documentation in [
        ("thunderctl_sandbox_prepare_seconds", "prepare_s", "Time to prepare a sandbox."),
        (
            "thunderctl_sandbox_acquire_to_ready_seconds",
            "acquire_to_ready_s",
            "Time from a request to a ready sandbox.",
        ),
    ]:
        yield summary(name, documentation, stats[key])
    disk = GaugeMetricFamily(
        "thunderctl_sandbox_disk_bytes", "Disk the sandboxes use, per Docker host.", labels=["host"]
    )
    for host in stats["hosts"]:
        if host["disk_bytes"] is not None:
            disk.add_metric([host["url"]], host["disk_bytes"])
    yield disk
    # How old that figure is: a reader after a change waits for a measurement taken since.
    age = GaugeMetricFamily(
        "thunderctl_sandbox_disk_age_seconds", "Age of the disk figure, per Docker host.", labels=["host"]
    )
    for host in stats["hosts"]:
        if host["disk_age_s"] is not None:
            age.add_metric([host["url"]], round(host["disk_age_s"], 3))
    yield age
    yield CounterMetricFamily(
        "thunderctl_sandboxes_reaped_total", "Leftover sandbox containers removed.", value=stats["reaped"]
    )
    yield CounterMetricFamily(
        "thunderctl_sandbox_images_evicted_total",
        "Images removed above the disk high watermark.",
        value=stats["evicted_images"],
    )


def summary(name: str, documentation: str, percentiles: dict) -> Metric:
    """Percentiles known so far and the count, without a sum: the pool keeps only recent samples."""
    family = Metric(name, documentation, "summary")
    for q in QUANTILES:
        if percentiles[f"p{q}"] is not None:
            family.add_sample(name, {"quantile": str(q / 100)}, percentiles[f"p{q}"])
    family.add_sample(f"{name}_count", {}, percentiles["count"])
    return family
