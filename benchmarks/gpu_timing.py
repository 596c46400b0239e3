"""Time each GPU preset's GEMMs and attention on this machine's GPU, with PyTorch alone (no vLLM),
and write the compute and bandwidth efficiencies its RooflineCost uses.

    python benchmarks/gpu_timing.py                     # on one CUDA GPU, a few minutes
    python benchmarks/gpu_timing.py --check             # ... and how far the presets' figures are
    python benchmarks/gpu_timing.py --from gpu-timing.json --check   # check a saved result
    python benchmarks/gpu_timing.py --tiny --device cpu # tiny shapes on CPU (the tests)

One GPU stands for one of the worker's `tp` GPUs: each layer's weights a GPU holds are timed as
one GEMM of the same FLOPs (hidden × active_body_params / layers / hidden / tp), and attention
over its share of the heads (scaled_dot_product_attention, grouped KV heads).

- prefill, by context length: a chunk of max_num_batched_tokens (or the context, if shorter)
  through the GEMM and attending to the whole context: achieved FLOP/s ÷ the GPU's peak is
  `compute_efficiency` (the median over contexts);
- decode, by batch size and context: one token per sequence through the GEMM (it streams the
  weights) and attending to its context (it streams the KV): achieved bytes/s ÷ peak HBM
  bandwidth is `memory_efficiency` (the median over points).

Peaks are the preset's GPU (H100 SXM) unless --peak-flops/--peak-bytes name this one's. The GEMMs
run in BF16 (FP8 presets are compared against the BF16 peak: torch has no portable FP8 GEMM).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from thunderctl.sim.cost import RooflineCost
from thunderctl.sim.presets import PRESET_BUILDERS, get_preset

GPU_PRESETS = [name for name in PRESET_BUILDERS if isinstance(get_preset(name).cost, RooflineCost)]
PREFILL_CONTEXTS = (1024, 4096, 16384, 65536)
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (1024, 8192, 32768)
MAX_DECODE_KV_TOKENS = 2**21  # batch × context per point: the KV must fit beside the weights
TINY_DIVISOR = 16  # --tiny: hidden size and heads ÷ this, contexts and batches small
TINY_CONTEXTS = (64, 256)
TINY_BATCHES = (1, 4)


@dataclass(frozen=True)
class Shape:
    """What one of a worker's GPUs computes per layer."""

    hidden: int
    gemm_out: int  # the layer's weights on this GPU as one hidden × gemm_out matrix
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    chunk: int


@dataclass(frozen=True)
class Point:
    kind: str  # "prefill" or "decode"
    batch: int
    context: int
    seconds: float  # the whole model: layers × (GEMM + attention)
    flops: float
    bytes: float


