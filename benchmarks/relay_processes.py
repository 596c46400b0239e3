"""Relay processes (`gateway.relays`): what each process spends per chunk and per step, and the
messages between them, against the one-process gateway, in the same run.

    python benchmarks/relay_processes.py                      # 64 and 512 streams, ~5 minutes
    python benchmarks/relay_processes.py --streams 1,64,512,2048 --slice-s 20 --slices 2
    python benchmarks/relay_processes.py --relays 2,4
    python benchmarks/relay_processes.py --streams 512,2048 --pin --kills 5
    python benchmarks/relay_processes.py --streams 64 --slices 4 --against ../base   # another tree

With `--against TREE` (a `git worktree` of another commit) the arms are this tree and that one,
each with the first `--relays` count of relay processes (no one-process arm): the same-run
comparison of two trees' costs per step and per chunk, each cluster running its tree's code.

With `--pin` the gateway's processes (daemon, relays) run on the last core and the simulated
worker and the clients on the others, so that the load generator does not take the relays' core
(on 2 cores the relays share one core: it shows each process's cost, not a gain from more cores).
With `--kills K`, after the slices, a relay of the first relay-process cluster is killed with -9 K
times under load (`--kill-streams`): how soon its replacement is connected to the scheduler (the
supervisor starts it; its imports are most of the time), and what the clients saw. Each victim
has run the supervisor's STABLE_RUN_S first, so no restart waits out the crash-loop backoff.

Two clusters (or more, one per `--relays` value) come up through the real CLI, each on one
simulated worker at full speed (`engine.time_scale: 0`, every step as fast as Python takes it):
the real supervisor, daemon and relay processes. Per concurrency, closed-loop streamed chat
requests (relay_throughput.py's clients, named programs, one SSE chunk per token) go to each
cluster in turn, in slices (ABBA), from `--clients` processes. Per arm:

- chunks/s and the p50 of the time to first token and of the whole request (clients' view);
- the relays' CPU per chunk (µs) and per step (ms): the relay processes' utime + stime over the
  slice divided by the chunks and requests the clients read in all of it; with one relay that is
  the daemon's, which relays and schedules in one process;
- the scheduler's CPU per step (ms): the daemon's, where relay processes do the relaying;
- messages per step: frames the relays sent the daemon over the requests.

The first token's p50 at 1 stream, relays against one process, is what the two calls (the
admission, and the answer's end before its last event goes) add. 1 / (relay CPU per chunk) is the chunks/s one relay core carries:
the cluster it serves is that over the chunks/s a worker sends (its decode rate over the
profile's `engine.stream_interval`).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import httpx
import psutil
import yaml
from relay_throughput import ClientJob, ClientResult, arm_order, ms, run_client
from rich.console import Console
from rich.table import Table

from thunderctl.daemon.supervisor import STABLE_RUN_S
from thunderctl.processes import pick_free_ports
from thunderctl.profile import PROFILES_DIR

ANSWER_TOKENS = 64


@dataclass
class ArmFigures:
    tree: str  # "this", or the `--against` tree
    relays: int
    streams: int
    chunks_per_s: float
    ttft_p50_s: float | None
    total_p50_s: float | None
    relay_cpu_us_per_chunk: float
    relay_cpu_ms_per_step: float
    scheduler_cpu_ms_per_step: float | None  # the daemon's, with relay processes
    messages_per_step: float | None
    failed: int


class Cluster:
    """A simulated cluster with `relays` relay processes, through the CLI, in `directory`; of the code
    of `tree` (a checkout's root) when given, else of this one."""

    def __init__(self, directory: Path, relays: int, tree: Path | None = None) -> None:
        self.relays = relays
        self.name = f"relays{relays}-{secrets.token_hex(3)}"
        worker_port, gateway_port = pick_free_ports(2)
        profile = yaml.safe_load((PROFILES_DIR / "sim.yaml").read_text())
        profile |= {"cluster": self.name, "model": {"path": "sim", "served_name": "sim"}}
        profile["engine"]["time_scale"] = 0
        profile["nodes"] = [{"name": "sim-0", "transport": "local", "replicas": 1, "base_port": worker_port}]
        profile["gateway"] = {"host": "127.0.0.1", "port": gateway_port, "relays": relays}
        self.profile = directory / f"{self.name}.yaml"
        self.profile.write_text(yaml.safe_dump(profile))
        self.state_dir = directory / self.name
        self.env = os.environ | {"THUNDERCTL_STATE_DIR": str(self.state_dir)}
        # `python -m` puts its working directory first on the path: the CLI runs in the tree it is of.
        self.cwd = tree.resolve() if tree is not None else None
        if self.cwd is not None:
            self.env["PYTHONPATH"] = str(self.cwd)
        self.url = f"http://127.0.0.1:{gateway_port}"
        self.pin_to: tuple[set[int], set[int]] | None = None  # (the gateway's cores, the others')

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "thunderctl", *args], env=self.env, cwd=self.cwd, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"thunderctl {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def status(self) -> dict:
        """The daemon's /status, on its control socket (quicker than `status --json`, to poll)."""
        socket_path = next(self.state_dir.rglob("control.sock"))
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path)), base_url="http://thunderctl") as client:
            return client.get("/status").raise_for_status().json()

    def processes(self) -> tuple[psutil.Process, list[psutil.Process], dict[int, int]]:
        """The daemon, the relay processes, and each relay's messages so far (by pid); pinned, with
        the workers' processes, when `pin_to` says so (a relay started again is a new process)."""
        status = self.status()
        relays = status["gateway"].get("relays", [])
        daemon, relaying = psutil.Process(status["daemon_pid"]), [psutil.Process(r["pid"]) for r in relays]
        if self.pin_to is not None:
            gateway_cores, other_cores = self.pin_to
            for process in (daemon, *relaying):
                process.cpu_affinity(sorted(gateway_cores))
            for worker in json.loads(next(self.state_dir.rglob("state.json")).read_text())["workers"]:
                leader = psutil.Process(worker["pid"])
                for process in (leader, *leader.children(recursive=True)):
                    process.cpu_affinity(sorted(other_cores))
        return daemon, relaying, {r["pid"]: r.get("messages", 0) for r in relays}


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def run_slice(cluster: Cluster, streams: int, args: argparse.Namespace, pool: ProcessPoolExecutor) -> dict:
    daemon, relays, messages_before = cluster.processes()
    before = {p.pid: cpu_s(p) for p in [daemon, *relays]}
    start_at = time.time() + 1.0
    share = [streams // args.clients + (i < streams % args.clients) for i in range(args.clients)]
    jobs = [
        ClientJob(cluster.url, {}, n, sum(share[:i]), ANSWER_TOKENS, start_at, args.warmup_s, args.slice_s, True, 1, "")
        for i, n in enumerate(share)
        if n
    ]
    results: list[ClientResult] = [f.result() for f in [pool.submit(run_client, job) for job in jobs]]
    _, _, messages_after = cluster.processes()
    # A relay killed in the slice (--kills) has no CPU time left to read: its slice counts none.
    after = {p.pid: cpu_s(p) if p.is_running() else before[p.pid] for p in [daemon, *relays]}
    return {
        "chunks": sum(r.chunks for r in results),
        "chunks_all": sum(r.chunks_all for r in results),
        "requests_all": sum(r.requests_all for r in results),
        "failed": sum(r.failed for r in results),
        "ttft_s": [t for r in results for t in r.ttft_s],
        "total_s": [t for r in results for t in r.total_s],
        "daemon_cpu_s": after[daemon.pid] - before[daemon.pid],
        "relays_cpu_s": sum(after[p.pid] - before[p.pid] for p in relays),
        "messages": sum(messages_after.get(pid, 0) - n for pid, n in messages_before.items()),
        "window_s": args.slice_s,
    }


def restart_times(
    cluster: Cluster, streams: int, kills: int, args: argparse.Namespace, pool: ProcessPoolExecutor
) -> dict:
    """Kill a relay with -9 `kills` times, each under a slice of load; seconds until a relay of its
    number is connected again with a new pid, and the clients' requests and failures meanwhile.

    Each victim is the relay that has run longest, killed only once it has run STABLE_RUN_S: one
    killed sooner is a crash loop to the supervisor, which waits out a backoff before its restart."""
    times, failed, requests = [], 0, 0
    kill_after_s = 1.0 + args.warmup_s + args.slice_s / 3
    for _ in range(kills):
        victim = min(cluster.status()["gateway"]["relays"], key=lambda r: psutil.Process(r["pid"]).create_time())
        time.sleep(max(0.0, psutil.Process(victim["pid"]).create_time() + STABLE_RUN_S - kill_after_s - time.time()))
        with ThreadPoolExecutor(1) as background:
            running = background.submit(run_slice, cluster, streams, args, pool)
            time.sleep(kill_after_s)
            psutil.Process(victim["pid"]).kill()
            killed_at = time.perf_counter()
            while not any(
                r["relay"] == victim["relay"] and r["pid"] != victim["pid"]
                for r in cluster.status()["gateway"]["relays"]
            ):
                time.sleep(0.02)
            times.append(time.perf_counter() - killed_at)
            done = running.result()
        failed, requests = failed + done["failed"], requests + done["requests_all"]
    return {"kills": kills, "streams": streams, "restart_s": times, "requests": requests, "failed": failed}


def figures(tree: str, relays: int, streams: int, slices: list[dict]) -> ArmFigures:
    chunks_all = sum(s["chunks_all"] for s in slices) or 1
    steps = sum(s["requests_all"] for s in slices) or 1
    daemon = sum(s["daemon_cpu_s"] for s in slices)
    relaying = sum(s["relays_cpu_s"] for s in slices) if relays > 1 else daemon
    ttfts = [t for s in slices for t in s["ttft_s"]]
    totals = [t for s in slices for t in s["total_s"]]
    return ArmFigures(
        tree=tree,
        relays=relays,
        streams=streams,
        chunks_per_s=sum(s["chunks"] for s in slices) / sum(s["window_s"] for s in slices),
        ttft_p50_s=statistics.median(ttfts) if ttfts else None,
        total_p50_s=statistics.median(totals) if totals else None,
        relay_cpu_us_per_chunk=relaying / chunks_all * 1e6,
        relay_cpu_ms_per_step=relaying / steps * 1e3,
        scheduler_cpu_ms_per_step=daemon / steps * 1e3 if relays > 1 else None,
        messages_per_step=sum(s["messages"] for s in slices) / steps if relays > 1 else None,
        failed=sum(s["failed"] for s in slices),
    )


def milli(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def render(rows: list[ArmFigures], console: Console) -> None:
    table = Table(title="relay processes, arms in the same run (ABBA slices; times in ms)")
    for column in ("streams", "tree", "relays", "chunks/s", "TTFT p50", "request p50", "relay µs/chunk",
                   "relay ms/step", "scheduler ms/step", "messages/step", "failed"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            str(r.streams), r.tree, str(r.relays), f"{r.chunks_per_s:,.0f}", ms(milli(r.ttft_p50_s)),
            ms(milli(r.total_p50_s)),
            f"{r.relay_cpu_us_per_chunk:.0f}", f"{r.relay_cpu_ms_per_step:.2f}",
            "–" if r.scheduler_cpu_ms_per_step is None else f"{r.scheduler_cpu_ms_per_step:.3f}",
            "–" if r.messages_per_step is None else f"{r.messages_per_step:.1f}", str(r.failed),
        )  # fmt: skip
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="64,512", help="concurrent streams, comma-separated")
    parser.add_argument("--relays", default="2", help="relay processes of the other arms (the first arm: 1)")
    parser.add_argument("--against", type=Path, help="another tree (a worktree's root): its arm against this tree's")
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    parser.add_argument("--slices", type=int, default=2, help="slices per arm and concurrency (ABBA order)")
    parser.add_argument("--slice-s", type=float, default=20.0, help="measured seconds per slice")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="seconds of load before each slice's window")
    parser.add_argument("--pin", action="store_true", help="the gateway's processes on the last core, the rest off it")
    parser.add_argument("--kills", type=int, default=0, help="relays killed with -9 under load, after the slices")
    parser.add_argument("--kill-streams", type=int, default=64, help="concurrent streams while relays are killed")
    parser.add_argument("--out", type=Path, default=Path("results/relay_processes.json"))
    args = parser.parse_args()
    counts = [int(n) for n in args.relays.split(",")]
    # Each arm: its name, its relay processes and its tree (None: this one).
    arms: dict[str, tuple[int, Path | None]] = (
        {"this": (counts[0], None), str(args.against): (counts[0], args.against)}
        if args.against is not None
        else {str(n): (n, None) for n in [1, *counts]}
    )
    if args.against is not None and not (args.against / "thunderctl" / "__init__.py").is_file():
        raise SystemExit(f"--against {args.against}: not a thunderctl checkout (no thunderctl/__init__.py there)")
    cores = set(os.sched_getaffinity(0))
    if args.pin and len(cores) < 2:
        raise SystemExit("--pin needs 2 cores or more: one for the gateway's processes, the others for the load")
    pin_to = ({max(cores)}, cores - {max(cores)}) if args.pin else None
    restarts: dict | None = None
    console = Console()
    rows: list[ArmFigures] = []
    with tempfile.TemporaryDirectory(prefix="relays-bench-") as directory:
        clusters = {arm: Cluster(Path(directory), n, tree) for arm, (n, tree) in arms.items()}
        for cluster in clusters.values():
            cluster.pin_to = pin_to
        try:
            for cluster in clusters.values():
                cluster.cli("up", "-f", str(cluster.profile))
            for cluster in clusters.values():
                while cluster.relays > 1 and len(cluster.status()["gateway"].get("relays", [])) < cluster.relays:
                    time.sleep(0.5)
            pinned = {"initializer": os.sched_setaffinity, "initargs": (0, pin_to[1])} if pin_to else {}
            with ProcessPoolExecutor(args.clients, mp_context=get_context("spawn"), **pinned) as pool:
                for streams in (int(n) for n in args.streams.split(",")):
                    done: dict[str, list[dict]] = {arm: [] for arm in arms}
                    for arm in arm_order(tuple(arms), args.slices, flip=False):
                        console.print(f"[dim]{streams} streams, arm {arm}…[/]")
                        done[arm].append(run_slice(clusters[arm], streams, args, pool))
                    rows.extend(
                        figures("this" if tree is None else str(tree), n, streams, done[arm])
                        for arm, (n, tree) in arms.items()
                    )
                render(rows, console)
                if args.kills:
                    console.print(f"[dim]{args.kills} relay kills under load…[/]")
                    killed = next(arm for arm, (n, tree) in arms.items() if n > 1 and tree is None)
                    restarts = restart_times(clusters[killed], args.kill_streams, args.kills, args, pool)
        finally:
            for cluster in clusters.values():
                subprocess.run(
                    [sys.executable, "-m", "thunderctl", "down"], env=cluster.env, cwd=cluster.cwd, capture_output=True
                )
    if restarts is not None:
        back = restarts["restart_s"]
        console.print(
            f"a relay killed -9 under {restarts['streams']} streams, {restarts['kills']} times: back (connected to the "
            f"scheduler) in {statistics.median(back):.2f} s p50, {max(back):.2f} s max; "
            f"{restarts['failed']} of {restarts['requests']} requests failed meanwhile"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"arms": [asdict(r) for r in rows], "pinned": pin_to is not None, "restarts": restarts},
            indent=2,
            default=sorted,
        )
    )
    console.print(f"written to {args.out}")


if __name__ == "__main__":
    main()
