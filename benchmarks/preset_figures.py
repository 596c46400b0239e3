"""What the simulator's GPU presets predict, beside the published measurements they are checked on.

    python benchmarks/preset_figures.py

Prints the tables of docs/sim-presets.md: each preset's KV capacity,
prefill throughput and decode step times, then the calibration cases. Pure arithmetic on
thunderctl/sim/presets.py, no engine needed.
"""

from __future__ import annotations

from dataclasses import replace

from thunderctl.sim.cost import GIB, Deployment, ModelConfig, RooflineCost, StepLoad
from thunderctl.sim.presets import GLM_4_6_FP8, H100_SXM, QWEN3_32B, get_preset

GPU_PRESETS = ("h100-tp4-32b", "h100x8-tp8-glm46")
DECODE_CONTEXT = 16384
DECODE_BATCHES = (1, 64, 256)
CHUNK = 8192


def prefill(tokens: int, offset: int = 0) -> StepLoad:
    return StepLoad(tokens, 1, tokens * offset + tokens * (tokens + 1) // 2, offset + tokens)


def decode(batch: int, context: int) -> StepLoad:
    return StepLoad(batch, batch, batch * context, batch * context)


def together(first: StepLoad, second: StepLoad) -> StepLoad:
    """One step that computes both loads."""
    return StepLoad(
        scheduled_tokens=first.scheduled_tokens + second.scheduled_tokens,
        num_seqs=first.num_seqs + second.num_seqs,
        attention_pairs=first.attention_pairs + second.attention_pairs,
        context_tokens=first.context_tokens + second.context_tokens,
    )


def preset_table() -> None:
    print("| preset | weights / GPU | KV / token / GPU | KV capacity | prefill 1 tok | prefill 8k tok | "
          + " | ".join(f"decode b={b} @16k" for b in DECODE_BATCHES) + " |")  # fmt: skip
    print("|---" * (6 + len(DECODE_BATCHES)) + "|")
    for name in GPU_PRESETS:
        preset = get_preset(name)
        cost = preset.cost
        assert isinstance(cost, RooflineCost)
        deployment = cost.deployment
        capacity = preset.engine.kv_capacity_tokens
        decodes = []
        for batch in DECODE_BATCHES:
            seconds = cost.step_seconds(decode(batch, DECODE_CONTEXT))
            over = " (over capacity)" if batch * DECODE_CONTEXT > capacity else ""
            decodes.append(f"{seconds * 1e3:.1f} ms{over}")
        print(
            f"| {name} | {deployment.model.weight_bytes / deployment.tp / GIB:.1f} GiB "
            f"| {deployment.kv_bytes_per_token_per_gpu // 1024} KiB "
            f"| {capacity:,} tokens ({preset.engine.num_gpu_blocks:,} blocks of {preset.engine.block_size}) "
            f"| {1 / cost.step_seconds(prefill(1)):,.0f} tok/s "
            f"| {CHUNK / cost.step_seconds(prefill(CHUNK)):,.0f} tok/s "
            f"| {' | '.join(decodes)} |"
        )


def step_breakdown() -> None:
    print("\n| preset | step | compute | memory | all-reduce | total |")
    print("|---|---|---|---|---|---|")
    for name in GPU_PRESETS:
        cost = get_preset(name).cost
        assert isinstance(cost, RooflineCost)
        loads = {
            "prefill 8k": prefill(CHUNK),
            **{f"decode b={b} @16k": decode(b, DECODE_CONTEXT) for b in DECODE_BATCHES},
        }
        for label, load in loads.items():
            print(
                f"| {name} | {label} | {cost.compute_seconds(load) * 1e3:.1f} ms | {cost.memory_seconds(load) * 1e3:.1f} ms "
                f"| {cost.communication_seconds(load) * 1e3:.1f} ms | {cost.step_seconds(load) * 1e3:.1f} ms |"
            )


# Qwen3-235B-A22B (Megatron arguments mirroring its Hugging Face config, e.g. THUDM/slime
# scripts/models/qwen3-235B-A22B.sh): 94 layers, hidden 4096, 64 heads, 4 KV heads of 128,
# 128 experts (8 per token) of 3 × 4096 × 1536, vocab 151,936, untied. Not a preset: a check.
QWEN3_235B_A22B = ModelConfig(
    name="Qwen3-235B-A22B",
    num_layers=94,
    hidden_size=4096,
    num_heads=64,
    num_kv_heads=4,
    head_dim=128,
    vocab_size=151_936,
    total_params=94 * (71.3e6 + 128 * 3 * 4096 * 1536 + 128 * 4096) + 2 * 151_936 * 4096,
    active_body_params=94 * (71.3e6 + 8 * 3 * 4096 * 1536 + 128 * 4096),
    weight_bytes_per_param=2,
    kv_bytes_per_element=2,
    num_experts=128,
    experts_per_token=8,
    routed_expert_params=94 * 128 * 3 * 4096 * 1536,
)


def with_deployment(preset_name: str, deployment: Deployment) -> RooflineCost:
    """A preset's efficiencies and overheads on another model or GPU count."""
    reference = get_preset(preset_name).cost
    assert isinstance(reference, RooflineCost)
    return replace(reference, deployment=deployment)


def long_prompt_run(label: str, cost: RooflineCost, measured: str) -> None:
    """gpustack's random 32,000-in / 100-out x 100 run, in the steady state the KV cache sets.

    All 100 requests arrive at once; the cache holds `slots` of them. One is always being
    prefilled (8,192-token chunks, the decoders riding along), the others decode, and a
    request leaves after ~77 output tokens (7,681 over the 100 requests).
    """
    prompt, output_tokens = 32000, 7681 / 100
    slots = max(1, cost.deployment.kv_capacity_tokens() // (prompt + 100))
    decoders = slots - 1
    contexts = prompt + output_tokens / 2
    chunk_s, offset = [], 0
    while offset < prompt:
        chunk = min(CHUNK - decoders, prompt - offset)
        chunk_s.append(cost.step_seconds(together(prefill(chunk, offset), decode(decoders, round(contexts)))))
        offset += chunk
    decode_s = cost.step_seconds(decode(max(decoders, 1), round(contexts)))
    # Per request that leaves: its prefill chunks, then decode-only steps until the decoders
    # have produced one request's worth of tokens (every step gives each decoder one).
    decode_only = max(0.0, output_tokens / max(decoders, 1) - len(chunk_s)) if decoders else output_tokens - 1
    per_request = sum(chunk_s) + decode_only * decode_s
    steps = len(chunk_s) + decode_only
    tpot = per_request / steps if decoders else decode_s
    print(f"\n{label}: KV capacity {cost.deployment.kv_capacity_tokens():,} tokens, {slots} request(s) at a time")
    print(f"  prefill chunk {min(chunk_s) * 1e3:.0f}-{max(chunk_s) * 1e3:.0f} ms, decode step {decode_s * 1e3:.1f} ms")
    print(
        f"  predicted: {100 * per_request:,.0f} s for the run, {prompt / per_request:,.0f} input tok/s, TPOT {tpot * 1e3:.1f} ms"
    )
    print(f"  measured:  {measured}")


def glm_sharegpt() -> None:
    """gpustack's GLM-4.6-FP8 TP8 ShareGPT run: what the roofline's steps imply beside it."""
    deployment = Deployment(model=GLM_4_6_FP8, gpu=H100_SXM, tp=8, gpu_memory_utilization=0.85)
    cost = with_deployment("h100x8-tp8-glm46", deployment)
    running, context = 1000, 400  # all 1,000 prompts fit; ShareGPT's ~215 in + ~200 out
    step = cost.step_seconds(decode(running, context))
    input_tokens = 214_465
    riders = running // 2
    chunk = CHUNK - riders
    # A chunk of many ShareGPT prompts (~150 tokens of attention each) beside half the decoders.
    mixed = together(StepLoad(chunk, 1, chunk * 150, chunk), decode(riders, context))
    prefill_steps = input_tokens / chunk
    print("\nGLM-4.6-FP8 on 8 H100 (TP8, gpu-memory-utilization 0.85), ShareGPT x 1000 (gpustack, vLLM 0.11):")
    print(f"  KV capacity: {deployment.kv_capacity_tokens():,} tokens: all 1,000 requests run at once")
    print(f"  decode step of {running} sequences at ~{context} tokens: {step * 1e3:.0f} ms, "
          f"i.e. {running / step:,.0f} output tok/s (measured: peak 3,935 output tok/s, median ITL 150 ms)")  # fmt: skip
    print(f"  prefilling all prompts: ~{prefill_steps:.0f} steps of {CHUNK} tokens at {cost.step_seconds(mixed) * 1e3:.0f} ms, "
          f"{prefill_steps * cost.step_seconds(mixed):.1f} s (measured: median TTFT 26.8 s, p99 45.9 s)")  # fmt: skip


def qwen_sharegpt() -> None:
    """gpustack's Qwen3-32B ShareGPT run on one H100: its decode steps at the cache's concurrency."""
    cost = with_deployment("h100-tp4-32b", Deployment(model=QWEN3_32B, gpu=H100_SXM, tp=1))
    running = cost.deployment.kv_capacity_tokens() // 420  # a ShareGPT request ends at ~420 tokens
    step = cost.step_seconds(decode(running, 320))
    print("\nQwen3-32B on 1 H100, ShareGPT x 1000 (gpustack, vLLM 0.11):")
    print(
        f"  ~{running} sequences fit; a decode step of them at ~320 tokens: {step * 1e3:.1f} ms "
        "(measured: median ITL 50.2 ms, mean TPOT 88 ms with prefill chunks mixed in)"
    )


def main() -> None:
    preset_table()
    step_breakdown()
    long_prompt_run(
        "Qwen3-32B BF16 on 1 H100, 32,000 in / 100 out x 100 (gpustack, vLLM 0.11; the calibration case)",
        with_deployment("h100-tp4-32b", Deployment(model=QWEN3_32B, gpu=H100_SXM, tp=1)),
        "1,157 s, 2,765 input tok/s, TPOT 43.4 ms (p99 44.3 ms; peak output 24 tok/s: one stream)",
    )
    long_prompt_run(
        "Qwen3-235B-A22B BF16 on 8 H100 TP8, 32,000 in / 100 out x 100 (gpustack, vLLM 0.11; a check)",
        with_deployment("h100x8-tp8-glm46", Deployment(model=QWEN3_235B_A22B, gpu=H100_SXM, tp=8)),
        "22,599 input tok/s, TPOT 132 ms",
    )
    qwen_sharegpt()
    glm_sharegpt()


if __name__ == "__main__":
    main()
