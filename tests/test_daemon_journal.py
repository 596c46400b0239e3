"""Programs survive a daemon's death: a cluster of simulated workers through the real CLI, its daemon
killed with SIGKILL between two journal writes (daemon/journal.py) and started again by its supervisor.
The new daemon serves the same programs under the same ids, finds a derived conversation's program
through the restored index, and pauses the programs of a worker that died meanwhile.

One cluster serves the module; each test kills the daemon once.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from support import Cli, RunningCluster, sim_profile, wait_for
from thunderctl.daemon.client import daemon_answers, fetch_status
from thunderctl.processes import pid_alive

MODEL = "qwen3-32b"  # profiles/sim.yaml's served name
TICK_S = 1.0  # the scheduler's tick, at which the journal is written
# What /programs must show the same after the restart (`status` may change: a tick may place a paused program).
KEPT = ("program_id", "steps", "group", "parent", "tokens", "derived")


class Cluster(RunningCluster):
    @property
    def gateway(self) -> str:
        return fetch_status(self.state()).endpoint.removesuffix("/v1")

    def programs(self) -> dict[str, dict[str, Any]]:
        programs = httpx.get(f"{self.gateway}/programs", timeout=60).json()["programs"]
        return {p["program_id"]: p for p in programs}

    def ask(self, messages: list[dict[str, str]], **fields: Any) -> dict[str, Any]:
        body = {"model": MODEL, "max_tokens": 8, "messages": messages, **fields}
        response = httpx.post(f"{self.gateway}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]

    def ask_streamed(self, messages: list[dict[str, str]]) -> str:
        """The answer's text, as a streaming client puts it together from the deltas up to [DONE]."""
        body = {"model": MODEL, "max_tokens": 8, "messages": messages, "stream": True}
        text, done = [], False
        with httpx.stream("POST", f"{self.gateway}/v1/chat/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                done = done or line == "data: [DONE]"
                if line.startswith("data: {"):
                    text += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
        assert done, "the stream ended without its [DONE]"
        return "".join(text)

    def journaled(self) -> None:
        """Wait for a journal write of the state as it is now (the next tick's)."""
        now = time.time()
        wait_for(lambda: (fetch_status(self.state()).daemon.journal.written_at or 0) > now, 30, "a journal write")

    def kill_daemon(self) -> None:
        """SIGKILL, and wait until its successor answers."""
        pid = fetch_status(self.state()).daemon_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 30, "the daemon's end")
        wait_for(lambda: daemon_answers(self.state()) and fetch_status(self.state()).daemon_pid != pid, 120,
                 "the next daemon")  # fmt: skip


def kept(programs: dict[str, dict[str, Any]]) -> dict[str, tuple]:
    return {i: tuple(p[key] for key in KEPT) for i, p in programs.items()}


