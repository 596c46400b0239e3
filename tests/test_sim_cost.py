"""The simulator's cost models and presets: the roofline by hand, KV sizes, the fitted CPU model."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from thunderctl.sim.cost import (
    GIB,
    AllReduce,
    Deployment,
    Gpu,
    LinearStepCost,
    ModelConfig,
    RooflineCost,
    StepLoad,
)
from thunderctl.sim.presets import (
    CPU_TINY_COST,
    GLM_4_6_FP8,
    H100_SXM,
    QWEN3_32B,
    UnknownPreset,
    get_preset,
    preset_names,
)
from thunderctl.sim.steptable import CPU_TINY_STEPS_CSV, MeasuredSteps, read_step_table, write_step_table

KIB = 1024

# Round numbers so every figure below can be checked with a pencil.
GPU = Gpu(
    name="round",
    bf16_flops_per_s=1e15,
    fp8_flops_per_s=2e15,
    memory_bytes=100 * GIB,
    hbm_bytes_per_s=1e12,
    nvlink_bytes_per_s=1e11,
    host_link_bytes_per_s=1e10,
)
MODEL = ModelConfig(
    name="round-1b",
    num_layers=2,
    hidden_size=1024,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    vocab_size=1000,
    total_params=1e9,
    active_body_params=1e9,
    weight_bytes_per_param=2,
    kv_bytes_per_element=2,
)
# 2 (K and V) × 2 layers × 2 KV heads × 128 × 2 bytes
MODEL_KV_BYTES_PER_TOKEN = 2048
ALLREDUCE = AllReduce(latency_s=1e-5, small_message_bytes=1 << 20, small_message_bytes_per_s=1e10, ring_efficiency=0.5)


def roofline(tp: int = 1, model: ModelConfig = MODEL) -> RooflineCost:
    return RooflineCost(
        deployment=Deployment(model=model, gpu=GPU, tp=tp),
        compute_efficiency=0.5,
        memory_efficiency=0.5,
        step_overhead_s=1e-3,
        allreduce=ALLREDUCE,
    )


def prefill(tokens: int, offset: int = 0) -> StepLoad:
    return StepLoad(
        scheduled_tokens=tokens,
        num_seqs=1,
        attention_pairs=tokens * offset + tokens * (tokens + 1) // 2,
        context_tokens=offset + tokens,
    )


def decode(batch: int, context: int) -> StepLoad:
    return StepLoad(
        scheduled_tokens=batch, num_seqs=batch, attention_pairs=batch * context, context_tokens=batch * context
    )


# --- roofline by hand ------------------------------------------------------------------


def test_a_long_prefill_is_compute_bound() -> None:
    cost = roofline()
    load = prefill(4096)
    pairs = 4096 * 4097 // 2
    matmul_flops = 2 * 1e9 * 4096 + 2 * 1000 * 1024  # body per token, output head once
    attention_flops = 4 * 2 * 8 * 128 * pairs
    compute = (matmul_flops + attention_flops) / (1e15 * 0.5)
    memory = (2e9 + (4096 + 4096) * MODEL_KV_BYTES_PER_TOKEN) / (1e12 * 0.5)
    assert cost.compute_seconds(load) == pytest.approx(compute)
    assert cost.memory_seconds(load) == pytest.approx(memory)
    assert compute > memory
    assert cost.step_seconds(load) == pytest.approx(compute + 1e-3)


def test_a_decode_step_is_memory_bound() -> None:
    cost = roofline()
    load = decode(batch=8, context=1000)
    compute = (2 * 1e9 * 8 + 2 * 1000 * 1024 * 8 + 4 * 2 * 8 * 128 * 8000) / (1e15 * 0.5)
    # All the weights, then every sequence's 1000 tokens of KV read and its new token written.
    memory = (2e9 + (8000 + 8) * MODEL_KV_BYTES_PER_TOKEN) / (1e12 * 0.5)
    assert cost.compute_seconds(load) == pytest.approx(compute)
    assert cost.memory_seconds(load) == pytest.approx(memory)
    assert memory > compute
    assert cost.step_seconds(load) == pytest.approx(memory + 1e-3)


def test_the_step_is_the_slower_of_compute_and_memory() -> None:
    cost = roofline()
    # Where a prefill of n tokens costs as much compute as the weights take to stream.
    for tokens in (64, 256, 512, 1024, 2048):
        load = prefill(tokens)
        busy = max(cost.compute_seconds(load), cost.memory_seconds(load))
        assert cost.step_seconds(load) == pytest.approx(busy + 1e-3)
    assert cost.memory_seconds(prefill(64)) > cost.compute_seconds(prefill(64))
    assert cost.compute_seconds(prefill(2048)) > cost.memory_seconds(prefill(2048))


def test_fp8_weights_run_at_the_fp8_peak_and_stream_half_the_bytes() -> None:
    fp8 = ModelConfig(**{**MODEL.__dict__, "name": "round-1b-fp8", "weight_bytes_per_param": 1})
    bf16_cost, fp8_cost = roofline(), roofline(model=fp8)
    load = StepLoad(scheduled_tokens=4096, num_seqs=1, attention_pairs=0, context_tokens=0)
    assert fp8_cost.compute_seconds(load) == pytest.approx(bf16_cost.compute_seconds(load) / 2)
    assert fp8.weight_bytes == MODEL.weight_bytes / 2


def test_tensor_parallelism_splits_the_work_and_adds_two_allreduces_per_layer() -> None:
    single, split = roofline(tp=1), roofline(tp=4)
    small = decode(batch=8, context=1000)
    assert split.compute_seconds(small) == pytest.approx(single.compute_seconds(small) / 4)
    # 2 KV heads over 4 GPUs: each GPU still holds one, so KV bytes do not shrink fourfold.
    kv_per_gpu = MODEL_KV_BYTES_PER_TOKEN // 2
    assert split.memory_seconds(small) == pytest.approx((2e9 / 4 + 8008 * kv_per_gpu) / (1e12 * 0.5))
    # 8 tokens × 1024 × 2 bytes = 16 KiB: a small message, 10 µs + bytes at 10 GB/s.
    assert split.communication_seconds(small) == pytest.approx(2 * 2 * (1e-5 + 16 * KIB / 1e10))
    large = prefill(4096)
    # 8 MiB: its first MiB at the small-message rate, the other 7 at NCCL's ring rate, where
    # every GPU sends 2·3/4 of them over NVLink at half its bandwidth.
    message = 4096 * 1024 * 2
    ring = 1e-5 + 2**20 / 1e10 + 2 * 3 / 4 * (message - 2**20) / (1e11 * 0.5)
    assert split.communication_seconds(large) == pytest.approx(2 * 2 * ring)
    assert single.communication_seconds(large) == 0


def test_an_moe_step_reads_only_the_experts_its_tokens_are_routed_to() -> None:
    moe = ModelConfig(
        **{
            **MODEL.__dict__,
            "name": "round-moe",
            "num_experts": 16,
            "experts_per_token": 2,
            "routed_expert_params": 8e8,
        }
    )
    dense_bytes = (1e9 - 8e8) * 2
    assert moe.weight_bytes_read(1) == pytest.approx(dense_bytes + 8e8 * 2 * 2 / 16)
    assert moe.weight_bytes_read(2) == pytest.approx(dense_bytes + 8e8 * 2 * (1 - (14 / 16) ** 2))
    assert moe.weight_bytes_read(10_000) == pytest.approx(moe.weight_bytes)


# --- KV sizes and capacity -------------------------------------------------------------


def test_kv_bytes_per_token_follow_the_model_configs() -> None:
    assert QWEN3_32B.kv_bytes_per_token == 256 * KIB
    assert GLM_4_6_FP8.kv_bytes_per_token == 368 * KIB
    assert Deployment(model=QWEN3_32B, gpu=H100_SXM, tp=4).kv_bytes_per_token_per_gpu == 64 * KIB
    assert Deployment(model=GLM_4_6_FP8, gpu=H100_SXM, tp=8).kv_bytes_per_token_per_gpu == 46 * KIB


def test_kv_capacity_is_what_the_weights_and_reserve_leave_of_the_memory_budget() -> None:
    deployment = Deployment(model=QWEN3_32B, gpu=H100_SXM, tp=4)
    per_gpu = 81_559 * 2**20 * 0.9 - 32.76e9 * 2 / 4 - 2 * GIB
    assert deployment.kv_capacity_tokens() == int(per_gpu // (64 * KIB))
    assert deployment.num_gpu_blocks(16) == deployment.kv_capacity_tokens() // 16


def test_a_model_that_does_not_fit_says_so_and_what_to_change() -> None:
    with pytest.raises(ValueError, match="GLM-4.6-FP8 does not fit 2× H100.*larger tp"):
        Deployment(model=GLM_4_6_FP8, gpu=H100_SXM, tp=2).kv_capacity_tokens()


# --- presets ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", preset_names())
def test_a_preset_holds_its_longest_request_and_costs_more_for_more_work(name: str) -> None:
    preset = get_preset(name)
    engine = preset.engine
    assert preset.name == name
    # vLLM refuses to start unless one request of max_model_len fits the KV cache.
    assert engine.kv_capacity_tokens >= engine.max_model_len
    assert engine.max_num_batched_tokens >= 1 and engine.max_num_seqs >= 1
    cost = preset.cost
    base = decode(batch=8, context=2048)
    more_tokens = prefill(engine.max_num_batched_tokens)
    assert cost.step_seconds(prefill(1)) > 0
    assert cost.step_seconds(more_tokens) > cost.step_seconds(prefill(engine.max_num_batched_tokens // 4))
    assert cost.step_seconds(decode(batch=32, context=2048)) > cost.step_seconds(base)
    assert cost.step_seconds(decode(batch=8, context=8192)) > cost.step_seconds(base)
    # Batching pays: a token of a 64-sequence decode step costs less than a lone one.
    assert cost.step_seconds(decode(64, 2048)) / 64 < cost.step_seconds(decode(1, 2048))
    assert preset.transfer_seconds(1000) == pytest.approx(
        1000 * preset.kv_bytes_per_token / preset.host_link_bytes_per_s
    )


@pytest.mark.parametrize("name", preset_names())
def test_a_step_never_gets_cheaper_by_growing(name: str) -> None:
    cost = get_preset(name).cost
    budget = get_preset(name).engine.max_num_batched_tokens
    prefills = [cost.step_seconds(prefill(tokens)) for tokens in range(1, budget + 1, 7)]
    decodes = [cost.step_seconds(decode(batch, 1024)) for batch in range(1, 1025, 3)]
    assert prefills == sorted(prefills)
    assert decodes == sorted(decodes)


def test_gpu_presets_use_vllm_defaults_and_the_profiles_settings() -> None:
    qwen = get_preset("h100-tp4-32b")
    assert (qwen.engine.block_size, qwen.engine.max_num_batched_tokens, qwen.engine.max_num_seqs) == (16, 8192, 1024)
    assert qwen.engine.max_model_len == 65536
    assert qwen.kv_bytes_per_token == 256 * KIB
    glm = get_preset("h100x8-tp8-glm46")
    assert glm.kv_bytes_per_token == 368 * KIB
    # A lone decoding sequence touches 8 of 160 experts a layer: GLM then streams ~4 GB per
    # GPU against the dense 32B's 16 GB, but a large batch touches nearly all 44 GB.
    assert glm.cost.step_seconds(decode(1, 4096)) < qwen.cost.step_seconds(decode(1, 4096))
    assert glm.cost.step_seconds(decode(256, 4096)) > qwen.cost.step_seconds(decode(256, 4096))


def test_cpu_tiny_is_profiles_local_engine() -> None:
    engine = get_preset("cpu-tiny").engine
    assert (engine.num_gpu_blocks, engine.block_size, engine.max_model_len) == (256, 128, 16384)
    assert engine.kv_capacity_tokens == 32768


def test_an_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(UnknownPreset, match="unknown preset 'h100'.*cpu-tiny, h100-tp4-32b, h100x8-tp8-glm46"):
        get_preset("h100")


# --- the fitted CPU model --------------------------------------------------------------


def test_the_cpu_tiny_fit_has_no_negative_cost() -> None:
    assert all(value >= 0 for value in CPU_TINY_COST.__dict__.values())
    assert CPU_TINY_COST.base_s > 0


def test_the_cpu_tiny_fit_predicts_the_measurements_it_ships_with() -> None:
    rows = read_step_table(CPU_TINY_STEPS_CSV)
    assert {row.kind for row in rows} == {"prefill", "cached-prefill", "decode", "mixed"}
    errors = sorted(abs(CPU_TINY_COST.seconds_over(row.steps, row.summed) - row.seconds) / row.seconds for row in rows)
    # The machine was busy while they were measured: the fit is loose, but it is this table's fit.
    assert statistics.median(errors) < 0.3
    assert errors[int(0.9 * len(errors))] < 0.6


def test_a_linear_cost_over_several_steps_is_the_sum_of_its_steps() -> None:
    cost = LinearStepCost(
        base_s=1e-3, per_token_s=1e-5, per_attention_pair_s=1e-9, per_seq_s=1e-4, per_context_token_s=1e-7
    )
    loads = [decode(4, 100), prefill(512, offset=256)]
    summed = StepLoad(*(sum(getattr(load, name) for load in loads) for name in StepLoad.__dataclass_fields__))
    assert cost.seconds_over(2, summed) == pytest.approx(sum(cost.step_seconds(load) for load in loads))


def test_the_step_table_round_trips_and_rejects_foreign_columns(tmp_path: Path) -> None:
    row = MeasuredSteps("decode", "k=4", 3, 0.5, 0.4, 0.6, 47, 188, 9400, 188, 9400)
    path = tmp_path / "steps.csv"
    write_step_table(path, [row], "made by a test")
    assert path.read_text().startswith("# made by a test\n")
    assert read_step_table(path) == [row]
    path.write_text("kind,label,seconds\ndecode,k=4,0.5\n")
    with pytest.raises(ValueError, match="row 2 has columns"):
        read_step_table(path)
