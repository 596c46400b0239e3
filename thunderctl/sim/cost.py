"""Engine step time: what one continuous-batching step computes, and what a preset says it costs."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import astuple, dataclass, replace
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
    # vLLM's `scheduler_reserve_full_isl` (default on since its V1 scheduler gained it): a waiting
    # request is admitted only when blocks for its whole sequence are free, not just for its
    # first chunk, so a full cache queues new requests instead of preempting running ones.
    reserve_full_sequence: bool = True

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


@dataclass(frozen=True)
class FrontendCost:
    """vLLM's API-server process, outside the engine step: the chat template, tokenizing the
    prompt, detokenizing and framing each output token, HTTP. It runs beside the engine core, one
    piece of work after another (one asyncio process), so it delays answers without taking batch
    slots. All zero: the engine model alone, figure for figure.

    Fitted by benchmarks/fit_frontend.py: what the client waits beyond the engine's prefill and
    decode (per request and per prompt token) and, per output token, the CPU streaming takes.
    """

    per_request_s: float = 0.0
    per_prompt_token_s: float = 0.0
    # Charged as the engine emits each token, step by step, as vLLM's output processor streams
    # them: the answer is out once its last token is framed, and a frontend slower than the
    # engine's steps falls behind.
    per_output_token_s: float = 0.0
    # Where the API server shares the engine's cores (cpu-tiny): the share of the engine's CPU
    # it takes while it has work, so that the engine runs at (1 - share) of its speed meanwhile.
    engine_cpu_share: float = 0.0

    def __post_init__(self) -> None:
        figures = (self.per_request_s, self.per_prompt_token_s, self.per_output_token_s)
        if min(figures) < 0 or not 0 <= self.engine_cpu_share < 1:
            raise ValueError(f"frontend cost {self}: seconds must be >= 0 and engine_cpu_share in [0, 1)")

    def scaled(self, factor: float) -> FrontendCost:
        """The same work on a clock that runs `factor` times the model's seconds (engine sim's --time-scale)."""
        return replace(
            self,
            per_request_s=self.per_request_s * factor,
            per_prompt_token_s=self.per_prompt_token_s * factor,
            per_output_token_s=self.per_output_token_s * factor,
        )

    def before_engine_s(self, prompt_tokens: int) -> float:
        """Work before the engine sees the request: HTTP, chat template, tokenizing the prompt."""
        return self.per_request_s + self.per_prompt_token_s * prompt_tokens

    def streamed_s(self, output_tokens: int) -> float:
        """Work on the tokens one engine step emitted: detokenizing and framing them."""
        return self.per_output_token_s * output_tokens


@dataclass(frozen=True)
class Preset:
    """A worker (model × hardware) the simulator can stand in for."""

    name: str
    summary: str
    cost: CostModel
    engine: EngineShape
    kv_bytes_per_token: int  # one worker's KV bytes per token, over all its GPUs
    host_link_bytes_per_s: float  # host ↔ GPU, what a host-tier hit moves its blocks over
    frontend: FrontendCost = FrontendCost()
    # How many tokens an answer becomes when the client sends it back in the next prompt, per
    # token generated, for a model whose answers do not survive detokenizing and re-tokenizing
    # (other ids): then the next prompt's cache match ends at the block where the answer starts.
    # None: answers come back as generated (a real model's text round-trips).
    answer_retokenized_ratio: float | None = None

    def transfer_seconds(self, tokens: int) -> float:
        """Time to bring `tokens` of KV from the host tier back to the GPU."""
        return tokens * self.kv_bytes_per_token / self.host_link_bytes_per_s

    def prefill_tokens_per_s(self, context_tokens: int) -> float:
        """The rate of prefilling a context of `context_tokens` alone, chunk after chunk: what a
        program that lost its cache costs to recompute."""
        return context_tokens / self.prefill_seconds(context_tokens)

    def prefill_seconds(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Prefilling a prompt alone, its first `cached_tokens` hits, chunk after chunk; the last
        chunk's step samples the first answer token."""
        chunk, done, seconds = self.engine.max_num_batched_tokens, cached_tokens, 0.0
        while done < prompt_tokens:
            n = min(chunk, prompt_tokens - done)
            pairs = n * done + n * (n + 1) // 2
            seconds += self.cost.step_seconds(StepLoad(n, 1, pairs, done + n))
            done += n
        return seconds

    def decode_seconds(self, prompt_tokens: int, answer_tokens: int) -> float:
        """Decoding an answer alone after its prompt: one step per token after the first (which
        the prefill sampled), the j-th reading a context of prompt + j tokens."""

        def step_s(context: int) -> float:
            return self.cost.step_seconds(StepLoad(1, 1, context, context))

        return summed(step_s, prompt_tokens + 1, prompt_tokens + answer_tokens - 1)

    def alone_seconds(self, prompt_tokens: int, cached_tokens: int, answer_tokens: int) -> float:
        """One request on an engine of its own, from the client's send to its whole answer: the API
        server's work on the prompt, the prefill of what is not cached, the decode, and the framing
        of the last token (the others are framed while the next steps run)."""
        return (
            self.frontend.before_engine_s(prompt_tokens)
            + self.prefill_seconds(prompt_tokens, cached_tokens)
            + self.decode_seconds(prompt_tokens, answer_tokens)
            + self.frontend.streamed_s(1)
        )


