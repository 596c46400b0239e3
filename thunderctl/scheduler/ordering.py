"""The orders the policy walks programs in (who resumes first, who pauses first), its waiting queue, and an ACTING reservation's decay."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping

from thunderctl.scheduler.config import PauseOrder, SchedulerConfig
from thunderctl.scheduler.critical import Held, WorkLeft
from thunderctl.scheduler.groups import GroupBook
from thunderctl.scheduler.program import Phase, Program, Worker
from thunderctl.scheduler.progress import ProgramLengths

ResumeKey = tuple[int, float, float]


def resume_key(config: SchedulerConfig, program: Program, delay_s: float = 0.0) -> ResumeKey:
    """Programs whose request waits first, then the rest shortest first. `delay_s` queues a
    waiting program that much later (nearest the end first, progress.py)."""
    if program.waiting_since is None:
        return 1, program.tokens, program.paused_at or 0.0
    if config.waits.aging_tokens_per_s is None:
        return 0, float(program.is_new), program.tokens
    # Shorter first, but aged: a program is behind none that began waiting more than
    # tokens / rate (+ the delay of a new program) after it. The key is fixed while it
    # waits, so the waiting list stays sorted by insertion.
    place = program.waiting_since + program.tokens / config.waits.aging_tokens_per_s
    return 0, place + config.waits.new_program_delay_s * program.is_new + delay_s, program.tokens


def pause_key(order: PauseOrder) -> Callable[[Program], tuple[float, int, str]]:
    """The sort key of ACTING programs, the first to pause first.

    Longest in its tool first: its KV was freed to the engine's cache earliest, so the
    engine's LRU evicts it first anyway (pausing it keeps the scheduler's charge and the
    engine's cache in step), and under the tool times' heavy tail it is the one expected
    back last. Ties (responses at the same instant) go shortest first, as the reference."""
    if order is PauseOrder.SHORTEST:
        return lambda p: (0.0, p.tokens, p.id)
    return lambda p: (p.acting_since, p.tokens, p.id)


def acting_in_pause_order(
    programs: Iterable[Program], order: PauseOrder, work_left: Callable[[Program], float | None] | None = None
) -> list[Program]:
    """The ACTING ones among `programs`, the first to pause first. With `work_left` (the critical
    path first, critical.py), those of a batch pause after the others, the least work left first."""
    key = pause_key(order)
    acting = (p for p in programs if p.phase is Phase.ACTING)
    if work_left is None:
        return sorted(acting, key=key)

    def batch_last(program: Program) -> tuple[bool, float, float, int, str]:
        left = work_left(program)
        return (left is not None, left or 0.0, *key(program))

    return sorted(acting, key=batch_last)


class WaitingQueue:
    """The paused programs whose request waits, in resume order (their ids).

    A waiting program's key is fixed when it enters (kept until it leaves), so insertion keeps it
    sorted; `delay_s` gives a program's extra queueing delay then (none: 0)."""

    def __init__(self, config: SchedulerConfig, delay_s: Callable[[Program], float] | None = None) -> None:
        self._config = config
        self._delay_s = delay_s
        self._entries: list[tuple[ResumeKey, str]] = []
        self._keys: dict[str, ResumeKey] = {}

    def key(self, program: Program) -> ResumeKey:
        """Its place: the one it entered with while it waits, else what it would enter with."""
        kept = self._keys.get(program.id)
        if kept is not None and program.waiting_since is not None:
            return kept
        delay = self._delay_s(program) if self._delay_s is not None and program.waiting_since is not None else 0.0
        return resume_key(self._config, program, delay)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return (program_id for _, program_id in self._entries)

    def add(self, program: Program, since: float) -> None:
        if program.waiting_since is None:
            program.waiting_since = since
            key = self._keys[program.id] = self.key(program)
            bisect.insort(self._entries, (key, program.id))

    def remove(self, program: Program) -> None:
        if program.waiting_since is not None:
            self._entries.remove((self._keys.pop(program.id), program.id))
            program.waiting_since = None

    def since_before(self, moment: float, programs: Mapping[str, Program]) -> list[Program]:
        """The waiting programs that began waiting at `moment` or earlier, in resume order."""
        waiting = (programs[program_id] for program_id in self)
        return [p for p in waiting if p.waiting_since is not None and p.waiting_since <= moment]


class Precedence:
    """Who goes first by the waits law: the delay with which a program that begins to wait
    queues, and who pauses first. Later the more steps it has left (nearest the end first,
    progress.py); in a batch, sooner and later to pause the more work it has left (the critical
    path first, critical.py)."""

    def __init__(
        self,
        config: SchedulerConfig,
        lengths: ProgramLengths,
        groups: GroupBook,
        programs: Mapping[str, Program],
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.lengths = lengths
        self.programs = programs
        self.work_left = WorkLeft(groups, lengths, programs)
        self.clock = clock

    def survey(self, programs: Iterable[Program]) -> None:
        """Read the running programs' steps into the lengths law, when a setting asks of it (not
        a sort of thousands a tick for nobody)."""
        waits = self.config.waits
        if waits.nearest_end_s is not None or (waits.critical_path and self.work_left.groups.groups):
            self.lengths.survey(p.steps for p in programs)

    def queue_delay_s(self, program: Program) -> float:
        if self.config.waits.critical_path and (left := self.work_left.seconds(program, self.clock())) is not None:
            return -left
        return self.lengths.queue_delay_s(program)

    def acting_in_pause_order(self, worker: Worker) -> list[Program]:
        now = self.clock()
        work_left = (lambda p: self.work_left.seconds(p, now)) if self.config.waits.critical_path else None
        programs = (self.programs[i] for i in worker.programs)
        return acting_in_pause_order(programs, self.config.admission.pause_order, work_left)

    def priced(self, held: list[tuple[Program, Held]]) -> list[tuple[Program, Held]]:
        """The held programs priced retention may drop (in a batch, not its critical path)."""
        return self.work_left.priced(held, self.clock()) if self.config.waits.critical_path else held
