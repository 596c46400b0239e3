"""The program-aware scheduling policy (docs/architecture.md, docs/scheduler.md): pure, synchronous, clock injected;
no I/O (listeners)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from typing import Any

from thunderctl.scheduler.admission import AdmissionTuner
from thunderctl.scheduler.capacity import Room
from thunderctl.scheduler.config import SchedulerConfig
from thunderctl.scheduler.ending import EndingLaw, LikelyEnded
from thunderctl.scheduler.events import Counters, EventKind, Listener, ProgramEvent, notify
from thunderctl.scheduler.groups import GroupBook
from thunderctl.scheduler.ledger import Load
from thunderctl.scheduler.ordering import Precedence, WaitingQueue
from thunderctl.scheduler.placement import admit_in_order, placements
from thunderctl.scheduler.program import Phase, Program, Status, Worker
from thunderctl.scheduler.progress import ProgramLengths
from thunderctl.scheduler.retention import RetentionLaw
from thunderctl.scheduler.snapshot import SchedulerSnapshot, program_from_record, program_record, program_state

log = logging.getLogger(__name__)


class Scheduler:
    """Programs, workers and the policy over them."""

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        listeners: Iterable[Listener] = (),
    ) -> None:
        self.config = config or SchedulerConfig()
        self.clock = clock
        self.listeners = list(listeners)
        self.programs: dict[str, Program] = {}
        self.workers: dict[str, Worker] = {}
        self.lengths = ProgramLengths(self.config)
        self.groups = GroupBook(self.config)
        self.precedence = Precedence(self.config, self.lengths, self.groups, self.programs, clock)
        self._waiting = WaitingQueue(self.config, self.precedence.queue_delay_s)
        self.retention = RetentionLaw.from_config(self.config)
        self.ending = EndingLaw.from_config(self.config)
        self.counters = Counters()
        self.tuner = AdmissionTuner(self.config)
        self.room = Room(self.config.admission, self.programs, lambda: self.tuner.weight, clock)

    # ---- workers -------------------------------------------------------------------------

    def add_worker(self, worker_id: str, capacity: int | None, host_capacity: int = 0) -> Worker:
        """A worker of `capacity` GPU KV tokens, and `host_capacity` more in a host tier."""
        worker = self.workers.setdefault(worker_id, Worker(worker_id, capacity))
        self.room.add_worker(worker_id)
        worker.capacity, worker.host_capacity = capacity, host_capacity
        return worker

    def set_schedulable(self, worker_id: str, schedulable: bool) -> None:
        self.workers[worker_id].schedulable = schedulable
        if schedulable:
            self._resume_waiting()

    def drain(self, worker_id: str) -> None:
        """Nothing new goes there; ACTING programs pause now (to resume elsewhere), REASONING
        ones at their next tool boundary. In-flight requests finish where they are."""
        worker = self.workers[worker_id]
        worker.schedulable = False
        for program in [self.programs[i] for i in worker.programs]:
            if program.phase is Phase.ACTING:
                self._pause(program)
            else:
                program.pause_at_boundary = True
        self._resume_waiting()

    def requeue(self, program_id: str, avoid: str | None = None) -> None:
        """The program's request could not be served where it was placed (the worker died, or
        did not take the connection in time): it waits at the head of the queue to resume
        elsewhere. The pass it resumes in leaves out `avoid`, the worker that just failed it,
        while another worker is schedulable (one that is not dead is not drained for it)."""
        program = self.programs.get(program_id)
        if program is None or program.status is not Status.ACTIVE:
            return
        self._pause(program)
        program.phase = Phase.REASONING
        assert program.paused_at is not None, "_pause stamps it"
        self._waiting.add(program, program.paused_at)
        held = self.workers.get(avoid) if avoid is not None else None
        if (
            held is None
            or not held.schedulable
            or not any(w.schedulable for w in self.workers.values() if w is not held)
        ):
            self._resume_waiting()
            return
        held.schedulable = False
        try:
            self._resume_waiting()
        finally:
            held.schedulable = True

    def forget_cached_contexts(self) -> int:
        """New weights: no worker holds any program's context any more (each cached block is stale).

        ACTING programs pause, as a program whose KV the engine dropped is paused: their next
        request waits in the queue and is charged again from the engine's usage once it ends.
        No program keeps a worker it should return to (its prefix and host-tier KV are gone too).
        REASONING ones stay where their request runs: the engine recomputes what it needs.
        Returns how many programs paused.
        """
        acting = [p for p in self.programs.values() if p.status is Status.ACTIVE and p.phase is Phase.ACTING]
        for program in acting:
            self._pause(program)
        for program in self.programs.values():
            if program.status is not Status.ACTIVE:
                program.worker = None
        self.counters.cache_resets += 1
        self._resume_waiting()
        return len(acting)

    # ---- what the gateway reports ---------------------------------------------------------

    def on_request(
        self,
        program_id: str,
        prompt_tokens: int,
        prefix_key: str | None = None,
        prefix_tokens: int = 0,
        group: str | None = None,
        parent: str | None = None,
    ) -> str | None:
        """A request of the program (a sample of `group`, started from the program `parent`, when it
        names them) arrived; returns its worker, or None while it must wait.

        `prompt_tokens` is the gateway's estimate of the prompt; the engine's usage replaces
        it when the response ends.
        """
        now = self.clock()
        program = self.programs.get(program_id)
        if program is None:
            program = Program(program_id, created_at=now, paused_at=now)
            self.programs[program_id] = program
            self._adopt(program, parent)
            self._emit(EventKind.CREATED, program)
        self.groups.join(program, group)
        self.ending.on_request(program)
        self.retention.on_request(program, now)
        self.tuner.arrived = True
        waiting_since = program.waiting_since or now
        with self.room.recharged(program, self._waiting):
            program.tokens = max(program.tokens, prompt_tokens)
            if prefix_key is not None:
                program.prefix_key = prefix_key
                program.prefix_tokens = min(prefix_tokens, program.tokens)
            program.phase = Phase.REASONING
        program.last_activity = now
        if program.status is Status.ACTIVE:
            worker = self.workers.get(program.worker or "")
            # The open gate: the engine admits by its own cache.
            if worker is None or self.tuner.gate_open or self.room.decode_fits(program, worker):
                return program.worker
            # Its KV waits in the host tier; it resumes, by a transfer, as GPU room frees.
            self._pause(program)
            self.counters.gpu_waits += 1
        self._waiting.add(program, waiting_since)
        self._resume_waiting()
        if self._pause_likely_ended():
            self._resume_waiting()  # the room of programs that have likely ended is for those waiting now
        if program.status is not Status.ACTIVE:
            self.tuner.waited = True
            return None
        return program.worker

    def on_response(self, program_id: str, prompt_tokens: int, completion_tokens: int, tool: str | None = None) -> None:
        """A response ended: the engine's usage becomes the program's size; it now ACTs, in
        `tool` when the answer names the tool it called."""
        program = self.programs.get(program_id)
        if program is None or program.status is Status.TERMINATED:
            return
        now = self.clock()
        with self.room.recharged(program, self._waiting):
            program.tokens = prompt_tokens + completion_tokens
            program.prefix_tokens = min(program.prefix_tokens, program.tokens)
            program.phase = Phase.ACTING
            program.steps += 1
            program.acting_since = program.responded_at = program.last_activity = now  # its ledger hears it now
        self.counters.steps += 1
        program.tool = tool
        if program.pause_at_boundary:
            self._pause(program)
        # An ACTING program is charged less than a REASONING one below full weight: the
        # room it left is for the queue now, not at the next tick.
        self._resume_waiting()

    def on_request_failed(self, program_id: str) -> None:
        """The request ended without usage (worker error, client gone): the program ACTs."""
        program = self.programs.get(program_id)
        if program is None or program.status is Status.TERMINATED:
            return
        with self.room.recharged(program, self._waiting):
            program.phase = Phase.ACTING
            program.acting_since = program.last_activity = self.clock()
        program.responded_at = None  # no tool runs: the gap to its retry is not a tool time
        if program.pause_at_boundary:
            self._pause(program)
        self._resume_waiting()

    def observe_prefill(self, uncached_tokens: int, seconds: float) -> None:
        """A request's uncached prompt tokens and its time to first token: the re-prefill rate."""
        self.retention.prefill.observe(uncached_tokens, seconds)

    def release(self, program_id: str) -> bool:
        """The program ended; idempotent. Returns whether it was known."""
        program = self.programs.get(program_id)
        if program is None:
            return False
        self._terminate(program, EventKind.RELEASED)
        self.counters.released += 1
        self._resume_waiting()
        return True

    # ---- its state, for a daemon that comes back -------------------------------------------

    def snapshot(self, since: Mapping[str, tuple[Any, ...] | None] | None = None) -> SchedulerSnapshot:
        """Every live program and what the laws learnt, as plain data (snapshot.py); with `since` (the
        programs' states an earlier snapshot took), of the programs only those changed since. A
        journal of thousands of programs then encodes and writes only the few that took a step."""
        states = {program_id: program_state(program) for program_id, program in self.programs.items()}
        changed = states if since is None else [i for i, state in states.items() if since.get(i) != state]
        programs = self.program_records(changed)
        learnt = (
            self.retention.snapshot()
            | self.ending.snapshot()
            | {
                "admission": self.tuner.snapshot(),
                "lengths": self.lengths.snapshot(),
                "groups": self.groups.snapshot(),
                "counters": asdict(self.counters),
            }
        )
        return SchedulerSnapshot(self.clock(), programs, learnt, states)

    def program_records(self, ids: Iterable[str]) -> list[dict[str, Any]]:
        """The live programs among `ids`, as plain data (snapshot.py)."""
        by_program = self.retention.tool_times.by_program
        return [
            program_record(program, gaps.samples() if (gaps := by_program.get(program.id)) is not None else [])
            for program in (self.programs.get(i) for i in ids)
            if program is not None
        ]

    def restore(self, snapshot: SchedulerSnapshot, elapsed_s: float = 0.0) -> None:
        """Take back a snapshot taken `elapsed_s` ago, into this scheduler with its workers added and
        no program yet; its times move into this scheduler's clock.

        The requests in flight or waiting when it was taken went with the connections of the process
        that held them: a program with one ACTs, as after a failed request (its client sends again).
        A program placed on a worker this scheduler does not have is paused.
        """
        if self.programs:
            raise ValueError("a snapshot is restored into a scheduler with no programs")
        now, learnt = self.clock(), snapshot.learnt
        shift_s = now - elapsed_s - snapshot.taken_at
        self.retention.restore(learnt)
        self.ending.restore(learnt)
        self.tuner.restore(learnt["admission"], shift_s)
        self.lengths.restore(learnt["lengths"])
        self.groups.restore(learnt["groups"])
        self.counters = Counters(**learnt["counters"])
        interrupted = []
        for record in snapshot.programs:
            program, gaps = program_from_record(record, shift_s)
            self.programs[program.id] = program
            self.retention.tool_times.restore_program(program.id, gaps)
            if program.phase is Phase.REASONING and (
                program.status is Status.ACTIVE or program.waiting_since is not None
            ):
                interrupted.append(program.id)
            program.waiting_since = None
            worker = self.workers.get(program.worker or "")
            if program.status is not Status.ACTIVE:
                continue
            if worker is None:
                program.status, program.paused_at = Status.PAUSED, now
            else:
                self.room.charge(program, worker, Load())
        for program_id in interrupted:
            self.on_request_failed(program_id)

    # ---- the tick -------------------------------------------------------------------------

    @property
    def acting_weight(self) -> float:
        """The share of an ACTING program's private tokens charged on the resume side."""
        return self.tuner.weight

    def adapt(self, utilization: float) -> None:
        """Feed the workers' busy fraction over the last period (0-1) to the admission law."""
        if self.config.adaptive.enabled:
            self.tuner.retention_pays = self.config.retention.enabled and self.retention.pays(self.workers.values())
        before = self.tuner.label
        self.tuner.end_period(self.clock(), self.counters.steps, utilization, waiting=bool(self._waiting))
        if self.tuner.label != before:
            log.info("admission: %s -> %s (workers busy %.0f%%)", before, self.tuner.label, 100 * utilization)

    def tick(self) -> None:
        """Expire idle programs, then resume (and make room for waits at their bound), then pause
        (so nothing resumes the tick it paused).

        A tick that raises fails open: every paused program is let go, so a policy bug costs
        cache hits, never a stuck agent.
        """
        try:
            self._expire_idle()
            self.precedence.survey(self.programs.values())
            self._pause_likely_ended()
            self._resume()
            self._make_room_for_overdue()
            self._pause_overfull()
            self._pause_priced()
        except Exception:
            self.counters.tick_failures += 1
            log.exception("scheduler tick failed; resuming every paused program")
            self._fail_open()
            raise

    # ---- views ----------------------------------------------------------------------------

    def reserved_tokens(self, worker_id: str) -> int:
        """Physical (undecayed) tokens charged on a worker."""
        return round(self.room.load(self.workers[worker_id], physical=True).tokens)

    def paused(self) -> list[Program]:
        return [p for p in self.programs.values() if p.status is Status.PAUSED]

    def resume_queue(self) -> list[Program]:
        """Paused programs in the order they will resume."""
        return sorted(self.paused(), key=self._waiting.key)

    # ---- policy ---------------------------------------------------------------------------

    def _expire_idle(self) -> None:
        """End the programs not continued within the learnt law (ending.py), as a release does."""
        for program in self.ending.expired(list(self.programs.values()), self.retention.tool_times, self.clock()):
            self._terminate(program, EventKind.EXPIRED)
            self.counters.expired += 1

    def _likely_ended(self) -> LikelyEnded:
        return self.ending.likely_ended(self.programs.values(), self.retention.tool_times, self.clock())

    def _pause_likely_ended(self) -> bool:
        """While requests wait, an ACTING program that has likely ended gives up its room (its KV
        stays in the engine's cache until evicted, should it return). Whether any did."""
        if not self._waiting:
            return False
        likely_ended = self._likely_ended()
        silent = self.room.silent(self.workers.values(), self.clock() - likely_ended.floor)
        ended = [program for program in silent if likely_ended(program)]
        for program in ended:
            self._pause(program)
        self.counters.ended_pauses += len(ended)
        return bool(ended)

    def _resume_waiting(self) -> None:
        """The event-driven resume: only programs whose request waits, nobody forced."""
        self._resume(force_overdue=False, waiting_only=True)

    def _resume(self, force_overdue: bool = True, waiting_only: bool = False) -> None:
        targets = [b for b in self.workers.values() if b.schedulable]
        if not targets:
            return
        if self._waiting:
            self._resume_waiting_programs(targets, force_overdue)
        if waiting_only:
            return
        # A program with no request waiting only reserves ahead of need: it gets room the
        # physical check leaves, never overbooked room, or the next pause pass takes it back.
        physical = {b.id: self.room.load(b, physical=True) for b in targets}
        if not any(not b.programs or self.room.headroom(b, physical[b.id]) > self.room.buffer for b in targets):
            return  # a full cluster: no need to sort thousands of paused programs
        # One that has likely ended is not coming back: no room is reserved for it.
        likely_ended = self._likely_ended()
        idle = [p for p in self.resume_queue() if p.waiting_since is None and not likely_ended(p)]
        self._place_all(admit_in_order(idle, targets, physical, self.config), targets, physical)

    def _resume_waiting_programs(self, targets: list[Worker], force_overdue: bool) -> None:
        # Lazily: admission stops at the first program that does not fit, and a response
        # triggers this pass, so it must not cost a walk over a long queue.
        waiting: Iterable[Program] = (self.programs[program_id] for program_id in self._waiting)
        loads = {b.id: self.room.load(b, physical=False) for b in targets}
        if self.tuner.gate_open or force_overdue:
            # Behind the open gate every request goes, and a wait past its forced resume ends, at
            # once onto the roomiest worker.
            deadline = self.clock() - self.config.waits.forced_resume_s
            queue, waiting = list(waiting), []
            for program in queue:
                since = program.waiting_since
                if self.tuner.gate_open or (since is not None and since <= deadline):
                    worker = self.room.roomiest(targets, loads)
                    self._place(program, worker, loads[worker.id], forced=not self.tuner.gate_open)
                else:
                    waiting.append(program)
        self._place_all(admit_in_order(waiting, targets, loads, self.config), targets, loads)

    def _place_all(self, chosen: list[Program], targets: list[Worker], loads: dict[str, Load]) -> None:
        for program, worker in placements(chosen, len(self._waiting), targets, loads, self.config, self.workers):
            self._place(program, worker, loads[worker.id])

    def _place(self, program: Program, worker: Worker, load: Load, forced: bool = False) -> None:
        self.room.charge(program, worker, load)
        program.resume(self.clock())
        self._waiting.remove(program)
        self.counters.resumes += 1
        self.counters.forced_resumes += forced
        self._emit(EventKind.RESUMED, program, forced=forced)

    def _pause_overfull(self) -> None:
        if self.tuner.gate_open:
            return  # the engine admits by its own cache: a pause would only delay a request
        for worker in self.workers.values():
            load = self.room.load(worker, physical=True)
            if self.room.overfull(worker, load):
                now, at_boundary = self.room.relief(worker, load, self.precedence.acting_in_pause_order(worker))
                for program in now:
                    self._pause(program)
                for program in at_boundary:
                    program.pause_at_boundary = True

    def _make_room_for_overdue(self) -> None:
        """A program that has waited `waits.bound_s` is admitted now onto the worker with the most
        headroom, ACTING programs there pausing for it in pause order: rotation where the cache
        is far smaller than the working set, so that no wait runs into the forced resume (which
        overbooks the cache) while others are admitted."""
        bound = self.config.waits.bound_s
        targets = [b for b in self.workers.values() if b.schedulable and b.capacity]
        if bound is None or not self._waiting or self.tuner.gate_open or not targets:
            return
        for program in self._waiting.since_before(self.clock() - bound, self.programs):
            loads = {b.id: self.room.load(b, physical=True) for b in targets}
            worker = self.room.roomiest(targets, loads)
            load = loads[worker.id]
            if self.room.need(program, load) > self.room.gpu_room(worker, load):
                continue  # what decodes fills the GPU: pausing ACTING programs frees none of it
            for member in self.room.make_room(program, worker, load, self.precedence.acting_in_pause_order(worker)):
                self._pause(member)
                self.counters.bound_pauses += 1
            if self.room.takes(program, worker, load):
                self._place(program, worker, load)

    def _pause_priced(self) -> None:
        """While requests wait, pause the ACTING programs whose KV costs more to hold than to
        recompute (retention.py); the room goes to the queue at once."""
        if not (self.config.retention.enabled and self._waiting) or self.tuner.gate_open:
            return
        demand = sum(self.programs[i].tokens + self.room.buffer for i in self._waiting)
        held = self.precedence.priced(self.room.droppable(self.workers.values()))
        drops = self.retention.drops(held, demand, self.clock())
        for program_id in drops:
            self._pause(self.programs[program_id])
        self.counters.priced_pauses += len(drops)
        if drops:
            self._resume_waiting()

    def _pause(self, program: Program) -> None:
        self.room.discharge(program, self.workers)
        program.pause(self.clock())
        self.counters.pauses += 1
        self._emit(EventKind.PAUSED, program)

    def _adopt(self, program: Program, parent_id: str | None) -> None:
        """A new program started from a live one: its parent is not silent while it lives."""
        parent = self.programs.get(parent_id) if parent_id is not None and parent_id != program.id else None
        if parent is not None:
            program.parent = parent.id
            parent.children += 1

    def _terminate(self, program: Program, kind: EventKind) -> None:
        parent = self.programs.get(program.parent) if program.parent is not None else None
        if parent is not None:
            parent.children -= 1
            # Its tool call (the child's life) ended now: its silence counts from here.
            parent.last_activity = self.clock()
        self.ending.on_end(program)
        self.retention.on_end(program)
        self.lengths.observe(program.steps)
        self.groups.end(program)
        self.room.discharge(program, self.workers)
        self._waiting.remove(program)
        program.status = Status.TERMINATED
        del self.programs[program.id]
        self._emit(kind, program)

    def _fail_open(self) -> None:
        targets = [b for b in self.workers.values() if b.schedulable] or list(self.workers.values())
        if not targets:
            return
        for program in self.paused():
            worker = min(targets, key=lambda b: len(b.programs))
            self._place(program, worker, Load(), forced=True)

    def _emit(self, kind: EventKind, program: Program, forced: bool = False) -> None:
        notify(self.listeners, ProgramEvent(kind, program, forced))
