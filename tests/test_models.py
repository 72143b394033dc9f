"""Policies from a local checkpoint directory: dropout off by default (no false mismatch), and their own defaults."""
import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from molt_engine import NullSink, train
from molt_engine.models import char_tokenizer


class Recorder(NullSink):
    def __init__(self):
        self.steps, self.events = {}, []

    def metrics(self, step, values):
        self.steps.setdefault(step, {}).update(values)

    def event(self, kind, message, **data):
        self.events.append({"kind": kind, "message": message, **data})


def dropout_checkpoint(directory) -> str:
    """A Qwen2 directory whose config ships attention dropout, as many real checkpoints do (char tokenizer beside)."""
    tokenizer = char_tokenizer()
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                 attention_dropout=0.1, pad_token_id=0, eos_token_id=1)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("dropout", [False, True])
def test_a_checkpoint_with_dropout_trains_without_logprob_mismatch_unless_asked(tmp_path, dropout):
    """fp32, on-policy: the trainer's recomputed log-probs equal the sampler's; model.dropout keeps the noise."""
    sink = Recorder()
    summary = train({"env": "max_digit", "model": {"preset": None, "path": dropout_checkpoint(tmp_path),
                                                   "dropout": dropout},
                     "loop": {"steps": 2, "groups_per_step": 4, "group_size": 4, "eval_every": 0}}, sink)
    assert summary["status"] == "completed" and len(sink.steps) == 2
    mismatch = [values["mismatch_abs"] for values in sink.steps.values()]
    if dropout:
        assert min(mismatch) > 1e-3  # the hazard is real: dropout in the trainer's forward only
    else:
        assert max(mismatch) < 1e-5


def test_a_checkpoint_run_gets_its_own_defaults_and_says_so_first(tmp_path):
    sink = Recorder()
    train({"env": "max_digit", "model": {"preset": None, "path": dropout_checkpoint(tmp_path)},
           "loop": {"steps": 1, "groups_per_step": 2, "group_size": 2, "eval_every": 0}}, sink)
    first = sink.events[0]
    assert first["kind"] == "defaults" and first["profile"] == "checkpoint" and "algo.lr 1e-06" in first["message"]
    assert sink.steps[0]["lr"] == 1e-6  # what the optimizer really used
    assert "warm_start" not in [e["kind"] for e in sink.events]  # no warm start unless asked for

    sink = Recorder()
    train({"env": "max_digit", "loop": {"steps": 1, "groups_per_step": 2, "group_size": 2, "eval_every": 0},
           "warm_start": {"steps": 1}}, sink)
    assert sink.events[0]["kind"] == "defaults" and sink.events[0]["profile"] == "preset"
    assert sink.steps[0]["lr"] == 3e-4
