"""The simulated engine's `/metrics`: vLLM 0.32's names, labels and help texts, read off the engine
model at each scrape, so the gateway and `bench` read a simulated worker as they read a real one."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from thunderctl.sim.engine import Engine

# A single engine core, as a vLLM server without data parallelism labels it.
ENGINE_LABEL = "0"


class EngineCollector:
    """A prometheus-client collector over one `Engine`."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.labels = ("engine", "model_name")
        self.values = (ENGINE_LABEL, model_name)

    def _gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, help_text, labels=self.labels)
        family.add_metric(self.values, value)
        return family

    def _counter(self, name: str, help_text: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, help_text, labels=self.labels)
        family.add_metric(self.values, value)
        return family

    def collect(self) -> Iterator[Metric]:
        engine, counters = self.engine, self.engine.counters
        shape = engine.shape
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", len(engine.running)
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(engine.waiting)
        )
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.kv_usage)
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            counters.prefix_cache_queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            counters.prefix_cache_hits,
        )
        # vLLM counts every sampled token; the model's counter leaves out each answer's first, sampled by its prefill.
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.", counters.decode_tokens)
        yield self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", counters.preemptions
        )
        config = {
            "block_size": str(shape.block_size),
            "enable_prefix_caching": "True",
            "engine": ENGINE_LABEL,
            "kv_cache_size_tokens": str(shape.kv_capacity_tokens),
            "num_gpu_blocks": str(shape.num_gpu_blocks),
        }
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(config)
        )
        info.add_metric(list(config.values()), 1.0)
        yield info


def metrics_registry(engine: Engine, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry
