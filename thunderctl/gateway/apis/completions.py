"""OpenAI completions (`/v1/completions`): text or token ids in, as RL rollout workers send them."""

from __future__ import annotations

from typing import Any

from thunderctl.gateway.apis.base import Answer, Api, StreamedAnswer
from thunderctl.gateway.apis.chat import GenerationFields, OpenAIChunks, first_choice
from thunderctl.gateway.identity import Turn
from thunderctl.gateway.requests import PromptShape


class CompletionsApi(Api):
    name = "completions"
    asks_usage = True
    fields = GenerationFields

    def turn(self, body: dict[str, Any]) -> Turn:
        return Turn(prompt=body.get("prompt"))

    def shape(self, body: dict[str, Any], turn: Turn) -> PromptShape:
        prompt = body.get("prompt", "")
        if isinstance(prompt, str):
            return PromptShape(len(prompt))
        if all(isinstance(t, int) for t in prompt):
            return PromptShape(0, tokens=len(prompt))
        return PromptShape(sum(map(len, prompt)))  # a batch of prompts counts as one

    def answered(self, body: dict[str, Any]) -> Answer:
        choice = first_choice(body)
        text, token_ids = choice.get("text"), choice.get("token_ids")
        return Answer(
            body.get("usage"),
            text=text if isinstance(text, str) else None,
            token_ids=token_ids if isinstance(token_ids, list) else None,
        )

    def streamed(self, sent_at: float) -> StreamedAnswer:
        return OpenAIChunks(sent_at)
