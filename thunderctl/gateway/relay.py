"""The relay: each generation request sent to the worker the scheduler side admits it to, its answer
relayed to the client as it comes, and the answer's end told to the scheduler side.

It meets the scheduler only through `Admissions` (admissions.py): it never reads the scheduler's
state, so the byte path can run in processes of its own while one process schedules.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from thunderctl.apiusage import Usage
from thunderctl.gateway.admissions import Admission, Admissions, Admitted, AnswerEnd, ChainStep, Failure
from thunderctl.gateway.apis import Api
from thunderctl.gateway.apis.base import Answer, StreamedAnswer
from thunderctl.gateway.identity import Followed, HashedPrompt, PromptMatches, Turn, hash_turn
from thunderctl.gateway.requests import PromptShape, relayed_payload
from thunderctl.gateway.sse import StreamRelay
from thunderctl.gateway.stalls import UnansweredRequests, WorkerStalled

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker could not be reached mid-request; the client gets a 502 naming it."""


@dataclass(frozen=True)
class Relayed:
    """A worker's answer: a whole body, or a stream of SSE events as they come."""

    status: int
    media_type: str
    body: bytes | AsyncGenerator[bytes, None]


def reads(response: httpx.Response) -> AsyncIterator[bytes]:
    """A streamed answer's body, read by read. An SSE stream is not content-encoded (vLLM's is
    not), so its reads come straight from the transport, past httpx's two layers of decoding and
    re-chunking that would pass them on unchanged, at a cost per read."""
    if "content-encoding" in response.headers or not isinstance(response.stream, httpx.AsyncByteStream):
        return response.aiter_bytes()
    return aiter(response.stream)


