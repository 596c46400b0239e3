"""What a relay asks of the scheduler side, and tells it, about each generation request.

The relay (relay.py) carries bytes; the scheduler side (gateway.py) decides. They meet only here,
in messages of plain data: the program of a request that names none (by its identity hashes, which
the relay takes), the Responses chain a request continues, a request's admission (where it goes,
once its program may run), the end of its answer (what the answer taught the scheduler, and, when
the relay holds the answer's last event, the wait until that is kept), a failure (whether to try
again), and the route of an unscheduled request; the other way, one push: give up the unanswered
requests on a stalled worker. In one process they are calls; with relay processes
(`gateway.relays`), the messages of wire.py (remote.py; docs/gateway.md, "Past one core").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from thunderctl.apiusage import Usage
from thunderctl.gateway.identity import Candidates, Claim, Conversation, Keys, PromptKeys, PromptMatches
from thunderctl.gateway.requests import PromptShape


@dataclass(frozen=True, slots=True)
class Admission:
    """A generation request's ask for a worker: of its program (None: unscheduled), the program's
    group and parent, the worker that just failed it (`avoid`), and which try it is."""

    program_id: str | None
    shape: PromptShape
    group: str | None = None
    parent: str | None = None
    avoid: str | None = None
    attempt: int = 1


@dataclass(frozen=True, slots=True)
class Admitted:
    """The worker a request goes to, and whether it waited for its program's resume."""

    worker: str
    url: str
    waited: bool = False
    ticket: int = 0  # which admission it is, where the scheduler side is another process (wire.py)


@dataclass(frozen=True, slots=True)
class ChainStep:
    """A Responses answer to keep for `previous_response_id` chains: the response it follows, and
    the input it added (chains.py)."""

    program_id: str | None
    previous: str | None
    own_input: list[Any]


@dataclass(frozen=True, slots=True)
class Chain:
    """A kept Responses chain: the program of its turns, and all their input and output items."""

    program_id: str | None
    items: list[Any]


@dataclass(frozen=True, slots=True)
class AnswerEnd:
    """The end of a request's answer on `worker`, whole or cut short: the engine's usage, the tool
    the answer called, its first token's time, and, when the client had it whole, what it extends: a
    derived program's conversation as it now stands, a chain's step with the API's answer object."""

    worker: str
    program_id: str | None
    shape: PromptShape
    usage: Usage | None
    tool: str | None = None
    ttft_s: float | None = None
    conversation: Conversation | None = None
    chain: ChainStep | None = None
    response: dict[str, Any] | None = None
    ticket: int = 0  # its admission's


@dataclass(frozen=True, slots=True)
class Failure:
    """A request that failed on `worker` before any byte reached its client. `worker_down`: the
    failure says the worker is gone (a refused connection), not only slow or stalled."""

    worker: str
    program_id: str | None
    worker_down: bool
    attempt: int
    ticket: int = 0  # its admission's


class Admissions(Protocol):
    """The scheduler side, as a relay sees it."""

    @property
    def keeps_answers(self) -> bool:
        """Whether what an answer teaches is kept somewhere (the daemon's journal) before its client
        has the answer's end."""
        ...

    @property
    def remote(self) -> bool:
        """Whether the scheduler side is another process: then each scheduled answer's end is held
        until the scheduler acknowledges it (`ended`), so that the program's next request, through
        whichever relay, finds this one ended."""
        ...

    @property
    def derives(self) -> bool:
        """Whether a request that names no program is followed by its conversation (else it is
        served unscheduled, and needs no hashing)."""
        ...

    async def claim(self, keys: Keys, matches: PromptMatches) -> Claim | None:
        """The program of a request that names none, by its hashes (and, for a prompt, which of its
        `candidates` it starts with); None when derivation is off."""
        ...

    async def candidates(self, keys: PromptKeys) -> Candidates:
        """The conversations a prompt may continue, for the relay to check against the prompt."""
        ...

    async def chain(self, response_id: str) -> Chain | None:
        """The kept chain up to and with this Responses answer (None: not kept, or forgotten)."""
        ...

    async def admit(self, admission: Admission) -> Admitted:
        """Where the request goes; waits while its program is paused or the cluster pauses for a
        weight update. The worker counts it in flight from here."""
        ...

    def finished(self, end: AnswerEnd) -> None:
        """The answer ended; its worker no longer counts it in flight."""
        ...

    async def ended(self, end: AnswerEnd, keep: bool) -> None:
        """The answer ended (as `finished`); returns once what it taught is kept (`keep`), or else
        once the scheduler side has its end. One message where the scheduler side is another process."""
        ...

    async def failed(self, failure: Failure) -> bool:
        """The request failed; whether it goes again (to another worker, when one is usable)."""
        ...

    async def route(self, program_id: str | None) -> Admitted:
        """Where a request of an unscheduled engine route goes: the worker of the program it names,
        when that program is placed there, else the least-loaded worker."""
        ...


class Relays(Protocol):
    """The relays, as the scheduler side sees them: what it tells them unasked."""

    def give_up(self, worker: str) -> int:
        """Give up the requests on `worker` with no byte of their answer yet (it stalled; each goes
        to another worker); how many there were."""
        ...
