"""A backend's SSE stream relayed as bytes: cut into whole events, read only where the gateway needs to.

The gateway learns the engine's usage from the last chunk and, for a program's request, the
answer's text (its tool) and first token from every content chunk; everything else passes
as it came, one write per network read rather than one per line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from thunderctl.gateway.answers import StreamedAnswer

# An event ends at a blank line; vLLM ends its lines with "\n", the SSE standard allows "\r\n".
EVENT_END = re.compile(rb"\r?\n\r?\n")
JSON_DATA = b"data: {"
USAGE_KEY = b'"usage"'


class EventFramer:
    """Takes network reads, gives back the whole events they complete (each with its blank line)."""

    def __init__(self) -> None:
        self._pending = b""

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

    `answer` is the program's answer to follow chunk by chunk (None: not a program's request, so
    only a chunk that carries usage is parsed). A client that did not ask for usage does not get
    the usage-only chunk the gateway asked for, nor `usage` riding on another chunk.
    """

    answer: StreamedAnswer | None
    client_wants_usage: bool
    clock: Callable[[], float]
    usage: dict[str, Any] | None = None
    _framer: EventFramer = field(default_factory=EventFramer)

    def feed(self, data: bytes) -> bytes:
        """The events `data` completes, as the client gets them (b"" while an event is incomplete)."""
        events = self._framer.feed(data)
        if self.answer is None and not any(USAGE_KEY in event for event in events):
            return b"".join(events)
        return b"".join(self._event(event) for event in events)

    def end(self) -> bytes:
        """The stream's unterminated tail, if it had one."""
        rest = self._framer.rest()
        return self._event(rest) if rest else b""

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
        if self.answer is None and not carries_usage:
            return line
        chunk = json.loads(line[len(b"data: ") :])
        if self.answer is not None:
            # The scheduler learns the tool the answer calls and the prefill rate.
            self.answer.chunk(chunk, self.clock())
        if not carries_usage:
            return line
        self.usage = chunk.get("usage") or self.usage
        if self.client_wants_usage:
            return line
        if not chunk.get("choices"):
            return None
        chunk.pop("usage", None)
        ending = line[len(line.rstrip(b"\r\n")) :]
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + ending
