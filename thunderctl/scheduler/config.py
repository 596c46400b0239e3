"""The scheduler's knobs, validated: thresholds, ticks, the admission law and priced retention."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

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
        "fixed wait_bound_s (docs/evidence/removed-laws.md)"
        for key in ("wait_bound_factor", "wait_bound_min_s", "wait_bound_window", "wait_bound_min_samples")
    },
}

# The paper's policy, where it differs from the defaults; docs/scheduler.md's table says why they differ.
REFERENCE_SETTINGS: dict[str, Any] = {
    "adaptive": False,
    "retention": False,
    "resume_aging_tokens_per_s": None,
    "pause_order": PauseOrder.SHORTEST,
    "placement": PlacementRule.ROOMIEST,
    "wait_bound_s": None,
    "pause_target": 0.85,
    "critical_path": False,
}


class SchedulerConfig(BaseModel):
    """Knobs of the policy; fractions are of a worker's KV capacity."""

    model_config = {"extra": "forbid"}

    policy: Policy = Field(
        Policy.DEFAULT,
        description="where the settings not given come from: thunderctl's defaults, or the ThunderAgent paper's "
        "policy (reference: " + ", ".join(REFERENCE_SETTINGS) + " as the paper has them)",
    )
    tick_interval_s: float = Field(5.0, gt=0, description="seconds between scheduler ticks")
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
    resume_timeout_s: float = Field(
        600.0, gt=0, description="seconds a waiting request waits before its program is forced back in"
    )
    end_floor_s: float = Field(
        30.0, gt=0, description="a program never released ends no sooner than this after its last answer"
    )
    end_quantile: float = Field(
        1.0, gt=0, le=1, description="share of the recent continuation gaps (answer → next request) waited for"
    )
    end_margin: float = Field(
        3.0, ge=1, description="a silent program ends after this many times the gap it is expected back within"
    )
    end_gap_window: int = Field(
        4096, ge=1, description="recent continuation gaps of the cluster kept for the longest, which ending waits for"
    )
    end_likely_odds: float = Field(
        2.0, gt=0, description="a silent program gives up its room once this many times likelier ended than continued"
    )
    end_chance_window: int = Field(
        1024, ge=1, description="recent answers of unreleased programs the chance of their continuation is read from"
    )
    end_unlearnt_s: float = Field(
        900.0, gt=0, description="silence after which a program ends while too few continuation gaps are known"
    )
    acting_decay: Decay = Field(
        Decay.OFF, description="how an ACTING reservation shrinks with time in its tool (resume side)"
    )
    acting_decay_tau_s: float = Field(30.0, gt=0, description="the decay's time constant, seconds")
    acting_overbook: float = Field(
        1.0, ge=0, le=1, description="weight of an ACTING reservation on the resume side (the ceiling when adaptive)"
    )
    adaptive: bool = Field(True, description="seek the ACTING weight that gives the most steps/s (docs/admission.md)")
    acting_weight_min: float = Field(
        0.0, ge=0, le=1, description="the adaptive ladder's lowest ACTING weight (the rung before the open gate)"
    )
    adapt_utilization_low: float = Field(
        0.80, gt=0, le=1, description="workers busy less than this while requests wait: admit more"
    )
    adapt_step: float = Field(0.5, gt=0, le=1, description="ACTING weight between rungs of the ladder")
    adapt_window_s: float = Field(15.0, gt=0, description="seconds of steps/s measured per move")
    adapt_settle_s: float = Field(10.0, ge=0, description="seconds not measured after a move")
    adapt_tolerance: float = Field(0.1, ge=0, lt=1, description="change of steps/s taken as level")
    adapt_probe_windows: int = Field(8, ge=1, description="windows before a neighbouring rung is measured again")
    adapt_open_gate: bool = Field(
        True, description="last rung: no gate, the engine admits by its own KV cache (vLLM alone)"
    )
    retention: bool = Field(
        True, description="pause an ACTING program while others wait when keeping its KV costs more than its re-prefill"
    )
    retention_price_scale: float = Field(1.0, gt=0, description="multiplies the price of KV held while others wait")
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
    resume_aging_tokens_per_s: float | None = Field(
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
        16, ge=1, description="programs (ended or running) seen before nearest_end_s orders anything"
    )
    critical_path: bool = Field(
        True,
        description="while programs belong to groups (a batch), those with the most expected work left "
        "(steps left, from their group's lengths, × their pace) resume first and pause last, so that the batch's "
        'longest samples do not wait behind short ones (docs/admission.md, "The critical path first")',
    )
    groups_remembered: int = Field(
        1024, ge=0, description="groups whose programs all ended kept for their counts (status, /programs)"
    )
    pause_order: PauseOrder = Field(
        PauseOrder.LONGEST_IN_TOOL, description="which ACTING programs an overfull worker pauses first"
    )
    placement: PlacementRule = Field(
        PlacementRule.AFFINITY, description="which worker a program that fits on several is placed on"
    )
    wait_bound_s: float | None = Field(
        400.0,
        gt=0,
        description="the longest wait before ACTING programs pause (pause_order) to give a waiting program room, "
        "unless resume_timeout_s comes first; none: no bound, only the forced resume ends a wait",
    )
    stall_timeout_s: float = Field(
        30.0, gt=0, description="a worker with requests in flight and no progress for this long is taken out as stalled"
    )

    @model_validator(mode="before")
    @classmethod
    def _policy_gives_the_rest(cls, data: Any) -> Any:
        given = data if isinstance(data, dict) else {}
        removed = [f"{key} was removed: {why}; delete it" for key, why in REMOVED_SETTINGS.items() if key in given]
        if removed:
            raise ValueError("; ".join(removed))
        if isinstance(data, dict) and data.get("policy") == Policy.REFERENCE:
            return REFERENCE_SETTINGS | data
        return data

    @classmethod
    def reference(cls, **settings: Any) -> SchedulerConfig:
        """The ThunderAgent paper's policy, with `settings` changed."""
        return cls(policy=Policy.REFERENCE, **settings)

    @model_validator(mode="after")
    def _bands_are_ordered(self) -> SchedulerConfig:
        if not self.pause_target < self.pause_threshold:
            raise ValueError(
                f"pause_target ({self.pause_target}) must be below pause_threshold "
                f"({self.pause_threshold}), or pausing never gets usage back under the threshold"
            )
        if not self.resume_threshold < self.pause_threshold:
            raise ValueError(
                f"resume_threshold ({self.resume_threshold}) must be below pause_threshold "
                f"({self.pause_threshold}), or a resumed program is paused again at once"
            )
        return self
