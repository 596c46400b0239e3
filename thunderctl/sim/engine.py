"""One vLLM V1 engine in virtual time: continuous batching, chunked prefill, prefix caching, preemption.

Each step schedules the running requests first, in order (a decode takes one token, a prefill
the next chunk of the token budget), and the waiting ones after them, first come first served,
while the budget, `max_num_seqs` and the KV cache allow. A running request that cannot get a
block preempts the last running request (possibly itself): its blocks are freed, its computed
tokens reset, and it goes back to the front of the waiting queue (recompute; its freed blocks
may still be hits). The step's time comes from the cost model.

Counters are vLLM 0.32's (the engine this project runs): a lookup is counted when the request
is admitted, in `prefix_cache_queries`/`_hits` the first time and in the `preempted_` pair after
a preemption (vLLM keeps those out of `vllm:prefix_cache_*`).

A request decoding is not touched every step: its computed tokens are `base + step index`, and
it only has events when it needs a block or ends, so a step costs the requests that change in
it, not the whole batch.

An `EngineMode` (a peer's scheduling inside the engine, sim/peers.py) may order the waiting
queue by each request's `priority` (vLLM's priority policy), choose preemption victims by it,
let a waiting request preempt running ones, and pin a finished request's KV for a while.
Without one the engine is vLLM's default, and no mode code runs.

A `FrontendCost` is vLLM's API-server process: requests reach the engine after its work on
their prompt and reach the client after its work on their answer, one request's work after
another's (`frontend_in_s`, `frontend_out_s`; the worker that drives the engine keeps the time).
It never holds a batch slot; on shared cores it only slows the steps that start while it works.
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections.abc import Callable
from typing import Protocol

from thunderctl.sim.cost import CostModel, EngineShape, FrontendCost, StepLoad
from thunderctl.sim.kv import BlockPool, HostTier
from thunderctl.sim.requests import EngineCounters, Request, cdiv


class EngineMode(Protocol):
    """A peer's scheduling inside the engine. vLLM's default (FCFS, the last running request
    preempted, nothing pinned) is no mode at all."""

    @property
    def ordered(self) -> bool:
        """The waiting queue is kept in (priority, arrival) order, preempted requests included."""
        ...

    @property
    def preempt_by_priority(self) -> bool:
        """A victim is the running request of largest (priority, arrival), not the last admitted."""
        ...

    @property
    def admission_preempts(self) -> bool:
        """The waiting head preempts running requests of larger priority until it fits."""
        ...

    def on_submit(self, request: Request) -> None:
        """A request arrives: set its priority."""
        ...

    def finished(self, request: Request, now: float, engine: Engine) -> float:
        """A request finished: how long its KV stays pinned on the GPU for its program's next (0: freed now)."""
        ...


def queue_key(request: Request) -> tuple[float, float]:
    return request.priority, request.arrival_s


