"""`thunderctl pause` and `thunderctl resume`: a running cluster held for a trainer's weight update."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape

from thunderctl.cluster.state import ClusterNotFound
from thunderctl.gateway.auth import API_KEY_ENV
from thunderctl.integrations.cluster import ClusterClient, ClusterError, cluster_endpoints
from thunderctl.scheduler.pause import PauseMode
from thunderctl.terminal import fail, out

ClusterOption = Annotated[
    str | None, typer.Option("--cluster", "-c", help="The running cluster (default: the only one).")
]
EndpointOption = Annotated[
    str | None, typer.Option(help="A gateway's URL (`thunderctl serve`) instead of a local cluster's name.")
]
ApiKeyOption = Annotated[str | None, typer.Option(envvar=API_KEY_ENV, help="The gateway's API key, if it has one.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the gateway's answer as JSON.")]


def gateway_client(cluster: str | None, endpoint: str | None, api_key: str | None) -> ClusterClient:
    """The running cluster's gateway, with its profile's key unless one is given."""
    try:
        if endpoint is None:
            found = cluster_endpoints(cluster)
            endpoint, api_key = found.endpoint, api_key or found.api_key
        return ClusterClient(endpoint, api_key)
    except (ClusterNotFound, ValueError) as exc:
        raise fail(str(exc)) from exc


def pause(
    mode: Annotated[
        PauseMode,
        typer.Option(
            help="What the engines do with the requests they run: keep them frozen until the resume, "
            "wait for them to finish, or abort them (their clients get an aborted answer)."
        ),
    ] = PauseMode.KEEP,
    cluster: ClusterOption = None,
    endpoint: EndpointOption = None,
    api_key: ApiKeyOption = None,
    json_output: JsonOption = False,
) -> None:
    """Pause the cluster for a weight update: new requests wait at the gateway, every worker's engine pauses.

    Nothing fails: held requests go on after `thunderctl resume`. A pause nobody resumes ends by
    itself after the profile's admin.max_pause_s (default 600 s). `thunderctl status --json` lists
    the workers' URLs, for the trainer's own weight transfer.
    """
    with gateway_client(cluster, endpoint, api_key) as client:
        try:
            answer = client.pause(mode.value)
        except ClusterError as exc:
            raise fail(str(exc)) from exc
    if json_output:
        print(json.dumps(answer, indent=2))
        return
    out.print(
        f"[bold]paused[/] ({answer['mode']}) on {escape(', '.join(answer['workers']))} in {answer['took_s']:.2f} s; "
        "requests wait at the gateway until `thunderctl resume`"
    )


def resume(
    weights_changed: Annotated[
        bool,
        typer.Option(
            help="The weights changed: every engine's prefix cache is reset and the scheduler forgets "
            "which contexts were cached."
        ),
    ] = False,
    cluster: ClusterOption = None,
    endpoint: EndpointOption = None,
    api_key: ApiKeyOption = None,
    json_output: JsonOption = False,
) -> None:
    """End the pause: the engines resume and the held requests go."""
    with gateway_client(cluster, endpoint, api_key) as client:
        try:
            answer = client.resume(weights_changed)
        except ClusterError as exc:
            raise fail(str(exc)) from exc
    if json_output:
        print(json.dumps(answer, indent=2))
    else:
        changed = (
            f"; caches reset, {answer['programs_paused']} ACTING program(s) to resume from the queue"
            if answer["weights_changed"]
            else ""
        )
        out.print(f"[bold]resumed[/] after {answer['paused_s']:.1f} s paused, in {answer['took_s']:.2f} s{changed}")
    if answer["errors"]:
        refused = "; ".join(f"{worker}: {why}" for worker, why in answer["errors"].items())
        raise fail(f"the cluster runs again, but some workers did not do their part: {refused}")