def summed(f: Callable[[int], float], low: int, high: int) -> float:
    """f(low) + f(low + 1) + ... + f(high) (0 when high < low), for f convex and piecewise linear,
    as a step's time is in the context it reads (a line, or the larger of compute's and memory's):
    exact, in a few calls per kink instead of one per token. A convex function that meets its chord
    inside an interval is that chord over the whole interval, so halving stops at straight pieces."""
    if high < low:
        return 0.0
    total, pending = 0.0, [(low, high, f(low), f(high))]
    while pending:
        a, b, fa, fb = pending.pop()
        if b - a < 2:
            total += fa + (fb if b > a else 0.0)
            continue
        m = (a + b) // 2
        fm = f(m)
        chord = fa + (fb - fa) * (m - a) / (b - a)
        if math.isclose(fm, chord, rel_tol=1e-9, abs_tol=1e-15):
            total += (b - a + 1) * (fa + fb) / 2
            continue
        # [a, m] and [m, b] both count f(m)
        total -= fm
        pending += [(a, m, fa, fm), (m, b, fm, fb)]
    return total


# --- GPU roofline ----------------------------------------------------------------------

GIB = 2**30
ACTIVATION_BYTES = 2  # BF16 hidden states: what a TP all-reduce moves per element


@dataclass(frozen=True)
class Gpu:
    """One accelerator's published peaks (dense, no sparsity)."""

    name: str
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    memory_bytes: int
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # one direction, what a ring all-reduce step can use
    host_link_bytes_per_s: float  # PCIe, one direction

    def tensor_flops_per_s(self, bytes_per_element: float) -> float:
        """One-byte operands run on the FP8 tensor cores (W8A8, as vLLM's FP8 checkpoints do)."""
        return self.fp8_flops_per_s if bytes_per_element <= 1 else self.bf16_flops_per_s


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer's shape, enough for FLOPs and bytes per token."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    total_params: float  # every weight, embeddings and output head included
    # Weights a token multiplies by, without the input embedding (a lookup) and the output
    # head (which vLLM applies only to the one position per sequence that it samples).
    active_body_params: float
    weight_bytes_per_param: float
    kv_bytes_per_element: int
    # MoE: routed experts are read only when some token in the step is routed to them.
    num_experts: int = 0
    experts_per_token: int = 0
    routed_expert_params: float = 0.0

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_bytes_per_param

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def matmul_flops(self, tokens: int, seqs: int) -> float:
        return 2 * self.active_body_params * tokens + 2 * self.head_params * seqs

    def attention_flops(self, attention_pairs: int) -> float:
        # Per (query, key) pair, layer and head: q·k and p·v, head_dim multiply-adds each.
        return 4 * self.num_layers * self.num_heads * self.head_dim * attention_pairs

    def weight_bytes_read(self, tokens: int) -> float:
        """Bytes of weights one step streams from HBM: the dense part and the experts hit."""
        if self.num_experts == 0 or tokens == 0:
            return self.weight_bytes
        # Uniform routing: an expert is missed by all `tokens` with (1 - k/E)^tokens.
        missed = (1 - self.experts_per_token / self.num_experts) ** tokens
        return self.weight_bytes - self.routed_expert_params * missed * self.weight_bytes_per_param


