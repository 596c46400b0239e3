"""A worker's host KV tier in tokens: the profile's `kv_offload_gib` over the KV bytes a token
takes on the worker's GPUs, which the engine does not report (its /metrics give the host tier
only as a share in use), so they come from the profile or from the model's config.json."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from thunderctl.profile import NodeSpec, Profile

log = logging.getLogger(__name__)

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2}
KV_CACHE_DTYPE_FLAG = "--kv-cache-dtype"


def kv_bytes_per_token(config: Mapping[str, Any], tensor_parallel: int, element_bytes: int | None = None) -> int:
    """As vLLM lays a decoder's KV out over `tensor_parallel` GPUs: K and V of every layer and
    KV head, the heads split over the GPUs (replicated where there are fewer heads than GPUs).
    `element_bytes`: the KV cache's dtype, when it is not the model's."""
    text = config.get("text_config", config)  # a multimodal model's decoder is nested
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    dtype = str(text.get("torch_dtype") or text.get("dtype") or "bfloat16")
    element = element_bytes or DTYPE_BYTES.get(dtype, 2)
    heads_per_gpu = -(-kv_heads // tensor_parallel)
    return 2 * text["num_hidden_layers"] * heads_per_gpu * head_dim * element * tensor_parallel


def kv_cache_element_bytes(args: Sequence[str]) -> int | None:
    """1 when the engine's extra arguments ask for an FP8 KV cache, else None (the model's dtype)."""
    for index, arg in enumerate(args):
        value = arg.partition("=")[2] if arg.startswith(f"{KV_CACHE_DTYPE_FLAG}=") else None
        if arg == KV_CACHE_DTYPE_FLAG and index + 1 < len(args):
            value = args[index + 1]
        if value is not None and value.startswith("fp8"):
            return 1
    return None


def host_kv_tokens(profile: Profile, node: NodeSpec) -> int | None:
    """Tokens the host tier of one of `node`'s workers holds: 0 without one; None when the
    profile gives one but neither `engine.kv_bytes_per_token` nor a local config.json."""
    engine = profile.engine
    if not engine.kv_offload_gib:
        return 0
    per_token = engine.kv_bytes_per_token
    config_path = Path(profile.model.path).expanduser() / "config.json"
    if per_token is None and config_path.is_file():
        config = json.loads(config_path.read_text())
        per_token = kv_bytes_per_token(config, node.tensor_parallel, kv_cache_element_bytes(engine.args))
    if per_token is None:
        return None
    return int(engine.kv_offload_gib * GIB // per_token)


def counted_host_kv_tokens(profile: Profile, node_name: str) -> int:
    """What the gateway counts for a worker of the named node: `host_kv_tokens`, or 0 (its GPU
    alone, with a warning where the profile gives a tier it cannot convert; a node no longer in
    the profile has none)."""
    node = next((n for n in profile.nodes if n.name == node_name), None)
    tokens = 0 if node is None else host_kv_tokens(profile, node)
    if tokens is None:
        log.warning(
            "engine.kv_offload_gib: the host KV tier of %s's workers is not counted: the KV bytes per token of %s "
            "are unknown here (no config.json at that path); set engine.kv_bytes_per_token",
            node_name, profile.model.path,
        )  # fmt: skip
        return 0
    return tokens
