"""Pytest plugin: a real sshd on 127.0.0.2 and 127.0.0.3, two "nodes" on this machine.

Host key, user keys, authorized_keys and the config live in a temp dir; the server runs in the
foreground (-D) as our child and is stopped by its pid. The only fake is nvidia-smi (no GPU
here): the sessions' PATH starts with a directory whose nvidia-smi prints a recorded 8×H100
query from tests/data, after checking it was asked exactly that query.
"""

from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from thunderctl.cluster.gpus import NVIDIA_SMI_QUERY
from thunderctl.processes import pick_free_port, port_free

SSHD = Path("/usr/sbin/sshd")
NODE_ADDRESSES = ("127.0.0.2", "127.0.0.3")
DATA = Path(__file__).with_name("data")
SSHD_START_TIMEOUT_S = 10.0
# sshd refuses to start without its privilege-separation directory (the Debian service makes it).
PRIVSEP_DIR = Path("/run/sshd")


@dataclass(frozen=True)
class SshNodes:
    directory: Path
    port: int
    user: str
    key: Path
    wrong_key: Path
    log: Path

    def node(self, name: str, address: str, **fields: object) -> dict[str, object]:
        """A profile node on one of the addresses, logging in with the authorized key."""
        return {
            "name": name,
            "transport": "ssh",
            "host": address,
            "port": self.port,
            "user": self.user,
            "key": str(self.key),
            **fields,
        }

    @staticmethod
    def free_port() -> int:
        """A port free on both node addresses."""
        while True:
            port = pick_free_port(NODE_ADDRESSES[0])
            if all(port_free(address, port) for address in NODE_ADDRESSES):
                return port

    def record_gpus(self, recording: str) -> None:
        """What the nodes' nvidia-smi prints from now on: a file of tests/data."""
        shutil.copy(DATA / recording, self.directory / "nvidia-smi.csv")


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


def fake_nvidia_smi(directory: Path) -> Path:
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    expected = NVIDIA_SMI_QUERY.removeprefix("nvidia-smi ")
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'[ "$*" = "{expected}" ] || {{ echo "fake nvidia-smi: unexpected arguments: $*" >&2; exit 2; }}\n'
        f"grep -v '^#' {directory / 'nvidia-smi.csv'}\n"
    )
    script.chmod(0o755)
    return bin_dir


def write_config(directory: Path, port: int, host_key: Path, authorized: Path, bin_dir: Path) -> Path:
    listen = "".join(f"ListenAddress {address}:{port}\n" for address in NODE_ADDRESSES)
    config = directory / "sshd_config"
    config.write_text(
        f"{listen}"
        f"HostKey {host_key}\n"
        f"PidFile {directory / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {authorized}\n"
        # The temp dir's parents are world-writable (/tmp), which strict modes reject.
        "StrictModes no\n"
        "UsePAM no\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\n"
        f"SetEnv PATH={bin_dir}:/usr/local/bin:/usr/bin:/bin\n"
    )
    return config


def wait_listening(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + SSHD_START_TIMEOUT_S
    while not all(accepts(address, port) for address in NODE_ADDRESSES):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"sshd did not start (exit {process.poll()}):\n{log.read_text()}")
        time.sleep(0.1)


def accepts(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1):
            return True
    except OSError:
        return False


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def ssh_nodes(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[SshNodes]:
    if not SSHD.exists():
        # A missing server is a broken setup, not a reason to skip: fail loudly.
        pytest.fail(f"{SSHD} is missing: apt-get install -y openssh-server", pytrace=False)
    directory = tmp_path_factory.mktemp("sshd")
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    key = keygen(directory / "node_key")
    wrong_key = keygen(directory / "unknown_key")
    authorized = directory / "authorized_keys"
    authorized.write_text(key.with_suffix(".pub").read_text())
    port = SshNodes.free_port()
    config = write_config(directory, port, keygen(directory / "host_key"), authorized, fake_nvidia_smi(directory))
    nodes = SshNodes(directory, port, getpass.getuser(), key, wrong_key, directory / "sshd.log")
    nodes.record_gpus("nvidia-smi-8xh100.csv")
    process = subprocess.Popen([str(SSHD), "-D", "-f", str(config), "-E", str(nodes.log)])
    request.addfinalizer(lambda: stop(process))
    wait_listening(process, port, nodes.log)
    yield nodes
