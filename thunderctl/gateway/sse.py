"""A worker's SSE stream relayed as bytes: cut into whole events, read only where the gateway needs to.

The gateway learns the engine's usage from the last chunk and, for a program's request, the
answer's first token and text (its tool) from its content chunks; everything else passes
as it came, one write per network read rather than one per line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from thunderctl.apiusage import Usage
from thunderctl.gateway.apis.base import StreamedAnswer

# An event ends at a blank line; vLLM ends its lines with "\n", the SSE standard allows "\r\n".
EVENT_END = re.compile(rb"\r?\n\r?\n")
JSON_DATA = b"data: {"
USAGE_KEY = b'"usage"'
# A program's chunks past its first token are read in batches of about this many bytes (a few
# hundred chunks): one parse of them all costs a fraction of a parse per chunk, and a long answer's
# chunks do not pile up in memory until its end.
UNREAD_BYTES = 64 * 1024


class EventFramer:
    """Takes network reads, gives back the whole events they complete (each with its blank line)."""

    def __init__(self) -> None:
        self._pending = b""

    @property
    def between_events(self) -> bool:
        """Whether no event is cut short so far: the next read starts a new one."""
        return not self._pending

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._pending + data if self._pending else data
        events, start = [], 0
        for end in EVENT_END.finditer(buffer):
            events.append(buffer[start : end.end()])
            start = end.end()
        self._pending = buffer[start:]
        return events

    def rest(self) -> bytes:
        """What followed the last blank line when the stream ended: an event cut short, or nothing."""
        rest, self._pending = self._pending, b""
        return rest


@dataclass
class StreamRelay:
    """One stream on its way to the client: the usage it carried, and the events as the client gets them.

    `answer` is the program's answer to follow (None: not a program's request, so only a chunk
    that carries usage is parsed); `usage_of` reads the usage an event carries, in its API's terms.
    Its chunks are read one by one until its first token (whose time the scheduler learns); the rest
    wait, as bytes, to be read in batches (`settle`), since only the whole answer's text and tool
    calls matter. A client that did not ask for usage does
    not get the usage-only chunk the gateway asked for, nor `usage` riding on another chunk.
    """

    answer: StreamedAnswer | None
    client_wants_usage: bool
    clock: Callable[[], float]
    usage_of: Callable[[dict[str, Any]], Usage | None] = lambda chunk: chunk.get("usage")
    usage: Usage | None = None
    _framer: EventFramer = field(default_factory=EventFramer)
    _unread: list[bytes] = field(default_factory=list)  # the answer's events past its first token
    _unread_bytes: int = 0

    def feed(self, data: bytes) -> bytes:
        """The events `data` completes, as the client gets them (b"" while an event is incomplete)."""
        if self._framer.between_events and data.endswith(b"\n\n") and USAGE_KEY not in data:
            # Whole events that need no reading now: as they came, in one piece.
            if self.answer is None:
                return data
            if self.answer.first_token_at is not None:
                self._later(data)
                return data
        events = self._framer.feed(data)
        if self.answer is None and not any(USAGE_KEY in event for event in events):
            return b"".join(events)
        return b"".join(self._event(event) for event in events)

    def end(self) -> bytes:
        """The stream's unterminated tail, if it had one; the answer is then read to its end."""
        rest = self._framer.rest()
        relayed = self._event(rest) if rest else b""
        self.settle()
        return relayed

    def settle(self) -> None:
        """Read the answer's events that waited; the gateway calls it, too, for a stream cut short."""
        if self.answer is None or not self._unread:
            return
        payloads = [
            line[len(b"data: ") :] for line in b"".join(self._unread).splitlines() if line.startswith(JSON_DATA)
        ]
        self._unread.clear()
        self._unread_bytes = 0
        try:
            chunks = json.loads(b"[" + b",".join(payloads) + b"]")
        except ValueError:  # one of them is not JSON: the others still count
            chunks = [chunk for payload in payloads if (chunk := parsed(payload)) is not None]
        for chunk in chunks:
            self.answer.chunk(chunk, self.clock())

    def _later(self, events: bytes) -> None:
        self._unread.append(events)
        self._unread_bytes += len(events)
        if self._unread_bytes >= UNREAD_BYTES:
            self.settle()

    def _event(self, event: bytes) -> bytes:
        if JSON_DATA not in event:  # [DONE], comments, non-JSON data
            return event
        lines = event.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.startswith(JSON_DATA):
                relayed = self._json_line(line)
                if relayed is None:
                    return b""  # the usage-only chunk the client did not ask for, blank line and all
                lines[i] = relayed
        return b"".join(lines)

    def _json_line(self, line: bytes) -> bytes | None:
        carries_usage = USAGE_KEY in line
        answer = self.answer
        reading_now = answer is not None and answer.first_token_at is None
        if answer is not None and not reading_now:
            self._later(line)  # in order with the content chunks before it
        if not carries_usage and not reading_now:
            return line
        chunk = json.loads(line[len(b"data: ") :])
        if answer is not None and reading_now:
            # The scheduler learns the prefill rate from the first token's time.
            answer.chunk(chunk, self.clock())
        if not carries_usage:
            return line
        if found := self.usage_of(chunk):
            self.usage = {**self.usage, **found} if self.usage else found
        if self.client_wants_usage:
            return line
        if not chunk.get("choices"):
            return None
        chunk.pop("usage", None)
        ending = line[len(line.rstrip(b"\r\n")) :]
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + ending


def parsed(payload: bytes) -> dict[str, Any] | None:
    try:
        chunk = json.loads(payload)
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) else None
