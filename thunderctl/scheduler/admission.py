"""How much of the ACTING reservations to honour: the adaptive admission law of
docs/admission.md, pure and driven by the scheduler's tick."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from thunderctl.scheduler.config import SchedulerConfig

OPEN = None  # the last rung: no gate at all, the engine admits by its own KV cache


def admission_levels(config: SchedulerConfig) -> list[float | None]:
    """ACTING weights from full protection down, then (optionally) the open gate."""
    levels: list[float | None] = []
    weight = config.admission.acting_overbook
    while weight > config.adaptive.weight_min + 1e-9:
        levels.append(round(weight, 6))
        weight -= config.adaptive.step
    levels.append(config.adaptive.weight_min)
    if config.adaptive.open_gate:
        levels.append(OPEN)
    return levels


@dataclass(frozen=True)
class Measurement:
    steps_per_s: float
    window: int  # the law's count of windows with load when it was taken


@dataclass
class AdmissionTuner:
    """Seeks, on a ladder of admission levels, the one that gives the most steps per second.

    Rungs, from the most protective: ACTING weights `acting_overbook`, `- adapt_step`, ...,
    `acting_weight_min`, then the open gate. Whether more admission adds steps or only
    recompute cannot be read off utilisation, so it is measured, one rung at a time:

    - every `adapt_window_s` in which requests waited for admission (or, behind the open
      gate, any step was served), the steps/s of the rung are recorded;
    - the law moves to a neighbouring rung measured better by more than `adapt_tolerance`,
      or measured level with it and keeping more cache (ties go to the cache; weight 0,
      which keeps none, gives way to the open gate);
    - when the rung it is on is the best known, it probes a neighbour that was never measured
      or not for `adapt_probe_windows` windows, so a changed load is noticed; each probe that
      finds the neighbour no better doubles that wait (up to 4x), so a settled load pays for
      few probes; a probe that wins by more than twice the tolerance is kept for
      `adapt_probe_windows` before the next probe, as a confirmed rung is;
    - a tick through which requests waited while the workers were busy less than
      `adapt_utilization_low` of the time goes one rung down at once: reservations held
      capacity that nobody used, nothing needs measuring. The rung left counts as measured
      at 0 steps/s until that reading is stale.

    The two ends of the ladder are neighbours too: full protection and the engine alone are
    the two policies a user weighs, so each is one probe from the other, and the first probe
    from the top goes to the open gate. Where protection does not pay, the law is there after
    one window rather than after one per rung.

    After a move, and when load arrives after a quiet spell, `adaptive.settle_s` pass uncounted
    before the next window starts: the programs admitted or held back reach the engine's pace
    first (a backlog draining right after a move would credit the move with steps its
    steady state does not make). Windows in which nobody waited (and the gate was shut) move
    nothing: the level constrains nothing then. A window is measured up to its last tick with
    load, and not at all when the load ended in its first half: the steps a load does not
    send say nothing about the rung.
    """

    config: SchedulerConfig
    levels: list[float | None] = field(init=False)
    rung: int = 0
    measured: dict[int, Measurement] = field(default_factory=dict)
    patience: dict[int, int] = field(default_factory=dict)  # windows before a rung is probed again
    windows: int = 0  # windows with load measured so far
    _probed_from: int | None = None
    # The window in which a probe won by more than twice the tolerance: from there the law
    # probes further only after `adaptive.probe_windows`, as from a rung a probe confirmed.
    _won_at: int | None = None
    _quiet: bool = True  # no load in the last window: the next load is just arriving
    _window_start: float = 0.0
    _window_steps: int = 0
    # The time and step count of the last tick with load; at the window's start while it had none.
    _last_load: tuple[float, int] = (0.0, 0)
    _started: bool = False
    # Set by the scheduler from priced retention (retention.py): keeping an ACTING program's
    # KV through its expected tool time costs less than recomputing it, even at the full price
    # of KV. Then the top rung is not left on a probe; only starved engines move it.
    retention_pays: bool = False
    # What the scheduler saw since the end of its last period (`end_period`).
    arrived: bool = False  # a request arrived: the load behind an open gate
    waited: bool = False  # a request waited for admission
    _waiting_at_end: bool = False

    def __post_init__(self) -> None:
        self.levels = admission_levels(self.config)

    @property
    def level(self) -> float | None:
        return self.levels[self.rung]

    @property
    def gate_open(self) -> bool:
        return self.level is OPEN

    @property
    def weight(self) -> float:
        return self.config.adaptive.weight_min if self.level is OPEN else self.level

    @property
    def label(self) -> str:
        return "open gate" if self.level is OPEN else f"ACTING weight {self.level:g}"

    def snapshot(self) -> dict[str, Any]:
        """Where it is on the ladder and what it measured there, JSON-ready; times in the scheduler's clock."""
        return {
            "levels": self.levels, "rung": self.rung, "windows": self.windows,
            "measured": [[rung, m.steps_per_s, m.window] for rung, m in self.measured.items()],
            "patience": [[rung, windows] for rung, windows in self.patience.items()],
            "probed_from": self._probed_from, "won_at": self._won_at, "quiet": self._quiet,
            "window_start": self._window_start, "window_steps": self._window_steps,
            "last_load": list(self._last_load), "started": self._started, "retention_pays": self.retention_pays,
        }  # fmt: skip

    def restore(self, snapshot: dict[str, Any], shift_s: float) -> None:
        """Back where `snapshot` was, its times moved by `shift_s` into this clock; a ladder of other
        rungs (its settings changed) starts afresh, as nothing measured on it holds."""
        if snapshot["levels"] != self.levels:
            return
        self.rung, self.windows = snapshot["rung"], snapshot["windows"]
        self.measured = {rung: Measurement(rate, window) for rung, rate, window in snapshot["measured"]}
        self.patience = {rung: windows for rung, windows in snapshot["patience"]}
        self._probed_from, self._won_at, self._quiet = snapshot["probed_from"], snapshot["won_at"], snapshot["quiet"]
        self._window_start, self._window_steps = snapshot["window_start"] + shift_s, snapshot["window_steps"]
        load_at, load_steps = snapshot["last_load"]
        self._last_load = (load_at + shift_s, load_steps)
        self._started, self.retention_pays = snapshot["started"], snapshot["retention_pays"]

    def end_period(self, now: float, steps: int, utilization: float, waiting: bool) -> None:
        """The end of one of the scheduler's periods (`Scheduler.adapt`): `waiting`, whether a
        request waits now; the law moves when it is enabled."""
        waited, throughout, arrived = self.waited or waiting, waiting and self._waiting_at_end, self.arrived
        self.waited, self._waiting_at_end, self.arrived = False, waiting, False
        if self.config.adaptive.enabled:
            self.observe(now, steps, utilization, waited, throughout, arrived)

    def observe(
        self,
        now: float,
        steps: int,
        utilization: float,
        waited: bool,
        waited_throughout: bool = False,
        arrived: bool = False,
    ) -> None:
        """One tick: `steps` is the running count of responses; `waited`, whether a request
        waited for admission during the tick; `waited_throughout`, whether the queue was
        never empty in it (only then does idleness of the workers mean the gate starved them,
        rather than a load that is just arriving); `arrived`, whether any request arrived in it."""
        cfg = self.config
        if not self._started:
            self._started = True
            self._begin(now, steps)
        if waited_throughout and utilization < cfg.adaptive.utilization_low:
            # Starving the engines is the worst a rung can do: it is not probed again until
            # this reading is stale.
            self.measured[self.rung] = Measurement(0.0, self.windows)
            self._probed_from = None
            self._go(min(self.rung + 1, len(self.levels) - 1), now, steps)
            self._quiet = False
            return
        # Behind an open gate nobody waits: requests arriving are the load. (Not steps: the
        # answers of a load that stopped keep coming for seconds, at a rate that is not the gate's.)
        loaded = waited or (self.gate_open and arrived)
        if loaded and self._quiet:  # a load arriving: let it reach its pace before measuring
            self._quiet = False
            self._begin(now + cfg.adaptive.settle_s, steps)
            return
        if now <= self._window_start:  # settling: the load has not followed the last move yet
            self._window_steps = steps
            return
        if loaded:
            self._last_load = (now, steps)
        elapsed = now - self._window_start
        if elapsed < cfg.adaptive.window_s:
            return
        loaded_s = self._last_load[0] - self._window_start
        if loaded_s < elapsed / 2:  # no load at all (0 s), or it ended in the window's first half
            self._quiet = True
            self._begin(now, steps)
            return
        self.windows += 1
        self._record((self._last_load[1] - self._window_steps) / loaded_s)
        if self._probed_from is not None and self._far_below(self._probed_from, self.rung):
            self._won_at = self.windows  # a probe that won by that much is where the load is
        rung, probing = self._choose()
        if self._probed_from is not None:  # this window was a probe: did it find better?
            if rung == self._probed_from:
                base = cfg.adaptive.probe_windows
                self.patience[self.rung] = min(2 * self.patience.get(self.rung, base), 4 * base)
            else:
                self.patience.clear()
        self._wait_longest_for_far_worse(rung if not probing else self.rung)
        self._probed_from = self.rung if probing else None
        self._go(rung, now, steps)

    def _wait_longest_for_far_worse(self, best: int) -> None:
        """Rungs measured below the best by more than twice the tolerance are probed only at the
        longest wait: a probe costs a window at a rung's deficit, and a gap that wide is not
        noise (on vLLM-CPU's small cache full protection made 0.4x the open gate's steps)."""
        base = self.config.adaptive.probe_windows
        for rung in self.measured:
            if self._far_below(rung, best) and not self._stale(rung):
                self.patience[rung] = 4 * base

    def _far_below(self, rung: int, other: int) -> bool:
        """Whether `rung` measured below `other` by more than twice the tolerance: not noise."""
        floor = 1 - 2 * self.config.adaptive.tolerance
        return self.measured[rung].steps_per_s < self.measured[other].steps_per_s * floor

    def _record(self, steps_per_s: float) -> None:
        last = self.measured.get(self.rung)
        if last is not None and not self._stale(self.rung):
            steps_per_s = (last.steps_per_s + steps_per_s) / 2  # staying: smooth the noise
        self.measured[self.rung] = Measurement(steps_per_s, self.windows)

    def _choose(self) -> tuple[int, bool]:
        """The next rung, and whether going there is a probe."""
        tolerance = self.config.adaptive.tolerance
        count = len(self.levels)
        below, above = (self.rung - 1) % count, (self.rung + 1) % count  # the top's `below` is the gate
        neighbours = [r for r in dict.fromkeys((below, above)) if r != self.rung]
        fresh = [r for r in neighbours if r in self.measured and not self._stale(r)]
        best = self.rung
        for rung in fresh:
            rate, best_rate = self.measured[rung].steps_per_s, self.measured[best].steps_per_s
            level = rate >= best_rate * (1 - tolerance)
            if rate > best_rate * (1 + tolerance) or (level and self._tie_rank(rung) > self._tie_rank(best)):
                best = rung
        if best != self.rung:
            return best, False
        # The wrap is probed downwards only: from the engine alone, full protection is reached a
        # rung at a time, each measured better (a probe of it costs most where the gate won).
        wrap = count - 1 if count > 2 else None
        unmeasured = [r for r in neighbours if r not in fresh and not (self.rung == wrap and r == 0)]
        if self.retention_pays and self.rung == 0:
            return self.rung, False  # priced: full protection is worth it, nothing to probe below
        if self._won_at is not None and self.windows - self._won_at < self.config.adaptive.probe_windows:
            return self.rung, False  # reached by a probe that won by far: it holds a probe interval
        return (unmeasured[0], True) if unmeasured else (self.rung, False)

    def _tie_rank(self, rung: int) -> float:
        """Which of two rungs measured level wins: the one that keeps more cache. A rung of
        weight 0 keeps none (only the requests running are charged); it gives way to the
        open gate, which admits the same way without the gateway's estimates."""
        level = self.levels[rung]
        if level is OPEN:
            return 0.0
        return level if level > 0 else -1.0

    def _stale(self, rung: int) -> bool:
        """Measured more than its patience ago, counted in windows with load (a quiet spell
        does not age a reading: nothing was learnt, nothing changed)."""
        patience = self.patience.get(rung, self.config.adaptive.probe_windows)
        return self.windows - self.measured[rung].window > patience

    def _go(self, rung: int, now: float, steps: int) -> None:
        if rung == self.rung:
            self._begin(now, steps)
            return
        self.rung = rung
        # Programs admitted (or held back) by the move take a while to reach the engine's
        # pace: counting them at once would bias every comparison towards the move.
        self._begin(now + self.config.adaptive.settle_s, steps)

    def _begin(self, start: float, steps: int) -> None:
        self._window_start, self._window_steps, self._last_load = start, steps, (start, steps)
