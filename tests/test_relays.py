"""Two relay processes on the gateway's port (`gateway.relays: 2`), through the real CLI on simulated
workers (real processes, real HTTP, the real supervisor and daemon): both take connections, a
conversation continues its program whichever relay takes each turn, hundreds of programs spread
over both are each admitted once, and a relay killed under load is started again (from a spare
started ahead) while the other serves on, with no program lost. The in-process gateway tests run
at two relays as well (tests/api_fixtures.py, tests/test_gateway_relay.py).

One cluster serves the module.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from support import SHAPE, Cli, RunningCluster, live_group_members, sim_profile, wait_for
from thunderctl.bench.closed_loop import LoadSpec, Target, run_load
from thunderctl.bench.results import LoadResult
from thunderctl.daemon.status import RelayStatus
from thunderctl.gateway.requests import PROGRAM_HEADER
from thunderctl.processes import pid_alive

pytestmark = pytest.mark.slow

MODEL = "qwen3-32b"  # profiles/sim.yaml's served name


class RelayCluster(RunningCluster):
    @property
    def gateway(self) -> str:
        return self.cli.status().endpoint.removesuffix("/v1")

    def relays(self) -> dict[int | None, RelayStatus]:
        return {relay.relay: relay for relay in self.cli.status().gateway.relays}

    def chat(self, messages: list[dict], **body: object) -> httpx.Response:
        """One request on a connection of its own: the kernel gives it to either relay."""
        request = {"model": MODEL, "max_tokens": 8, "messages": messages, **body}
        return httpx.post(f"{self.gateway}/v1/chat/completions", json=request, timeout=60)

    def load(self, programs: int, concurrency: int) -> tuple[threading.Thread, list[LoadResult]]:
        """Named programs, answers whole; a request cut before its answer is sent again, as agents' SDKs do."""
        spec = LoadSpec(
            concurrency=concurrency, programs=programs, shape=SHAPE, seed=7, model=MODEL, retry_unanswered_s=30
        )
        results: list[LoadResult] = []
        gateway = self.gateway
        thread = threading.Thread(
            target=lambda: results.append(asyncio.run(run_load(Target.gateway(gateway), spec, [])))
        )
        thread.start()
        return thread, results

    def settled(self) -> bool:
        """No request in flight on any worker, and none open in any relay."""
        status = self.cli.status()
        return all(w.requests_in_flight == 0 for w in status.workers) and all(
            r.open == 0 for r in status.gateway.relays
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    directory: Path = tmp_path_factory.mktemp("relays")
    name = f"relays-{secrets.token_hex(3)}"
    profile = sim_profile(name, 2, time_scale=0.1)
    profile["gateway"]["relays"] = 2
    path = directory / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    cli = Cli(directory / "state")
    cli("up", "-f", str(path))
    running = RelayCluster(cli, path, name)
    wait_for(lambda: len(running.relays()) == 2, 30, "both relays connected")
    yield running
    cli("down", check=False)


def test_both_relays_take_connections_and_status_shows_each(cluster: RelayCluster) -> None:
    before = {n: r.requests for n, r in cluster.relays().items()}
    answers = [cluster.chat([{"role": "user", "content": f"task {n}"}], program_id=f"spread-{n}") for n in range(40)]
    assert [a.status_code for a in answers] == [200] * 40
    relays = cluster.relays()
    assert sorted(relays) == [1, 2] and len({r.pid for r in relays.values()}) == 2
    taken = {n: relays[n].requests - before[n] for n in relays}
    assert sum(taken.values()) == 40 and all(taken.values()), taken
    shown = cluster.cli.in_process("status").stdout
    assert "relays: 1 pid" in shown and "| 2 pid" in shown


def test_a_conversation_continues_its_program_whichever_relay_takes_each_turn(cluster: RelayCluster) -> None:
    for n in range(12):
        task = {"role": "user", "content": f"fix issue {n}"}
        first = cluster.chat([task])
        answer = first.json()["choices"][0]["message"]
        second = cluster.chat(
            [task, {"role": "assistant", "content": answer["content"]}, {"role": "user", "content": "ok"}]
        )
        assert first.headers[PROGRAM_HEADER] == second.headers[PROGRAM_HEADER]


def test_hundreds_of_programs_over_both_relays_are_each_admitted_once(cluster: RelayCluster) -> None:
    thread, results = cluster.load(programs=256, concurrency=64)
    thread.join(timeout=600)
    (result,) = results
    assert (result.programs_completed, result.steps_failed) == (256, 0)
    # Each request admitted once and its end told once: nothing stays counted in flight.
    wait_for(cluster.settled, 30, "every request's end told")
    programs = httpx.get(f"{cluster.gateway}/programs", timeout=30).json()["programs"]
    assert not [p for p in programs if p["program_id"].startswith(f"{result.salt}-p")]  # all released


def test_a_relay_killed_under_load_is_started_again_while_the_other_serves_and_no_program_is_lost(
    cluster: RelayCluster,
) -> None:
    killed = cluster.relays()[1]
    assert killed.pid is not None
    thread, results = cluster.load(programs=48, concurrency=16)
    wait_for(lambda: cluster.relays()[1].requests > killed.requests + 10, 60, "load through relay 1")
    os.kill(killed.pid, signal.SIGKILL)
    wait_for(lambda: 1 in cluster.relays() and cluster.relays()[1].pid != killed.pid, 30, "relay 1 started again")
    thread.join(timeout=600)
    (result,) = results
    assert (result.programs_completed, result.steps_failed) == (48, 0)
    assert not pid_alive(killed.pid)
    wait_for(cluster.settled, 30, "the killed relay's requests ended")  # its admissions freed by the daemon
    log = cluster.state().daemon_log.read_text()
    assert f"relay 1 (pid {killed.pid}) ended: killed by SIGKILL" in log


def test_a_killed_relays_place_is_taken_by_a_spare_started_before_it_died(cluster: RelayCluster) -> None:
    wait_for(lambda: set(cluster.relays()) == {1, 2}, 30, "both relays connected")
    killed = cluster.relays()[2]
    assert killed.pid is not None
    running_before = live_group_members(os.getpgid(killed.pid))
    os.kill(killed.pid, signal.SIGKILL)
    wait_for(lambda: 2 in cluster.relays() and cluster.relays()[2].pid != killed.pid, 30, "relay 2 started again")
    replacement = cluster.relays()[2].pid
    assert replacement is not None
    assert replacement in running_before  # it only had to connect
    assert all(cluster.chat([{"role": "user", "content": f"hi {n}"}]).status_code == 200 for n in range(8))


def test_the_daemon_killed_under_load_comes_back_while_the_relays_hold_its_requests(cluster: RelayCluster) -> None:
    daemon = cluster.cli.status().daemon_pid
    assert daemon is not None
    relays = {n: r.pid for n, r in cluster.relays().items()}
    thread, results = cluster.load(programs=32, concurrency=16)
    wait_for(lambda: sum(r.open for r in cluster.relays().values()) > 0, 60, "requests under way")
    os.kill(daemon, signal.SIGKILL)
    thread.join(timeout=600)
    (result,) = results
    assert (result.programs_completed, result.steps_failed, result.release_failures) == (32, 0, 0)
    status = cluster.cli.status()
    assert status.daemon_pid != daemon and {r.relay: r.pid for r in status.gateway.relays} == relays  # the same relays
    wait_for(cluster.settled, 30, "every request's end told")
