"""Programs the gateway derived for requests that name none, from the conversations it relayed."""

from __future__ import annotations

from collections.abc import Container, Iterable

from thunderctl.gateway.identity import (
    Candidates,
    Claim,
    Conversation,
    ConversationIndex,
    IdentityConfig,
    IndexSnapshot,
    Keys,
    PromptKeys,
    PromptMatches,
)
from thunderctl.scheduler import EventKind, ProgramEvent


class DerivedPrograms:
    """Which live programs were derived, and the conversations that find them again."""

    def __init__(self, identity: IdentityConfig) -> None:
        # None: derivation is off; every request that names no program is served unscheduled.
        self.conversations = ConversationIndex(identity.remembered_conversations) if identity.derive_programs else None
        self._ids: set[str] = set()

    def __contains__(self, program_id: str) -> bool:
        return program_id in self._ids

    def ids(self) -> list[str]:
        """The programs derived so far that have not ended."""
        return list(self._ids)

    def restore(self, ids: Iterable[str], conversations: IndexSnapshot | None) -> None:
        """Back to a journal's derived programs and conversations (with derivation off, none are found
        again). A conversation's program was derived, even one derived after the journal's last list."""
        self._ids.update(ids)
        if self.conversations is not None and conversations is not None:
            self.conversations.restore(conversations)
            self._ids.update(c.program_id for c in conversations.conversations)

    @property
    def on(self) -> bool:
        """Whether requests that name no program are followed (else served unscheduled)."""
        return self.conversations is not None

    def claim(self, keys: Keys, matches: PromptMatches) -> Claim | None:
        """The program of a request that names none, by its hashes: the one whose conversation it
        continues, or a new one (None: derivation is off)."""
        if self.conversations is None:
            return None
        claim = self.conversations.claim(keys, matches)
        self._ids.add(claim.program_id)
        return claim

    def candidates(self, keys: PromptKeys) -> Candidates:
        """The conversations a prompt may continue (none: derivation is off)."""
        return self.conversations.candidates(keys) if self.conversations is not None else Candidates()

    def live(self, programs: Container[str]) -> int:
        """Live programs (of the scheduler's `programs`) whose id was derived from their conversation."""
        return sum(1 for program_id in self._ids if program_id in programs)

    def on_program_event(self, event: ProgramEvent) -> None:
        if event.kind in (EventKind.RELEASED, EventKind.EXPIRED):
            self._ids.discard(event.program.id)
        if event.kind is EventKind.RELEASED and self.conversations is not None:
            self.conversations.forget(event.program.id)  # a released conversation that goes on is a new program

    def remember(self, program_id: str, conversation: Conversation) -> None:
        """Remember the conversation a derived program's answer extends, for its next request."""
        if self.conversations is not None:
            self.conversations.remember(program_id, conversation)
