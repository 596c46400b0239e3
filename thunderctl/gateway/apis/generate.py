"""vLLM's token-in, token-out route (`/inference/v1/generate`), which RL trainers (SkyRL's remote
client) call with the token ids they rendered themselves: identity follows the ids as completions'."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, StrictBool, StrictInt

from thunderctl.gateway.apis.base import Answer, Api, StreamedAnswer
from thunderctl.gateway.apis.chat import OpenAIChunks, _StreamOptions, first_choice
from thunderctl.gateway.identity import Turn
from thunderctl.gateway.requests import PromptShape


class GenerateFields(BaseModel):
    """The fields of a generate request the gateway acts on, with the types vLLM documents."""

    token_ids: list[StrictInt] = Field(min_length=1, description="a non-empty array of token ids")
    stream: StrictBool | None = Field(None, description="true or false")
    stream_options: _StreamOptions | None = Field(None, description="an object or null")


class GenerateApi(Api):
    name = "generate"
    asks_usage = True
    fields = GenerateFields

    def turn(self, body: dict[str, Any]) -> Turn:
        return Turn(prompt=body["token_ids"])

    def shape(self, body: dict[str, Any], turn: Turn) -> PromptShape:
        return PromptShape(0, tokens=len(body["token_ids"]))

    def answered(self, body: dict[str, Any]) -> Answer:
        token_ids = first_choice(body).get("token_ids")
        return Answer(body.get("usage"), text="", token_ids=token_ids if isinstance(token_ids, list) else None)

    def streamed(self, sent_at: float) -> StreamedAnswer:
        return OpenAIChunks(sent_at)
