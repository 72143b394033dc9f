"""Run-config defaults that depend on the run (model.path, GSPO), the renamed alert threshold, the CLI's merge, and
eval suites (validation; a short run whose suites report under their prefixes and pick OUT/best)."""
import json

import pytest

from app.cli import main
from molt_engine import RunConfig, train
from molt_engine.config import ValidationError, config_errors
from molt_engine.alerts import Alerts

CHECKPOINT = {"preset": None, "path": "/models/some-checkpoint"}  # validating a config never opens the directory


def config(**sections) -> RunConfig:
    return RunConfig.model_validate({"env": "max_digit", **sections})


def test_a_model_path_run_gets_checkpoint_defaults_and_a_preset_run_keeps_its_own():
    preset, checkpoint = config(), config(model=CHECKPOINT)
    assert (preset.algo.lr, preset.warm_start.steps, preset.warm_start.lr) == (3e-4, 70, 3e-3)
    assert (checkpoint.algo.lr, checkpoint.warm_start.steps, checkpoint.warm_start.lr) == (1e-6, 0, 1e-5)
    assert (checkpoint.algo.clip_low, checkpoint.algo.clip_high) == (0.2, 0.28)  # PPO's band either way


def test_explicit_values_always_win_over_run_dependent_defaults():
    cfg = config(model=CHECKPOINT, algo={"lr": 3e-4, "loss": "gspo", "clip_high": 0.28}, warm_start={"steps": 5})
    assert (cfg.algo.lr, cfg.warm_start.steps, cfg.warm_start.lr) == (3e-4, 5, 1e-5)
    assert (cfg.algo.clip_low, cfg.algo.clip_high) == (3e-4, 0.28)
    # A stored config (the daemon freezes every default in) validates to itself: the defaults are not applied twice.
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_gspo_gets_its_own_clip_band_unless_set():
    gspo, ppo = config(algo={"loss": "gspo"}), config(algo={"loss": "ppo"})
    assert (gspo.algo.clip_low, gspo.algo.clip_high) == (3e-4, 4e-4)
    assert (ppo.algo.clip_low, ppo.algo.clip_high) == (0.2, 0.28)
    assert config(algo={"loss": "gspo", "clip_low": 0.2, "clip_high": 0.28}).algo.clip_low == 0.2


def test_the_staleness_alert_threshold_has_its_own_name_and_the_old_key_still_loads():
    new, old = config(alerts={"staleness_reaches": 2}), config(alerts={"staleness_max": 2})
    assert new.alerts == old.alerts and old.alerts.staleness_reaches == 2
    assert "staleness_reaches" in new.model_dump()["alerts"] and "staleness_max" not in new.model_dump()["alerts"]
    for cfg in (new, old):
        [(kind, message, data)] = Alerts(cfg.alerts).check(
            3, {"staleness_max": 2.0, "mismatch_kl": 0.0, "stale_episodes_dropped": 0}, trained=16)
        assert kind == "staleness" and data["metric"] == "staleness_max" and data["threshold"] == 2
    assert Alerts(config().alerts).check(3, {"staleness_max": 9.0, "mismatch_kl": 0.0, "stale_episodes_dropped": 0}, 16) == []


def test_cli_model_flags_pick_the_policy_and_keep_the_configs_other_model_settings(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({
        "env": "max_digit", "model": {"preset": "tiny-chat", "dtype": "bfloat16", "device": "cpu", "dropout": True},
        "loop": {"steps": 1, "groups_per_step": 2, "group_size": 2, "eval_every": 0}, "warm_start": {"steps": 0}}))

    def molt_train(out, *flags) -> dict:
        with pytest.raises(SystemExit) as done:  # `molt train` in this process: no second import of torch
            main(["train", "--config", str(tmp_path / "run.json"), "--out", str(out), *flags])
        assert done.value.code == 0
        return json.loads((out / "config.json").read_text())["model"]

    model = molt_train(tmp_path / "preset", "--preset", "tiny-dense")
    assert (model["preset"], model["path"]) == ("tiny-dense", None)
    assert (model["dtype"], model["device"], model["dropout"]) == ("bfloat16", "cpu", True)
    model = molt_train(tmp_path / "path", "--model-path", str(tmp_path / "preset" / "final"))
    assert (model["preset"], model["path"]) == (None, str(tmp_path / "preset" / "final"))
    assert (model["dtype"], model["device"], model["dropout"]) == ("bfloat16", "cpu", True)


