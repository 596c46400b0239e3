"""The messages of admissions.py between processes: a relay process and the scheduler's process.

Each frame is msgpack (msgspec), prefixed by its length as msgspec's own docs frame messages on a
stream: `(kind, call, payload)`. A call (`admit`, `claim`, …) is answered by a `reply` frame with
the same call number (an `error` frame, when the scheduler raised while answering it); a tell
(`finished`, `adopt`, `disconnected`) is answered by nothing; `give_up` goes the other way,
unasked. One connection per relay process, read in order: a tell reaches the scheduler before any
call the relay sends after it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec

from thunderctl.gateway.admissions import Admission, Admitted, AnswerEnd, Chain, Failure
from thunderctl.gateway.identity import Candidates, ChatKeys, Claim, PromptKeys, PromptMatches

LENGTH_BYTES = 4  # a frame's length prefix, big-endian: frames up to 4 GiB


@dataclass(frozen=True, slots=True)
class ClaimAsk:
    """`Admissions.claim`'s arguments as one message (msgpack cannot tell two dataclasses apart in
    one field): a chat-like request's keys or a prompt's, and the prompt's matches."""

    chat: ChatKeys | None = None
    prompt: PromptKeys | None = None
    matches: PromptMatches = PromptMatches()


@dataclass(frozen=True, slots=True)
class Hello:
    """A relay process's first frame: which relay it is (its number under the supervisor), its pid."""

    relay: int
    pid: int


@dataclass(frozen=True, slots=True)
class Welcome:
    """The scheduler's answer to a hello: whether it derives programs and keeps answers (journal)."""

    derives: bool
    keeps_answers: bool


@dataclass(frozen=True, slots=True)
class Adopt:
    """A request named its program's sandboxes (`docker_ids`): the daemon's pool adopts them."""

    program_id: str
    docker_ids: list[str]


@dataclass(frozen=True, slots=True)
class EndedAsk:
    """`Admissions.ended`'s arguments."""

    end: AnswerEnd
    keep: bool


# What each kind of frame carries, and what the reply to it carries (None: a tell, which has no
# reply, or a call whose reply says only that it is done).
CALLS: dict[str, tuple[Any, Any]] = {
    "hello": (Hello, Welcome),
    "admit": (Admission, Admitted),
    "claim": (ClaimAsk, Claim | None),
    "candidates": (PromptKeys, Candidates),
    "chain": (str, Chain | None),
    "failed": (Failure, bool),
    "route": (str | None, Admitted),
    "finished": (AnswerEnd, None),
    "ended": (EndedAsk, None),
    "give_up": (str, None),
    "release": (str, None),
    "adopt": (Adopt, None),
    "disconnected": (None, None),  # a client went away mid-body
}
REPLY = "reply"
ERROR = "error"  # the reply to a call the scheduler failed on: its payload is what went wrong


class WireError(RuntimeError):
    """A frame that is not one of these messages: the other side runs another version."""


class Codec:
    """Frames in and out: `encode` one, `decode` the payload of a frame read by `read_frame`."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._head = msgspec.msgpack.Decoder(tuple[str, int, msgspec.Raw])
        self._payloads = {kind: msgspec.msgpack.Decoder(payload) for kind, (payload, _) in CALLS.items()}
        self._replies = {kind: msgspec.msgpack.Decoder(reply) for kind, (_, reply) in CALLS.items()}
        self._error = msgspec.msgpack.Decoder(str)

    def encode(self, kind: str, call: int, payload: Any) -> bytes:
        body = self._encoder.encode((kind, call, payload))
        return len(body).to_bytes(LENGTH_BYTES, "big") + body

    def head(self, frame: bytes) -> tuple[str, int, msgspec.Raw]:
        try:
            kind, call, payload = self._head.decode(frame)
        except msgspec.DecodeError as exc:
            raise WireError(f"not a frame of this version: {exc}") from exc
        if kind not in (REPLY, ERROR) and kind not in CALLS:
            raise WireError(f"unknown message kind {kind!r}")
        return kind, call, payload

    def payload(self, kind: str, payload: msgspec.Raw) -> Any:
        return self._decode(self._payloads[kind], kind, payload)

    def reply(self, kind: str, payload: msgspec.Raw) -> Any:
        return self._decode(self._replies[kind], kind, payload)

    def error(self, payload: msgspec.Raw) -> str:
        return str(self._decode(self._error, ERROR, payload))

    @staticmethod
    def _decode(decoder: msgspec.msgpack.Decoder, kind: str, payload: msgspec.Raw) -> Any:
        try:
            return decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise WireError(f"a {kind} message not of this version: {exc}") from exc


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's bytes; None when the other side closed the connection between frames."""
    try:
        prefix = await reader.readexactly(LENGTH_BYTES)
        return await reader.readexactly(int.from_bytes(prefix, "big"))
    except asyncio.IncompleteReadError:
        return None
