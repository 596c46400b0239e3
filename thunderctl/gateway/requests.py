"""What the gateway reads off any request it schedules, whatever its API: the program it names (in
the body, thunderctl's headers or a harness's session headers), its group and parent, and its
prompt's size and shared prefix. What differs by API lives in `gateway/apis/`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from thunderctl.jsonapi import (
    MAX_CONTAINER_REF_CHARS,
    BadRequest,
    valid_program_id,
)

PROGRAM_HEADER = "x-program-id"
GROUP_HEADER = "x-group-id"
# The headers harnesses name their session (an agent's run) with, after thunderctl's own, in this
# order of precedence: SkyRL's trajectory (vLLM reads it too), litellm's (OpenHands), Claude Code's,
# Codex CLI's session and thread, Dynamo's trajectory, and Dynamo's older session header.
SESSION_HEADERS = (
    "x-session-id",
    "x-litellm-session-id",
    "x-claude-code-session-id",
    "session-id",
    "thread-id",
    "x-dynamo-trajectory-id",
    "x-dynamo-session-id",
)
# A request that names its program's parent (the program it was started from, in whose tool call it runs).
PARENT_HEADER = "x-dynamo-parent-trajectory-id"
# Claude Code's subagent: a program of its own under the session's program.
AGENT_HEADER = "x-claude-code-agent-id"
# The session's last request: its program is released once the answer has gone out.
FINAL_HEADERS = ("x-dynamo-trajectory-final", "x-dynamo-session-final")


# A client's headers that do not go on to the worker: the hop's own (the transport sets its own), and
# thunderctl's names. Every other header goes on unchanged (the session headers too: vLLM reads
# X-Session-ID), but Authorization where the gateway acts on it (the gateway's key) or where the
# cluster's worker key replaces it.
NOT_FORWARDED = frozenset(
    {"host", "content-length", "content-type", "accept-encoding", "connection", "keep-alive", "transfer-encoding",
     "te", "trailer", "upgrade", "proxy-authorization", "proxy-connection", PROGRAM_HEADER, GROUP_HEADER}
)  # fmt: skip


def forwarded_headers(headers: Mapping[str, str], keyed: bool) -> list[tuple[str, str]]:
    """The client's headers that go on to the worker; `keyed`: the gateway asks for a key of its own,
    so the client's Authorization is the gateway's and stays here."""
    return [
        (name, value)
        for name, value in headers.items()
        if name.lower() not in NOT_FORWARDED and not (keyed and name.lower() == "authorization")
    ]


# What the gateway takes out of a body, or merges its own into: a body with none of these fields goes
# on to the worker as the client's own bytes (but for the usage the gateway asks a stream for).
EDITED_FIELDS = frozenset({"program_id", "group_id", "docker_ids", "extra_body", "stream_options"})
ASK_USAGE = b',"stream_options":{"include_usage":true}}'


def as_sent(raw: bytes, body: dict[str, Any]) -> bytes | None:
    """The body's bytes, when the worker can have them as the client sent them (None: the gateway
    edits the body, which is then encoded again). A 130 KB chat costs 0.3 ms to encode, per request."""
    sent = raw.strip(b" \t\r\n")
    # A UTF-16 or UTF-32 body (which JSON allows) does not start and end with these bytes.
    if body and EDITED_FIELDS.isdisjoint(body) and sent.startswith(b"{") and sent.endswith(b"}"):
        return sent
    return None


def relayed_payload(body: dict[str, Any], sent: bytes | None, ask_usage: bool) -> bytes:
    """What goes to the worker: the client's bytes (`as_sent`) with the gateway's request for a
    stream's usage added as the object's last member, or else the body encoded again."""
    if sent is None:
        # ASCII escapes: a lone surrogate from the client's JSON stays representable.
        return json.dumps(body).encode()
    return sent[:-1] + ASK_USAGE if ask_usage else sent


@dataclass(frozen=True)
class Named:
    """The program a request names, if any, with its group, its parent and whether it is its last."""

    program_id: str | None = None
    group: str | None = None
    parent: str | None = None
    final: bool = False


def named_program(body: dict[str, Any], headers: Mapping[str, str], hints: Sequence[tuple[str, Any]] = ()) -> Named:
    """Everything a request says of its program, taken out of the body where the engine would not
    know the field. `hints`: the API's own places (after thunderctl's and the session headers)."""
    program_id = pop_program_id(body, headers, hints)
    agent = _header_id(headers, AGENT_HEADER)
    parent = _header_id(headers, PARENT_HEADER)
    if agent is not None and program_id is not None:
        # A subagent is a program of its own, in its session's program's tool call.
        program_id, parent = valid_program_id(f"{program_id}/{agent}", f"the {AGENT_HEADER} header"), program_id
    group = pop_group_id(body, headers)
    return Named(program_id, group, parent if program_id is not None else None, ends_session(headers, program_id))


def pop_program_id(
    body: dict[str, Any], headers: Mapping[str, str], hints: Sequence[tuple[str, Any]] = ()
) -> str | None:
    """Take the program id out of the body (top level or `extra_body`), then look in the X-Program-Id
    header, the session headers (`SESSION_HEADERS`) and the API's `hints`, in that order of
    precedence; every one given must be a valid id.

    The id is removed from the body so the engine never sees a field it does not know. An
    empty id is no id: the request is served unscheduled.
    """
    return _pop_id(body, headers, "program_id", (PROGRAM_HEADER, *SESSION_HEADERS), hints)


def pop_group_id(body: dict[str, Any], headers: Mapping[str, str]) -> str | None:
    """Take the group id (the task a GRPO sample belongs to) out of the body (top level or
    `extra_body`) or the X-Group-Id header, in that order of precedence, as `pop_program_id` does
    the program's. An empty id is no group."""
    return _pop_id(body, headers, "group_id", (GROUP_HEADER,))