def errors(**sections) -> list[str]:
    with pytest.raises(ValidationError) as e:
        config(**sections)
    return config_errors(e.value)


def test_eval_suites_are_validated_like_the_training_env_with_the_field_named():
    two = config(eval={"suites": [{"name": "digits", "env": "max_digit", "episodes": 3},
                                  {"name": "calc.v1", "env": "calculator", "env_args": {"max_operand": 20}}],
                       "best": "calc.v1/eval_pass_rate"})
    assert [s.name for s in two.eval.suites] == ["digits", "calc.v1"] and config().eval.best == "eval_reward"
    assert errors(eval={"suites": [{"name": "x", "env": "nope"}]})[0].startswith("eval.suites.0.env: unknown env 'nope'")
    assert errors(eval={"suites": [{"name": "x", "env": "calculator", "env_args": {"max_operand": 1}}]}) == [
        "config: eval.suites.0 (x): env_args: calculator: max_operand must be in [10, 999999] and max_second in "
        "[2, 999999]"]
    assert "got unknown args: typo" in errors(eval={"suites": [{"name": "x", "env": "max_digit",
                                                               "env_args": {"typo": 1}}]})[0]
    assert "no chat template" in errors(eval={"suites": [{"name": "x", "env": "chat_calculator"}]})[0]
    [agent] = errors(eval={"suites": [{"name": "x", "env": "calculator_agent"}]})
    assert agent.startswith("eval.suites.0.env: env 'calculator_agent' is an agent, which needs the run's served")
    assert errors(eval={"suites": [{"name": "a/b", "env": "max_digit"}]})[0].startswith("eval.suites.0.name:")
    assert errors(eval={"suites": [{"name": "x", "env": "max_digit", "episodes": 0}]})[0].startswith(
        "eval.suites.0.episodes:")
    assert errors(eval={"suites": [{"name": "x", "env": "max_digit"}, {"name": "x", "env": "calculator"}]}) == [
        "eval: suite names must be unique, got ['x', 'x']"]
    for best in ("y/eval_reward", "x/reward_mean", "reward_mean"):
        assert errors(eval={"suites": [{"name": "x", "env": "max_digit"}], "best": best})[0].startswith(
            f"eval: best {best!r} is not an eval metric"), best


class Metrics:
    def __init__(self):
        self.steps = {}

    def metrics(self, step, values):
        self.steps.setdefault(step, {}).update(values)

    def __getattr__(self, name):  # events, alerts, checkpoints: not looked at here
        return lambda *args, **kwargs: None


def test_two_eval_suites_report_under_their_prefixes_at_every_eval_and_best_follows_the_chosen_one(tmp_path):
    sink = Metrics()
    summary = train({"env": "max_digit", "loop": {"steps": 6, "groups_per_step": 2, "group_size": 2, "eval_every": 2,
                                                   "eval_episodes": 4}, "warm_start": {"steps": 40},
                     "checkpoint": {"every": 0},
                     "eval": {"suites": [{"name": "calc", "env": "calculator", "episodes": 3},
                                         {"name": "digits", "env": "max_digit", "episodes": 12}],
                              "best": "digits/eval_reward"}}, sink, tmp_path)
    evals = {step: values for step, values in sink.steps.items() if "eval_reward" in values}
    assert sorted(evals) == [0, 2, 4, 6]
    for values in evals.values():
        for suite in ("calc", "digits"):
            assert {f"{suite}/eval_reward", f"{suite}/eval_pass_rate", f"{suite}/eval_tool_call_rate"} <= set(values)
        assert {name.split("/")[0] for name in values if "/" in name} == {"calc", "digits"}
    chosen = [evals[step]["digits/eval_reward"] for step in sorted(evals)]
    assert summary["best_step"] == sorted(evals)[chosen.index(max(chosen))] and (tmp_path / "best").is_dir()
