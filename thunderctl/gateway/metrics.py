"""The gateway's own Prometheus metrics (text exposition format)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from thunderctl.scheduler import Phase, Status

if TYPE_CHECKING:
    from thunderctl.gateway.gateway import Gateway


def _sample(name: str, value: float, **labels: str) -> str:
    if not labels:
        return f"{name} {value}"
    rendered = ",".join(f'{key}="{val}"' for key, val in labels.items())
    return f"{name}{{{rendered}}} {value}"


def render_metrics(gateway: Gateway) -> str:
    sched = gateway.scheduler
    by_state = Counter((p.phase, p.status) for p in sched.programs.values())
    lines = ["# TYPE thunderctl_programs gauge"]
    for phase in Phase:
        for status in (Status.ACTIVE, Status.PAUSED):
            count = by_state[(phase, status)]
            lines.append(_sample("thunderctl_programs", count, phase=phase, status=status))
    for name, value in [
        ("thunderctl_pauses_total", sched.counters.pauses),
        ("thunderctl_resumes_total", sched.counters.resumes),
        ("thunderctl_forced_resumes_total", sched.counters.forced_resumes),
        ("thunderctl_programs_released_total", sched.counters.released),
        ("thunderctl_programs_expired_total", sched.counters.expired),
        ("thunderctl_scheduler_tick_failures_total", sched.counters.tick_failures),
    ]:
        lines += [f"# TYPE {name} counter", _sample(name, value)]
    lines += [
        "# TYPE thunderctl_acting_weight gauge",
        _sample("thunderctl_acting_weight", round(sched.acting_weight, 4)),
        "# TYPE thunderctl_admission_gate_open gauge",
        _sample("thunderctl_admission_gate_open", int(sched.tuner.gate_open)),
        "# TYPE thunderctl_worker_utilization gauge",
        _sample("thunderctl_worker_utilization", round(gateway.last_utilization, 4)),
        "# TYPE thunderctl_backend_reserved_tokens gauge",
        "# TYPE thunderctl_backend_capacity_tokens gauge",
        "# TYPE thunderctl_backend_requests_in_flight gauge",
    ]
    for upstream in gateway.upstreams.values():
        lines.append(
            _sample(
                "thunderctl_backend_reserved_tokens",
                sched.reserved_tokens(upstream.id),
                backend=upstream.id,
            )
        )
        if upstream.capacity is not None:
            lines.append(
                _sample("thunderctl_backend_capacity_tokens", upstream.capacity, backend=upstream.id)
            )
        lines.append(
            _sample("thunderctl_backend_requests_in_flight", upstream.in_flight, backend=upstream.id)
        )
    return "\n".join(lines) + "\n" + gateway.timings.render()
