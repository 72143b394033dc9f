"""Staleness and mismatch alerts: decides when a step's metrics cross a threshold; resumes via state_dict."""
from collections import deque


class Alerts:
    """Fires once when a metric crosses its threshold, again only after it recovered. The trainer sends what
    `check` returns; this only keeps the books (the recent stale-dropped counts, which metrics are above now)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.recent_stale: deque = deque(maxlen=cfg.window)  # (dropped, trained) samples per step
        self.alerting: set[str] = set()                       # metrics above their threshold now

    def check(self, step: int, metrics: dict, trained: int) -> list[tuple[str, str, dict]]:
        """Adds `stale_share` to metrics; returns the alerts to raise as (kind, message, data)."""
        cfg = self.cfg
        self.recent_stale.append((metrics["stale_dropped"], trained))
        dropped = sum(d for d, _ in self.recent_stale)
        share = dropped / max(1, dropped + sum(t for _, t in self.recent_stale))
        metrics["stale_share"] = share
        checks = [
            ("stale_share", "staleness", share, cfg.stale_share,
             f"{share:.0%} of samples in the last {len(self.recent_stale)} steps were dropped as too stale"),
            ("staleness_max", "staleness", metrics["staleness_max"], cfg.staleness_reaches,
             f"a trained token was {metrics['staleness_max']:.0f} versions old"),
            ("mismatch_kl", "mismatch", metrics["mismatch_kl"], cfg.mismatch_kl,
             f"KL between behaviour and recomputed log-probs is {metrics['mismatch_kl']:.3g}"),
        ]
        alerts = []
        for name, kind, value, threshold, message in checks:
            above = threshold is not None and value >= threshold if name == "staleness_max" else value > threshold
            if above and name not in self.alerting:
                alerts.append((kind, f"step {step}: {message} (threshold {threshold})",
                               {"step": step, "metric": name, "value": value, "threshold": threshold}))
            (self.alerting.add if above else self.alerting.discard)(name)
        return alerts

    def state_dict(self) -> dict:
        return {"recent_stale": list(self.recent_stale), "alerting": sorted(self.alerting)}

    def load_state_dict(self, state: dict):
        self.recent_stale.extend(state["recent_stale"])
        self.alerting = set(state["alerting"])