class Relay:
    """`client` carries the cluster's worker key and timeouts; `transport` is the one under it,
    which a relayed request goes to straight (`relay`); `resumed_priority` is sent with a request
    that waited for its program's resume."""

    def __init__(
        self,
        admissions: Admissions,
        client: httpx.AsyncClient,
        transport: httpx.AsyncBaseTransport,
        clock: Callable[[], float],
        resumed_priority: int | None = None,
    ) -> None:
        self.admissions = admissions
        self.resumed_priority = resumed_priority
        # Each worker's requests with no byte of their answer yet, given up when it stalls.
        self._unanswered = UnansweredRequests()
        self._client = client
        self._transport = transport
        self._clock = clock
        # Each worker's endpoints parsed once: httpx parses a URL given as text on every request.
        self._endpoints: dict[tuple[str, str], httpx.URL] = {}
        # A relayed request goes straight to the transport with the client's headers and timeouts:
        # the client's per-request work (URL and cookie merging, its cookie jar read and written,
        # auth and redirect handling, a wrapper around every read of the answer) is none a relay needs.
        self._relay_headers = httpx.Headers(client.headers)
        self._relay_headers["content-type"] = "application/json"
        self._relay_extensions = {"timeout": client.timeout.as_dict()}

    async def relay(
        self,
        api: Api,
        path: str,
        body: dict[str, Any],
        program_id: str | None,
        shape: PromptShape,
        followed: Followed | None = None,
        group: str | None = None,
        sent: bytes | None = None,
        parent: str | None = None,
        client_headers: Sequence[tuple[str, str]] = (),
        chain: ChainStep | None = None,
    ) -> Relayed:
        """Send the request to its worker; tell the scheduler side when its answer ends. `followed`:
        the request's derived program (`follow`), whose conversation its answer extends; `group`: the program's
        group (groups.py), named or derived; `sent`: the body's bytes as the client sent them, when
        the worker can have them so (requests.as_sent); `parent`: the program it was started from;
        `client_headers`: the client's headers that go on to the worker (requests.forwarded_headers);
        `chain`: the Responses chain a whole answer extends.

        A request that fails before any byte reached the client (its worker died or stalled) is tried
        once more on another worker.
        """
        stream = bool(body.get("stream"))
        client_wants_usage = True
        ask_usage = stream and api.asks_usage
        if ask_usage:
            options = body.get("stream_options") or {}
            client_wants_usage = bool(options.get("include_usage"))
            body["stream_options"] = {**options, "include_usage": True}
        payload = relayed_payload(body, sent, ask_usage)
        headers = self._worker_headers(client_headers)
        failed: str | None = None
        for attempt in (1, 2):
            admitted = await self.admissions.admit(Admission(program_id, shape, group, parent, failed, attempt))
            if admitted.waited and self.resumed_priority is not None:
                # Resumed programs first inside the engine, as Dynamo's resume boost does.
                payload = json.dumps({**body, "priority": self.resumed_priority}).encode()
            answer = api.streamed(self._clock())
            response = None
            try:
                async with self._unanswered.waiting_on(admitted.worker):  # given up if the worker stalls
                    request = httpx.Request(
                        "POST",
                        self._endpoint(admitted.url, path),
                        headers=headers,
                        content=payload,
                        extensions=self._relay_extensions,
                    )
                    response = await self._transport.handle_async_request(request)
                    if response.status_code == 200 and stream:
                        read = program_id is not None or chain is not None  # its whole answer is wanted
                        relay = StreamRelay(answer if read else None, client_wants_usage, self._clock, api.usage_of)
                        lines = self._relay_stream(
                            response,
                            admitted,
                            program_id,
                            shape,
                            relay,
                            answer,
                            followed,
                            chain,
                            api.final_events,
                        )
                        return Relayed(200, response.headers.get("content-type", "text/event-stream"), lines)
                    content = await response.aread()
                break
            except (httpx.TransportError, WorkerStalled) as exc:
                down = not isinstance(exc, WorkerStalled | httpx.ConnectTimeout)
                if await self.admissions.failed(Failure(admitted.worker, program_id, down, attempt, admitted.ticket)):
                    log.warning("worker %s failed (%r); the request goes again", admitted.worker, exc)
                    failed = admitted.worker
                    continue
                raise WorkerError(f"backend {admitted.worker} ({admitted.url}) failed: {exc!r}") from exc
            finally:
                if response is not None and not (stream and response.status_code == 200):
                    await response.aclose()
        end = AnswerEnd(admitted.worker, program_id, shape, None, ticket=admitted.ticket)
        if response.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                answered = api.answered(json.loads(content))
                end = self._end(
                    admitted, program_id, shape, answered.usage, answered.tool, None, answered, followed, chain
                )
        # An error teaches nothing to keep, but its end is acknowledged all the same.
        whole = response.status_code == 200
        if (keep := self._holds(program_id, followed if whole else None, chain if whole else None)) is not None:
            await self.admissions.ended(end, keep)
        else:
            self.admissions.finished(end)
        media_type = response.headers.get("content-type", "application/json")
        return Relayed(response.status_code, media_type, content)

    async def follow(self, turn: Turn) -> Followed | None:
        """The derived program of a request that names none: its hashes taken here, looked up by the
        scheduler side (a prompt's in two steps: the conversations it may continue, then which it
        starts with). None: derivation is off, or the request cannot be followed."""
        hashed = hash_turn(turn) if self.admissions.derives else None
        if hashed is None:
            return None
        matches = PromptMatches()
        if isinstance(hashed, HashedPrompt):
            matches = hashed.matches(await self.admissions.candidates(hashed.keys))
        claim = await self.admissions.claim(hashed.keys, matches)
        return Followed(claim, hashed) if claim is not None else None

    def give_up(self, worker: str) -> int:
        return self._unanswered.give_up(worker)

    def _holds(self, program_id: str | None, followed: Followed | None, chain: ChainStep | None) -> bool | None:
        """Whether an answer's end waits until what it taught is kept (True), or only until the
        scheduler side has it (False: it is another process), or not at all (None)."""
        if self.admissions.keeps_answers and (followed is not None or chain is not None):
            return True
        return False if self.admissions.remote and program_id is not None else None

    @staticmethod
    def _end(
        admitted: Admitted, program_id: str | None, shape: PromptShape, usage: Usage | None, tool: str | None,
        ttft_s: float | None,
        whole: Answer | None, followed: Followed | None, chain: ChainStep | None,
    ) -> AnswerEnd:  # fmt: skip
        """An answer's end as the scheduler side is told it: of a whole answer, the derived program's
        conversation as it now stands (hashed here) and the API's answer object a chain keeps."""
        conversation = None
        if whole is not None and followed is not None:
            conversation = followed.hashed.answered(whole.message, whole.text, whole.token_ids)
        response = whole.whole if whole is not None and chain is not None else None
        return AnswerEnd(
            admitted.worker, program_id, shape, usage, tool, ttft_s, conversation, chain, response, admitted.ticket
        )

    async def _relay_stream(
        self,
        response: httpx.Response,
        admitted: Admitted,
        program_id: str | None,
        shape: PromptShape,
        relay: StreamRelay,
        answer: StreamedAnswer,
        followed: Followed | None,
        chain: ChainStep | None,
        final_events: tuple[bytes, ...],
    ) -> AsyncGenerator[bytes, None]:
        ended = False
        keep = self._holds(program_id, followed, chain)
        held = b""  # the stream's last event and anything after it, until the answer is kept
        try:
            async for data in reads(response):
                if relayed := relay.feed(data):
                    if keep is not None and (held or any(event in relayed for event in final_events)):
                        held += relayed
                    else:
                        yield relayed
            if rest := relay.end():
                if held:
                    held += rest
                else:
                    yield rest
            ended = True
        finally:
            # Runs on normal end, worker error and client disconnect alike: the slot is freed.
            await response.aclose()
            relay.settle()
            whole = answer.answer() if program_id is not None or ended else None
            tool = whole.tool if whole is not None and program_id is not None else None
            # Only a whole answer is remembered: a client whose stream was cut does not echo it back.
            remembered = whole if ended else None
            end = self._end(admitted, program_id, shape, relay.usage, tool, answer.ttft_s, remembered, followed, chain)
            if not (ended and held):  # else told below, with the wait for its acknowledgement
                self.admissions.finished(end)
        if held:
            await self.admissions.ended(end, bool(keep))
            yield held

    def _endpoint(self, url: str, path: str) -> httpx.URL:
        endpoint = self._endpoints.get((url, path))
        if endpoint is None:
            endpoint = self._endpoints[url, path] = httpx.URL(f"{url}{path}")
        return endpoint

    def _worker_headers(self, client_headers: Sequence[tuple[str, str]]) -> httpx.Headers:
        """The gateway's headers to a worker, with the client's that go on (its key but where the
        worker has one of its own)."""
        if not client_headers:
            return self._relay_headers
        headers = httpx.Headers(self._relay_headers)
        keyed = "authorization" in self._relay_headers
        for name, value in client_headers:
            if not (keyed and name.lower() == "authorization"):
                headers[name] = value
        return headers

    async def forward(
        self,
        method: str,
        path: str,
        query: str,
        body: bytes,
        client_headers: Sequence[tuple[str, str]] = (),
        program_id: str | None = None,
    ) -> Relayed:
        """A request of an engine's route the gateway does not schedule (tokenize, a model's card,
        embeddings…), relayed whole to the worker the scheduler side routes it to."""
        worker = await self.admissions.route(program_id)
        url = f"{worker.url}{path}" + (f"?{query}" if query else "")
        headers = self._worker_headers(client_headers)
        try:
            response = await self._client.request(method, url, content=body or None, headers=headers)
        except httpx.HTTPError as exc:
            raise WorkerError(f"backend {worker.worker} ({worker.url}) failed: {exc!r}") from exc
        return Relayed(response.status_code, response.headers.get("content-type", "application/json"), response.content)
