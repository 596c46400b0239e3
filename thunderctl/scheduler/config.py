"""The scheduler's knobs, validated: thresholds, ticks, the admission law and priced retention."""

from __future__ import annotations

from enum import StrEnum

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


class SchedulerConfig(BaseModel):
    """Knobs of the policy; fractions are of a worker's KV capacity."""

    model_config = {"extra": "forbid"}

    tick_interval_s: float = Field(5.0, gt=0)
    pause_threshold: float = Field(0.95, gt=0, le=1.5)
    pause_target: float = Field(0.90, gt=0, le=1.5)
    resume_threshold: float = Field(0.90, gt=0, le=1.5)
    buffer_tokens: int = Field(256, ge=0, description="decode headroom charged per program")
    resume_timeout_s: float = Field(600.0, gt=0)
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
    end_unlearnt_s: float = Field(
        900.0, gt=0, description="silence after which a program ends while too few continuation gaps are known"
    )
    acting_decay: Decay = Decay.OFF
    acting_decay_tau_s: float = Field(30.0, gt=0)
    acting_overbook: float = Field(1.0, ge=0, le=1, description="weight of an ACTING reservation on the resume side")
    adaptive: bool = Field(True, description="seek the ACTING weight that gives the most steps/s")
    acting_weight_min: float = Field(0.0, ge=0, le=1)
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
        "None: shortest first, new programs last (the reference order, unbounded waits)",
    )
    new_program_delay_s: float = Field(60.0, ge=0, description="how far behind paused programs a new one queues")
    pause_order: PauseOrder = Field(
        PauseOrder.LONGEST_IN_TOOL, description="which ACTING programs an overfull worker pauses first"
    )
    placement: PlacementRule = Field(
        PlacementRule.AFFINITY, description="which worker a program that fits on several is placed on"
    )
    wait_bound_s: float | None = Field(
        400.0,
        gt=0,
        description="a program that waited this long gets room at once: ACTING programs pause for it "
        "(pause_order), unless resume_timeout_s comes first; None: only the forced resume bounds a wait",
    )
    stall_timeout_s: float = Field(
        30.0, gt=0, description="a worker with requests in flight and no progress for this long is taken out as stalled"
    )

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
