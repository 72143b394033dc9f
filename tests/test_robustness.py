"""Engine robustness: exact resume, kill -9 safety, SIGTERM, the gradient-norm breaker, alerts, drills."""
import asyncio
import json
import math
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import molt_engine.loop as loop_mod
import molt_engine.rollout as rollout_mod
import molt_engine.update as update_mod
from molt_engine import EnvFailure, NullSink, RunConfig, train
from molt_engine import checkpoint, dist
from molt_engine.alerts import Alerts
from molt_engine.breaker import Breaker
from molt_engine.inference.sampler import Request, Sampler
from conftest import wait_until

FAST = {"env": "max_digit", "loop": {"groups_per_step": 4, "group_size": 4, "eval_every": 0},
        "warm_start": {"steps": 5}}


def config(**sections):
    cfg = json.loads(json.dumps(FAST))
    for name, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(name, {}).update(values)
        else:
            cfg[name] = values
    return cfg


class Recorder(NullSink):
    def __init__(self):
        self.steps, self.alerts, self.events, self.checkpoints = {}, [], [], []

    def metrics(self, step, values):
        self.steps.setdefault(step, {}).update(values)

    def alert(self, kind, message, **data):
        self.alerts.append({"kind": kind, "message": message, **data})

    def event(self, kind, message, **data):
        self.events.append({"kind": kind, "message": message, **data})

    def checkpoint(self, step, path, **info):
        self.checkpoints.append((step, path))


def final_weights(out):
    return AutoModelForCausalLM.from_pretrained(out / "final").state_dict()


# ---- checkpoint and resume ------------------------------------------------------------------------------------------

def test_resume_is_exact(tmp_path, monkeypatch):
    """Interrupted at step 6 and resumed: same prompts in the same order, same final weights (<= 1e-6)."""
    trained = []
    real_collate = update_mod.collate
    for module in (rollout_mod, update_mod):  # warm-start batches, then RL batches
        monkeypatch.setattr(module, "collate", lambda eps, pad: trained.append([e.seed for e in eps]) or real_collate(eps, pad))
    cfg = config(loop={"steps": 12}, checkpoint={"every": 6})
    train(cfg, out_dir=tmp_path / "straight")
    straight, trained[:] = list(trained), []

    train(config(loop={"steps": 6}, checkpoint={"every": 6}), out_dir=tmp_path / "split")
    sink = Recorder()
    summary = train(cfg, sink, out_dir=tmp_path / "split", resume=True)
    assert [e["kind"] for e in sink.events][0] == "resumed"
    assert summary["status"] == "completed" and summary["step"] == 12
    assert trained == straight  # warm-start batches first, then every RL batch: no prompt skipped or repeated
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "split")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def test_best_policy_is_kept_whenever_eval_improves_and_final_eval_is_at_its_step(tmp_path, monkeypatch):
    """Evals at steps 0, 3, 6 (never a checkpoint step) and a final one at step 7, though a NaN drill left the
    version at 6: OUT/best holds exactly the weights the best eval ran on."""
    published = {}  # version -> the weights the sampler got for it
    real_init, real_publish = Sampler.__init__, Sampler.publish

    def init(self, model, *args, **kw):
        published[kw["version"]] = {k: v.clone() for k, v in model.state_dict().items()}
        real_init(self, model, *args, **kw)
    monkeypatch.setattr(Sampler, "__init__", init)
    monkeypatch.setattr(Sampler, "publish", lambda self, w, v: published.update({v: w}) or real_publish(self, w, v))
    sink = Recorder()
    summary = train(config(loop={"steps": 7, "eval_every": 3, "eval_episodes": 16}, drills={"nan_at": [1]},
                           checkpoint={"every": 5}), sink, out_dir=tmp_path)
    evals = {step: v["eval_reward"] for step, v in sink.steps.items() if "eval_reward" in v}
    assert sorted(evals) == [0, 3, 6, 7] and summary["version"] == 6
    best_step = max(evals, key=lambda step: (evals[step], -step))  # the first of the best
    assert summary["best_step"] == best_step and summary["best_path"] == str(tmp_path / "best")
    expected = published[sink.steps[best_step - 1]["version"] if best_step else 0]
    best = AutoModelForCausalLM.from_pretrained(tmp_path / "best").state_dict()
    assert best.keys() == expected.keys() and all(torch.equal(best[k], expected[k]) for k in best)


