"""The APIs the gateway schedules, one module each; `GENERATION_ROUTES` maps each route to its API."""

from thunderctl.gateway.apis.base import Answer, Api, StreamedAnswer
from thunderctl.gateway.apis.chat import ChatApi
from thunderctl.gateway.apis.completions import CompletionsApi
from thunderctl.gateway.apis.generate import GenerateApi
from thunderctl.gateway.apis.messages import MessagesApi
from thunderctl.gateway.apis.responses import ResponsesApi

CHAT, COMPLETIONS, RESPONSES, MESSAGES, GENERATE = (
    ChatApi(),
    CompletionsApi(),
    ResponsesApi(),
    MessagesApi(),
    GenerateApi(),
)
GENERATION_ROUTES: dict[str, Api] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
    "/inference/v1/generate": GENERATE,
}

__all__ = [
    "Answer",
    "Api",
    "StreamedAnswer",
    "GENERATION_ROUTES",
    "CHAT",
    "COMPLETIONS",
    "RESPONSES",
    "MESSAGES",
    "GENERATE",
]
