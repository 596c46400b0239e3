"""Weight sync through the cluster: `POST /admin/pause` and `POST /admin/resume` (and `GET /admin/pause`).

A pause holds every new request at the gateway (it waits, it does not fail) and forwards vLLM's
own pause to every worker in service; a resume forwards the resume and lets the held requests go.
With `weights_changed`, every engine's prefix cache is reset (vLLM's `/reset_prefix_cache`;
a paused engine keeps its cache, thunderctl asks it to) and the scheduler forgets which contexts
were cached. A pause nobody resumes ends by itself after `admin.max_pause_s`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from thunderctl.engines.vllm import pause_engine, reset_prefix_cache, resume_engine
from thunderctl.gateway.gateway import Gateway
from thunderctl.gateway.links import WorkerLink
from thunderctl.jsonapi import BadRequest, BodyLimits, bad_request, error, read_json_options, shown
from thunderctl.scheduler.pause import AdminConfig, ClusterPause, PauseEnd, PauseMode

log = logging.getLogger(__name__)


class NotNow(RuntimeError):
    """A pause while paused, or a resume while not: the message says which."""


class EnginesRefused(RuntimeError):
    """Some workers refused the call; the message names them and says what became of the cluster."""


def failures(links: list[WorkerLink], results: list[Any]) -> dict[str, str]:
    return {link.id: str(result) for link, result in zip(links, results, strict=True) if isinstance(result, Exception)}


class WeightSync:
    """The cluster's pause for a weight update, over a gateway and its workers."""

    def __init__(self, gateway: Gateway, config: AdminConfig | None = None) -> None:
        self.gateway = gateway
        self.state = ClusterPause((config or AdminConfig()).max_pause_s)
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None

    def in_service(self) -> list[WorkerLink]:
        """The workers a pause reaches: all but stopped and unhealthy ones (they run nothing)."""
        return [link for link in self.gateway.links.values() if not link.stopped and link.healthy]

    def view(self) -> dict[str, object]:
        return self.state.view(self.gateway.clock())

    async def pause(self, mode: PauseMode) -> dict[str, Any]:
        async with self._lock:
            clock = self.gateway.clock
            started = clock()
            if not self.state.begin(mode, started):
                raise NotNow(f"the cluster is paused already (mode {self.state.mode}); POST /admin/resume first")
            self.gateway.admitting.clear()
            links = self.in_service()
            results = await asyncio.gather(
                *(pause_engine(self.gateway.http, link.url, mode.value) for link in links), return_exceptions=True
            )
            refused = failures(links, results)
            if refused:
                paused = [link for link in links if link.id not in refused]
                await asyncio.gather(*(resume_engine(self.gateway.http, u.url) for u in paused), return_exceptions=True)
                self.state.end(clock(), PauseEnd.FAILED)
                self.gateway.admitting.set()
                raise EnginesRefused(
                    "not paused (the others were resumed): " + "; ".join(f"{k}: {v}" for k, v in refused.items())
                )
            self._watch = asyncio.create_task(self._end_when_overdue(), name="pause-bound")
            log.warning(
                "cluster paused (mode %s) on %d worker(s); requests wait at the gateway until POST /admin/resume "
                "or %gs (admin.max_pause_s)",
                mode, len(links), self.state.max_pause_s,
            )  # fmt: skip
            return {"paused": True, "mode": mode.value, "workers": [u.id for u in links], "took_s": clock() - started}

    async def resume(self, weights_changed: bool) -> dict[str, Any]:
        async with self._lock:
            if not self.state.paused:
                raise NotNow("the cluster is not paused; nothing to resume")
            return await self._resume(weights_changed, PauseEnd.RESUMED)

    async def _resume(self, weights_changed: bool, how: PauseEnd) -> dict[str, Any]:
        clock, http = self.gateway.clock, self.gateway.http
        started = clock()
        links = self.in_service()
        refused: dict[str, str] = {}
        if weights_changed:
            # While the engines are still paused: no step runs on a stale block after the resume.
            resets = await asyncio.gather(*(reset_prefix_cache(http, u.url) for u in links), return_exceptions=True)
            refused.update(failures(links, resets))
            refused.update({u.id: "its prefix cache was not reset" for u, ok in zip(links, resets) if ok is False})
        resumes = await asyncio.gather(*(resume_engine(http, u.url) for u in links), return_exceptions=True)
        refused.update(failures(links, resumes))
        forgotten = self.gateway.scheduler.forget_cached_contexts() if weights_changed else 0
        await self.gateway.refresh_metrics()  # the engines' own figures again, and their pause flags
        paused_s = clock() - (self.state.since_s or started)
        self.state.end(clock(), how)
        self.gateway.admitting.set()
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()
        self._watch = None
        answer = {
            "resumed": True,
            "how": how.value,
            "weights_changed": weights_changed,
            "paused_s": round(paused_s, 3),
            "took_s": round(clock() - started, 3),
            "programs_paused": forgotten,
            "workers": [u.id for u in links],
            "errors": refused,
        }
        log.warning(
            "cluster pause ended (%s) after %.1fs; the engines resumed in %.2fs%s%s",
            how, paused_s, answer["took_s"],
            f"; weights changed: caches reset, {forgotten} ACTING program(s) paused" if weights_changed else "",
            f"; workers that refused: {refused}" if refused else "",
        )  # fmt: skip
        return answer

    async def _end_when_overdue(self) -> None:
        while True:
            await asyncio.sleep(self.state.left_s(self.gateway.clock()))
            async with self._lock:
                if not self.state.paused:
                    return
                if self.state.overdue(self.gateway.clock()):
                    log.warning(
                        "the pause was not resumed within admin.max_pause_s (%gs): resuming by itself, the caches "
                        "reset as after a weight update (nothing says the trainer had not changed them)",
                        self.state.max_pause_s,
                    )
                    await self._resume(True, PauseEnd.TIMED_OUT)
                    return

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()


def pause_mode(body: dict[str, Any]) -> PauseMode:
    value = body.get("mode", PauseMode.KEEP.value)
    try:
        return PauseMode(value)
    except ValueError:
        raise BadRequest(f"mode must be one of {', '.join(m.value for m in PauseMode)}, not {shown(value)}") from None


def weights_changed(body: dict[str, Any]) -> bool:
    value = body.get("weights_changed", False)
    if not isinstance(value, bool):
        raise BadRequest(f"weights_changed must be true or false, not {shown(value)}")
    return value


def admin_routes(sync: WeightSync, limits: BodyLimits = BodyLimits()) -> list[BaseRoute]:
    """The routes; the gateway's key guards them as it guards every route but /health."""

    async def call(
        request: Request, parse: Callable[[dict[str, Any]], Any], act: Callable[[Any], Awaitable]
    ) -> Response:
        try:
            value = parse(await read_json_options(request, limits))
        except BadRequest as exc:
            return bad_request(exc)
        try:
            return JSONResponse(await act(value))
        except NotNow as exc:
            return error(409, str(exc), "conflict")
        except EnginesRefused as exc:
            return error(502, str(exc), "backend_error")

    async def pause(request: Request) -> Response:
        return await call(request, pause_mode, sync.pause)

    async def resume(request: Request) -> Response:
        return await call(request, weights_changed, sync.resume)

    async def state(_: Request) -> Response:
        return JSONResponse(sync.view())

    return [
        Route("/admin/pause", pause, methods=["POST"]),
        Route("/admin/pause", state, methods=["GET"]),
        Route("/admin/resume", resume, methods=["POST"]),
    ]
