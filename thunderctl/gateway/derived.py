"""Programs the gateway derived for requests that name none, from the conversations it relayed."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from thunderctl.gateway.answers import StreamedAnswer
from thunderctl.gateway.identity import Claim, ConversationIndex, IdentityConfig
from thunderctl.scheduler import EventKind, ProgramEvent


class DerivedPrograms:
    """Which live programs were derived, and the conversations that find them again."""

    def __init__(self, identity: IdentityConfig) -> None:
        # None: derivation is off; every request that names no program is served unscheduled.
        self.conversations = ConversationIndex(identity.remembered_conversations) if identity.derive_programs else None
        self._ids: set[str] = set()

    def __contains__(self, program_id: str) -> bool:
        return program_id in self._ids

    def claim(self, body: dict[str, Any]) -> Claim | None:
        """The program of a request that names none: the one whose conversation it continues, or a
        new one (None: derivation is off, or the request cannot be followed)."""
        claim = self.conversations.claim(body) if self.conversations is not None else None
        if claim is not None:
            self._ids.add(claim.program_id)
        return claim

    def live(self, programs: Container[str]) -> int:
        """Live programs (of the scheduler's `programs`) whose id was derived from their conversation."""
        return sum(1 for program_id in self._ids if program_id in programs)

    def on_program_event(self, event: ProgramEvent) -> None:
        if event.kind in (EventKind.RELEASED, EventKind.EXPIRED):
            self._ids.discard(event.program.id)
        if event.kind is EventKind.RELEASED and self.conversations is not None:
            self.conversations.forget(event.program.id)  # a released conversation that goes on is a new program

    def remember(self, claim: Claim | None, path: str, answered: dict[str, Any] | StreamedAnswer) -> None:
        """Remember the conversation a derived program's answer extends, for its next request."""
        if claim is None or self.conversations is None:
            return
        chat = path.endswith("/chat/completions")
        if isinstance(answered, StreamedAnswer):
            if chat:
                self.conversations.answered_chat(claim, answered.message)
            else:
                self.conversations.answered_completion(claim, answered.text, answered.token_ids)
            return
        choices = answered.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        if chat and isinstance(choice.get("message"), dict):
            self.conversations.answered_chat(claim, choice["message"])
        elif not chat and isinstance(choice.get("text"), str):
            token_ids = choice.get("token_ids")
            self.conversations.answered_completion(
                claim, choice["text"], token_ids if isinstance(token_ids, list) else None
            )
