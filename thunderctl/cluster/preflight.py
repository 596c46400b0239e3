"""Checks before anything starts: each names what is wrong and how to fix it."""

from __future__ import annotations

import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from thunderctl.cluster.plan import WorkerPlan, model_path
from thunderctl.engines.local import EngineHome
from thunderctl.profile import BUILTIN_TINY_MODEL, Profile, state_root

MIN_FREE_DISK_GIB = 2.0


@dataclass(frozen=True)
class Check:
    node: str
    name: str
    ok: bool
    detail: str
    fix: str = ""


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_gib(path: Path) -> float:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / 2**30


def local_engine_checks(profile: Profile, node: str, home: EngineHome) -> list[Check]:
    engine = profile.engine
    if engine.install != "existing":
        return [Check(node, "engine", False, f"install: {engine.install} on a local node",
                      "use install: existing with the local engine (./install.sh builds it)")]
    python = Path(engine.python) if engine.python else home.python
    checks = [Check(node, "vllm", python.exists(), f"{python}",
                    "run ./install.sh (or set engine.python to a python that has vllm)")]
    model = Path(model_path(profile, home))
    if profile.model.path == BUILTIN_TINY_MODEL or model.is_absolute():
        checks.append(Check(node, "model", (model / "config.json").is_file(), str(model),
                            "run ./install.sh to build the tiny model" if profile.model.path == BUILTIN_TINY_MODEL
                            else "point model.path at a directory with config.json"))
    return checks


def preflight(profile: Profile, plans: list[WorkerPlan], home: EngineHome | None = None) -> list[Check]:
    home = home or EngineHome.default()
    checks = [Check("controller", "python", sys.version_info >= (3, 11), sys.version.split()[0], "use Python 3.11 or newer")]
    gateway = profile.gateway
    checks.append(Check("controller", f"gateway port {gateway.port}", port_free(gateway.host, gateway.port),
                        f"{gateway.host}:{gateway.port}", "stop what listens there or set gateway.port"))
    root = state_root(profile)
    disk = free_gib(root)
    checks.append(Check("controller", "disk", disk >= MIN_FREE_DISK_GIB, f"{disk:.1f} GiB free at {root}",
                        f"free at least {MIN_FREE_DISK_GIB} GiB"))
    for node in profile.nodes:
        if node.transport == "ssh":
            checks.append(Check(node.name, "transport", False, "ssh",
                                "SSH nodes are not supported by this version yet; use transport: local"))
            continue
        checks += local_engine_checks(profile, node.name, home)
    for plan in plans:
        node = next(n for n in profile.nodes if n.name == plan.node)
        if node.transport == "local":
            checks.append(Check(plan.node, f"port {plan.port}", port_free(plan.host, plan.port),
                                f"worker {plan.id}", f"stop what listens on {plan.port} or change base_port"))
    return checks
