"""Where a benchmark's load goes: the cluster's gateway or a given endpoint, its engines, and the arms over them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

import httpx
import typer

from thunderctl.bench.closed_loop import Routing, Target
from thunderctl.bench.replay import Arm, ArmOutcome
from thunderctl.cluster.state import ClusterNotFound
from thunderctl.engines.vllm import API_KEY_ENV as ENGINE_KEY_ENV
from thunderctl.gateway.auth import API_KEY_ENV
from thunderctl.integrations.cluster import Endpoints, cluster_endpoints, gateway_url
from thunderctl.jsonapi import bearer_headers
from thunderctl.profile import ProfileError
from thunderctl.terminal import fail

# The options every benchmark command finds its endpoint and engines with.
ClusterOption = Annotated[
    str | None, typer.Option("--cluster", "-c", help="The running cluster (default: the only one).")
]
EngineOption = Annotated[
    list[str] | None, typer.Option(help="A vLLM server behind the endpoint (repeat): the direct arm and /metrics.")
]
RoutingOption = Annotated[Routing, typer.Option(help="How the direct arm spreads requests over the engines.")]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        envvar=API_KEY_ENV, show_default=False, help="The --endpoint's API key (a cluster's comes from its profile)."
    ),
]
EngineApiKeyOption = Annotated[
    str | None,
    typer.Option(
        envvar=ENGINE_KEY_ENV, show_default=False, help="The --engine servers' API key (a cluster's is its worker key)."
    ),
]

# The plan estimates the chat template's tokens; leave it room below max_model_len.
CONTEXT_HEADROOM = 0.9


class TargetArm(StrEnum):
    CLUSTER = "cluster"
    DIRECT = "direct"


@dataclass(frozen=True)
class EndpointInfo:
    model: str
    max_model_len: int | None
    thunderctl: bool  # answers GET /programs: program ids, releases and counters apply


def given_endpoints(
    endpoint: str | None, engines: list[str] | None, api_key: str | None, engine_key: str | None
) -> Endpoints | None:
    """The --endpoint (and its --engine servers) the user gave, or None: the running cluster's."""
    if endpoint is None:
        return None
    try:
        return Endpoints(gateway_url(endpoint), engines or [], api_key, engine_key)
    except ValueError as exc:
        raise fail(f"--endpoint: {exc}") from exc


def probe(endpoint: str, api_key: str | None) -> EndpointInfo:
    with httpx.Client(timeout=10.0, trust_env=False, headers=bearer_headers(api_key)) as client:
        models = client.get(f"{endpoint}/v1/models")
        models.raise_for_status()
        first = models.json()["data"][0]
        thunderctl = client.get(f"{endpoint}/programs").status_code == 200
    return EndpointInfo(first["id"], first.get("max_model_len"), thunderctl)


def build_arms(endpoints: Endpoints, info: EndpointInfo, arms: list[TargetArm], routing: Routing) -> list[Arm]:
    built = []
    for arm in arms:
        if arm is TargetArm.DIRECT:
            built.append(Arm("direct", Target.direct(endpoints.engines, routing, api_key=endpoints.engine_key)))
        elif info.thunderctl:
            target = Target.gateway(endpoints.endpoint, name="cluster", api_key=endpoints.api_key)
            built.append(Arm("cluster", target, endpoints.endpoint))
        else:  # any OpenAI-compatible endpoint: no program ids to send, nothing to release
            built.append(Arm("cluster", Target.direct([endpoints.endpoint], name="cluster", api_key=endpoints.api_key)))
    return built


def find_endpoints(cluster: str | None, given: Endpoints | None, need_engines: bool) -> tuple[Endpoints, EndpointInfo]:
    """The endpoint and engines to use (the cluster's unless given) and what serves there."""
    try:
        endpoints = given or cluster_endpoints(cluster)
    except (ClusterNotFound, ProfileError) as exc:
        raise fail(str(exc)) from exc
    if need_engines and not endpoints.engines:
        raise fail("the direct arm needs the engines' URLs: give --engine URL (repeat) with --endpoint")
    try:
        return endpoints, probe(endpoints.endpoint, endpoints.api_key)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 401:
            what = "a wrong API key" if endpoints.api_key else f"no API key: give --api-key or set {API_KEY_ENV}"
            raise fail(f"{endpoints.endpoint} answers 401 to {what}") from exc
        raise fail(f"{endpoints.endpoint} does not answer GET /v1/models with a model: {exc}") from exc


def check_served(outcomes: dict[str, ArmOutcome]) -> None:
    """A run where an arm served nothing is a failure, whatever the table says."""
    for name, outcome in outcomes.items():
        combined = outcome.combined()
        if combined.steps_ok == 0:
            errors = {r.error for r in combined.records if r.error}
            raise fail(f"the {name} arm served no step: {'; '.join(sorted(errors))[:500] or 'no program ran'}")
