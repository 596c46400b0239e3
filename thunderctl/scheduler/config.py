"""The scheduler's settings, validated, in one section per law: admission (the band and what is
charged), the adaptive admission law, priced retention, ending, and the waiting queue."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, ClassVar

from pydantic import BaseModel, Field, model_validator


class Decay(StrEnum):
    OFF = "off"
    EXP = "exp"
    LINEAR = "linear"


class PauseOrder(StrEnum):
    SHORTEST = "shortest"  # the reference: the smallest ACTING program first
    LONGEST_IN_TOOL = "longest-in-tool"  # the one whose KV the engine's LRU evicts first; ties shortest first


class PlacementRule(StrEnum):
    ROOMIEST = "roomiest"  # the reference: the worker with the most headroom that fits
    AFFINITY = "affinity"  # where its KV is (last worker, else its hash home) while nobody else waits


class Policy(StrEnum):
    DEFAULT = "default"  # thunderctl's
    REFERENCE = "reference"  # the ThunderAgent paper's (arXiv 2602.13692)


# Settings removed because they never helped where measured (docs/evidence/removed-laws.md): a
# profile that still sets one is told so, not given pydantic's bare "extra inputs are not permitted".
REMOVED_SETTINGS = {
    "group_head_start_s": "the group head start never shortened a batch (docs/evidence/removed-laws.md)",
    **{
        key: "the wait bound that followed the waits made no more steps and ended no more programs than the "
        "fixed waits.bound_s (docs/evidence/removed-laws.md)"
        for key in ("wait_bound_factor", "wait_bound_min_s", "wait_bound_window", "wait_bound_min_samples")
    },
}

# The paper's policy, where it differs from the defaults; docs/scheduler.md's table says why they differ.
REFERENCE_SETTINGS: dict[str, Any] = {
    "adaptive.enabled": False,
    "retention.enabled": False,
    "waits.aging_tokens_per_s": None,
    "waits.bound_s": None,
    "waits.critical_path": False,
    "admission.pause_order": PauseOrder.SHORTEST,
    "admission.pause_target": 0.85,
    "placement": PlacementRule.ROOMIEST,
}


class Section(BaseModel):
    model_config = {"extra": "forbid"}


class Admission(Section):
    """The band: when a worker is full, and what a program is charged (fractions of a worker's KV capacity)."""

    pause_threshold: float = Field(
        0.95, gt=0, le=1.5, description="a worker whose reserved KV exceeds this share of its capacity pauses programs"
    )
    pause_target: float = Field(
        0.90, gt=0, le=1.5, description="the share of capacity an overfull worker pauses down to"
    )
    resume_threshold: float = Field(
        0.90, gt=0, le=1.5, description="programs resume while a worker's reserved KV stays within this share"
    )
    buffer_tokens: int = Field(256, ge=0, description="decode headroom charged per program")
    pause_order: PauseOrder = Field(
        PauseOrder.LONGEST_IN_TOOL, description="which ACTING programs an overfull worker pauses first"
    )
    acting_overbook: float = Field(
        1.0, ge=0, le=1, description="weight of an ACTING reservation on the resume side (the ceiling when adaptive)"
    )
    acting_decay: Decay = Field(
        Decay.OFF, description="how an ACTING reservation shrinks with time in its tool (resume side)"
    )
    acting_decay_tau_s: float = Field(30.0, gt=0, description="the decay's time constant, seconds")

    @model_validator(mode="after")
    def _bands_are_ordered(self) -> Admission:
        if not self.pause_target < self.pause_threshold:
            raise ValueError(
                f"admission.pause_target ({self.pause_target}) must be below admission.pause_threshold "
                f"({self.pause_threshold}), or pausing never gets usage back under the threshold"
            )
        if not self.resume_threshold < self.pause_threshold:
            raise ValueError(
                f"admission.resume_threshold ({self.resume_threshold}) must be below admission.pause_threshold "
                f"({self.pause_threshold}), or a resumed program is paused again at once"
            )
        return self


class Adaptive(Section):
    """The adaptive admission law: the ACTING weight that gives the most steps/s (docs/admission.md)."""

    enabled: bool = Field(True, description="seek the ACTING weight rung by rung; off: admission.acting_overbook")
    weight_min: float = Field(
        0.0, ge=0, le=1, description="the ladder's lowest ACTING weight (the rung before the open gate)"
    )
    utilization_low: float = Field(
        0.80, gt=0, le=1, description="workers busy less than this while requests wait: admit more"
    )
    step: float = Field(0.5, gt=0, le=1, description="ACTING weight between rungs of the ladder")
    window_s: float = Field(15.0, gt=0, description="seconds of steps/s measured per move")
    settle_s: float = Field(10.0, ge=0, description="seconds not measured after a move")
    tolerance: float = Field(0.1, ge=0, lt=1, description="change of steps/s taken as level")
    probe_windows: int = Field(8, ge=1, description="windows before a neighbouring rung is measured again")
    open_gate: bool = Field(True, description="last rung: no gate, the engine admits by its own KV cache (vLLM alone)")


class Retention(Section):
    """Priced retention: an ACTING program's KV against its re-prefill while others wait (docs/admission.md)."""

    enabled: bool = Field(
        True, description="pause an ACTING program while others wait when keeping its KV costs more than its re-prefill"
    )
    price_scale: float = Field(1.0, gt=0, description="multiplies the price of KV held while others wait")
    prefill_tokens_per_s: float = Field(
        10_000.0, gt=0, description="re-prefill rate until the engines' own is measured (uncached tokens / TTFT)"
    )
    host_transfer_tokens_per_s: float = Field(
        500_000.0,
        gt=0,
        description="KV tokens per second a host tier loads back to the GPU (PCIe ≈ 63 GB/s per GPU "
        "÷ KV bytes per token per GPU): what a paused program's return costs on a worker with one",
    )
    tool_time_window: int = Field(256, ge=1, description="recent tool times kept per program, tool kind and cluster")
    tool_time_min_samples: int = Field(8, ge=1, description="tool times longer than the elapsed one to trust a key")


class Ending(Section):
    """When a program nobody releases ends: the continuation law (docs/scheduler.md, "Ending")."""

    floor_s: float = Field(
        30.0, gt=0, description="a program never released ends no sooner than this after its last answer"
    )
    quantile: float = Field(
        1.0, gt=0, le=1, description="share of the recent continuation gaps (answer → next request) waited for"
    )
    margin: float = Field(
        3.0, ge=1, description="a silent program ends after this many times the gap it is expected back within"
    )
    gap_window: int = Field(
        4096, ge=1, description="recent continuation gaps of the cluster kept for the longest, which ending waits for"
    )
    likely_odds: float = Field(
        2.0, gt=0, description="a silent program gives up its room once this many times likelier ended than continued"
    )
    chance_window: int = Field(
        1024, ge=1, description="recent answers of unreleased programs the chance of their continuation is read from"
    )
    unlearnt_s: float = Field(
        900.0, gt=0, description="silence after which a program ends while too few continuation gaps are known"
    )


class Waits(Section):
    """The waiting queue: who resumes first, and how long a wait may last."""

    forced_resume_s: float = Field(
        600.0, gt=0, description="seconds a waiting request waits before its program is forced back in"
    )
    bound_s: float | None = Field(
        400.0,
        gt=0,
        description="the longest wait before ACTING programs pause (admission.pause_order) to give a waiting program "
        "room, unless waits.forced_resume_s comes first; none: no bound, only the forced resume ends a wait",
    )
    aging_tokens_per_s: float | None = Field(
        150.0,
        gt=0,
        description="a waiting program's place: when it began waiting + its tokens / this; "
        "none: shortest first, new programs last (the reference order, unbounded waits)",
    )
    new_program_delay_s: float = Field(60.0, ge=0, description="how far behind paused programs a new one queues")
    nearest_end_s: float | None = Field(
        None,
        gt=0,
        description="nearest the end first: a waiting program queues this many seconds times its expected share "
        "of steps left (from the lengths of programs that ended and the steps of those running) behind one "
        "expected to end now: a fresh program waits at most this much longer than an old one of its size "
        '(300 measured; docs/admission.md, "Nearest the end first"); none: off (the default)',
    )
    nearest_end_window: int = Field(256, ge=1, description="lengths (steps) of the programs that ended lately kept")
    nearest_end_min_samples: int = Field(
        16, ge=1, description="programs (ended or running) seen before waits.nearest_end_s orders anything"
    )
    critical_path: bool = Field(
        True,
        description="while programs belong to groups (a batch), those with the most expected work left "
        "(steps left, from their group's lengths, × their pace) resume first and pause last, so that the batch's "
        'longest samples do not wait behind short ones (docs/admission.md, "The critical path first")',
    )


SECTIONS: dict[str, type[Section]] = {
    "admission": Admission,
    "adaptive": Adaptive,
    "retention": Retention,
    "ending": Ending,
    "waits": Waits,
}

# The flat keys of the release before the sections, read for one more release with a warning.
RENAMED: dict[str, str] = {
    "pause_threshold": "admission.pause_threshold",
    "pause_target": "admission.pause_target",
    "resume_threshold": "admission.resume_threshold",
    "buffer_tokens": "admission.buffer_tokens",
    "pause_order": "admission.pause_order",
    "acting_overbook": "admission.acting_overbook",
    "acting_decay": "admission.acting_decay",
    "acting_decay_tau_s": "admission.acting_decay_tau_s",
    "adaptive": "adaptive.enabled",
    "acting_weight_min": "adaptive.weight_min",
    "adapt_utilization_low": "adaptive.utilization_low",
    "adapt_step": "adaptive.step",
    "adapt_window_s": "adaptive.window_s",
    "adapt_settle_s": "adaptive.settle_s",
    "adapt_tolerance": "adaptive.tolerance",
    "adapt_probe_windows": "adaptive.probe_windows",
    "adapt_open_gate": "adaptive.open_gate",
    "retention": "retention.enabled",
    "retention_price_scale": "retention.price_scale",
    "prefill_tokens_per_s": "retention.prefill_tokens_per_s",
    "host_transfer_tokens_per_s": "retention.host_transfer_tokens_per_s",
    "tool_time_window": "retention.tool_time_window",
    "tool_time_min_samples": "retention.tool_time_min_samples",
    "end_floor_s": "ending.floor_s",
    "end_quantile": "ending.quantile",
    "end_margin": "ending.margin",
    "end_gap_window": "ending.gap_window",
    "end_likely_odds": "ending.likely_odds",
    "end_chance_window": "ending.chance_window",
    "end_unlearnt_s": "ending.unlearnt_s",
    "resume_timeout_s": "waits.forced_resume_s",
    "wait_bound_s": "waits.bound_s",
    "resume_aging_tokens_per_s": "waits.aging_tokens_per_s",
    "new_program_delay_s": "waits.new_program_delay_s",
    "nearest_end_s": "waits.nearest_end_s",
    "nearest_end_window": "waits.nearest_end_window",
    "nearest_end_min_samples": "waits.nearest_end_min_samples",
    "critical_path": "waits.critical_path",
}


def nested(settings: Mapping[str, Any]) -> dict[str, Any]:
    """`{"ending.floor_s": 60}` as `{"ending": {"floor_s": 60}}`, merged with sections given whole; a
    flat key of the release before (`end_floor_s`) is read as today's, with a warning."""
    out: dict[str, Any] = {}
    for given, value in settings.items():
        key = _current_key(given, value)
        if isinstance(value, BaseModel):
            value = value.model_dump(exclude_unset=True)
        section, dot, name = key.partition(".")
        if dot:
            key, value = section, {name: value}
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, section by section (both nested)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class SchedulerConfig(BaseModel):
    """The policy's settings: a few of the scheduler's own, then one section per law."""

    model_config = {"extra": "forbid"}
    renamed: ClassVar[dict[str, str]] = RENAMED

    policy: Policy = Field(
        Policy.DEFAULT,
        description="where the settings not given come from: thunderctl's defaults, or the ThunderAgent paper's "
        "policy (reference: " + ", ".join(REFERENCE_SETTINGS) + " as the paper has them)",
    )
    tick_interval_s: float = Field(5.0, gt=0, description="seconds between scheduler ticks")
    placement: PlacementRule = Field(
        PlacementRule.AFFINITY, description="which worker a program that fits on several is placed on"
    )
    stall_timeout_s: float = Field(
        30.0, gt=0, description="a worker with requests in flight and no progress for this long is taken out as stalled"
    )
    groups_remembered: int = Field(
        1024, ge=0, description="groups whose programs all ended kept for their counts (status, /programs)"
    )
    admission: Admission = Field(default_factory=Admission)
    adaptive: Adaptive = Field(default_factory=Adaptive)
    retention: Retention = Field(default_factory=Retention)
    ending: Ending = Field(default_factory=Ending)
    waits: Waits = Field(default_factory=Waits)

    @model_validator(mode="before")
    @classmethod
    def _policy_gives_the_rest(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        removed = [f"{key} was removed: {why}; delete it" for key, why in REMOVED_SETTINGS.items() if key in data]
        if removed:
            raise ValueError("; ".join(removed))
        data = nested(data)
        if data.get("policy") == Policy.REFERENCE:
            return merged(nested(REFERENCE_SETTINGS), data)
        return data

    @classmethod
    def reference(cls, **settings: Any) -> SchedulerConfig:
        """The ThunderAgent paper's policy, with `settings` changed (sections as dicts, or dotted keys via **)."""
        return cls(policy=Policy.REFERENCE, **settings)


def _current_key(key: str, value: Any) -> str:
    """A key as today's sections spell it; a flat key of the release before is read with a warning."""
    new = RENAMED.get(key)
    if new is None or (key in SECTIONS and isinstance(value, dict | BaseModel)):
        return key
    warnings.warn(
        f"scheduler setting {key} is now {new}: write it under the {new.split('.')[0]} section "
        f"(scheduler: {{{new.split('.')[0]}: {{{new.split('.')[1]}: ...}}}}) or as --scheduler {new}=...; "
        "the flat key is read for one more release",
        FutureWarning,
        stacklevel=2,
    )
    return new
