"""The Docker labels thunderctl puts on the containers it starts, shared by sandboxes and workers.

Both kinds carry the cluster's name; `thunderctl.role` tells them apart, so that the sandbox
reaper can ask Docker for sandboxes alone and never meets a Docker-installed vLLM worker.
"""

from __future__ import annotations

LABEL_CLUSTER = "thunderctl.cluster"
LABEL_ROLE = "thunderctl.role"
ROLE_SANDBOX = "sandbox"
ROLE_WORKER = "worker"
LABEL_WORKER = "thunderctl.worker"  # a worker's id
LABEL_PROGRAM = "thunderctl.program"  # a sandbox's program, empty for one born in the warm pool
LABEL_LEASE = "thunderctl.lease"  # a sandbox's id; only sandboxes have ever carried it


def sandbox_selectors(cluster: str) -> list[list[str]]:
    """Docker label filters (each list ANDed by Docker) that together select a cluster's sandboxes:
    those labelled with the sandbox role, and those made before roles existed, which are known by
    their lease label. A worker matches neither, whichever thunderctl started it."""
    cluster_label = f"{LABEL_CLUSTER}={cluster}"
    return [[cluster_label, f"{LABEL_ROLE}={ROLE_SANDBOX}"], [cluster_label, LABEL_LEASE]]


def is_sandbox(labels: dict[str, str], cluster: str) -> bool:
    """The same selection as `sandbox_selectors`, for listings Docker cannot filter (`docker system df`)."""
    return labels.get(LABEL_CLUSTER) == cluster and (labels.get(LABEL_ROLE) == ROLE_SANDBOX or LABEL_LEASE in labels)