def test_an_eval_is_one_version_while_training_publishes_newer_ones(monkeypatch):
    """The eval of step 0 holds its requests until training has published version 1: every token it decodes is
    still of version 0, the version it evaluates, and so are those of every later eval."""
    published = {}  # version 1 is out: set by the trainer's publish, awaited by eval (greedy) requests
    real_publish, real_generate = Sampler.publish, Sampler.generate

    def publish(self, weights, version):
        if version == 1:
            published.setdefault(1, asyncio.Event()).set()
        real_publish(self, weights, version)

    async def generate(self, context, max_tokens, **kw):
        if kw.get("greedy"):
            await published.setdefault(1, asyncio.Event()).wait()
        return await real_generate(self, context, max_tokens, **kw)
    monkeypatch.setattr(Sampler, "publish", publish)
    monkeypatch.setattr(Sampler, "generate", generate)

    class Sent(Recorder):
        def __init__(self):
            super().__init__()
            self.sent = []  # (kind, step, records) in the order the engine sent them

        def metrics(self, step, values):
            self.sent.append(("eval_metrics" if "eval_reward" in values else "metrics", step, None))

        def samples(self, step, kind, records):
            self.sent.append((kind, step, records))
    sink = Sent()
    train(config(loop={"steps": 3, "eval_every": 2, "eval_episodes": 8}), sink)
    evals = [(step, records) for kind, step, records in sink.sent if kind == "eval"]
    assert evals[0][0] == 0 and evals[-1][0] == 3 and all(records for _, records in evals)
    for step, records in evals:
        for r in records:
            assert r["version"] == step  # no breaker trip: the version of step s is s
            assert {v for v, a in zip(r["tokens"]["version"], r["tokens"]["action"]) if a} == {step}
    order = [(kind, step) for kind, step, _ in sink.sent]
    assert order.index(("metrics", 0)) < order.index(("eval", 0))  # step 0 trained (and published) during its eval


