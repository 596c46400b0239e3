"""The paper's third failure mode: sandboxes and their disk piling up when nothing collects them.

    python benchmarks/sandbox_leak.py                      # 300 programs per arm, both at once: 41 minutes at load 33
    python benchmarks/sandbox_leak.py --programs 40 --out results/leak-small.json

Two arms at the same time, each on a cluster of its own (`thunderctl up`, then `down`): one
simulated worker (`thunderctl engine sim`, profiles/sim.yaml's preset, sped up by
--engine-time-scale) and sandboxes in the local Docker engine. Each arm replays --programs of the
recorded SWE-bench Lite runs (--steps cuts each to its first steps) through
`thunderctl bench swe-lite --sandboxes`, --concurrency at once: every program gets a sandbox whose
setup writes a --workspace-mib checkout, and every tool step is an exec that sleeps the step's
tool time (× --time-scale) and appends its observation to a file.

- `collect`: each sandbox is its program's, removed at the program's release;
- `no-collect` (`--no-collect`): the sandboxes have an owner the gateway never releases, as with
  a harness that starts its sandboxes apart from its LLM calls: they stay until idle expiry or `down`.

Every --interval seconds, and after each arm's last program until the count holds still, Docker
itself is asked (thunderctl/bench/sandbox_census.py) for the containers that carry the arm's
cluster labels and their writable layers' size, per Docker host. Printed: a table over time
(share of each arm's run) and at the end, peaks and means, and the ratios; written: --out (JSON)
and a plot beside it when matplotlib is installed. Only the containers of the two clusters this
run made are counted and removed, and the image it built (when no --image is given).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import docker
from rich.console import Console
from rich.table import Table
from soak import Cluster

from thunderctl.bench.recorded import recorded_swe_lite
from thunderctl.bench.sandbox_census import SandboxCensus
from thunderctl.processes import pick_free_port, pick_free_ports
from thunderctl.sandbox.busybox import build_busybox_image
from thunderctl.sandbox.config import LOCAL_DOCKER
from thunderctl.traceformat import write_trace

ARMS = ("collect", "no-collect")
IMAGE_LABEL = "thunderctl.bench"  # on the image this script builds, to find it again and remove it
# The end figures: after the last program, sampled until the count is the same this many times.
SETTLE_SAMPLES = 3
SETTLE_S = 120.0
SHARES = (0.1, 0.25, 0.5, 0.75, 1.0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=300, help="programs per arm")
    parser.add_argument("--concurrency", type=int, default=16, help="programs (and sandboxes in use) at once")
    parser.add_argument(
        "--steps", type=int, default=6, help="cut each recorded run to its first steps (0: whole runs, ~36 p50)"
    )
    parser.add_argument("--time-scale", type=float, default=0.05, help="× every tool time (the trace's are seconds)")
    parser.add_argument("--engine-time-scale", type=float, default=0.1, help="wall seconds per simulated second")
    parser.add_argument("--preset", default="h100-tp4-32b", help="the simulated worker's preset")
    parser.add_argument(
        "--workspace-mib", type=float, default=4.0, help="each sandbox's setup writes a checkout of this size"
    )
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between Docker samples")
    parser.add_argument("--image", help="the sandboxes' image (default: a busybox image built here and removed after)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/sandbox-leak.json"))
    parser.add_argument("--keep", type=Path, help="keep the profiles and each arm's bench report and output here")
    parser.add_argument("--plot", type=Path, help="default: --out with .png (needs matplotlib)")
    args = parser.parse_args()
    for name in ("programs", "concurrency", "interval"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.steps < 0 or args.workspace_mib < 0:
        parser.error("--steps and --workspace-mib cannot be negative")
    return args


def leak_profile(args: argparse.Namespace, cluster: str, image: str) -> dict[str, Any]:
    (port,) = pick_free_ports(1)
    setup = f"head -c {round(args.workspace_mib * 2**20)} /dev/urandom > /workspace" if args.workspace_mib else None
    return {
        "cluster": cluster,
        "model": {"path": "Qwen/Qwen3-32B", "served_name": "qwen3-32b"},
        "engine": {"kind": "sim", "preset": args.preset, "time_scale": args.engine_time_scale},
        "nodes": [{"name": "sim-0", "transport": "local", "replicas": 1, "base_port": port}],
        "gateway": {"host": "127.0.0.1", "port": pick_free_port()},
        "scheduler": {"tick_interval_s": 2},
        # Disk measured every 5 s, so that the gateway's own figures are as fresh as Docker's.
        "sandboxes": {"image": image, "setup": setup, "memory": "64m", "maintenance_interval_s": 5},
    }


@dataclass
class Sampler:
    """Docker's count of one cluster's sandboxes every `interval_s` in a thread, with the load average."""

    census: SandboxCensus
    interval_s: float
    started: float = field(default_factory=time.monotonic)
    samples: list[dict[str, Any]] = field(default_factory=list)

    def take(self) -> dict[str, Any]:
        counts = self.census.count()
        sample = {
            "t_s": round(time.monotonic() - self.started, 1),
            "containers": sum(c.containers for c in counts.values()),
            "disk_bytes": sum(c.disk_bytes for c in counts.values()),
            "hosts": {url: {"containers": c.containers, "disk_bytes": c.disk_bytes} for url, c in counts.items()},
            "load1": os.getloadavg()[0],
        }
        self.samples.append(sample)
        return sample

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.take()
            stop.wait(self.interval_s)

    def settle(self) -> dict[str, Any]:
        """Sample until the count holds still (the releases collect in the background); the last sample."""
        deadline = time.monotonic() + SETTLE_S
        steady = 0
        while steady < SETTLE_SAMPLES and time.monotonic() < deadline:
            before = self.samples[-1]["containers"]
            time.sleep(self.interval_s)
            steady = steady + 1 if self.take()["containers"] == before else 0
        return self.samples[-1]


def run_arm(args: argparse.Namespace, arm: str, image: str, trace: Path | None, base: Path) -> dict[str, Any]:
    workdir = base / arm
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(workdir, leak_profile(args, f"leak-{secrets.token_hex(3)}-{arm}", image))
    report_path = workdir / f"{arm}.json"
    bench = ["bench", "swe-lite", "--cluster", cluster.name, "--sandboxes", "--programs", str(args.programs)]
    bench += ["--concurrency", str(args.concurrency), "--warmup", "0", "--time-scale", str(args.time_scale)]
    bench += ["--seed", str(args.seed), "--out", str(report_path)]
    bench += [] if arm == "collect" else ["--no-collect"]
    bench += [] if trace is None else ["--trace", str(trace)]
    census = SandboxCensus(cluster.name, [LOCAL_DOCKER])
    sampler = Sampler(census, args.interval)
    stop = threading.Event()
    thread = threading.Thread(target=sampler.run, args=(stop,), daemon=True)
    cluster.cli("up", "-f", str(cluster.profile_path))
    try:
        sampler.started = time.monotonic()
        thread.start()
        print(f"{arm}: thunderctl {' '.join(bench)}", flush=True)
        (workdir / f"{arm}.out").write_text(cluster.cli(*bench, timeout=6 * 3600))
        run_s = time.monotonic() - sampler.started
        stop.set()
        thread.join()
        end = sampler.settle()
    finally:
        stop.set()
        cluster.cli("down", "--cluster", cluster.name, timeout=900)
        after_down = census.count()[LOCAL_DOCKER].containers
        removed = census.remove_all()
        census.close()
    timeline = sampler.samples
    bench_report = json.loads(report_path.read_text())
    (arm_report,) = bench_report["arms"].values()
    return {
        "cluster": cluster.name,
        "command": f"thunderctl {' '.join(bench)}",
        "run_s": round(run_s, 1),
        "programs_started": arm_report["programs_started"],
        "steps_ok": arm_report["steps_ok"],
        "steps_failed": arm_report["steps_failed"],
        "pool": arm_report["sandboxes"] and {k: v for k, v in arm_report["sandboxes"].items() if k != "timeline"},
        "containers_end": end["containers"],
        "disk_bytes_end": end["disk_bytes"],
        "containers_peak": max(s["containers"] for s in timeline),
        "disk_bytes_peak": max(s["disk_bytes"] for s in timeline),
        "containers_mean": mean(s["containers"] for s in timeline if s["t_s"] <= run_s),
        "disk_bytes_mean": mean(s["disk_bytes"] for s in timeline if s["t_s"] <= run_s),
        "load1_mean": mean(s["load1"] for s in timeline),
        "left_after_down": after_down,
        "removed_after_down": removed,
        "timeline": timeline,
    }


def mean(values: Any) -> float:
    listed = list(values)
    return sum(listed) / len(listed) if listed else 0.0


def at_share(arm: dict[str, Any], share: float) -> dict[str, Any]:
    """The last sample at or before `share` of the arm's run (1.0: the last program's end)."""
    cutoff = share * arm["run_s"]
    return [s for s in arm["timeline"] if s["t_s"] <= cutoff][-1] if arm["timeline"][0]["t_s"] <= cutoff else {}


def megabytes(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f} MB"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}×" if b else ("∞ (against 0)" if a else "-")


def render(result: dict[str, Any], console: Console) -> None:
    arms = result["arms"]
    collect, leak = arms["collect"], arms["no-collect"]
    over_time = Table(title="Docker's count of each cluster's sandbox containers and their disk (SizeRw)")
    for column in ("share of the run", *(f"{name}: containers" for name in ARMS), *(f"{name}: disk" for name in ARMS)):
        over_time.add_column(column, justify="right")
    for share in SHARES:
        rows = [at_share(arms[name], share) for name in ARMS]
        over_time.add_row(
            f"{share:.0%}",
            *(str(r.get("containers", "-")) for r in rows),
            *(megabytes(r.get("disk_bytes")) for r in rows),
        )
    over_time.add_row(
        "end (settled)", str(collect["containers_end"]), str(leak["containers_end"]),
        megabytes(collect["disk_bytes_end"]), megabytes(leak["disk_bytes_end"]),
    )  # fmt: skip
    console.print(over_time)
    summary = Table(title="Per arm (one Docker host: the local engine)")
    for column in ("", *ARMS, "no-collect ÷ collect"):
        summary.add_column(column, justify="left" if not column else "right")
    for label, key, show in (
        ("containers, mean over the run", "containers_mean", lambda v: f"{v:.1f}"),
        ("containers, peak", "containers_peak", str),
        ("containers at the end", "containers_end", str),
        ("disk, mean over the run", "disk_bytes_mean", megabytes),
        ("disk, peak", "disk_bytes_peak", megabytes),
        ("disk at the end", "disk_bytes_end", megabytes),
    ):
        summary.add_row(label, show(collect[key]), show(leak[key]), ratio(leak[key], collect[key]))
    summary.add_row("run time (to the last program's end)", f"{collect['run_s']:.0f} s", f"{leak['run_s']:.0f} s", "")
    summary.add_row("steps ok (failed)", *(f"{a['steps_ok']} ({a['steps_failed']})" for a in (collect, leak)), "")
    summary.add_row(
        "tool execs (failed)",
        *(f"{a['pool']['execs']} ({a['pool']['exec_failures']})" if a["pool"] else "-" for a in (collect, leak)),
        "",
    )
    summary.add_row("load average (1 min), mean", f"{collect['load1_mean']:.1f}", f"{leak['load1_mean']:.1f}", "")
    summary.add_row(
        "left after down / removed here", *(f"{a['left_after_down']} / {a['removed_after_down']}" for a in (collect, leak)),
        "",
    )  # fmt: skip
    console.print(summary)


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (containers, disk) = pyplot.subplots(1, 2, figsize=(10, 4))
    for name, arm in result["arms"].items():
        minutes = [s["t_s"] / 60 for s in arm["timeline"]]
        containers.plot(minutes, [s["containers"] for s in arm["timeline"]], label=name)
        disk.plot(minutes, [s["disk_bytes"] / 1e6 for s in arm["timeline"]], label=name)
    containers.set_ylabel("sandbox containers")
    disk.set_ylabel("their disk (MB, SizeRw)")
    for axis in (containers, disk):
        axis.set_xlabel("minutes since the arm's start")
        axis.legend()
    figure.suptitle(f"{result['parameters']['programs']} programs, {result['parameters']['concurrency']} at once")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def main() -> int:
    args = parse_args()
    console = Console(width=140)
    client = docker.from_env()
    built = None
    image = args.image
    if image is None:
        image = f"thunderctl-bench/busybox:leak-{secrets.token_hex(3)}"
        built = build_busybox_image(client, image, {IMAGE_LABEL: "sandbox-leak"})
    started = datetime.now(UTC)
    try:
        with tempfile.TemporaryDirectory(prefix="sandbox-leak-") as tmp:
            workdir = args.keep or Path(tmp)
            trace = None
            if args.steps:
                trace = workdir / f"first{args.steps}.jsonl"
                write_trace((p.model_copy(update={"steps": p.steps[: args.steps]}) for p in recorded_swe_lite()), trace)
            # Both arms at once, each on its own cluster: on a shared machine they see the same load.
            with ThreadPoolExecutor(len(ARMS)) as pool:
                running = {arm: pool.submit(run_arm, args, arm, image, trace, workdir) for arm in ARMS}
                arms = {arm: future.result() for arm, future in running.items()}
    finally:
        if built is not None:
            client.images.remove(built.id, force=True)
        client.close()
    result = {
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"image": image},
        "arms": arms,
    }
    render(result, console)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    console.print(f"report: {args.out}")
    figure = args.plot or args.out.with_suffix(".png")
    if plot(result, figure):
        console.print(f"plot: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