def up(directory: Path, workers: int, tick_s: float, relays: int = 1) -> Cluster:
    name = f"journal-{secrets.token_hex(3)}"
    profile = sim_profile(name, workers, time_scale=0.1)
    profile["scheduler"] = {"tick_interval_s": tick_s}
    profile["gateway"]["relays"] = relays
    path = directory / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    cli = Cli(directory / "state")
    cli("up", "-f", str(path))
    return Cluster(cli, path, name)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    cluster = up(tmp_path_factory.mktemp("journal"), 2, TICK_S)
    yield cluster
    cluster.cli("down", check=False)


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-relays"])
def untick(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """A cluster whose tick (and so the journal's whole write) comes once in ten minutes: what the
    next daemon finds of an answer was written at the answer. With relay processes too: the answer's
    end is then a message, and its last event waits for the daemon's reply after the write."""
    cluster = up(tmp_path_factory.mktemp("untick"), 1, 600.0, relays=request.param)
    yield cluster
    cluster.cli("down", check=False)


@pytest.mark.slow
def test_a_daemon_killed_between_two_ticks_comes_back_with_the_same_programs(cluster: Cluster) -> None:
    for n in range(4):
        for step in range(n + 1):
            cluster.ask([{"role": "user", "content": f"named {n}, step {step}"}], program_id=f"named-{n}",
                        group_id=f"task-{n % 2}")  # fmt: skip
    cluster.journaled()
    before = cluster.programs()
    assert {f"named-{n}" for n in range(4)} <= set(before)

    cluster.kill_daemon()
    after = cluster.programs()
    assert kept(after) == kept(before)
    assert fetch_status(cluster.state()).daemon.journal.restored_programs == len(before)
    cluster.ask([{"role": "user", "content": "named 3, next step"}], program_id="named-3", group_id="task-1")
    assert cluster.programs()["named-3"]["steps"] == before["named-3"]["steps"] + 1


@pytest.mark.slow
def test_a_derived_conversation_continued_after_the_restart_stays_its_program(cluster: Cluster) -> None:
    history = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix utils.py, please"}]
    known = set(cluster.programs())
    answer = cluster.ask(history)  # names no program: one is derived from its conversation
    (derived,) = set(cluster.programs()) - known
    history += [{"role": "assistant", "content": answer["content"]}, {"role": "user", "content": "ran: 1 failed"}]
    cluster.journaled()

    cluster.kill_daemon()
    cluster.ask(history)  # the client, unchanged, sends its next turn
    programs = cluster.programs()
    assert set(programs) - known == {derived}
    assert programs[derived]["steps"] == 2 and programs[derived]["derived"]


@pytest.mark.slow
def test_a_program_whose_worker_died_with_the_daemon_waits_in_the_queue_not_lost(cluster: Cluster) -> None:
    state = cluster.state()
    victim = state.workers[1]
    n = 0
    while not any(p["backend"] == victim.id for p in cluster.programs().values()):
        n += 1
        cluster.ask([{"role": "user", "content": f"placed {n}"}], program_id=f"placed-{n}")
        assert n < 50, f"no program was placed on {victim.id}"
    moved = {i: p for i, p in cluster.programs().items() if p["backend"] == victim.id}
    cluster.journaled()

    os.killpg(victim.pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(victim.pid), 30, "the worker's end")
    cluster.kill_daemon()
    after = cluster.programs()
    for program_id, program in moved.items():
        assert program_id in after, f"{program_id} was lost"
        assert after[program_id]["steps"] == program["steps"]
        assert after[program_id]["status"] == "paused" or after[program_id]["backend"] != victim.id
    program_id = next(iter(moved))
    cluster.ask([{"role": "user", "content": "and on"}], program_id=program_id)  # served, on the worker left
    assert cluster.programs()[program_id]["steps"] == moved[program_id]["steps"] + 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.slow
def test_a_derived_answer_the_client_has_is_found_by_a_daemon_killed_right_after(untick: Cluster, stream) -> None:
    history = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": f"Fix io.py ({stream})"}]
    known = set(untick.programs())
    answer = untick.ask_streamed(history) if stream else untick.ask(history)["content"]
    (derived,) = set(untick.programs()) - known

    untick.kill_daemon()  # no tick since the answer
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "ran: 1 failed"}]
    untick.ask(history)
    programs = untick.programs()
    assert set(programs) - known == {derived}
    assert programs[derived]["steps"] == 2 and programs[derived]["derived"]


@pytest.mark.slow
def test_a_responses_chain_goes_on_from_a_daemon_killed_right_after_its_answer(untick: Cluster) -> None:
    turn = {"model": MODEL, "max_output_tokens": 8, "input": "List the files."}
    first = httpx.post(f"{untick.gateway}/v1/responses", json=turn, timeout=120)
    assert first.status_code == 200, first.text

    untick.kill_daemon()
    then = {**turn, "input": "Now the tests.", "previous_response_id": first.json()["id"]}
    second = httpx.post(f"{untick.gateway}/v1/responses", json=then, timeout=120)
    assert second.status_code == 200, second.text
