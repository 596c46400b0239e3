"""Which containers a program may adopt (`sandboxes.adopt`). An adopted container is removed with
its program, so whoever holds the gateway key must not be able to hand over what is not the
program's: a database, another team's service, another cluster's workers."""

from __future__ import annotations

from thunderctl.docker_labels import LABEL_CLUSTER, LABEL_ROLE, ROLE_WORKER
from thunderctl.sandbox.config import AdoptPolicy
from thunderctl.sandbox.host import ContainerInfo
from thunderctl.sandbox.lease import Sandbox

ANY_RISK = "`any` takes any container, at the risk of removing what is not the program's"


def adoption_refusal(
    info: ContainerInfo, cluster: str, policy: AdoptPolicy, program_id: str, began_at: float
) -> str | None:
    """Why `program_id` (first heard of at `began_at`, Unix time) may not adopt this container, or None.
    For a container none of the pool's sandboxes holds (those are `holder_refusal`'s)."""
    short = info.id[:12]
    owner, role = info.labels.get(LABEL_CLUSTER), info.labels.get(LABEL_ROLE)
    if policy is AdoptPolicy.OFF:
        return f"container {short} cannot be adopted: adoption is off in this cluster's profile (sandboxes.adopt: off)"
    if owner == cluster:
        what = "worker" if role == ROLE_WORKER else "sandbox, held by no live program (the reaper removes it)"
        return f"container {short} is this cluster's own {what}: a program cannot adopt it"
    if policy is AdoptPolicy.ANY:
        return None
    if owner is not None:
        return (
            f"container {short} belongs to thunderctl cluster {owner!r} ({LABEL_CLUSTER}), not to this "
            f"cluster {cluster!r}: a program adopts only containers it started itself"
        )
    if role is not None:
        return f"container {short} is a thunderctl {role} ({LABEL_ROLE}={role}): a program adopts only containers it started itself"
    if info.created < began_at:
        return (
            f"container {short} was created {began_at - info.created:.1f} s before program {program_id!r} began "
            f"(its first request to this cluster): a program adopts only containers it started itself "
            f"(sandboxes.adopt: recent; {ANY_RISK})"
        )
    return None


def holder_refusal(sandbox: Sandbox, program_id: str) -> str | None:
    """Why `program_id` may not adopt the container one of the pool's sandboxes holds, or None
    (the sandbox is its own: handed back as it is). Whatever `sandboxes.adopt` says: another
    program's release would remove it."""
    if sandbox.program_id == program_id:
        return None
    short = (sandbox.container_id or "")[:12]
    if sandbox.is_warm:
        return (
            f"container {short} is in this cluster's warm pool: POST /v1/sandboxes for a sandbox of the program's own"
        )
    return (
        f"container {short} is sandbox {sandbox.id} of program {sandbox.program_id!r}: a program cannot adopt "
        "another program's sandbox"
    )
