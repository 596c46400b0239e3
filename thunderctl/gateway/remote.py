"""The scheduler side and the relays in two kinds of process, over a Unix socket (wire.py).

`AdmissionsServer` runs in the scheduler's process (the daemon) and answers each relay process's
messages from its `Gateway`. It knows which admissions each relay holds: when a relay's connection
closes (the relay died, or was stopped), each of them ends as a stream cut short would, and its
worker's slot is free again. `RemoteAdmissions` is that scheduler side as a relay process sees it:
while the scheduler's process is away (restarting), a call waits for it to come back, up to
`hold_s`, then fails open: the request goes to the worker this relay has fewest requests on,
unscheduled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from thunderctl.gateway.admissions import Admission, Admitted, AnswerEnd, Chain, Failure
from thunderctl.gateway.gateway import Gateway
from thunderctl.gateway.identity import Candidates, ChatKeys, Claim, Keys, PromptKeys, PromptMatches
from thunderctl.gateway.wire import (
    ERROR,
    REPLY,
    Adopt,
    ClaimAsk,
    Codec,
    EndedAsk,
    Hello,
    Welcome,
    WireError,
    read_frame,
)

log = logging.getLogger(__name__)

HOLD_S = 10.0  # how long a relay holds a request while the scheduler's process is away
RECONNECT_S = 0.1  # how soon a relay tries the scheduler's socket again


class SchedulerGone(ConnectionError):
    """The scheduler's process closed the connection before it answered."""


class SchedulerFailed(RuntimeError):
    """The scheduler raised while answering a call (its log has the traceback)."""


class RemoteAdmissions:
    """The Admissions of a relay process: each call a message to the scheduler's process at `path`.
    `workers` (id, URL) are where a request goes when that process stays away past `hold_s`;
    `on_give_up` gives up a stalled worker's unanswered requests, as the scheduler pushes it."""

    def __init__(
        self,
        path: Path,
        relay: int,
        workers: Sequence[tuple[str, str]],
        on_give_up: Callable[[str], int],
        hold_s: float = HOLD_S,
    ) -> None:
        self.path = path
        self.relay = relay
        self.hold_s = hold_s
        self._workers = list(workers)
        self._on_give_up = on_give_up
        self._codec = Codec()
        self._calls: dict[int, tuple[str, asyncio.Future[Any]]] = {}
        self._numbers = itertools.count(1)
        self._writer: asyncio.StreamWriter | None = None
        self._connected = asyncio.Event()
        self._welcome = Welcome(derives=False, keeps_answers=False)
        self._open: Counter[str] = Counter()  # this relay's requests per worker, for failing open
        self.disconnects = 0
        self._task: asyncio.Task[None] | None = None

    # ---- the connection -------------------------------------------------------------------

    async def start(self) -> None:
        """Connect (in the background, again whenever the connection closes)."""
        self._task = asyncio.get_running_loop().create_task(self._keep_connected())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def _keep_connected(self) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.path))
            except OSError:
                await asyncio.sleep(RECONNECT_S)
                continue
            try:
                await self._serve(reader, writer)
            except (OSError, WireError) as exc:
                log.warning("relay %d: the scheduler's connection failed: %s", self.relay, exc)
            finally:
                self._connected.clear()
                self._writer = None
                writer.close()
                for _, future in self._calls.values():
                    if not future.done():
                        future.set_exception(SchedulerGone("the scheduler's process went away"))
                self._calls.clear()
            await asyncio.sleep(RECONNECT_S)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        hello = self._send("hello", Hello(self.relay, os.getpid()))
        reading = asyncio.get_running_loop().create_task(self._read(reader))
        try:
            self._welcome = await asyncio.wait_for(asyncio.shield(hello), self.hold_s)
            self._connected.set()
            log.info("relay %d: connected to the scheduler", self.relay)
            await reading
        finally:
            reading.cancel()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while (frame := await read_frame(reader)) is not None:
            kind, number, payload = self._codec.head(frame)
            if kind == "give_up":
                self._on_give_up(self._codec.payload(kind, payload))
                continue
            if kind not in (REPLY, ERROR):
                raise WireError(f"a relay is not asked {kind!r}")
            asked, future = self._calls.pop(number, ("", None))
            if future is None or future.done():
                continue
            if kind == ERROR:
                future.set_exception(SchedulerFailed(self._codec.error(payload)))
            else:
                future.set_result(self._codec.reply(asked, payload))

    def _send(self, kind: str, payload: Any) -> asyncio.Future[Any]:
        """Send a call; the future of its reply."""
        if self._writer is None:
            raise SchedulerGone("not connected to the scheduler's process")
        number = next(self._numbers)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[number] = (kind, future)
        self._writer.write(self._codec.encode(kind, number, payload))
        return future

    def _tell(self, kind: str, payload: Any) -> None:
        if self._writer is not None:
            self._writer.write(self._codec.encode(kind, 0, payload))

    async def _call(self, kind: str, payload: Any) -> tuple[bool, Any]:
        """(True, the reply), or (False, None) once the scheduler's process stayed away `hold_s` or
        failed on the call: the request is then served as if there were no scheduler."""
        deadline = asyncio.get_running_loop().time() + self.hold_s
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False, None
            try:
                await asyncio.wait_for(self._connected.wait(), left)
                return True, await self._send(kind, payload)
            except (TimeoutError, SchedulerGone):
                continue
            except SchedulerFailed as exc:
                log.warning(
                    "relay %d: the scheduler failed on a %s call (%s); served unscheduled", self.relay, kind, exc
                )
                return False, None

    # ---- Admissions -----------------------------------------------------------------------

    @property
    def remote(self) -> bool:
        return True

    @property
    def keeps_answers(self) -> bool:
        return self._welcome.keeps_answers

    @property
    def derives(self) -> bool:
        return self._welcome.derives

    async def claim(self, keys: Keys, matches: PromptMatches) -> Claim | None:
        ask = (
            ClaimAsk(chat=keys, matches=matches)
            if isinstance(keys, ChatKeys)
            else ClaimAsk(prompt=keys, matches=matches)
        )
        answered, claim = await self._call("claim", ask)
        return claim if answered else None  # failing open: served unscheduled

    async def candidates(self, keys: PromptKeys) -> Candidates:
        answered, candidates = await self._call("candidates", keys)
        return candidates if answered else Candidates()

    async def chain(self, response_id: str) -> Chain | None:
        answered, chain = await self._call("chain", response_id)
        return chain if answered else None

    async def admit(self, admission: Admission) -> Admitted:
        answered, admitted = await self._call("admit", admission)
        if not answered:
            admitted = self._open_to(admission.avoid)
            log.warning(
                "relay %d: no scheduler for %gs; a request goes to %s unscheduled",
                self.relay,
                self.hold_s,
                admitted.worker,
            )
        self._open[admitted.worker] += 1
        return admitted

    def finished(self, end: AnswerEnd) -> None:
        self._open[end.worker] -= 1
        if end.ticket:
            self._tell("finished", end)

    async def failed(self, failure: Failure) -> bool:
        self._open[failure.worker] -= 1
        if not failure.ticket:
            return failure.attempt == 1
        answered, again = await self._call("failed", failure)
        return bool(again) if answered else failure.attempt == 1

    async def ended(self, end: AnswerEnd, keep: bool) -> None:
        self._open[end.worker] -= 1
        if end.ticket:
            await self._call("ended", EndedAsk(end, keep))

    async def route(self, program_id: str | None) -> Admitted:
        answered, admitted = await self._call("route", program_id)
        return admitted if answered else self._open_to(None)

    async def release(self, program_id: str) -> None:
        """The session's last request was answered: the program ends (as POST /programs/release),
        before the relay takes the connection's next request."""
        await self._call("release", program_id)

    def adopt(self, program_id: str, docker_ids: list[str]) -> None:
        self._tell("adopt", Adopt(program_id, docker_ids))

    def client_gone(self) -> int:
        """A client went away mid-body: counted in the daemon's /metrics; this relay's count so far."""
        self.disconnects += 1
        self._tell("disconnected", None)
        return self.disconnects

    def _open_to(self, avoid: str | None) -> Admitted:
        """The worker this relay has fewest requests on (another than `avoid`, where there is one)."""
        workers = [w for w in self._workers if w[0] != avoid] or self._workers
        worker, url = min(workers, key=lambda w: self._open[w[0]])
        return Admitted(worker, url)


