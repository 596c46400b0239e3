"""Engine step time: what one continuous-batching step computes, and what a preset says it costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StepLoad:
    """What one engine step computes, summed over the sequences in it."""

    scheduled_tokens: int  # prefill-chunk tokens plus one token per decoding sequence
    num_seqs: int
    # (query, key) pairs attended: a chunk of n tokens at offset c adds n·c + n(n+1)/2
    attention_pairs: int
    # KV tokens the step reads: each sequence's context length after the step, summed
    context_tokens: int


class CostModel(Protocol):
    def step_seconds(self, load: StepLoad) -> float:
        """Wall time of one engine step that computes `load`."""
        ...


@dataclass(frozen=True)
class EngineShape:
    """The vLLM settings that bound a step and the KV cache of one worker."""

    num_gpu_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


@dataclass(frozen=True)
class Preset:
    """A worker (model × hardware) the simulator can stand in for."""

    name: str
    summary: str
    cost: CostModel
    engine: EngineShape
    kv_bytes_per_token: int  # one worker's KV bytes per token, over all its GPUs
    host_link_bytes_per_s: float  # host ↔ GPU, what a host-tier hit moves its blocks over

    def transfer_seconds(self, tokens: int) -> float:
        """Time to bring `tokens` of KV from the host tier back to the GPU."""
        return tokens * self.kv_bytes_per_token / self.host_link_bytes_per_s
