"""The gradient-norm circuit breaker: decides which updates are too dangerous to apply."""
import math
import statistics
from collections import deque


class Breaker:
    """Trips on a non-finite norm, on a norm above `factor` x the median of recent healthy steps (but never below
    `floor`), or above an absolute cap. The trainer acts on a trip (skip, force sync, cool down, roll back); this only keeps the books."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.healthy = deque(maxlen=cfg.window)  # norms of recent applied steps with a learning signal
        self.trips: list[int] = []                # steps of trips since the last rollback
        self.cooldown_left = self.rollbacks = 0

    def threshold(self) -> float:
        limit = self.cfg.abs_max or math.inf
        if len(self.healthy) >= self.cfg.min_history:
            limit = min(limit, max(self.cfg.floor, self.cfg.factor * statistics.median(self.healthy)))
        return limit

    def refuses(self, norm: float) -> bool:
        """Whether a pre-clip gradient norm must not be applied; records nothing (see `check`)."""
        return not math.isfinite(norm) or norm > self.threshold()

    def check(self, step: int, norm: float) -> bool:
        """Record a step's pre-clip gradient norm; True if the step must not be applied."""
        if self.refuses(norm):
            self.trips.append(step)
            self.cooldown_left = self.cfg.cooldown
            return True
        if norm > 0:  # a zero norm (no advantage signal) says nothing about the scale of healthy gradients
            self.healthy.append(norm)
        self.cooldown_left = max(0, self.cooldown_left - 1)
        return False

    def recent_trips(self, step: int) -> int:
        return sum(step - s < self.cfg.trip_window for s in self.trips)

    def state_dict(self) -> dict:
        return {"healthy": list(self.healthy), "trips": self.trips, "cooldown_left": self.cooldown_left,
                "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict):
        self.healthy.extend(state["healthy"])
        self.trips, self.cooldown_left, self.rollbacks = state["trips"], state["cooldown_left"], state["rollbacks"]