class Engine:
    """A single worker (a DP replica). Drive it with `submit`, `begin_step` and `end_step`."""

    def __init__(
        self,
        shape: EngineShape,
        cost: CostModel,
        *,
        host: HostTier | None = None,
        transfer_seconds: Callable[[int], float] | None = None,
        unbounded_kv: bool = False,
        running_only_kv: bool = False,
        mode: EngineMode | None = None,
        frontend: FrontendCost | None = None,
    ) -> None:
        """`unbounded_kv`: nothing is ever evicted (the `limit`); `running_only_kv`: only the
        blocks running requests hold count against the cache, freed ones stay cached at no
        charge (the `bound`)."""
        if shape.max_num_seqs > shape.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs ({shape.max_num_seqs}) exceeds max_num_batched_tokens "
                f"({shape.max_num_batched_tokens}); vLLM rejects that too: lower max_num_seqs"
            )
        if host is not None and transfer_seconds is None:
            raise ValueError("a host KV tier needs transfer_seconds (the preset's host link)")
        self.shape = shape
        self.cost = cost
        self.block_size = shape.block_size
        self.pool = BlockPool(None if unbounded_kv else shape.num_gpu_blocks, host, keep_freed=running_only_kv)
        self.mode = mode
        self._pinned: dict[str, tuple[float, Request]] = {}  # program -> (expiry, its finished request)
        self.transfer_seconds = transfer_seconds
        self.counters = EngineCounters()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._prefilling: list[Request] = []  # running and not decoding, in running order
        self.step_index = 0
        self._orders = 0
        self._decoders = 0
        self._decoder_base_sum = 0
        self._block_events: list[tuple[int, int, int, Request]] = []
        self._finish_events: list[tuple[int, int, int, Request]] = []
        self._chunks: list[tuple[Request, int]] = []
        self._link_free_s = 0.0
        self.frontend = frontend or FrontendCost()
        self._frontend_free_s = 0.0

    # ---- requests in ----------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        total = request.prompt_tokens + request.max_tokens
        if total > self.shape.max_model_len:
            raise ValueError(
                f"a request of {request.prompt_tokens} prompt + {request.max_tokens} answer tokens exceeds "
                f"max_model_len {self.shape.max_model_len}; end programs earlier (the workload's max context)"
            )
        # The last sampled token is never computed: a request holds at most total - 1 tokens.
        if self.pool.num_blocks is not None and cdiv(total - 1, self.block_size) > self.pool.num_blocks:
            raise ValueError(
                f"a request of {total} tokens does not fit a KV cache of {self.pool.num_blocks} blocks "
                f"of {self.block_size}: give the engine more blocks or the workload a smaller max context"
            )
        if self.mode is None:
            self.waiting.append(request)
            return
        self.mode.on_submit(request)
        self._enqueue(request, front=False)

    def _enqueue(self, request: Request, front: bool) -> None:
        if self.mode is not None and self.mode.ordered:
            insort(self.waiting, request, key=queue_key)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def abort(self, request: Request) -> bool:
        """Between steps: a request whose client went away leaves the engine, as vLLM aborts it,
        and its blocks are freed (what it computed stays in the prefix cache). False when it had
        finished already."""
        if request in self.waiting:
            self.waiting.remove(request)
            if request.ready_s is not None:  # its host-tier load never landed: nothing new to cache
                request.computed_tokens = request.registered_blocks * self.block_size
                request.ready_s = None
        elif request in self.running:
            self.running.remove(request)
            if request.decoding:
                self._stop_decoding(request, self.step_index)
            else:
                self._prefilling.remove(request)
        else:
            return False
        self._release_blocks(request)
        self.counters.aborted += 1
        return True

    @property
    def kv_usage(self) -> float:
        """Share of the shape's KV blocks in use (above 1 only for an unbounded cache)."""
        return self.pool.in_use / self.shape.num_gpu_blocks

    def sampled_tokens(self, request: Request) -> int:
        """Tokens `request` has sampled so far; a decoding request's count is implicit."""
        if request.decoding:
            return request.base + self.step_index - request.prompt_tokens + 1
        return request.output_tokens

    def wake_s(self) -> float | None:
        """When a host-tier load that holds up the waiting queue completes, or pinned KV that keeps
        it out expires, if any: an idle engine must step again then, or the queue waits forever."""
        moments = [r.ready_s for r in self.waiting if r.ready_s is not None]
        if self.waiting and self._pinned:
            moments.append(min(expiry for expiry, _ in self._pinned.values()))
        return min(moments) if moments else None

    def frontend_in_s(self, request: Request, now: float) -> float:
        """When the API server, given `request` at `now`, hands it to the engine."""
        return self._frontend_work(now, self.frontend.before_engine_s(request.prompt_tokens))

    def frontend_out_s(self, now: float) -> float:
        """When the client has the whole answer of a request the engine finished at `now`: once
        the API server has framed every token emitted so far, its last one included."""
        return max(now, self._frontend_free_s)

    def _frontend_work(self, now: float, seconds: float) -> float:
        if seconds <= 0:
            return now
        self._frontend_free_s = max(now, self._frontend_free_s) + seconds
        return self._frontend_free_s

    # ---- one step -------------------------------------------------------------------------

    def begin_step(self, now: float) -> float | None:
        """Schedule a step at `now`; returns its duration, or None when nothing can run."""
        budget = self.shape.max_num_batched_tokens
        if self._pinned:
            self._expire_pins(now)
        if self.mode is not None and self.mode.admission_preempts and self.waiting:
            self._preempt_for_head()
        preempted = self._schedule_decodes()
        budget -= self._decoders
        self._chunks = []
        for request in list(self._prefilling):
            if request not in self._prefilling:
                continue  # preempted by an earlier request of this step
            chunk = min(request.num_tokens - request.computed_tokens, budget)
            if chunk <= 0:
                continue
            need = cdiv(request.computed_tokens + chunk, self.block_size) - request.num_blocks
            if not self._make_room(request, need):
                preempted = True
                continue
            self._extend(request, chunk)
            budget -= chunk
        # As vLLM, a step that preempted admits nobody; one that preempted its last request would
        # be empty, and vLLM's next step, at once, admits.
        if not preempted or not self.running:
            self._admit_waiting(now, budget)
        load = self._load()
        if load.scheduled_tokens == 0:
            return None
        seconds = self.cost.step_seconds(load)
        if share := self.frontend.engine_cpu_share:
            # The engine runs at (1 - share) of its speed while the frontend still works: slowed
            # for the whole step, or for the frontend's remaining work and then at full speed.
            busy = max(0.0, self._frontend_free_s - now)
            seconds = min(seconds / (1 - share), seconds + busy * share)
        self.counters.steps += 1
        self.counters.busy_s += seconds
        return seconds

    def end_step(self, now: float) -> list[Request]:
        """The step ends at `now`: chunks are computed, tokens sampled; returns finished requests."""
        step = self.step_index
        finished = []
        self.counters.decode_tokens += self._decoders
        emitted = self._decoders
        for request, chunk in self._chunks:
            request.computed_tokens += chunk
            self.counters.prefill_tokens += chunk
            if request.computed_tokens < request.num_tokens:
                continue
            request.output_tokens += 1
            emitted += 1
            if request.output_tokens >= request.max_tokens:
                finished.append(request)
            else:
                self._start_decoding(request, step + 1)
        events = self._finish_events
        while events and events[0][0] == step:
            _, _, epoch, request = heapq.heappop(events)
            if request.epoch == epoch:
                self._stop_decoding(request, step + 1)
                finished.append(request)
        self._chunks = []
        self.step_index += 1
        # The API server detokenizes and frames the step's tokens while the next step runs.
        self._frontend_work(now, self.frontend.streamed_s(emitted))
        for request in finished:
            self._finish(request, now)
        return finished

    # ---- scheduling -----------------------------------------------------------------------

    def _schedule_decodes(self) -> bool:
        """Decoding requests that reach a block boundary this step take a block, in running
        order; returns whether any request was preempted."""
        step, preempted = self.step_index, False
        events = self._block_events
        while events and events[0][0] == step:
            _, _, epoch, request = heapq.heappop(events)
            if request.epoch != epoch:
                continue
            self._register(request, request.base + step + 1)
            if not self._make_room(request, 1):
                preempted = True
                continue
            self.pool.allocate(1)
            request.num_blocks += 1
            heapq.heappush(events, (step + self.block_size, request.order, request.epoch, request))
        return preempted

    def _admit_waiting(self, now: float, budget: int) -> None:
        index = 0
        while budget > 0 and index < len(self.waiting) and len(self.running) < self.shape.max_num_seqs:
            request = self.waiting[index]
            if request.ready_s is not None:
                if request.ready_s > now:
                    index += 1  # its host-tier load is in flight: it keeps its place
                    continue
                request.ready_s = None
                self._register(request, request.computed_tokens)
            if request.computed_tokens == 0:
                if not self._admit_from_cache(request, now, budget):
                    if index == 0 and self._give_back_held_blocks(now):
                        continue
                    break
                if request.ready_s is not None:
                    index += 1
                    continue
            chunk = min(request.num_tokens - request.computed_tokens, budget)
            need = cdiv(request.computed_tokens + chunk, self.block_size) - request.num_blocks
            if need > self.pool.num_free:
                if index == 0 and self._give_back_held_blocks(now):
                    continue
                break
            del self.waiting[index]
            if request.scheduled_s is None:
                request.scheduled_s = now
            self._orders += 1
            request.order = self._orders
            self.running.append(request)
            self._prefilling.append(request)
            self._extend(request, chunk)
            budget -= chunk

    def _give_back_held_blocks(self, now: float) -> bool:
        """The waiting head does not fit while nothing runs or is pinned, so no block will ever be
        freed for it: the waiting requests behind it that hold blocks (their host-tier loads) give
        them back, what landed cached, and load again when their turn comes. Whether any did."""
        if self.running or self._pinned:
            return False
        holders = [request for request in self.waiting[1:] if request.num_blocks]
        for request in holders:
            if request.ready_s is not None and request.ready_s > now:
                request.computed_tokens = request.registered_blocks * self.block_size  # nothing landed
            request.ready_s = None
            self._release_blocks(request)
            request.computed_tokens = 0
        return bool(holders)

    def _admit_from_cache(self, request: Request, now: float, budget: int) -> bool:
        """Look the request's prefix up (device, then host) and adopt the hits; False when the
        blocks its first chunk needs are not free (it stays at the head, uncounted)."""
        size = self.block_size
        hashable = (request.num_tokens - 1) // size  # the last token is always computed
        hits = self.pool.cache_hits(request.stream.block_runs(0, hashable))
        host_blocks = 0
        if self.pool.host is not None and hits < hashable:
            host_blocks = self.pool.host.hits(request.stream.block_hashes(hits, hashable))
        computed = (hits + host_blocks) * size
        if host_blocks:
            need = host_blocks  # the load fills whole blocks; its prefill is scheduled later
        elif self.shape.reserve_full_sequence:
            need = cdiv(min(request.num_tokens, self.shape.max_model_len), size) - hits
        else:
            first_chunk = min(request.num_tokens - computed, budget)
            need = cdiv(computed + first_chunk, size) - hits
        hit_runs = request.stream.block_runs(0, hits)
        if need + hits - self.pool.held(hit_runs) > self.pool.num_free:
            return False
        self.pool.take(hit_runs)
        if self._pinned and request.program in self._pinned:
            self.counters.pin_hits += 1
            self._unpin(request.program)
        self.pool.allocate(host_blocks)
        request.num_blocks = hits + host_blocks
        request.registered_blocks = hits
        request.computed_tokens = computed
        if request.cached_tokens is None:  # as vLLM, the first admission's hits: a preemption's are not counted
            request.cached_tokens = computed
        self._count_lookup(request, hits * size)
        if host_blocks:
            tokens = host_blocks * size
            assert self.transfer_seconds is not None
            seconds = self.transfer_seconds(tokens)
            start = max(now, self._link_free_s)
            self._link_free_s = request.ready_s = start + seconds
            self.counters.host_hit_tokens += tokens
            self.counters.transfer_s += seconds
        return True

    def _count_lookup(self, request: Request, hit_tokens: int) -> None:
        c = self.counters
        if request.preemptions:
            c.preempted_queries += request.num_tokens
            c.preempted_hits += hit_tokens
        else:
            c.prefix_cache_queries += request.num_tokens
            c.prefix_cache_hits += hit_tokens

    def _extend(self, request: Request, chunk: int) -> None:
        """Schedule `chunk` prompt tokens of a request; the caller made room for them."""
        need = cdiv(request.computed_tokens + chunk, self.block_size) - request.num_blocks
        if need > 0:
            self.pool.allocate(need)
            request.num_blocks += need
        self._register(request, request.computed_tokens + chunk)
        self._chunks.append((request, chunk))

    def _make_room(self, request: Request, blocks: int) -> bool:
        """Preempt from the back of the running queue until `blocks` are free; False when
        `request` itself had to go."""
        while blocks > self.pool.num_free:
            if self._pinned:  # pinned KV goes before a running request does
                self._unpin(min(self._pinned, key=lambda program: self._pinned[program][0]))
                continue
            victim = self._victim()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _victim(self) -> Request:
        if self.mode is not None and self.mode.preempt_by_priority:
            return max(self.running, key=queue_key)
        return self.running[-1]

    def _preempt_for_head(self) -> None:
        """The waiting head takes the place of running requests it outranks, until its prompt
        (less what is cached) and a sequence slot are free."""
        head = self.waiting[0]
        hashable = (head.num_tokens - 1) // self.block_size
        need = cdiv(head.num_tokens, self.block_size) - self.pool.cache_hits(head.stream.block_runs(0, hashable))
        while self.running and (need > self.pool.num_free or len(self.running) >= self.shape.max_num_seqs):
            victim = max(self.running, key=queue_key)
            if queue_key(victim) <= queue_key(head):
                return
            self._preempt(victim)

    def _preempt(self, request: Request) -> None:
        if self.running[-1] is request:
            self.running.pop()
        else:
            self.running.remove(request)
        if request.decoding:
            self._stop_decoding(request, self.step_index)
        else:
            self._prefilling.remove(request)
        self._release_blocks(request)
        request.computed_tokens = 0
        request.preemptions += 1
        self.counters.preemptions += 1
        self._enqueue(request, front=True)

    def _start_decoding(self, request: Request, step: int) -> None:
        self._prefilling.remove(request)
        request.decoding = True
        request.base = request.computed_tokens - step
        self._decoders += 1
        self._decoder_base_sum += request.base
        boundary = request.num_blocks * self.block_size - request.base
        last = request.max_tokens + request.prompt_tokens - 2 - request.base
        heapq.heappush(self._block_events, (boundary, request.order, request.epoch, request))
        heapq.heappush(self._finish_events, (last, request.order, request.epoch, request))

    def _stop_decoding(self, request: Request, step: int) -> None:
        """Make a decoding request's implicit progress explicit, as of the start of `step`."""
        request.decoding = False
        request.epoch += 1
        self._decoders -= 1
        self._decoder_base_sum -= request.base
        request.computed_tokens = request.base + step
        request.output_tokens = request.computed_tokens - request.prompt_tokens + 1

    def _register(self, request: Request, tokens: int) -> None:
        """Blocks full of known tokens (of the first `tokens`) serve prefix hits from now on."""
        full = min(tokens, request.num_blocks * self.block_size) // self.block_size
        done = request.registered_blocks
        if full > done:
            request.duplicate_runs += self.pool.register(request.stream.block_runs(done, full))
            request.registered_blocks = full

    def _release_blocks(self, request: Request) -> None:
        self._register(request, request.computed_tokens)
        hashed = request.registered_blocks
        self.pool.free(request.stream.block_runs(0, hashed), request.duplicate_runs, request.num_blocks - hashed)
        request.num_blocks = request.registered_blocks = 0
        request.duplicate_runs = []

    def _finish(self, request: Request, now: float) -> None:
        self.running.remove(request)
        if request in self._prefilling:  # its answer was its prompt's one sampled token
            self._prefilling.remove(request)
        pin_s = 0.0 if self.mode is None or request.program is None else self.mode.finished(request, now, self)
        if pin_s > 0 and request.program is not None:
            if request.program in self._pinned:
                self._unpin(request.program)
            self._register(request, request.computed_tokens)
            self._pinned[request.program] = (now + pin_s, request)
            self.counters.pins += 1
        else:
            self._release_blocks(request)
        request.finished_s = now
        self.counters.finished += 1
        if request.on_finish is not None:
            request.on_finish(request)

    def _unpin(self, program: str) -> None:
        _, request = self._pinned.pop(program)
        self._release_blocks(request)

    def _expire_pins(self, now: float) -> None:
        for program in [p for p, (expiry, _) in self._pinned.items() if expiry <= now]:
            self._unpin(program)

    def _load(self) -> StepLoad:
        decode_context = self._decoder_base_sum + self._decoders * (self.step_index + 1)
        tokens, pairs, context = self._decoders, decode_context, decode_context
        for request, chunk in self._chunks:
            offset = request.computed_tokens
            tokens += chunk
            pairs += chunk * offset + chunk * (chunk + 1) // 2
            context += offset + chunk
        return StepLoad(
            scheduled_tokens=tokens, num_seqs=self._decoders + len(self._chunks),
            attention_pairs=pairs, context_tokens=context,
        )  # fmt: skip
