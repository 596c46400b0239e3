"""A worker's room: one level of KV, or two with a host tier (what decodes must fit the GPU;
ACTING programs' KV may spill to the host, bounded by GPU + host)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager

from thunderctl.scheduler.config import Admission, Decay
from thunderctl.scheduler.ledger import Ledger, Load, recharged
from thunderctl.scheduler.ordering import WaitingQueue
from thunderctl.scheduler.program import Phase, Program, Status, Worker


def headroom(worker: Worker, load: Load, band: float) -> float:
    """Room for one more decoding program under `band` (a fraction of capacity) on every level."""
    if worker.capacity is None:
        return math.inf
    return min(worker.kv_capacity * band - load.tokens, gpu_room(worker, load, band))


def gpu_room(worker: Worker, load: Load, band: float) -> float:
    """Room on the GPU for what decodes; without a host tier GPU and all are one level (`tokens`)."""
    if not worker.host_capacity or worker.capacity is None:
        return math.inf
    return worker.capacity * band - load.decoding


def gpu_binds(worker: Worker, load: Load, band: float) -> bool:
    """Whether the GPU, not all the KV, is what keeps the queue out: then dropping an ACTING
    program's KV, which sits in the host tier, admits nobody."""
    return gpu_room(worker, load, band) < worker.kv_capacity * band - load.tokens


def decode_fits(worker: Worker, ledger: Ledger, program: Program, buffer: int, band: float) -> bool:
    """Whether an admitted program (charged on `ledger` as REASONING already) may decode now:
    always without a host tier (its reservation holds its room); with one, while what decodes
    fits the GPU's `band`, or when it would decode alone there."""
    if not worker.host_capacity or worker.capacity is None:
        return True
    alone = ledger.decoding <= program.private_tokens + buffer
    return alone or ledger.load(1.0).decoding <= worker.capacity * band


