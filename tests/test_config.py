"""Run-config defaults that depend on the run (model.path, GSPO), the renamed alert threshold, and the CLI's merge."""
import json

import pytest

from app.cli import main
from molt_engine import RunConfig
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
            3, {"staleness_max": 2.0, "mismatch_kl": 0.0, "stale_dropped": 0}, trained=16)
        assert kind == "staleness" and data["metric"] == "staleness_max" and data["threshold"] == 2
    assert Alerts(config().alerts).check(3, {"staleness_max": 9.0, "mismatch_kl": 0.0, "stale_dropped": 0}, 16) == []


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
