"""`down` forgets a cluster only once nothing of it is left: while a Docker host that holds its
sandboxes does not answer, the state directory (its record of them) is kept and `down` fails,
saying what is left and how to finish. No real service: the host is a loopback port nothing
listens on."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import Cli, write_profile
from thunderctl.cluster.state import ClusterState
from thunderctl.processes import pick_free_port
from thunderctl.sandbox.state import BoundContainer, PoolState


@pytest.mark.parametrize("profile", ["kept", "gone"])
def test_down_keeps_the_state_while_a_sandbox_host_does_not_answer(tmp_path: Path, profile: str) -> None:
    silent = f"tcp://127.0.0.1:{pick_free_port()}"
    profile_path = write_profile(tmp_path, sandboxes={"enabled": True, "hosts": [silent]})
    if profile == "gone":
        profile_path.unlink()
    root = tmp_path / "state"
    state = ClusterState("local", root / "local", str(profile_path), "http://127.0.0.1:1/v1")
    state.save()
    adopted = BoundContainer(host=silent, container_id="ab" * 32)
    PoolState(used_hosts=[silent], adopted=[adopted]).save(state.dir / "sandboxes.json")

    down = Cli(root).in_process("down")
    assert down.exit_code == 1, down.output
    said = " ".join(down.output.split())  # as wrapped for the terminal
    assert f"the state is kept in {state.dir}" in said
    assert f"no Docker engine answers at {silent}" in said and f"container {'ab' * 6} adopted on {silent}" in said
    assert "`thunderctl down` again, once Docker answers" in said
    assert PoolState.load(state.dir / "sandboxes.json").adopted == [adopted]
    assert ClusterState.load(state.dir).cluster == "local"