class Room:
    """What each worker is charged and the room that leaves it: the ledgers, kept matching the
    programs, with ACTING programs charged at the admission law's weight (and decay) on the
    resume side, and the buffer and bands of that law."""

    def __init__(
        self,
        admission: Admission,
        programs: Mapping[str, Program],
        acting_weight: Callable[[], float],
        clock: Callable[[], float],
    ) -> None:
        self.admission = admission
        self.buffer = admission.buffer_tokens
        self.ledgers: dict[str, Ledger] = {}
        self._programs = programs
        self._acting_weight = acting_weight
        self._clock = clock

    def add_worker(self, worker_id: str) -> None:
        self.ledgers.setdefault(worker_id, Ledger())

    def load(self, worker: Worker, physical: bool) -> Load:
        """The worker's charge: `physical`, every token; otherwise ACTING programs at the weight."""
        if physical or self.admission.acting_decay is Decay.OFF:
            return self.ledgers[worker.id].load(1.0 if physical else self._acting_weight())
        load, now = Load(), self._clock()
        for program in (self._programs[i] for i in worker.programs):
            weight = 1.0
            if program.phase is Phase.ACTING:
                weight = self._acting_weight() * self.decay(max(now - program.acting_since, 0.0))
            load.add(program, weight, self.buffer)
        return load

    def decay(self, idle_s: float) -> float:
        """The share of an ACTING program's reservation still charged `idle_s` into its tool."""
        match self.admission.acting_decay:
            case Decay.EXP:
                return math.pow(2.0, -idle_s / self.admission.acting_decay_tau_s)
            case Decay.LINEAR:
                return max(0.0, 1.0 - idle_s / self.admission.acting_decay_tau_s)
            case Decay.OFF:
                return 1.0

    def need(self, program: Program, load: Load) -> float:
        return load.need(program, 1.0, self.buffer)

    def headroom(self, worker: Worker, load: Load) -> float:
        return headroom(worker, load, self.admission.resume_threshold)

    def roomiest(self, targets: list[Worker], loads: Mapping[str, Load]) -> Worker:
        return max(targets, key=lambda b: self.headroom(b, loads[b.id]))

    def takes(self, program: Program, worker: Worker, load: Load) -> bool:
        """Whether the program fits the worker's headroom on top of `load`."""
        return self.need(program, load) <= self.headroom(worker, load)

    def gpu_room(self, worker: Worker, load: Load) -> float:
        return gpu_room(worker, load, self.admission.resume_threshold)

    def gpu_binds(self, worker: Worker, load: Load) -> bool:
        return gpu_binds(worker, load, self.admission.resume_threshold)

    def acting(self, workers: Iterable[Worker]) -> list[tuple[Program, Worker]]:
        """The ACTING programs placed on `workers`, each with its worker."""
        return [(p, b) for b in workers for p in (self._programs[i] for i in b.programs) if p.phase is Phase.ACTING]

    def silent(self, workers: Iterable[Worker], since: float) -> list[Program]:
        """The ACTING programs placed on `workers` not heard from since `since`: a walk over those
        only, however many others the workers hold."""
        return [self._programs[i] for b in workers for i in self.ledgers[b.id].heard_before(since)]

    def droppable(self, workers: Iterable[Worker]) -> list[tuple[Program, Worker]]:
        """The ACTING programs whose KV, dropped, makes room for the queue: on workers that have a
        capacity and whose GPU does not bind (there a dropped KV would only free the host tier)."""
        return self.acting(b for b in workers if b.capacity and not self.gpu_binds(b, self.load(b, physical=False)))

    def overfull(self, worker: Worker, load: Load) -> bool:
        return worker.capacity is not None and load.tokens > worker.kv_capacity * self.admission.pause_threshold

    def relief(self, worker: Worker, load: Load, acting: list[Program]) -> tuple[list[Program], list[Program]]:
        """What pauses on an overfull worker to bring `load` down to the pause target: ACTING
        programs (in pause order) now, and once none is left, the shortest decodes at the end of
        their response."""
        target = worker.kv_capacity * self.admission.pause_target
        now: list[Program] = []
        for program in acting:
            load.remove(program, 1.0, self.buffer)
            now.append(program)
            if load.tokens <= target:
                return now, []
        at_boundary = []
        for program in sorted((self._programs[i] for i in worker.programs), key=lambda p: (p.tokens, p.id)):
            if load.tokens <= target:
                break
            if program.phase is Phase.REASONING and program.status is Status.ACTIVE:
                at_boundary.append(program)
                load.remove(program, 1.0, self.buffer)
        return now, at_boundary

    def make_room(self, program: Program, worker: Worker, load: Load, acting: list[Program]) -> list[Program]:
        """Those of `acting` (in pause order) that pause, taken off `load`, until the program fits
        the worker's headroom (all of them when it never does)."""
        pausing = []
        for member in acting:
            if self.takes(program, worker, load):
                break
            load.remove(member, 1.0, self.buffer)
            pausing.append(member)
        return pausing

    def decode_fits(self, program: Program, worker: Worker) -> bool:
        return decode_fits(worker, self.ledgers[worker.id], program, self.buffer, self.admission.pause_threshold)

    def charge(self, program: Program, worker: Worker, load: Load) -> None:
        """The program is placed on the worker: on its ledger and on `load`, the pass's view of it."""
        load.add(program, 1.0, self.buffer)
        worker.programs.add(program.id)
        program.worker = worker.id
        self.ledgers[worker.id].add(program, self.buffer)

    def discharge(self, program: Program, workers: Mapping[str, Worker]) -> None:
        worker = workers.get(program.worker or "")
        if program.status is Status.ACTIVE and worker is not None:
            worker.programs.discard(program.id)
            self.ledgers[worker.id].remove(program, self.buffer)

    def recharged(self, program: Program, waiting: WaitingQueue) -> AbstractContextManager[None]:
        return recharged(program, self.ledgers, waiting, self.buffer)
