"""The soak over time: the daemon's RSS, and the p99 of its scheduler tick and of its event loop's
lateness over each sampling window, as JSON lines while the run goes (a run cut short keeps what it
had) and as a plot at the end.

A window's p99 is read from the difference of two scrapes of the gateway's histograms (the
observations made between them), as Prometheus' `rate()` then `histogram_quantile` would.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil
from prometheus_client.samples import Sample

from thunderctl.gateway.timings import LOOP_LAG_SECONDS, TICK_SECONDS, histogram_quantile
from thunderctl.prometheus import parse_samples

MIB = 2**20
# How much RSS may grow from the end of the warm-up to the end of the run (the want).
RSS_DRIFT_ALLOWED = 0.10
WARMUP_S = 600.0


@dataclass(frozen=True)
class SoakSample:
    t_s: float  # seconds since the load began
    rss_mib: float
    programs: int  # the gateway's live programs
    ticks: int  # scheduler ticks in the window
    tick_p99_s: float | None  # over the window
    loop_lag_p99_s: float | None  # over the window


def window(now: list[Sample], before: dict[tuple, float]) -> list[Sample]:
    """The histogram samples of `now` less the counts of the scrape before (`before`, by key)."""
    return [s._replace(value=s.value - before.get(key(s), 0.0)) for s in now]


def key(sample: Sample) -> tuple:
    return sample.name, tuple(sorted(sample.labels.items()))


class SeriesRecorder:
    """Samples the daemon and its gateway at each `sample()`, appending each sample to `path`."""

    def __init__(self, gateway_url: str, daemon: psutil.Process, path: Path | None) -> None:
        self.gateway_url = gateway_url
        self.daemon = daemon
        self.path = path
        self.samples: list[SoakSample] = []
        self.started = time.monotonic()
        self._before: dict[tuple, float] = {}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def sample(self) -> SoakSample:
        rss = self.daemon.memory_info().rss / MIB
        try:
            page = parse_samples(httpx.get(f"{self.gateway_url}/metrics", timeout=30).text)
        except httpx.HTTPError:
            page = []  # a scrape that timed out on a busy daemon: RSS alone for this window
        histograms = [s for s in page if s.name.startswith((TICK_SECONDS, LOOP_LAG_SECONDS))]
        delta = window(histograms, self._before) if page else []
        if page:
            self._before = {key(s): s.value for s in histograms}
        found = SoakSample(
            t_s=round(time.monotonic() - self.started, 1),
            rss_mib=round(rss, 1),
            programs=int(sum(s.value for s in page if s.name == "thunderctl_programs")),
            ticks=int(sum(s.value for s in delta if s.name == f"{TICK_SECONDS}_count")),
            tick_p99_s=histogram_quantile(delta, TICK_SECONDS, 0.99),
            loop_lag_p99_s=histogram_quantile(delta, LOOP_LAG_SECONDS, 0.99),
        )
        self.samples.append(found)
        if self.path is not None:
            with self.path.open("a") as out:
                out.write(json.dumps(asdict(found)) + "\n")
        return found


def rss_at(samples: list[SoakSample], t_s: float) -> float | None:
    """The RSS of the first sample at or after `t_s` seconds, None if the run was shorter."""
    return next((s.rss_mib for s in samples if s.t_s >= t_s), None)


def rss_drift(samples: list[SoakSample], warmup_s: float = WARMUP_S) -> float | None:
    """The RSS growth from the end of the warm-up to the end, as a fraction (0.1: +10 %); None for a
    run not longer than twice the warm-up (too short to tell drift from warm-up)."""
    if not samples or samples[-1].t_s < 2 * warmup_s:
        return None
    after_warmup = rss_at(samples, warmup_s)
    return None if not after_warmup else samples[-1].rss_mib / after_warmup - 1


def rss_checkpoints(samples: list[SoakSample], every_s: float) -> list[tuple[float, float]]:
    """(minute, RSS) every `every_s` seconds and at the end."""
    points, next_t = [], 0.0
    for sample in samples:
        if sample.t_s >= next_t:
            points.append((sample.t_s / 60, sample.rss_mib))
            next_t += every_s
    if samples and points[-1][0] != samples[-1].t_s / 60:
        points.append((samples[-1].t_s / 60, samples[-1].rss_mib))
    return points


def plot(samples: list[SoakSample], path: Path, title: str) -> None:
    """RSS, tick p99 and loop-lag p99 over time, one panel each, to a PNG."""
    import matplotlib  # imported here: slow, and only a finished run draws

    matplotlib.use("Agg")  # no display: write files only
    from matplotlib import pyplot

    minutes = [s.t_s / 60 for s in samples]
    figure, (rss, tick, lag) = pyplot.subplots(3, 1, sharex=True, figsize=(9, 8))
    rss.plot(minutes, [s.rss_mib for s in samples], color="tab:blue")
    rss.set_ylabel("daemon RSS (MiB)")
    rss.set_ylim(bottom=0)
    for axis, values, want, label in [
        (tick, [s.tick_p99_s for s in samples], 0.050, "scheduler tick p99 (ms)"),
        (lag, [s.loop_lag_p99_s for s in samples], None, "event loop late p99 (ms)"),
    ]:
        axis.plot(minutes, [None if v is None else v * 1000 for v in values], ".-", color="tab:orange")
        if want is not None:
            axis.axhline(want * 1000, color="grey", linestyle="--", linewidth=1, label=f"want ≤ {want * 1000:g} ms")
            axis.legend(loc="upper right")
        axis.set_ylabel(label)
        axis.set_yscale("log")
    lag.set_xlabel("minutes into the load")
    rss.set_title(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
