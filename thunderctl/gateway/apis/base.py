"""What the gateway asks of every API it schedules, answered once per API by its own module.

Each API (chat, completions, responses, messages) says where its body names a program, checks the
fields the gateway acts on, gives its conversation in the normal form identity hashes (chat's
messages, or a completions prompt), and reads an answer, whole or streamed, as the scheduler needs
it: the engine's usage in chat's terms, the tool it called, and the assistant message the next
request will carry. The rest of the gateway is the same for every API.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

from thunderctl.apiusage import Usage
from thunderctl.gateway.answers import tool_in_message, tool_in_text
from thunderctl.gateway.identity import Turn
from thunderctl.gateway.requests import PromptShape, chat_shape
from thunderctl.jsonapi import BadRequest, error, shown

MISSING = object()  # a required field the body left out


@dataclass(frozen=True)
class Answer:
    """A whole answer as the scheduler and identity read it."""

    usage: Usage | None
    message: dict[str, Any] | None = None  # chat-like APIs: the answer in chat's form
    text: str | None = None  # completions: the text, and its token ids when the engine returned them
    token_ids: list[int] | None = None
    whole: dict[str, Any] | None = None  # the API's own answer object, where the gateway keeps it (responses)

    @property
    def tool(self) -> str | None:
        """The tool the answer called (the kind of tool time that follows), when it names one."""
        if self.message is not None:
            return tool_in_message(self.message)
        return tool_in_text(self.text) if self.text else None


class StreamedAnswer(ABC):
    """A streamed answer as its events pass: the first token's time, then the whole answer."""

    def __init__(self, sent_at: float) -> None:
        self.sent_at = sent_at
        self.first_token_at: float | None = None

    @abstractmethod
    def chunk(self, chunk: dict[str, Any], now: float) -> None:
        """One event's JSON data, in order."""

    @abstractmethod
    def answer(self) -> Answer:
        """The answer as it stands (usage aside: the stream relay keeps it)."""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at


class Api(ABC):
    """One API the gateway schedules; see the module's docstring."""

    name: ClassVar[str]
    # The gateway's own request for a stream's usage (`stream_options.include_usage`); APIs whose
    # streams always carry it ask nothing.
    asks_usage: ClassVar[bool] = False
    fields: ClassVar[type[BaseModel]]  # the fields the gateway acts on, with their types
    # Its answers continue by reference (`previous_response_id`): the gateway keeps them (chains.py).
    chained: ClassVar[bool] = False
    # How its stream's last event begins: the gateway holds that event back until what the answer
    # taught it (a derived conversation, a chain) is kept, so a client that has its answer whole
    # can count on a restarted daemon knowing it.
    final_events: ClassVar[tuple[bytes, ...]] = (b"data: [DONE]",)

    def check(self, body: dict[str, Any]) -> None:
        """A BadRequest naming the first field of `fields` the body gets wrong, and what it must be."""
        try:
            self.fields.model_validate(body)
        except ValidationError as exc:
            raise BadRequest(field_error(self.fields, body, exc.errors()[0]["loc"])) from None

    def program_hints(self, body: dict[str, Any]) -> list[tuple[str, Any]]:
        """Where the body names its program in this API's own terms, after thunderctl's and the
        session headers: (where, value) in order of precedence."""
        return []

    @abstractmethod
    def turn(self, body: dict[str, Any]) -> Turn:
        """The request's conversation as identity hashes it."""

    def shape(self, body: dict[str, Any], turn: Turn) -> PromptShape:
        assert turn.messages is not None
        return chat_shape(turn.messages)

    @abstractmethod
    def answered(self, body: dict[str, Any]) -> Answer:
        """A whole (not streamed) answer's body, read."""

    def own_input(self, body: dict[str, Any]) -> list[Any]:
        """A chained API's: this turn's input, as the items the gateway keeps for the next turn."""
        raise NotImplementedError(f"the {self.name} API does not chain its answers")

    @abstractmethod
    def streamed(self, sent_at: float) -> StreamedAnswer:
        """A reader of this API's stream events."""

    def usage_of(self, chunk: dict[str, Any]) -> Usage | None:
        """The usage one stream event carries, in chat's terms (what it says; later events add to it)."""
        usage = chunk.get("usage")
        return usage if isinstance(usage, dict) else None

    def error(self, status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        """The gateway's own refusal, in the error shape this API's clients read."""
        return error(status, message, kind)


def field_error(model: type[BaseModel], body: dict[str, Any], loc: tuple[int | str, ...]) -> str:
    """`<field> must be <its description>, not <what was sent>`, for the deepest field in `loc`
    (a union's or list's own steps in it name no field)."""
    current: type[BaseModel] | None = model
    value: Any = body
    path: list[str] = []
    description = ""
    for step in loc:
        if current is None or step not in current.model_fields:
            break
        field = current.model_fields[str(step)]
        path.append(str(step))
        value, description = (
            value.get(step, MISSING) if isinstance(value, dict) else value[step],
            field.description or "",
        )
        nested = (a for a in get_args(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel))
        current = next(nested, None)
    sent = "an empty array" if value == [] else "missing" if value is MISSING else shown(value)
    return f"{'.'.join(path)} must be {description}, not {sent}"
