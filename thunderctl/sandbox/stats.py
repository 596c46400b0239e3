"""What the pool counts and measures, and its status view (`SandboxPool.stats()`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from thunderctl.percentiles import percentile
from thunderctl.sandbox.config import SandboxConfig
from thunderctl.sandbox.host import SandboxHost
from thunderctl.sandbox.lease import Sandbox, SandboxState

LATENCY_WINDOW = 1000  # latest preparations kept for percentiles


def percentiles(values: Iterable[float]) -> dict[str, float | int | None]:
    """The count and the p50/p90/p99 of the values, to 0.1 ms."""
    ordered = list(values)
    summary: dict[str, float | int | None] = {"count": len(ordered)}
    for q in (50, 90, 99):
        value = percentile(ordered, q)
        summary[f"p{q}"] = None if value is None else round(value, 4)
    return summary


@dataclass
class PoolCounters:
    acquire_to_ready_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    prepare_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    reaped: int = 0
    evicted_images: int = 0
    disk_bytes: dict[str, int] = field(default_factory=dict)  # host -> bytes, at the last maintenance
    disk_measured_at: dict[str, float] = field(default_factory=dict)  # host -> the pool's clock, then
    last_error: str | None = None


def pool_stats(
    config: SandboxConfig,
    hosts: Sequence[SandboxHost],
    records: Sequence[Sandbox],
    queued_for_preparation: int,
    counters: PoolCounters,
    now: float,
) -> dict:
    def count(state: SandboxState, warm: bool) -> int:
        return sum(1 for sb in records if sb.state is state and sb.is_warm is warm)

    unavailable = [host.reason for host in hosts if not host.available]
    available = config.enabled and len(unavailable) < len(hosts)
    reason = (
        None
        if available
        else ("disabled in the profile" if not config.enabled else "; ".join(r for r in unavailable if r))
    )
    return {
        "enabled": config.enabled,
        "available": available,
        "reason": reason,
        "hosts": [
            {
                "url": h.url,
                "available": h.available,
                "reason": h.reason,
                "sandboxes": sum(1 for sb in records if sb.host is h),
                "disk_bytes": counters.disk_bytes.get(h.url),
                "disk_age_s": now - counters.disk_measured_at[h.url] if h.url in counters.disk_measured_at else None,
            }
            for h in hosts
        ],
        "warm": count(SandboxState.READY, warm=True),
        "bound": count(SandboxState.READY, warm=False),
        "preparing": sum(1 for sb in records if sb.state is SandboxState.PREPARING),
        "failed": count(SandboxState.FAILED, warm=False),
        "adopted": sum(1 for sb in records if sb.adopted),
        "queued_for_preparation": queued_for_preparation,
        "acquire_to_ready_s": percentiles(counters.acquire_to_ready_s),
        "prepare_s": percentiles(counters.prepare_s),
        "disk_bytes": sum(counters.disk_bytes.values()) if counters.disk_bytes else None,
        "disk_high_watermark_bytes": config.disk_high_watermark_bytes,
        "reaped": counters.reaped,
        "evicted_images": counters.evicted_images,
        "last_error": counters.last_error,
    }
