"""Run-health alerts (staleness, mismatch, no learning signal) from a step's metrics; resumes via state_dict."""
from collections import deque


class Alerts:
    """Fires once when a metric crosses its threshold, again only after it recovered. The trainer sends what
    `check` returns; this only keeps the books (the recent stale-dropped counts, which metrics are above now)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.recent_stale: deque = deque(maxlen=cfg.window)  # (dropped, trained) samples per step
        self.alerting: set[str] = set()                       # metrics above their threshold now
        self.no_signal = 0                                    # steps in a row without a learning signal

    def check(self, step: int, metrics: dict, trained: int) -> list[tuple[str, str, dict]]:
        """Adds `stale_share` to metrics; returns the alerts to raise as (kind, message, data)."""
        cfg = self.cfg
        self.recent_stale.append((metrics["stale_episodes_dropped"], trained))
        dropped = sum(d for d, _ in self.recent_stale)
        metrics["stale_share"] = share = dropped / max(1, dropped + sum(t for _, t in self.recent_stale))
        checks = [("stale_share", "staleness", share, cfg.stale_share,
                   f"{share:.0%} of samples in the last {len(self.recent_stale)} steps were dropped as too stale"),
                  ("staleness_max", "staleness", metrics["staleness_max"], cfg.staleness_reaches,
                   f"a trained token was {metrics['staleness_max']:.0f} versions old"),
                  ("mismatch_kl", "mismatch", metrics["mismatch_kl"], cfg.mismatch_kl,
                   f"KL between behaviour and recomputed log-probs is {metrics['mismatch_kl']:.3g}")]
        # Every advantage is 0 when each group's rewards are equal (and no distillation teacher adds its own): the
        # loss has no gradient, nothing is learnt.
        flat = metrics.get("reward_std") == 0 and "teacher_kl" not in metrics
        self.no_signal = self.no_signal + 1 if metrics.get("grad_norm") == 0 or flat else 0
        cause = ("Every episode succeeds: the task is solved for this policy; stop, or try a harder task"
                 if metrics.get("pass_rate") == 1 else "The task is too hard or too easy for this policy; try a warm "
                 "start (warm_start.steps), a larger loop.group_size or another algo.lr")
        why = (f"no learning signal for {self.no_signal} steps in a row (grad norm "
               f"{metrics.get('grad_norm', 0):.3g}, reward std {metrics.get('reward_std', 0):.3g}): every group's "
               f"rewards are equal, so every advantage is 0. {cause}")
        checks.append(("no_signal", "no_signal", self.no_signal, cfg.no_signal_steps, why))
        alerts = []
        for name, kind, value, threshold, message in checks:
            reaches = name in ("staleness_max", "no_signal")
            above = threshold is not None and value >= threshold if reaches else value > threshold
            if above and name not in self.alerting:
                alerts.append((kind, f"step {step}: {message} (threshold {threshold})",
                               {"step": step, "metric": name, "value": value, "threshold": threshold}))
            (self.alerting.add if above else self.alerting.discard)(name)
        return alerts

    def state_dict(self) -> dict:
        return {"recent_stale": list(self.recent_stale), "alerting": sorted(self.alerting), "no_signal": self.no_signal}

    def load_state_dict(self, state: dict):
        self.recent_stale.extend(state["recent_stale"])
        self.alerting = set(state["alerting"])
        self.no_signal = state.get("no_signal", 0)  # absent from checkpoints of older versions
