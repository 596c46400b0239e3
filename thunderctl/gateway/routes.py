"""Which of an engine's routes the gateway serves, and how: the generation APIs are scheduled
(`gateway/apis/`), the engines' other public routes relayed as they are, and their control and
development routes kept for the cluster alone."""

from __future__ import annotations

from dataclasses import dataclass

from thunderctl.gateway.apis import CHAT, GENERATION_ROUTES, MESSAGES, Api


@dataclass(frozen=True)
class RelayedRoute:
    """A public route of vLLM (0.32) the gateway relays unscheduled, to the worker of the program the
    request names (`X-Program-Id`), else to the least-loaded worker."""

    path: str
    method: str = "POST"
    api: Api = CHAT  # whose error shape the gateway's own refusals take


RELAYED_ROUTES = (
    RelayedRoute("/v1/models", "GET"),
    RelayedRoute("/v1/models/{model_id:path}", "GET"),
    RelayedRoute("/version", "GET"),
    RelayedRoute("/ping", "GET"),
    RelayedRoute("/load", "GET"),
    RelayedRoute("/tokenizer_info", "GET"),
    RelayedRoute("/tokenize"),
    RelayedRoute("/detokenize"),
    RelayedRoute("/v1/chat/completions/render"),
    RelayedRoute("/v1/completions/render"),
    RelayedRoute("/v1/responses/render"),
    RelayedRoute("/v1/messages/render", api=MESSAGES),
    RelayedRoute("/v1/messages/count_tokens", api=MESSAGES),
    RelayedRoute("/v1/embeddings"),
    RelayedRoute("/pooling"),
    RelayedRoute("/classify"),
    RelayedRoute("/score"),
    RelayedRoute("/v1/score"),
    RelayedRoute("/rerank"),
    RelayedRoute("/v1/rerank"),
    RelayedRoute("/v2/rerank"),
)

# vLLM's (0.32) routes that change or read an engine's state, which the cluster drives (weight sync,
# profiling, sleep, LoRA adapters, fault tolerance): a client's call to one is refused, whatever its key.
CONTROL_PATHS = (
    "/abort_requests",
    "/collective_rpc",
    "/fault_tolerance/apply",
    "/fault_tolerance/status",
    "/finish_weight_update",
    "/get_world_size",
    "/init_weight_transfer_engine",
    "/is_paused",
    "/is_scaling_elastic_ep",
    "/is_sleeping",
    "/kv_event_sources",
    "/pause",
    "/release_kv_cache_memory",
    "/reset_encoder_cache",
    "/reset_mm_cache",
    "/reset_prefix_cache",
    "/resume",
    "/scale_elastic_ep",
    "/server_info",
    "/shutdown_weight_transfer_engine",
    "/sleep",
    "/start_draft_weight_update",
    "/start_profile",
    "/start_weight_update",
    "/stop_profile",
    "/update_weight_version",
    "/update_weights",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/wake_up",
    "/weight_checker",
    "/weight_info",
)


def served_paths() -> list[str]:
    """Every path a client may call, for the 404 that lists them."""
    own = ["/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel", "/programs", "/programs/release",
           "/metrics", "/health", "/admin/pause", "/admin/resume"]  # fmt: skip
    return [*GENERATION_ROUTES, *(route.path.replace(":path}", "}") for route in RELAYED_ROUTES), *own]