def _pop_id(
    body: dict[str, Any],
    headers: Mapping[str, str],
    key: str,
    header_names: tuple[str, ...],
    hints: Sequence[tuple[str, Any]] = (),
) -> str | None:
    found = [(key, body.pop(key, None))]
    extra = body.get("extra_body")
    if isinstance(extra, dict) and key in extra:
        found.append((f"extra_body.{key}", extra.pop(key)))
        if not extra:
            del body["extra_body"]
    found.extend((f"the {name} header", headers.get(name)) for name in header_names)
    found.extend(hints)
    ids = [valid_program_id(value, where) for where, value in found if value not in (None, "")]
    return ids[0] if ids else None


def _header_id(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    return valid_program_id(value, f"the {name} header") if value else None


def ends_session(headers: Mapping[str, str], program_id: str | None) -> bool:
    """Whether this request is its program's last (`x-dynamo-trajectory-final: true`, or the older
    `x-dynamo-session-final`): the program is released once the answer has gone out."""
    final = False
    for name in FINAL_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        flag = value.strip().lower()
        if flag not in ("true", "false"):
            raise BadRequest(f"the {name} header must be true or false, not {value[:40]!r}")
        if flag == "true" and program_id is None:
            raise BadRequest(
                f"{name}: true ends a program, but the request names none: send its id in the "
                f"x-dynamo-trajectory-id header (or {PROGRAM_HEADER}, or program_id in the body)"
            )
        final = final or flag == "true"
    return final


def pop_docker_ids(body: dict[str, Any]) -> list[str]:
    """Containers an agent started itself (as the ThunderAgent reference's clients send them),
    taken out of the body: they belong to the program, not to the engine."""
    ids = body.pop("docker_ids", None)
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(i, str) and 0 < len(i) <= MAX_CONTAINER_REF_CHARS for i in ids):
        raise BadRequest(
            f"docker_ids must be an array of container ids or names (strings of 1-{MAX_CONTAINER_REF_CHARS} characters)"
        )
    return ids


def text_of(content: Any) -> str:
    """A content value's text: a string, or the text of its parts (`text`, `input_text`, `output_text`
    alike); other parts (images) count for nothing here."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (part.get("text") for part in content if isinstance(part, dict))
        return "".join(text for text in texts if isinstance(text, str))
    return ""


@dataclass(frozen=True)
class PromptShape:
    chars: int
    tokens: int | None = None  # exact, when the client sent token ids
    prefix_key: str | None = None
    prefix_chars: int = 0


def chat_shape(messages: list[Any]) -> PromptShape:
    """A chat-like prompt's size in characters and its shared prefix (a leading system message), if any."""
    texts = [text_of(m.get("content")) if isinstance(m, dict) else "" for m in messages]
    first = messages[0] if messages and isinstance(messages[0], dict) else {}
    if first.get("role") == "system" and texts[0]:
        key = hashlib.blake2b(texts[0].encode(errors="surrogatepass"), digest_size=12).hexdigest()
        return PromptShape(sum(map(len, texts)), prefix_key=key, prefix_chars=len(texts[0]))
    return PromptShape(sum(map(len, texts)))


class TokenEstimator:
    """Characters → tokens, calibrated from the engine's real usage as responses arrive."""

    def __init__(self, tokens_per_char: float = 0.3, smoothing: float = 0.2) -> None:
        self.tokens_per_char = tokens_per_char
        self.smoothing = smoothing

    def estimate(self, chars: int) -> int:
        return round(chars * self.tokens_per_char)

    def prompt_tokens(self, shape: PromptShape) -> int:
        return shape.tokens if shape.tokens is not None else self.estimate(shape.chars)

    def observe(self, shape: PromptShape, prompt_tokens: int) -> None:
        chars = shape.chars
        if shape.tokens is None and chars > 0 and prompt_tokens > 0:
            sample = prompt_tokens / chars
            self.tokens_per_char += self.smoothing * (sample - self.tokens_per_char)
