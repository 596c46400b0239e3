"""Responses the gateway relayed, kept so that a `previous_response_id` chain works whichever worker
serves its next turn.

vLLM keeps a response (and with it the chain) only with `VLLM_ENABLE_RESPONSES_API_STORE=1`, and
then in one worker's memory: the next turn on another worker would not find it. The gateway keeps
each stored response it relayed instead (its own input items and its output items; the turns before
it by reference, so a chain of n turns costs n turns, not n²), and sends the worker a self-contained
request: the chain's items, then the new input, with no `previous_response_id`. A program's responses
are forgotten when it ends; at most `limit` are kept, the least recently used forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from thunderctl.gateway.changes import ChangedKeys

DEFAULT_LIMIT = 16_384


@dataclass
class Kept:
    """One response: what it was asked (its own turn's items) and answered, and the response before it."""

    program_id: str | None
    previous: str | None
    input: list[Any]
    response: dict[str, Any]
    touched: int = 0  # when it was last kept or read, in the chains' count of those: the lowest goes first


class ResponseChains:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._by_program: dict[str, set[str]] = {}
        self._touches = 0
        self.changes = ChangedKeys()  # responses kept, read or forgotten: what the journal writes

    def changed(self) -> tuple[list[tuple[str, Kept]], list[str]]:
        """Since the last call (once `changes.follow()` was called): the responses kept or read, and
        those forgotten."""
        changed, forgotten = [], []
        for response_id in self.changes.take():
            kept = self._kept.get(response_id)
            if kept is not None:
                changed.append((response_id, kept))
            else:
                forgotten.append(response_id)
        return changed, forgotten

    def snapshot(self) -> list[tuple[str, Kept]]:
        return list(self._kept.items())

    def restore(self, responses: list[tuple[str, Kept]]) -> None:
        """Back to what `snapshot` (or the journal) held, forgotten in the order they would have been."""
        for response_id, kept in sorted(responses, key=lambda item: item[1].touched)[-self.limit :]:
            self._kept[response_id] = kept
            if kept.program_id is not None:
                self._by_program.setdefault(kept.program_id, set()).add(response_id)
            self._touches = max(self._touches, kept.touched)

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, response_id: str) -> Kept | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._kept.move_to_end(response_id)
            self._touch(response_id, kept)
        return kept

    def _touch(self, response_id: str, kept: Kept) -> None:
        self._touches += 1
        kept.touched = self._touches
        self.changes.mark(response_id)

    def items(self, response_id: str) -> list[Any]:
        """The whole conversation up to and with this response: every turn's input and output items."""
        turns = []
        current: str | None = response_id
        while current is not None and (kept := self._kept.get(current)) is not None:
            turns.append(kept)
            current = kept.previous
        items: list[Any] = []
        for kept in reversed(turns):
            output = kept.response.get("output")
            items.extend([*kept.input, *(output if isinstance(output, list) else [])])
        return items

    def keep(
        self, program_id: str | None, previous: str | None, own_input: list[Any], response: dict[str, Any]
    ) -> None:
        response_id = response.get("id")
        if not isinstance(response_id, str):
            return
        kept = self._kept[response_id] = Kept(program_id, previous, own_input, response)
        self._touch(response_id, kept)
        if program_id is not None:
            self._by_program.setdefault(program_id, set()).add(response_id)
        while len(self._kept) > self.limit:
            self._drop(next(iter(self._kept)))

    def forget_program(self, program_id: str) -> None:
        for response_id in self._by_program.pop(program_id, set()):
            self._kept.pop(response_id, None)
            self.changes.mark(response_id)

    def _drop(self, response_id: str) -> None:
        kept = self._kept.pop(response_id)
        self.changes.mark(response_id)
        if kept.program_id is not None:
            held = self._by_program.get(kept.program_id)
            if held is not None:
                held.discard(response_id)
                if not held:
                    del self._by_program[kept.program_id]


def not_found(response_id: str) -> JSONResponse:
    """vLLM's answer for a response it does not hold."""
    message = f"Response with id '{response_id}' not found."
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": "response_id", "code": 404}}, 404
    )