@dataclass(frozen=True)
class Deployment:
    """A model on `tp` GPUs of one kind: one vLLM worker and the KV cache it can hold."""

    model: ModelConfig
    gpu: Gpu
    tp: int
    gpu_memory_utilization: float = 0.9
    # Per GPU, kept out of the KV cache besides the weights: the profiled forward pass at
    # max_num_batched_tokens, the sampler's FP32 logits for max_num_seqs, CUDA graphs, NCCL.
    reserve_bytes_per_gpu: int = 2 * GIB

    @property
    def kv_heads_per_gpu(self) -> int:
        # Fewer KV heads than GPUs: vLLM replicates them, one (or more) per GPU.
        return -(-self.model.num_kv_heads // self.tp)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return self.model.kv_bytes_per_token * self.kv_heads_per_gpu // self.model.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Over all the worker's GPUs: the bytes a host tier stores per token."""
        return self.kv_bytes_per_token_per_gpu * self.tp

    @property
    def kv_bytes_per_gpu(self) -> float:
        budget = self.gpu.memory_bytes * self.gpu_memory_utilization
        return budget - self.model.weight_bytes / self.tp - self.reserve_bytes_per_gpu

    def kv_capacity_tokens(self) -> int:
        if self.kv_bytes_per_gpu <= 0:
            raise ValueError(
                f"{self.model.name} does not fit {self.tp}× {self.gpu.name}: "
                f"{self.model.weight_bytes / self.tp / GIB:.1f} GiB of weights per GPU leave "
                f"{self.kv_bytes_per_gpu / GIB:.1f} GiB for the KV cache; use a larger tp"
            )
        return int(self.kv_bytes_per_gpu // self.kv_bytes_per_token_per_gpu)

    def num_gpu_blocks(self, block_size: int) -> int:
        return self.kv_capacity_tokens() // block_size


@dataclass(frozen=True)
class AllReduce:
    """Time of one TP all-reduce: measured small messages, then NCCL's ring rate per extra byte.

    Continuous and monotonic in the message size, so that a step never gets cheaper by
    growing; the small-message part is a measurement of vLLM's custom all-reduce.
    """

    latency_s: float
    small_message_bytes: int  # up to this size the measured rate applies
    small_message_bytes_per_s: float  # message bytes per second at those sizes
    ring_efficiency: float  # achieved ÷ NVLink bandwidth for NCCL's ring on large messages

    def seconds(self, message_bytes: int, tp: int, gpu: Gpu) -> float:
        small = min(message_bytes, self.small_message_bytes)
        # A ring all-reduce sends 2(tp−1)/tp of the message from every GPU.
        ring_bytes = 2 * (tp - 1) / tp * (message_bytes - small)
        ring_s = ring_bytes / (gpu.nvlink_bytes_per_s * self.ring_efficiency)
        return self.latency_s + small / self.small_message_bytes_per_s + ring_s


@dataclass(frozen=True)
class RooflineCost:
    """Step time of a GPU worker: the slower of compute and HBM traffic, plus all-reduces and overhead.

    Every GPU of the worker does 1/tp of the FLOPs and reads 1/tp of the weights and KV;
    tensor parallelism adds two all-reduces of the hidden states per layer, not overlapped
    with compute (vLLM runs them in line).
    """

    deployment: Deployment
    compute_efficiency: float  # achieved ÷ peak tensor FLOP/s (MFU) in a prefill-heavy step
    memory_efficiency: float  # achieved ÷ peak HBM bandwidth in a decode step
    step_overhead_s: float  # per step: scheduling, input preparation, sampling, launch
    allreduce: AllReduce

    def compute_seconds(self, load: StepLoad) -> float:
        model, gpu, tp = self.deployment.model, self.deployment.gpu, self.deployment.tp
        matmul = model.matmul_flops(load.scheduled_tokens, load.num_seqs)
        matmul_s = matmul / (gpu.tensor_flops_per_s(model.weight_bytes_per_param) * self.compute_efficiency)
        # Attention runs in the KV cache's dtype, whatever the weights are.
        attention = model.attention_flops(load.attention_pairs)
        attention_s = attention / (gpu.tensor_flops_per_s(model.kv_bytes_per_element) * self.compute_efficiency)
        return (matmul_s + attention_s) / tp

    def memory_seconds(self, load: StepLoad) -> float:
        deployment = self.deployment
        kv_bytes = (load.context_tokens + load.scheduled_tokens) * deployment.kv_bytes_per_token_per_gpu
        weight_bytes = deployment.model.weight_bytes_read(load.scheduled_tokens) / deployment.tp
        return (weight_bytes + kv_bytes) / (deployment.gpu.hbm_bytes_per_s * self.memory_efficiency)

    def communication_seconds(self, load: StepLoad) -> float:
        tp = self.deployment.tp
        if tp == 1 or load.scheduled_tokens == 0:
            return 0.0
        model = self.deployment.model
        message = model.hidden_size * load.scheduled_tokens * ACTIVATION_BYTES
        # Two all-reduces of the hidden states per layer: after attention and after the MLP.
        return 2 * model.num_layers * self.allreduce.seconds(message, tp, self.deployment.gpu)

    def step_seconds(self, load: StepLoad) -> float:
        busy = max(self.compute_seconds(load), self.memory_seconds(load))
        return busy + self.communication_seconds(load) + self.step_overhead_s


@dataclass(frozen=True)
class LinearStepCost:
    """A step time fitted to measurements: linear in what the step computes."""

    base_s: float
    per_token_s: float
    per_attention_pair_s: float
    per_seq_s: float
    per_context_token_s: float

    def seconds_over(self, steps: int, summed: StepLoad) -> float:
        """Wall time of `steps` steps whose loads add up to `summed` (the model is linear)."""
        return (
            self.base_s * steps
            + self.per_token_s * summed.scheduled_tokens
            + self.per_attention_pair_s * summed.attention_pairs
            + self.per_seq_s * summed.num_seqs
            + self.per_context_token_s * summed.context_tokens
        )

    def step_seconds(self, load: StepLoad) -> float:
        return self.seconds_over(1, load)

    def scaled(self, factor: float) -> LinearStepCost:
        """The same steps on a machine `factor` times slower (benchmarks/calibrate_sim.py --slowdown)."""
        return LinearStepCost(*(factor * value for value in astuple(self)))
