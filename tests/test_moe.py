"""MoE policies: routing replay, the routing_mismatch metric, router_freeze and the expert-load metrics, on real runs."""
import pytest
import torch

import molt_engine.update as update_mod
from molt_engine import train
from molt_engine.config import ModelConfig
from molt_engine.models import load_policy, routers

# k=1 with a large learning rate: the trainer's weights move away from the sampler's, so routing really differs
STALE = {"env": "max_digit", "seed": 3, "model": {"preset": "tiny-moe"}, "warm_start": {"steps": 10},
         "loop": {"steps": 6, "max_staleness": 1, "groups_per_step": 4, "group_size": 4, "eval_every": 0},
         "algo": {"lr": 3e-3}}


class Metrics:
    def __init__(self):
        self.steps = []
    def metrics(self, step, values):
        if "routing_mismatch" in values:
            self.steps.append(values)
    def alert(self, kind, message, **data): pass
    def event(self, kind, message, **data): pass
    def checkpoint(self, step, path, **info): pass


@pytest.fixture
def routing(monkeypatch):
    """After every training forward: per checked action token, the experts used, the router's own choice and the
    sampler's record, all layers stacked ([tokens, layers, k])."""
    seen = []
    real = update_mod.routing_stats

    def spy(layers, attention_mask, recorded, predicts_action):
        shape = (*recorded.shape[:2], -1)
        where = predicts_action & (recorded[..., 0, 0] >= 0)
        seen.append({"used": torch.stack([r.selected.view(shape) for r in layers], 2)[where],
                     "natural": torch.stack([r.natural.view(shape) for r in layers], 2)[where],
                     "recorded": recorded[where]})
        return real(layers, attention_mask, recorded, predicts_action)

    monkeypatch.setattr(update_mod, "routing_stats", spy)
    return seen


def differs(a, b):
    """Tokens whose expert set differs from the other's in any layer."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1).any(-1)


def test_routing_replay_trains_with_the_sampled_experts(routing):
    sink = Metrics()
    train(STALE, sink)
    assert len(routing) == 6
    for step in routing:
        assert len(step["recorded"]) > 0
        assert torch.equal(step["used"], step["recorded"])  # every action token, every layer, in order
    # replay was needed: left to itself, the training forward would have chosen other experts for some tokens
    forced = sum(int(differs(s["natural"], s["recorded"]).sum()) for s in routing)
    assert forced > 0
    assert max(m["routing_mismatch"] for m in sink.steps) > 0
    # on-policy (the first batch), the recomputed log-probs are the recorded ones
    assert sink.steps[0]["staleness_max"] == 0 and sink.steps[0]["mismatch_abs"] <= 1e-5


def test_without_replay_routing_mismatch_is_measured(routing):
    sink = Metrics()
    train({**STALE, "algo": {"lr": 3e-3, "routing_replay": False}}, sink)
    for step, metrics in zip(routing, sink.steps):
        assert torch.equal(step["used"], step["natural"])  # nothing replayed
        share = differs(step["natural"], step["recorded"]).float().mean().item()
        assert metrics["routing_mismatch"] == pytest.approx(share)
    # the first batch is sampled with the trainer's own weights: same experts; later ones are a version old
    assert sink.steps[0]["staleness_max"] == 0 and sink.steps[0]["routing_mismatch"] == 0
    assert max(m["routing_mismatch"] for m in sink.steps[1:]) > 0


def test_router_freeze_keeps_router_weights_bit_identical(tmp_path):
    sink = Metrics()
    summary = train({**STALE, "algo": {"lr": 3e-3, "router_freeze": True}}, sink, out_dir=tmp_path)
    initial, _ = load_policy(ModelConfig(preset="tiny-moe"), seed=3)
    final, _ = load_policy(ModelConfig(path=summary["final_path"]), seed=0)
    before, after = initial.state_dict(), final.state_dict()
    router_names = [name for name in before if ".mlp.gate." in name]
    assert len(router_names) == len(routers(initial)) == 4
    assert all(torch.equal(before[n], after[n]) for n in router_names)
    # and training did happen everywhere else, experts included
    assert not torch.equal(before["model.layers.0.mlp.experts.gate_up_proj"],
                           after["model.layers.0.mlp.experts.gate_up_proj"])


def test_expert_load_metrics_are_shares_per_layer():
    sink = Metrics()
    train({**STALE, "loop": {**STALE["loop"], "steps": 2}}, sink)
    for metrics in sink.steps:
        for layer in range(4):
            shares = [metrics[f"expert_share_l{layer}_e{e}"] for e in range(8)]
            assert sum(shares) == pytest.approx(1.0) and min(shares) >= 0
        assert 0 < metrics["moe_balance_entropy"] <= 1
        assert 0 < metrics["moe_aux_loss"] < 8  # Switch Transformer loss: 1 when balanced, 8 (= experts) when collapsed
