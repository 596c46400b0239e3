"""The gateway's `/programs` view: every program the scheduler holds, and their groups, as JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from thunderctl.gateway.gateway import Gateway


def groups_view(gateway: Gateway) -> list[dict[str, Any]]:
    """Each group the scheduler keeps: its programs that ended and all it has seen, the nearest
    done first (the groups whose programs all ended last). The daemon's `/status` shows the same rows."""
    return [{"group_id": g, "done": done, "total": total} for g, done, total in gateway.scheduler.groups.counts()]


def programs_view(gateway: Gateway) -> list[dict[str, Any]]:
    now = gateway.clock()
    return [
        {
            "program_id": p.id,
            "phase": p.phase.value,
            "status": p.status.value,
            "backend": p.worker,  # the API's key kept its old name
            "tokens": p.tokens,
            "steps": p.steps,
            "tool": p.tool,  # what its last answer called (the tool it is in while acting), or None
            "paused_s": round(p.paused_total_s + (now - p.paused_at if p.paused_at else 0), 3),
            "derived": p.id in gateway.derived,
            "group": p.group,
            "parent": p.parent,  # the program it was started from (a subagent's session), or None
        }
        for p in gateway.scheduler.programs.values()
    ]
