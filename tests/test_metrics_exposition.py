"""The gateway's and the sandbox pool's /metrics text: the names and values consumers read,
label values escaped so that any worker id or host URL reads back as it was."""

from __future__ import annotations

import re
from pathlib import Path

from thunderctl.engines.vllm import EngineMetrics
from thunderctl.gateway.gateway import Gateway
from thunderctl.gateway.links import WorkerLink
from thunderctl.gateway.metrics import render_metrics
from thunderctl.prometheus import parse_samples
from thunderctl.sandbox.metrics import render_sandbox_metrics

DOCS = Path(__file__).parent.parent / "docs"
AWKWARD = 'say "hi"\\ C:\\dir\\\nnext line'  # quotes, backslashes and a newline


def gateway_with(*links: WorkerLink) -> Gateway:
    gateway = Gateway(list(links))
    for link in links:
        gateway.scheduler.add_worker(link.id, link.capacity)
    return gateway


def pool_stats(**changes: object) -> dict:
    """The fields of SandboxPool.stats() that /metrics shows."""
    stats = {
        "available": True, "warm": 2, "bound": 1, "preparing": 0, "failed": 0, "adopted": 0,
        "prepare_s": {"p50": 1.5, "p90": None, "p99": None, "count": 3},
        "acquire_to_ready_s": {"p50": 0.01, "p90": 0.2, "p99": 0.3, "count": 9},
        "hosts": [
            {"url": "unix:///var/run/docker.sock", "disk_bytes": 1234, "disk_age_s": 2.5},
            {"url": "tcp://127.0.0.1:2375", "disk_bytes": None, "disk_age_s": None},
        ],
        "reaped": 4, "evicted_images": 0,
    }  # fmt: skip
    return stats | changes


def by_key(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse_samples(text)}


def test_a_backend_id_with_quotes_backslashes_and_newlines_reads_back_unchanged() -> None:
    gateway = gateway_with(
        WorkerLink(AWKWARD, "http://127.0.0.1:1", in_flight=2, metrics=EngineMetrics(kv_capacity_tokens=4096))
    )
    samples = by_key(render_metrics(gateway))
    assert samples[("thunderctl_backend_requests_in_flight", (("backend", AWKWARD),))] == 2
    assert samples[("thunderctl_backend_capacity_tokens", (("backend", AWKWARD),))] == 4096


def test_a_host_url_with_quotes_backslashes_and_newlines_reads_back_unchanged() -> None:
    stats = pool_stats(hosts=[{"url": AWKWARD, "disk_bytes": 77, "disk_age_s": 1.0}])
    assert by_key(render_sandbox_metrics(stats))[("thunderctl_sandbox_disk_bytes", (("host", AWKWARD),))] == 77


def test_the_gateway_page_carries_its_counters_gauges_and_per_backend_figures() -> None:
    gateway = gateway_with(
        WorkerLink("a", "http://127.0.0.1:1"),
        WorkerLink("b", "http://127.0.0.1:2", in_flight=3, metrics=EngineMetrics(kv_capacity_tokens=4096)),
    )
    gateway.scheduler.counters.pauses = 7
    gateway.scheduler.tuner.retention_pays = True
    gateway.scheduler.observe_prefill(20_000, 1.0)
    gateway.last_utilization = 0.123456
    samples = by_key(render_metrics(gateway))
    assert samples[("thunderctl_pauses_total", ())] == 7
    assert samples[("thunderctl_worker_utilization", ())] == 0.1235
    assert samples[("thunderctl_retention_pays", ())] == 1
    assert samples[("thunderctl_prefill_tokens_per_s", ())] == 11_000  # 10,000 moved a tenth towards 20,000
    assert samples[("thunderctl_programs", (("phase", "acting"), ("status", "paused")))] == 0
    assert samples[("thunderctl_backend_capacity_tokens", (("backend", "b"),))] == 4096
    assert ("thunderctl_backend_capacity_tokens", (("backend", "a"),)) not in samples  # not known yet
    assert samples[("thunderctl_backend_requests_in_flight", (("backend", "b"),))] == 3
    # The counters' names are the ones bench and the docs read, with no extra _created series.
    assert not any(name.endswith("_created") for name, _ in samples)


def test_every_metric_docs_gateway_md_lists_is_on_the_page() -> None:
    table = (DOCS / "gateway.md").read_text().split("## Metrics", 1)[1]
    documented = set(re.findall(r"`(thunderctl_\w+)`", table))
    assert len(documented) >= 9
    gateway = gateway_with(WorkerLink("a", "http://127.0.0.1:1", metrics=EngineMetrics(kv_capacity_tokens=1)))
    names = {name for name, _ in by_key(render_metrics(gateway))}
    histograms = {name.removesuffix("_bucket") for name in names if name.endswith("_bucket")}
    assert documented <= names | histograms


def test_the_sandbox_page_carries_states_summaries_disk_and_counters() -> None:
    samples = by_key(render_sandbox_metrics(pool_stats()))
    assert samples[("thunderctl_sandboxes", (("state", "warm"),))] == 2
    assert samples[("thunderctl_sandbox_prepare_seconds", (("quantile", "0.5"),))] == 1.5
    assert ("thunderctl_sandbox_prepare_seconds", (("quantile", "0.9"),)) not in samples  # no sample yet
    assert samples[("thunderctl_sandbox_acquire_to_ready_seconds", (("quantile", "0.99"),))] == 0.3
    assert samples[("thunderctl_sandbox_acquire_to_ready_seconds_count", ())] == 9
    assert samples[("thunderctl_sandbox_disk_bytes", (("host", "unix:///var/run/docker.sock"),))] == 1234
    assert len([key for key in samples if key[0] == "thunderctl_sandbox_disk_bytes"]) == 1
    assert samples[("thunderctl_sandbox_disk_age_seconds", (("host", "unix:///var/run/docker.sock"),))] == 2.5
    assert samples[("thunderctl_sandboxes_reaped_total", ())] == 4
    assert samples[("thunderctl_sandbox_images_evicted_total", ())] == 0