def preset_shape(name: str, tiny: bool) -> Shape:
    preset = get_preset(name)
    cost = preset.cost
    assert isinstance(cost, RooflineCost)
    model, tp = cost.deployment.model, cost.deployment.tp
    divisor = TINY_DIVISOR if tiny else 1
    hidden = model.hidden_size // divisor
    gemm_out = int(model.active_body_params / model.num_layers / model.hidden_size / tp) // divisor
    return Shape(
        hidden=hidden, gemm_out=gemm_out, heads=max(1, model.num_heads // tp // divisor),
        kv_heads=max(1, -(-model.num_kv_heads // tp) // divisor), head_dim=model.head_dim // (4 if tiny else 1),
        layers=2 if tiny else model.num_layers, chunk=256 if tiny else preset.engine.max_num_batched_tokens,
    )  # fmt: skip


def timed(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `run` after a warm-up."""
    run()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def layer_point(shape: Shape, kind: str, batch: int, context: int, device: torch.device, repeats: int) -> Point:
    dtype = torch.bfloat16
    queries = min(shape.chunk, context) if kind == "prefill" else 1
    tokens = queries * batch
    x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype)
    w = torch.randn(shape.hidden, shape.gemm_out, device=device, dtype=dtype)
    q = torch.randn(batch, shape.heads, queries, shape.head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, shape.kv_heads, context, shape.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    gqa = shape.heads != shape.kv_heads
    gemm_s = timed(lambda: x @ w, device, repeats)
    attention_s = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), device, repeats)
    element = x.element_size()
    flops = 2 * tokens * shape.hidden * shape.gemm_out + 4 * shape.heads * shape.head_dim * tokens * context
    moved = (shape.hidden * shape.gemm_out + 2 * batch * shape.kv_heads * context * shape.head_dim) * element
    layers = shape.layers
    return Point(kind, batch, context, (gemm_s + attention_s) * layers, flops * layers, moved * layers)


def points(shape: Shape, tiny: bool, device: torch.device, repeats: int) -> list[Point]:
    contexts = TINY_CONTEXTS if tiny else PREFILL_CONTEXTS
    batches, decode_contexts = (TINY_BATCHES, TINY_CONTEXTS) if tiny else (DECODE_BATCHES, DECODE_CONTEXTS)
    measured = [layer_point(shape, "prefill", 1, context, device, repeats) for context in contexts]
    for batch in batches:
        for context in decode_contexts:
            if batch * context <= MAX_DECODE_KV_TOKENS:
                measured.append(layer_point(shape, "decode", batch, context, device, repeats))
    return measured


def efficiencies(measured: list[Point], peak_flops: float, peak_bytes: float) -> dict[str, float]:
    prefill = [p.flops / p.seconds / peak_flops for p in measured if p.kind == "prefill"]
    decode = [p.bytes / p.seconds / peak_bytes for p in measured if p.kind == "decode"]
    return {"compute_efficiency": statistics.median(prefill), "memory_efficiency": statistics.median(decode)}


def measure(args: argparse.Namespace) -> dict[str, object]:
    device = torch.device(args.device)
    results: dict[str, object] = {}
    for name in args.presets:
        cost = get_preset(name).cost
        assert isinstance(cost, RooflineCost)
        gpu = cost.deployment.gpu
        peak_flops, peak_bytes = args.peak_flops or gpu.bf16_flops_per_s, args.peak_bytes or gpu.hbm_bytes_per_s
        measured = points(preset_shape(name, args.tiny), args.tiny, device, args.repeats)
        results[name] = {
            **efficiencies(measured, peak_flops, peak_bytes),
            "peak_flops_per_s": peak_flops,
            "peak_bytes_per_s": peak_bytes,
            "points": [asdict(p) for p in measured],
        }
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "tiny": args.tiny, "presets": results}


def check(result: dict[str, object]) -> list[str]:
    """One line per preset and figure: measured ÷ assumed."""
    lines = []
    presets = result["presets"]
    assert isinstance(presets, dict)
    for name, measured in presets.items():
        cost = get_preset(name).cost
        assert isinstance(cost, RooflineCost)
        for figure in ("compute_efficiency", "memory_efficiency"):
            assumed, got = getattr(cost, figure), measured[figure]
            lines.append(f"{name} {figure}: measured {got:.3g}, preset {assumed:.3g}, ratio {got / assumed:.3g}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=GPU_PRESETS, choices=GPU_PRESETS)
    parser.add_argument("--device", default="cuda", help="torch device: cuda (default), cuda:1, cpu")
    parser.add_argument("--tiny", action="store_true", help="Tiny shapes (for tests and CPUs), not the presets'.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed runs per point; the median is kept.")
    parser.add_argument("--peak-flops", type=float, help="This GPU's dense BF16 FLOP/s (default: the preset's GPU).")
    parser.add_argument("--peak-bytes", type=float, help="This GPU's HBM bytes/s (default: the preset's GPU).")
    parser.add_argument("--out", type=Path, default=Path("gpu-timing.json"), help="Where the result goes.")
    parser.add_argument("--from", dest="source", type=Path, help="Do not measure: read this saved result.")
    parser.add_argument("--check", action="store_true", help="Print measured ÷ the presets' efficiencies.")
    args = parser.parse_args(argv)
    if args.source is not None:
        result = json.loads(args.source.read_text())
    else:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU here: run on a GPU machine, or pass --device cpu --tiny to try the script")
        result = measure(args)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    for name, measured in result["presets"].items():
        print(f"{name}: compute_efficiency {measured['compute_efficiency']:.3g}, "
              f"memory_efficiency {measured['memory_efficiency']:.3g}")  # fmt: skip
    if args.check:
        print("\n".join(check(result)))


if __name__ == "__main__":
    sys.exit(main())
