"""What the gateway reads off an OpenAI-style request body: identity, size, shared prefix."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Annotated, Any, get_args

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr, ValidationError

from thunderctl.jsonapi import (
    MAX_CONTAINER_REF_CHARS,
    BadRequest,
    shown,
    valid_program_id,
)

PROGRAM_HEADER = "x-program-id"
GROUP_HEADER = "x-group-id"
# Dynamo's clients name an agent's session, and mark its last request, with these.
SESSION_HEADER = "x-dynamo-session-id"
SESSION_FINAL_HEADER = "x-dynamo-session-final"


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


def relayed_payload(body: dict[str, Any], sent: bytes | None, stream: bool) -> bytes:
    """What goes to the worker: the client's bytes (`as_sent`) with the gateway's request for a
    stream's usage added as the object's last member, or else the body encoded again."""
    if sent is None:
        # ASCII escapes: a lone surrogate from the client's JSON stays representable.
        return json.dumps(body).encode()
    return sent[:-1] + ASK_USAGE if stream else sent


def pop_program_id(body: dict[str, Any], headers: dict[str, str]) -> str | None:
    """Take the program id out of the body (top level or `extra_body`), the X-Program-Id header
    or Dynamo's session header, in that order of precedence; every one given must be a valid id.

    The id is removed from the body so the engine never sees a field it does not know. An
    empty id is no id: the request is served unscheduled.
    """
    return _pop_id(body, headers, "program_id", (PROGRAM_HEADER, SESSION_HEADER))


def pop_group_id(body: dict[str, Any], headers: dict[str, str]) -> str | None:
    """Take the group id (the task a GRPO sample belongs to) out of the body (top level or
    `extra_body`) or the X-Group-Id header, in that order of precedence, as `pop_program_id` does
    the program's. An empty id is no group."""
    return _pop_id(body, headers, "group_id", (GROUP_HEADER,))


def _pop_id(body: dict[str, Any], headers: dict[str, str], key: str, header_names: tuple[str, ...]) -> str | None:
    found = [(key, body.pop(key, None))]
    extra = body.get("extra_body")
    if isinstance(extra, dict) and key in extra:
        found.append((f"extra_body.{key}", extra.pop(key)))
        if not extra:
            del body["extra_body"]
    found.extend((f"the {name} header", headers.get(name)) for name in header_names)
    ids = [valid_program_id(value, where) for where, value in found if value not in (None, "")]
    return ids[0] if ids else None


def ends_session(headers: dict[str, str], program_id: str | None) -> bool:
    """Whether this request is its program's last (`x-dynamo-session-final: true`): the program
    is released once the answer has gone out."""
    value = headers.get(SESSION_FINAL_HEADER)
    if value is None:
        return False
    flag = value.strip().lower()
    if flag not in ("true", "false"):
        raise BadRequest(f"the {SESSION_FINAL_HEADER} header must be true or false, not {value[:40]!r}")
    if flag == "true" and program_id is None:
        raise BadRequest(
            f"{SESSION_FINAL_HEADER}: true ends a program, but the request names none: "
            f"send its id in the {SESSION_HEADER} header (or {PROGRAM_HEADER}, or program_id in the body)"
        )
    return flag == "true"


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


class _StreamOptions(BaseModel):
    include_usage: StrictBool | None = Field(None, description="true or false")


_Count = Annotated[StrictInt, Field(ge=1)]


class GenerationFields(BaseModel):
    """The fields of a chat or completion request the gateway itself acts on, with the types OpenAI
    documents; the rest is the engine's to judge. Only a check: the body goes on as the client sent it."""

    stream: StrictBool | None = Field(None, description="true or false")
    stream_options: _StreamOptions | None = Field(None, description="an object or null")
    max_tokens: _Count | None = Field(None, description="a positive integer or null")
    max_completion_tokens: _Count | None = Field(None, description="a positive integer or null")
    # Absent is a completion request; present, even null, must be a list.
    messages: list[Any] = Field(None, min_length=1, description="a non-empty list of {role, content} objects")
    prompt: str | list[StrictStr] | list[StrictInt] = Field(
        "", description="a string, a list of strings or a list of token ids"
    )


def check_generation_fields(body: dict[str, Any]) -> None:
    """A BadRequest naming the first field of GenerationFields the body gets wrong, and what it must be."""
    try:
        GenerationFields.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(_field_error(body, exc.errors()[0]["loc"])) from None


def _field_error(body: dict[str, Any], loc: tuple[int | str, ...]) -> str:
    """`<field> must be <its description>, not <what was sent>`, for the deepest field in `loc`
    (a union's or list's own steps in it name no field)."""
    model: type[BaseModel] | None = GenerationFields
    value: Any = body
    path: list[str] = []
    description = ""
    for step in loc:
        if model is None or step not in model.model_fields:
            break
        field = model.model_fields[str(step)]
        path.append(str(step))
        value, description = value[step], field.description or ""
        nested = (a for a in get_args(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel))
        model = next(nested, None)
    sent = "an empty array" if value == [] else shown(value)
    return f"{'.'.join(path)} must be {description}, not {sent}"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: count the text parts
        texts = (part.get("text") for part in content if isinstance(part, dict))
        return "".join(text for text in texts if isinstance(text, str))
    return ""


@dataclass(frozen=True)
class PromptShape:
    chars: int
    tokens: int | None = None  # exact, when the client sent token ids
    prefix_key: str | None = None
    prefix_chars: int = 0


def prompt_shape(body: dict[str, Any]) -> PromptShape:
    """Prompt size in characters and the shared prefix (a leading system message), if any, of a
    body check_generation_fields passed."""
    if "messages" in body:
        messages = body["messages"]
        texts = [_content_text(m.get("content")) if isinstance(m, dict) else "" for m in messages]
        first = messages[0] if isinstance(messages[0], dict) else {}
        if first.get("role") == "system" and texts[0]:
            key = hashlib.blake2b(texts[0].encode(errors="surrogatepass"), digest_size=12).hexdigest()
            return PromptShape(sum(map(len, texts)), prefix_key=key, prefix_chars=len(texts[0]))
        return PromptShape(sum(map(len, texts)))
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return PromptShape(len(prompt))
    if all(isinstance(t, int) for t in prompt):
        return PromptShape(0, tokens=len(prompt))
    return PromptShape(sum(map(len, prompt)))  # a batch of prompts counts as one


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
