"""train_step: minibatches and epochs against the proximal policy (decoupled PPO), GSPO, and a refused step."""
import pytest
import torch
from pydantic import ValidationError

from molt_engine import RunConfig, train
from molt_engine.breaker import Breaker
from molt_engine.episode import Episode, collate, token_logprobs
from molt_engine.models import char_tokenizer, load_policy
from molt_engine.update import train_step


def make_cfg(**algo):
    return RunConfig.model_validate({"env": "max_digit", "loop": {"groups_per_step": 4, "group_size": 4},
                                     "algo": {"lr": 0.02, **algo}})


def sampled_groups(model, tok) -> list[list[Episode]]:
    """Four groups of four episodes with random actions, their behaviour log-probs those of `model` (on-policy),
    and rewards that differ within each group, on a larger scale in later groups."""
    g = torch.Generator().manual_seed(0)
    groups = []
    for cursor, prompt in enumerate(["3 1 4=", "9 2=", "5 5 1 0=", "7 8="]):
        group = []
        for j in range(4):
            ep = Episode(seed=cursor, group=cursor)
            ep.extend(tok(prompt, add_special_tokens=False)["input_ids"])
            actions = torch.randint(3, len(tok), (2 + j % 3,), generator=g).tolist()
            ep.extend(actions, action=True, logprobs=[0.0] * len(actions), versions=[0] * len(actions))
            ep.reward = float((j + cursor) % 2) * (1 + cursor)
            ep.info = {"success": ep.reward >= 1, "entropy": 0.0, "tool_calls": 0, "turns": 1}
            group.append(ep)
        batch = collate(group, tok.pad_token_id)
        with torch.no_grad():
            logp = token_logprobs(model, batch, 1.0)
        for row, ep in enumerate(group):
            ep.logprobs = [0.0] * (len(ep.token_ids) - ep.n_actions) + logp[row][batch["action_mask"][row]].tolist()
        groups.append(group)
    return groups


def step_once(cfg, breaker=None, groups=slice(None)):
    """One train_step from the same policy and batch; returns (metrics, published weights or None, model, start)."""
    tok = char_tokenizer()
    model, _ = load_policy(cfg.model, seed=0)
    groups = sampled_groups(model, tok)[groups]
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.algo.lr)
    metrics, weights, _, _ = train_step(model, optimizer, groups, cfg, step=0,
                                        breaker=breaker or Breaker(cfg.breaker), published=start,
                                        pad_id=tok.pad_token_id)
    return metrics, weights, model, start


def test_the_trainer_logprobs_it_returns_are_the_behaviour_logprobs_of_the_same_weights():
    """What the samples record as the trainer's log-prob: with the sampler's own weights, each action token's
    recomputed log-prob equals the one recorded at sampling time, in every minibatch."""
    cfg, tok = make_cfg(minibatches=2), char_tokenizer()
    model, _ = load_policy(cfg.model, seed=0)
    groups = sampled_groups(model, tok)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.algo.lr)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    _, _, adv, trainer = train_step(model, optimizer, groups, cfg, step=0, breaker=Breaker(cfg.breaker),
                                    published=start, pad_id=tok.pad_token_id)
    episodes = [e for g in groups for e in g]
    assert len(adv) == len(episodes) and trainer and set(trainer) <= set(range(len(episodes)))
    for i, logprobs in trainer.items():
        e = episodes[i]
        assert len(logprobs) == len(e.token_ids)
        actions = [(mine, behaviour) for mine, behaviour, a in zip(logprobs, e.logprobs, e.is_action) if a]
        assert actions and all(abs(mine - behaviour) < 1e-5 for mine, behaviour in actions)


def differ(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_one_minibatch_one_epoch_leaves_the_clip_inert():
    """The documented special case: a single optimizer step per trainer step has ratio 1, so PPO and GSPO agree."""
    metrics, ppo, _, start = step_once(make_cfg())
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_ratio"] == 0.0
    _, gspo, _, _ = step_once(make_cfg(loss="gspo"))
    assert differ(ppo, start) > 0 and differ(ppo, gspo) == 0


def test_minibatches_make_the_clip_act():
    metrics, clipped, _, _ = step_once(make_cfg(minibatches=2, epochs=2))
    assert metrics["clip_ratio"] > 0 and metrics["ratio_mean"] != 1.0
    # The same step with a clip band too wide to ever act ends elsewhere: the clip changed the gradient.
    _, unclipped, _, _ = step_once(make_cfg(minibatches=2, epochs=2, clip_low=1.0, clip_high=1e9))
    assert differ(clipped, unclipped) > 1e-4


def test_gspo_gradient_differs_from_ppo():
    _, ppo, _, _ = step_once(make_cfg(minibatches=4))
    _, gspo, _, _ = step_once(make_cfg(minibatches=4, loss="gspo"))
    assert differ(ppo, gspo) > 1e-4


def test_a_step_refused_after_a_minibatch_was_applied_restores_the_published_weights():
    # The first minibatch of a 2-minibatch step is exactly a 1-minibatch step on the first two groups: its norm.
    # dr_grpo keeps the rewards' scale, larger in the last groups: the second minibatch has the larger gradient.
    first = step_once(make_cfg(estimator="dr_grpo"), groups=slice(0, 2))[0]["grad_norm"]
    largest = step_once(make_cfg(estimator="dr_grpo", minibatches=2))[0]["grad_norm"]
    assert largest > first  # so the second minibatch has the larger norm; a cap between the two refuses only it
    cfg = RunConfig.model_validate({**make_cfg(estimator="dr_grpo", minibatches=2).model_dump(), "breaker": {"abs_max": (first + largest) / 2}})
    breaker = Breaker(cfg.breaker)
    metrics, weights, model, start = step_once(cfg, breaker=breaker)
    assert weights is None and metrics["breaker_tripped"] == 1.0 and breaker.trips == [0]
    assert metrics["grad_norm"] == largest
    assert differ(model.state_dict(), start) == 0


def test_minibatched_run_clips_and_publishes_one_version_per_step():
    steps = {}

    class Sink:
        def metrics(self, step, values): steps.setdefault(step, {}).update(values)
        def alert(self, kind, message, **data): pass
        def event(self, kind, message, **data): pass
        def checkpoint(self, step, path, **info): pass

    summary = train({"env": "max_digit", "loop": {"steps": 6, "groups_per_step": 4, "group_size": 4, "eval_every": 0},
                     "algo": {"minibatches": 4, "lr": 3e-3}, "warm_start": {"steps": 30}}, Sink())  # rewards > 0
    assert summary["status"] == "completed"
    assert [steps[s]["version"] for s in range(6)] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert max(v["clip_ratio"] for v in steps.values()) > 0


def test_more_minibatches_than_groups_is_refused_naming_both_fields():
    with pytest.raises(ValidationError, match=r"algo.minibatches \(3\) must not exceed loop.groups_per_step \(2\)"):
        RunConfig.model_validate({"env": "max_digit", "loop": {"groups_per_step": 2}, "algo": {"minibatches": 3}})