class _RelayConnection:
    """One relay process's connection, as the scheduler's process holds it: the admissions it holds
    (by ticket), the calls it is waiting on, and the push the scheduler sends it (`give_up`)."""

    def __init__(self, writer: asyncio.StreamWriter, codec: Codec) -> None:
        self.writer = writer
        self.codec = codec
        self.relay: int | None = None
        self.pid: int | None = None
        self.admitted: dict[int, tuple[Admitted, Admission]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.requests = 0
        self.messages = 0  # frames it sent

    def give_up(self, worker: str) -> int:
        self.writer.write(self.codec.encode("give_up", 0, worker))
        return 0  # counted by the relay, which logs them

    def reply(self, number: int, payload: Any) -> None:
        if not self.writer.is_closing():
            self.writer.write(self.codec.encode(REPLY, number, payload))

    def error(self, number: int, exc: BaseException) -> None:
        if not self.writer.is_closing():
            self.writer.write(self.codec.encode(ERROR, number, f"{type(exc).__name__}: {exc}"))


class AdmissionsServer:
    """The scheduler's side of the relays' messages, served from `gateway` on the Unix socket `path`;
    `release` ends a program whose session's last request was answered, `adopt` takes a program's
    sandboxes (the daemon's, as build_app's)."""

    def __init__(
        self,
        gateway: Gateway,
        path: Path,
        release: Callable[[str], object],
        adopt: Callable[[str, list[str]], None] | None = None,
    ) -> None:
        self.gateway = gateway
        self.path = path
        self._release = release
        self._adopt = adopt
        self.connections: list[_RelayConnection] = []
        self._codec = Codec()
        # Past every ticket an earlier daemon of this boot gave (it gave far fewer than one a
        # nanosecond): an answer it admitted, ending at a relay after this daemon started, ends
        # nothing of this one's.
        self._tickets = itertools.count(time.monotonic_ns())
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        old_umask = os.umask(0o177)  # only the owner's relays
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        finally:
            os.umask(old_umask)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for connection in list(self.connections):
                connection.writer.close()
            await self._server.wait_closed()
        self.path.unlink(missing_ok=True)

    def relays(self) -> list[dict[str, Any]]:
        """Each connected relay: its number, pid, requests and messages so far, and requests open now."""
        return [
            {"relay": c.relay, "pid": c.pid, "requests": c.requests, "messages": c.messages, "open": len(c.admitted)}
            for c in self.connections
        ]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _RelayConnection(writer, self._codec)
        self.connections.append(connection)
        self.gateway.relays.append(connection)
        try:
            while (frame := await read_frame(reader)) is not None:
                connection.messages += 1
                kind, number, raw = self._codec.head(frame)
                await self._guarded(
                    connection, kind, number, self._handle(connection, kind, number, self._codec.payload(kind, raw))
                )
        except (OSError, WireError) as exc:
            log.warning("relay %s: its connection failed: %s", connection.relay, exc)
        finally:
            self._closed(connection)
            writer.close()

    async def _handle(self, connection: _RelayConnection, kind: str, number: int, payload: Any) -> None:
        """One frame, in the order they came: tells and quick calls at once, calls that wait (an
        admission while its program is paused, a journal write) as tasks of their own."""
        gateway = self.gateway
        if kind == "finished":
            self._finished(connection, payload)
        elif kind == "ended":
            self._finished(connection, payload.end)
            if payload.keep and gateway.keeps_answers:
                self._spawn(connection, kind, number, self._kept(connection, number, payload.end.program_id))
            else:
                connection.reply(number, None)
        elif kind == "failed":
            if connection.admitted.pop(payload.ticket, None) is not None:
                connection.reply(number, await gateway.failed(payload))
            else:
                connection.reply(number, False)
        elif kind == "release":
            self._release(payload)
            connection.reply(number, None)
        elif kind == "adopt":
            if self._adopt is not None:
                self._adopt(payload.program_id, payload.docker_ids)
        elif kind == "disconnected":
            gateway.count_client_disconnect()
        elif kind == "hello":
            connection.relay, connection.pid = payload.relay, payload.pid
            connection.reply(number, Welcome(gateway.derives, gateway.keeps_answers))
        elif kind == "route":
            connection.reply(number, await gateway.route(payload))
        elif kind == "candidates":
            connection.reply(number, await gateway.candidates(payload))
        elif kind == "claim":
            keys = payload.chat if payload.chat is not None else payload.prompt
            connection.reply(number, await gateway.claim(keys, payload.matches))
        elif kind == "chain":
            connection.reply(number, await gateway.chain(payload))
        elif kind == "admit":
            connection.requests += 1
            self._spawn(connection, kind, number, self._admit(connection, number, payload))
        else:
            raise WireError(f"the scheduler is not told {kind!r}")

    def _spawn(self, connection: _RelayConnection, kind: str, number: int, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(self._guarded(connection, kind, number, coroutine))
        connection.tasks.add(task)
        task.add_done_callback(connection.tasks.discard)

    @staticmethod
    async def _guarded(connection: _RelayConnection, kind: str, number: int, coroutine: Any) -> None:
        """Run the answer to one frame; if the scheduler raises, its relay is told so (a call is
        answered by an error frame, which the relay serves unscheduled) and the connection stays."""
        try:
            await coroutine
        except (WireError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.exception("the scheduler failed on relay %s's %s", connection.relay, kind)
            if number:
                connection.error(number, exc)

    async def _admit(self, connection: _RelayConnection, number: int, admission: Admission) -> None:
        admitted = dataclasses.replace(await self.gateway.admit(admission), ticket=next(self._tickets))
        if connection.writer.is_closing():  # the relay went while its request waited
            self.gateway.finished(AnswerEnd(admitted.worker, admission.program_id, admission.shape, None))
            return
        connection.admitted[admitted.ticket] = (admitted, admission)
        connection.reply(number, admitted)

    def _finished(self, connection: _RelayConnection, end: AnswerEnd) -> None:
        if connection.admitted.pop(end.ticket, None) is not None:
            self.gateway.finished(end)

    async def _kept(self, connection: _RelayConnection, number: int, program_id: str | None) -> None:
        await self.gateway.kept(program_id, keep=True)
        connection.reply(number, None)

    def _closed(self, connection: _RelayConnection) -> None:
        """A relay's connection closed: its waiting calls are dropped and its admissions end cut short."""
        self.connections.remove(connection)
        self.gateway.relays.remove(connection)
        for task in connection.tasks:
            task.cancel()
        for admitted, admission in connection.admitted.values():
            self.gateway.finished(AnswerEnd(admitted.worker, admission.program_id, admission.shape, None))
        if connection.admitted:
            log.warning(
                "relay %s closed its connection; its %d open request(s) end", connection.relay, len(connection.admitted)
            )
        connection.admitted.clear()
