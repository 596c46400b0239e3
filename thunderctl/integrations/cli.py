"""`thunderctl agents`: run a batch of mini-swe-agent tasks through a cluster.

mini-swe-agent is imported only when a command runs, so the CLI works without it installed.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from thunderctl.cluster.state import ClusterNotFound
from thunderctl.gateway.auth import API_KEY_ENV
from thunderctl.integrations.cluster import ClusterError, cluster_endpoints
from thunderctl.integrations.tasks import AgentResult, TaskFileError, load_tasks
from thunderctl.terminal import fail, out

agents_app = typer.Typer(help="Agent frameworks on the cluster: run batches of agent tasks.", no_args_is_help=True)


@agents_app.command("run")
def run(
    tasks_file: Annotated[
        Path,
        typer.Argument(
            help="Tasks: JSONL, JSON or YAML records of {id, problem_statement, image?} (SWE-bench's instance_id / image_name work too).",
            exists=True,
            dir_okay=False,
        ),
    ],
    cluster: Annotated[
        str | None, typer.Option("--cluster", "-c", help="The running cluster (default: the only one).")
    ] = None,
    endpoint: Annotated[
        str | None, typer.Option(help="The cluster's endpoint URL instead of a local cluster's name.")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar=API_KEY_ENV, help="The gateway's API key, if it has one.")
    ] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", "-j", min=1, help="Agents running at once.")] = 4,
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            help="mini-swe-agent config: a file (its built-in ones by name) or key.path=value; repeat to merge. "
            "key.path=value alone applies on top of the default, swebench_backticks.yaml; a file replaces it.",
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="litellm model name; default: openai/<the cluster's served model>.")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Directory for trajectories, results.jsonl and preds.json.")
    ] = None,
) -> None:
    """Run each task as a mini-swe-agent with a sandbox of the cluster, one program per task.

    Every program is released when its agent ends, also on an error or Ctrl-C.
    """
    try:
        from thunderctl.integrations import mini_swe_agent
    except ImportError as exc:
        raise fail(
            f"mini-swe-agent is not installed ({exc}); install it with pip install 'thunderctl[agents]'"
        ) from exc
    try:
        tasks = load_tasks(tasks_file)
        if endpoint is None:  # the running cluster's gateway, with its profile's key unless one is given
            found = cluster_endpoints(cluster)
            endpoint, api_key = found.endpoint, api_key or found.api_key
    except (TaskFileError, ClusterNotFound) as exc:
        raise fail(str(exc)) from exc
    results_file = None
    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
        results_file = (output / "results.jsonl").open("a", encoding="utf-8", buffering=1)

    def finished(result: AgentResult) -> None:
        detail = f" ({result.error})" if result.error else ""
        out.print(
            escape(
                f"{result.task_id}: {result.exit_status} after {result.steps} steps, {result.duration_s:.1f} s{detail}"
            )
        )
        if results_file is not None:
            results_file.write(json.dumps(asdict(result)) + "\n")

    # A SIGTERM ends the batch as Ctrl-C does: every running program released.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    out.print(f"{len(tasks)} task(s) on {endpoint}, at most {concurrency} at once")
    try:
        results = mini_swe_agent.run_batch(
            endpoint,
            tasks,
            concurrency=concurrency,
            config_specs=config or [],
            model_name=model,
            api_key=api_key,
            output_dir=output,
            on_result=finished,
        )
    except KeyboardInterrupt:
        raise fail("interrupted: the running agents were stopped and their programs released") from None
    except (ClusterError, ValueError, FileNotFoundError) as exc:
        raise fail(str(exc)) from exc
    finally:
        if results_file is not None:
            results_file.close()
    if output is not None:
        write_predictions(output / "preds.json", results, model or "thunderctl")
    out.print(results_table(results))


def write_predictions(path: Path, results: list[AgentResult], model_name: str) -> None:
    """SWE-bench's predictions file (as mini-swe-agent's batch writes it): each task's submission."""
    predictions = {
        r.task_id: {"model_name_or_path": model_name, "instance_id": r.task_id, "model_patch": r.submission}
        for r in results
    }
    path.write_text(json.dumps(predictions, indent=2))


def results_table(results: list[AgentResult]) -> Table:
    table = Table(title=f"{len(results)} agent(s); tracked: the steps the gateway saw")
    for column in ("task", "program", "exit", "steps", "tracked", "seconds"):
        table.add_column(column, overflow="fold")  # wrapped, never cut to "…"
    for r in results:
        table.add_row(r.task_id, r.program_id, r.exit_status, str(r.steps), str(r.gateway_steps), f"{r.duration_s:.1f}")
    return table
