"""What the gateway reads off an OpenAI-style request body: identity, size, shared prefix."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from thunderctl.jsonapi import (
    MAX_CONTAINER_REF_CHARS,
    BadRequest,
    json_type,
    shown,
    valid_program_id,
)

PROGRAM_HEADER = "x-program-id"
# Dynamo's clients name an agent's session, and mark its last request, with these.
SESSION_HEADER = "x-dynamo-session-id"
SESSION_FINAL_HEADER = "x-dynamo-session-final"


def pop_program_id(body: dict[str, Any], headers: dict[str, str]) -> str | None:
    """Take the program id out of the body (top level or `extra_body`), the X-Program-Id header
    or Dynamo's session header, in that order of precedence; every one given must be a valid id.

    The id is removed from the body so the engine never sees a field it does not know. An
    empty id is no id: the request is served unscheduled.
    """
    found = [("program_id", body.pop("program_id", None))]
    extra = body.get("extra_body")
    if isinstance(extra, dict) and "program_id" in extra:
        found.append(("extra_body.program_id", extra.pop("program_id")))
        if not extra:
            del body["extra_body"]
    found.append((f"the {PROGRAM_HEADER} header", headers.get(PROGRAM_HEADER)))
    found.append((f"the {SESSION_HEADER} header", headers.get(SESSION_HEADER)))
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


def check_generation_fields(body: dict[str, Any]) -> None:
    """The fields the gateway itself acts on have the types OpenAI documents; the rest is the
    engine's to judge."""
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise BadRequest(f"stream must be true or false, not {json_type(body['stream'])}")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest(f"stream_options must be an object or null, not {json_type(options)}")
        if not isinstance(options.get("include_usage"), bool | None):
            raise BadRequest(
                f"stream_options.include_usage must be true or false, not {json_type(options['include_usage'])}"
            )
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BadRequest(f"{name} must be a positive integer or null, not {shown(value)}")


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
    """Prompt size in characters and the shared prefix (a leading system message), if any."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content} objects")
        texts = [_content_text(m.get("content")) if isinstance(m, dict) else "" for m in messages]
        first = messages[0] if isinstance(messages[0], dict) else {}
        if first.get("role") == "system" and texts[0]:
            key = hashlib.blake2b(texts[0].encode(errors="surrogatepass"), digest_size=12).hexdigest()
            return PromptShape(sum(map(len, texts)), prefix_key=key, prefix_chars=len(texts[0]))
        return PromptShape(sum(map(len, texts)))
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return PromptShape(len(prompt))
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return PromptShape(0, tokens=len(prompt))
    if isinstance(prompt, list) and all(isinstance(t, str) for t in prompt):
        return PromptShape(sum(map(len, prompt)))  # a batch of prompts counts as one
    raise BadRequest("prompt must be a string, a list of strings or a list of token ids")


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
