"""When the daemon starts a dead worker again: at once the first time, then with a doubling backoff."""

from __future__ import annotations

from dataclasses import dataclass, field

from thunderctl.processes import backoff_s
from thunderctl.profile import RestartPolicy


@dataclass
class _Restarts:
    since_healthy: int = 0  # restarts that have not (yet) given a healthy worker
    not_before_s: float = 0.0


@dataclass
class RestartPlanner:
    """Pure: given what each check sees of a worker, says whether to restart it now.

    A worker that comes back healthy resets its backoff; one that keeps dying (a bad flag, a
    full disk) is retried ever more slowly, up to `max_backoff_s` apart, never given up on.
    """

    policy: RestartPolicy
    _workers: dict[str, _Restarts] = field(default_factory=dict)

    def should_restart(self, worker_id: str, *, alive: bool, healthy: bool, now_s: float) -> bool:
        restarts = self._workers.setdefault(worker_id, _Restarts())
        if alive:
            if healthy:
                restarts.since_healthy = 0
            return False
        return self.policy.enabled and now_s >= restarts.not_before_s

    def restarted(self, worker_id: str, now_s: float) -> None:
        restarts = self._workers.setdefault(worker_id, _Restarts())
        restarts.since_healthy += 1
        restarts.not_before_s = now_s + backoff_s(
            restarts.since_healthy, self.policy.initial_backoff_s, self.policy.max_backoff_s
        )
