"""The gateway's own Prometheus metrics (text exposition format)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from thunderctl.prometheus import exposition
from thunderctl.scheduler import Phase, Status

if TYPE_CHECKING:
    from thunderctl.gateway.gateway import Gateway


def render_metrics(gateway: Gateway) -> str:
    return exposition(gateway_families(gateway)) + gateway.timings.render()


def gateway_families(gateway: Gateway) -> Iterator[Metric]:
    sched = gateway.scheduler
    by_state = Counter((p.phase, p.status) for p in sched.programs.values())
    programs = GaugeMetricFamily("thunderctl_programs", "Programs by phase and status.", labels=["phase", "status"])
    for phase in Phase:
        for status in (Status.ACTIVE, Status.PAUSED):
            programs.add_metric([str(phase), str(status)], by_state[(phase, status)])
    yield programs
    for name, documentation, value in [
        ("thunderctl_pauses_total", "Programs paused.", sched.counters.pauses),
        ("thunderctl_resumes_total", "Programs resumed.", sched.counters.resumes),
        (
            "thunderctl_forced_resumes_total",
            "Programs resumed without room, past resume_timeout_s.",
            sched.counters.forced_resumes,
        ),
        ("thunderctl_programs_released_total", "Programs released.", sched.counters.released),
        (
            "thunderctl_programs_expired_total",
            "Programs never released, ended when not continued (scheduler.md, Ending).",
            sched.counters.expired,
        ),
        ("thunderctl_scheduler_tick_failures_total", "Scheduler ticks that raised.", sched.counters.tick_failures),
        (
            "thunderctl_client_disconnects_total",
            "Requests whose client went away before their body had arrived.",
            gateway.client_disconnects,
        ),
    ]:
        yield CounterMetricFamily(name, documentation, value=value)
    yield from identity_families(gateway)
    yield GaugeMetricFamily(
        "thunderctl_acting_weight",
        "Share of an acting program's private tokens charged.",
        round(sched.acting_weight, 4),
    )
    yield GaugeMetricFamily(
        "thunderctl_admission_gate_open", "1 while the admission law's gate is open.", int(sched.tuner.gate_open)
    )
    # Why the ladder holds its top rung: priced retention's verdict and the re-prefill rate it rests on.
    yield GaugeMetricFamily(
        "thunderctl_retention_pays",
        "1 while keeping a typical tool call's KV costs less than its re-prefill: the ladder holds its top rung.",
        int(sched.tuner.retention_pays),
    )
    yield GaugeMetricFamily(
        "thunderctl_prefill_tokens_per_s",
        "The re-prefill rate priced retention uses: uncached prompt tokens over time to first token, a running mean.",
        round(sched.retention.prefill.tokens_per_s, 1),
    )
    yield GaugeMetricFamily(
        "thunderctl_worker_utilization",
        "Mean busy fraction of the workers in service.",
        round(gateway.last_utilization, 4),
    )
    worker = ["backend"]
    reserved = GaugeMetricFamily(
        "thunderctl_backend_reserved_tokens", "Physical KV tokens charged on the worker.", labels=worker
    )
    capacity = GaugeMetricFamily("thunderctl_backend_capacity_tokens", "KV cache tokens of the worker.", labels=worker)
    in_flight = GaugeMetricFamily(
        "thunderctl_backend_requests_in_flight", "Requests relayed to the worker now.", labels=worker
    )
    for link in gateway.links.values():
        reserved.add_metric([link.id], sched.reserved_tokens(link.id))
        if link.capacity is not None:
            capacity.add_metric([link.id], link.capacity)
        in_flight.add_metric([link.id], link.in_flight)
    yield from (reserved, capacity, in_flight)


def identity_families(gateway: Gateway) -> Iterator[Metric]:
    """Programs the gateway found from their conversation (docs/gateway.md, Program identity)."""
    yield GaugeMetricFamily(
        "thunderctl_programs_derived",
        "Live programs whose requests named none: found from their conversation.",
        gateway.derived.live(gateway.scheduler.programs),
    )
    conversations = gateway.derived.conversations
    if conversations is None:
        return
    requests = CounterMetricFamily(
        "thunderctl_derived_requests",
        "Requests that named no program, by how their program was found (history, rewritten, new).",
        labels=["match"],
    )
    for match, count in conversations.matched.items():
        requests.add_metric([str(match)], count)
    yield requests
    yield GaugeMetricFamily(
        "thunderctl_conversations_remembered",
        "Conversations remembered to find the programs of requests that name none.",
        len(conversations),
    )
