"""When the launcher restarts a process that died, and when it gives up (compose's
``restart: on-failure`` and Kubernetes' crash-loop back-off, for ``make run``).

Life cycle per process name: ``died(name, now)`` → a delay before the restart (doubling from
``initial_backoff_s`` up to ``max_backoff_s`` with each death inside ``window_s``), or None once
``budget`` restarts were spent within the window: the process keeps dying, so it is reported and
left down while the others keep serving. Pure bookkeeping; the clock is the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    budget: int = 5
    """Restarts allowed within ``window_s``; 0: never restart (a death is reported only)."""
    window_s: float = 300.0
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"restart budget must be >= 0, got {self.budget}")
        if self.window_s <= 0 or self.initial_backoff_s < 0:
            raise ValueError("window_s must be > 0 and initial_backoff_s >= 0")
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("max_backoff_s must be >= initial_backoff_s")


@dataclass
class RestartBook:
    policy: RestartPolicy
    _restarts: dict[str, list[float]] = field(default_factory=dict)

    def died(self, name: str, now: float) -> float | None:
        """The delay before restarting ``name``, or None: its budget is spent, leave it down."""
        recent = [t for t in self._restarts.get(name, []) if now - t < self.policy.window_s]
        if len(recent) >= self.policy.budget:
            self._restarts[name] = recent
            return None
        delay = min(self.policy.initial_backoff_s * 2.0 ** len(recent), self.policy.max_backoff_s)
        self._restarts[name] = [*recent, now + delay]
        return delay

    def restarts(self, name: str) -> int:
        return len(self._restarts.get(name, []))
