"""The no-learning-signal alert: fires after a window of steps without a gradient, clears when it returns, resumes."""
import pytest

from molt_engine import Env, NullSink, Observation, Result, RunConfig, register, train
from molt_engine.alerts import Alerts

QUIET = {"stale_episodes_dropped": 0, "staleness_max": 0.0, "mismatch_kl": 0.0}


def step_metrics(grad_norm: float, reward_std: float, pass_rate: float = 0.0) -> dict:
    return {**QUIET, "grad_norm": grad_norm, "reward_std": reward_std, "reward_mean": 0.0, "pass_rate": pass_rate}


def check(alerts: Alerts, step: int, metrics: dict) -> list[tuple[str, dict]]:
    return [(message, data) for kind, message, data in alerts.check(step, metrics, trained=16) if kind == "no_signal"]


def test_no_signal_fires_after_the_window_clears_when_the_signal_returns_and_resumes():
    alerts = Alerts(RunConfig.model_validate({"env": "max_digit", "alerts": {"no_signal_steps": 3}}).alerts)
    flat, learning = step_metrics(0.0, 0.0), step_metrics(0.7, 0.4, 0.5)
    fired = {step: check(alerts, step, m) for step, m in enumerate([flat, flat, learning, flat, flat, flat, flat])}
    assert [step for step, got in fired.items() if got] == [5]  # the streak at 0-1 was broken at 2; 3-5 is 3 long
    [(message, data)] = fired[5]
    assert data == {"step": 5, "metric": "no_signal", "value": 3, "threshold": 3}
    assert "too hard or too easy" in message and "warm start" in message
    resumed = Alerts(alerts.cfg)  # a resumed run remembers the streak and that it already alerted
    resumed.load_state_dict(alerts.state_dict())
    assert check(resumed, 7, flat) == []
    assert check(resumed, 8, learning) == []  # the signal is back: cleared, so the next streak alerts again
    assert "no_signal" not in resumed.alerting and resumed.no_signal == 0
    # Grad norm 0 alone (rewards differ across groups, never within one) is no signal either; a solved task says so.
    got = [check(resumed, step, step_metrics(0.0, 0.3, pass_rate=1.0)) for step in (9, 10, 11)]
    assert [len(g) for g in got] == [0, 0, 1] and "solved" in got[2][0][0]
    # Defaults: a window of 10 steps; None turns it off; older checkpoints (no streak recorded) still load.
    default = RunConfig.model_validate({"env": "max_digit"}).alerts
    assert default.no_signal_steps == 10
    off = Alerts(RunConfig.model_validate({"env": "max_digit", "alerts": {"no_signal_steps": None}}).alerts)
    assert all(check(off, step, flat) == [] for step in range(20))
    old = Alerts(default)
    old.load_state_dict({"recent_stale": [], "alerting": []})
    assert old.no_signal == 0


@register
class FlatReward(Env):
    """Every answer earns 0: no group ever has a reward to learn from."""
    name = "test_flat_reward"
    max_turns, max_tokens = 1, 2

    async def reset(self, seed):
        return Observation("say anything:")

    async def step(self, action):
        return Result(reward=0.0, terminated=True)


class Recorder(NullSink):
    def __init__(self):
        self.alerts, self.steps = [], {}

    def metrics(self, step, values):
        self.steps[step] = values

    def alert(self, kind, message, **data):
        self.alerts.append({"kind": kind, "message": message, **data})


def test_a_real_run_without_reward_signal_raises_the_alert_through_its_sink():
    sink = Recorder()
    train({"env": "test_flat_reward", "loop": {"steps": 4, "groups_per_step": 2, "group_size": 2, "eval_every": 0},
           "alerts": {"no_signal_steps": 3}}, sink)
    assert all(s["grad_norm"] == 0 and s["reward_std"] == 0 for s in sink.steps.values())
    [alert] = [a for a in sink.alerts if a["kind"] == "no_signal"]
    assert alert["step"] == 2 and alert["value"] == 3 and "no learning signal for 3 steps" in alert["message"]


@pytest.mark.timeout(120)  # before: every group filtered, sampling forever without a metric
def test_filtering_every_group_counts_them_and_steps_go_on_without_signal():
    """algo.filter_zero_variance when every group is flat: at most a batch's worth is filtered per step (counted in
    groups_filtered), then the step trains the next batch as it comes, without signal, and the alert fires."""
    sink = Recorder()
    summary = train({"env": "test_flat_reward", "algo": {"filter_zero_variance": True}, "alerts": {"no_signal_steps": 3},
                     "loop": {"steps": 4, "groups_per_step": 2, "group_size": 2, "eval_every": 0}}, sink)
    assert summary["status"] == "completed" and sorted(sink.steps) == [0, 1, 2, 3]
    assert [s["groups_filtered"] for s in sink.steps.values()] == [2, 2, 2, 2]
    assert all(s["grad_norm"] == 0 for s in sink.steps.values())
    [alert] = [a for a in sink.alerts if a["kind"] == "no_signal"]
    assert alert["step"] == 2