def test_checkpoint_loads_with_plain_transformers_and_generates(tmp_path):
    train(config(loop={"steps": 2}, checkpoint={"every": 2}), out_dir=tmp_path)
    path = checkpoint.latest(tmp_path / "checkpoints") / "policy"
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("3 8 1=", return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    assert out[0, ids.shape[1]:].tolist() == greedy_with_our_sampler(model, tokenizer, ids[0].tolist())


def greedy_with_our_sampler(model, tokenizer, context, images=()) -> list[int]:
    """What the engine's own sampler generates greedily (3 tokens at most) from a policy."""
    sampler = Sampler(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, temperature=1.0)
    req = Request(context, 3, True, 0, list(images))
    sampler.pending.append(req)
    while sampler.pending or sampler.active:
        sampler.step()
    return req.ids


def test_vlm_checkpoint_and_final_load_with_plain_transformers_and_generate(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from molt_engine.config import ModelConfig
    from molt_envs.builtin import Shapes
    from molt_engine.models import load_policy
    train({"env": "shapes", "model": {"preset": "tiny-vlm"}, "loop": {"groups_per_step": 2, "group_size": 2,
           "steps": 2, "eval_every": 0}, "warm_start": {"steps": 2}, "checkpoint": {"every": 2}}, out_dir=tmp_path)
    image = Shapes.render("green", "square", [(2, 2)])
    for path in [checkpoint.latest(tmp_path / "checkpoints") / "policy", tmp_path / "final"]:
        model = AutoModelForImageTextToText.from_pretrained(path)
        processor = AutoProcessor.from_pretrained(path)
        inputs = processor(text="<image>color?\n", images=[image], return_tensors="pt", add_special_tokens=False)
        vision = model.config.vision_config
        assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == (vision.image_size // vision.patch_size) ** 2
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id)
        assert out.shape[1] > inputs["input_ids"].shape[1]
        assert out[0, inputs["input_ids"].shape[1]:].tolist() == greedy_with_our_sampler(
            model, processor.tokenizer, inputs["input_ids"][0].tolist(), inputs["pixel_values"])
    # And as a run's starting policy (model.path), offline, with the same weights.
    model, processor = load_policy(ModelConfig(preset=None, path=str(tmp_path / "final")), seed=0)
    assert type(model).__name__ == "LlavaForConditionalGeneration" and processor.image_token == "<image>"
    saved = AutoModelForImageTextToText.from_pretrained(tmp_path / "final").state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def molt_train(out, *extra):
    return subprocess.Popen([sys.executable, "-m", "app.cli", "train", "--out", str(out), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("kills", [pytest.param(4, id="4-kills", marks=pytest.mark.slow), pytest.param(10, id="10-kills", marks=pytest.mark.slow)])
def test_kill_9_at_random_moments_never_breaks_resume(tmp_path, kills):
    cfg_file = tmp_path / "run.json"
    # Room for every kill: an attempt trains up to ~10 steps (~60 ms each) before its kill; a run that ended early
    # would wait for a checkpoint that never comes
    steps = 20 * kills
    cfg_file.write_text(json.dumps(config(loop={"steps": steps}, checkpoint={"every": 2, "keep": 2})))
    root, out = tmp_path / "run" / "checkpoints", tmp_path / "run"
    rng = random.Random(0)
    proc = molt_train(out, "--config", str(cfg_file))
    for i in range(kills):
        before = checkpoint.latest(root)
        wait_until(lambda: checkpoint.latest(root) != before or proc.poll() is not None, 120, 0.05, "a new checkpoint")
        assert proc.poll() is None, f"kill {i}: the run ended first ({proc.returncode}): {proc.stderr.read()[-3000:]}"
        if i % 2:  # half the kills land while a checkpoint is being written
            wait_until(lambda: any(root.glob(".tmp-step-*")) or proc.poll() is not None, 60, 0.01, "a checkpoint write")
        else:
            time.sleep(rng.uniform(0, 0.5))  # a random moment of training
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        found = checkpoint.latest(root)
        state = checkpoint.load(found, AutoModelForCausalLM.from_pretrained(found / "policy"))
        assert state["step"] == int(found.name.split("-")[1])
        assert len(list(root.glob("step-*"))) <= 2 + 1  # the last K, plus one killed between its write and pruning
        proc = molt_train(out, "--resume")
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert checkpoint.latest(root).name == f"step-{steps:06d}"
    assert (out / "final" / "model.safetensors").exists()


def test_sigterm_checkpoints_and_exits_4(tmp_path):
    """How fast it exits is measured by bench/stop_latency.py."""
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps(config(loop={"steps": 10_000}, checkpoint={"every": 0})))
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "train", "--config", str(cfg_file), "--out",
                             str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = ""
    while not re.search(r" [1-9]\d*/10000", seen):  # the progress bar shows a finished training step
        chunk = proc.stdout.read(64)
        assert chunk, seen
        seen += chunk
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 4  # `stopped`, as `molt runs wait` says it
    found = checkpoint.latest(tmp_path / "run" / "checkpoints")
    assert found is not None and torch.load(found / "state.pt", weights_only=False)["step"] > 0


# ---- the breaker ----------------------------------------------------------------------------------------------------

def test_breaker_rules():
    b = Breaker(RunConfig.model_validate({"env": "max_digit", "breaker": {"factor": 3, "min_history": 3, "floor": 0,
                                                                          "cooldown": 2}}).breaker)
    assert b.threshold() == math.inf
    assert not b.check(0, 0.0) and len(b.healthy) == 0        # no signal: not a sample of healthy scale
    for step, norm in enumerate([1.0, 2.0, 3.0], start=1):
        assert not b.check(step, norm)
    assert b.threshold() == 6.0                                 # 3 x median(1, 2, 3)
    assert b.check(4, 6.5) and b.cooldown_left == 2
    assert b.check(5, math.nan) and b.check(6, math.inf)
    assert not b.check(7, 2.0) and b.cooldown_left == 1
    assert b.recent_trips(7) == 3
    capped = Breaker(RunConfig.model_validate({"env": "max_digit", "breaker": {"abs_max": 5}}).breaker)
    assert capped.check(0, 5.5) and not capped.check(1, 4.0)
    floored = Breaker(RunConfig.model_validate({"env": "max_digit", "breaker": {"min_history": 2}}).breaker)
    assert not floored.check(0, 0.01) and not floored.check(1, 0.02)
    assert floored.threshold() == 10.0 and not floored.check(2, 9.0) and floored.check(3, 11.0)  # 25 x 0.015 < floor


def slow_trainer_with_old_groups(monkeypatch, at_step):
    """Make the trainer wait at `at_step` until the buffer holds episodes of an older version (rollout ran ahead)."""
    real_update = loop_mod.Training.update

    def update(self, groups):
        if self.step == at_step:
            wait_until(lambda: any(min(e.oldest_version for e in g) < self.version for g in list(self.buffer)),
                       60, 0.02, "old episodes in the buffer")
        return real_update(self, groups)
    monkeypatch.setattr(loop_mod.Training, "update", update)


def test_spike_drill_skips_update_alerts_and_forces_sync(monkeypatch):
    k, B = 15, 4
    published = []
    real_publish = Sampler.publish
    monkeypatch.setattr(Sampler, "publish", lambda self, w, v: published.append((v, w)) or real_publish(self, w, v))
    admissions = []
    real_may_start = loop_mod.Training.may_start

    def may_start(self):
        ok = real_may_start(self)
        if ok:
            admissions.append((self.breaker.cooldown_left, self.cursor - self.dropped_groups, self.version))
        return ok
    monkeypatch.setattr(loop_mod.Training, "may_start", may_start)
    slow_trainer_with_old_groups(monkeypatch, k)
    sink = Recorder()
    summary = train(config(loop={"steps": 20, "max_staleness": 2}, drills={"spike_at": [k]},
                           breaker={"min_history": 3, "abs_max": 100.0, "cooldown": 3}), sink)
    assert summary["status"] == "completed"
    trip = sink.steps[k]
    assert trip["breaker_tripped"] == 1.0 and trip["grad_norm"] > trip["breaker_threshold"]
    # Weights identical before and after step k: nothing was published for it.
    versions = [v for v, _ in published]
    assert versions == sorted(set(versions)) and len(versions) == 20 - 1
    assert sink.steps[k]["version"] == sink.steps[k - 1]["version"]
    # The alert names the norm, the threshold and the action.
    [alert] = [a for a in sink.alerts if a["kind"] == "breaker"]
    assert alert["step"] == k and alert["norm"] == trip["grad_norm"] and alert["threshold"] == trip["breaker_threshold"]
    assert "skipped" in alert["action"]
    # Stale buffered episodes were dropped and counted at the trip.
    assert trip["stale_episodes_dropped"] > 0
    # During the cooldown, admission was strictly on-policy (no off-policy episodes were started).
    cooling = [(n, v) for left, n, v in admissions if left > 0]
    assert cooling and all(n < (v + 1) * B for n, v in cooling)
    assert any(n >= (v + 1) * B for left, n, v in admissions if left == 0)  # outside it, rollout ran ahead


def test_nan_drill_never_publishes_or_checkpoints_non_finite(tmp_path, monkeypatch):
    published = []
    real_publish = Sampler.publish
    monkeypatch.setattr(Sampler, "publish", lambda self, w, v: published.append(w) or real_publish(self, w, v))
    sink = Recorder()
    summary = train(config(loop={"steps": 8}, drills={"nan_at": [3, 5]}, checkpoint={"every": 1, "keep": 10}),
                    sink, out_dir=tmp_path)
    assert summary["status"] == "completed"
    assert math.isnan(sink.steps[3]["grad_norm"]) and sink.steps[3]["breaker_tripped"] == 1.0
    assert len(published) == 8 - 2
    for weights in published:
        assert all(torch.isfinite(v).all() for v in weights.values())
    assert len(sink.checkpoints) == 8
    for _, path in sink.checkpoints:
        model = AutoModelForCausalLM.from_pretrained(f"{path}/policy")
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_repeated_spikes_roll_back_then_persistent_spikes_trip(tmp_path):
    sink = Recorder()
    cfg = config(loop={"steps": 30}, drills={"spike_at": [10, 11, 12]}, checkpoint={"every": 5},
                 breaker={"min_history": 3, "abs_max": 100.0, "max_trips": 3, "max_rollbacks": 1})
    assert train(cfg, sink, out_dir=tmp_path / "a")["status"] == "completed"
    [rollback] = [e for e in sink.events if e["kind"] == "rollback"]
    assert rollback["step"] == 12 and rollback["path"].endswith("step-000010")

    sink = Recorder()
    cfg["drills"]["spike_at"] = list(range(10, 30))
    summary = train(cfg, sink, out_dir=tmp_path / "b")
    assert summary["status"] == "tripped"
    assert [e["kind"] for e in sink.events].count("rollback") == 1
    assert sink.alerts[-1]["action"] == "tripped" and summary["step"] == 16  # 3 trips, rollback, 3 more trips


def test_ranks_agree_on_the_checkpoint_a_rollback_restores(tmp_path, monkeypatch):
    """As on resume: every rank must roll back to the same checkpoint. Here another rank sees another one (a node
    without the run's directory): the run stops naming both instead of each rank restoring its own."""
    monkeypatch.setattr(dist, "all_gather", lambda value: [value] if value is None else [value, "step-000099"])
    cfg = config(loop={"steps": 8}, drills={"spike_at": [4, 5, 6]}, checkpoint={"every": 2},
                 breaker={"min_history": 3, "abs_max": 100.0, "max_trips": 3, "max_rollbacks": 1})
    with pytest.raises(RuntimeError, match=r"the ranks see different checkpoints .*step-000099"):
        train(cfg, Recorder(), out_dir=tmp_path)


def test_healthy_default_runs_never_trip():
    sink = Recorder()
    train({"env": "max_digit", "loop": {"steps": 40, "eval_every": 0}}, sink)
    assert all(s["breaker_tripped"] == 0.0 for s in sink.steps.values())
    assert not [a for a in sink.alerts if a["kind"] == "breaker"]


# ---- staleness alerts and env errors --------------------------------------------------------------------------------

def test_staleness_alert_fires_once_per_crossing_and_resumes():
    alerts = Alerts(RunConfig.model_validate(config(alerts={"window": 2, "stale_share": 0.15})).alerts)
    base = {"staleness_max": 0.0, "mismatch_kl": 0.0}
    fired = []
    for step, dropped in enumerate([0, 8, 8, 0, 0]):
        fired += alerts.check(step, {**base, "stale_episodes_dropped": dropped}, trained=16)
    resumed = Alerts(alerts.cfg)  # a resumed run remembers the window and what is above threshold
    resumed.load_state_dict(alerts.state_dict())
    fired += resumed.check(5, {**base, "stale_episodes_dropped": 8}, trained=16)
    stale = [data for kind, _, data in fired if kind == "staleness"]
    assert [a["step"] for a in stale] == [1, 5]   # crossed at 1, recovered at 4, crossed again at 5
    assert stale[0]["value"] == pytest.approx(8 / (8 + 32)) and stale[0]["threshold"] == 0.15
    [(kind, message, data)] = resumed.check(6, {**base, "stale_episodes_dropped": 0, "mismatch_kl": 0.5}, trained=16)
    assert kind == "mismatch" and data["metric"] == "mismatch_kl" and "0.5" in message


def test_env_errors_are_counted_and_too_many_stop_the_run():
    sink = Recorder()
    summary = train(config(loop={"steps": 6}, drills={"env_error_rate": 0.1}), sink)
    assert summary["status"] == "completed"
    assert sum(s["env_errors"] for s in sink.steps.values()) > 0
    with pytest.raises(EnvFailure, match="drill: injected env error"):
        train(config(loop={"steps": 6}, drills={"env_error_rate": 0.9}))
