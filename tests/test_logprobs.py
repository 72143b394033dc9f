"""The chunked LM head (molt_engine/logprobs.py) against the full [tokens, vocab] computation, and gradient
checkpointing against none."""
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaMLP

from molt_engine import RunConfig, logprobs
from molt_engine.breaker import Breaker
from molt_engine.episode import Episode, collate, token_logprobs
from molt_engine.logprobs import head_logprobs
from molt_engine.models import char_tokenizer, load_policy
from molt_engine.update import train_step


def full(hidden, linear, targets, temperature, masked_id):
    logits = linear(hidden).float() / temperature
    if masked_id is not None:  # the distribution over the other tokens
        logits, targets = logits[:, torch.arange(logits.shape[1]) != masked_id], targets - (targets > masked_id).long()
    lp = torch.log_softmax(logits, -1)
    return lp.gather(1, targets[:, None])[:, 0], -torch.special.xlogy(lp.exp(), lp.exp()).sum(1)


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
@pytest.mark.parametrize("bias, masked_id", [(False, None), (True, 5)])
def test_chunked_logprobs_entropies_and_their_gradients_equal_the_full_computation(chunk, bias, masked_id):
    g = torch.Generator().manual_seed(chunk or 0)
    linear = torch.nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=g).masked_fill_(torch.arange(37) % 9 == 0, 49)
    if masked_id is not None:
        targets[targets == masked_id] = 0
    weights = [torch.randn(37, generator=g) for _ in range(2)]  # any upstream gradient, on both outputs
    results = []
    for f in (lambda: head_logprobs(hidden, linear, targets, 0.7, masked_id, chunk),
              lambda: full(hidden, linear, targets, 0.7, masked_id)):
        linear.zero_grad()
        hidden.grad = None
        logp, entropy = f()
        ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
        results.append([logp, entropy, hidden.grad, *(p.grad for p in linear.parameters())])
    assert (results[0][1] >= 0).all() and results[0][2].abs().max() > 0
    for mine, reference in zip(*results):
        assert (mine - reference).abs().max() <= 1e-5 * max(1.0, reference.abs().max())


def test_under_bfloat16_autocast_the_chunks_match_the_linear_layers_own_matmul():
    linear, hidden = torch.nn.Linear(32, 40), torch.randn(12, 32)
    targets = torch.arange(12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine = head_logprobs(hidden, linear, targets, chunk=5)[0]
        reference = full(hidden, linear, targets, 1.0, None)[0]
    assert mine.dtype == torch.float32 and (mine - reference).abs().max() <= 1e-5


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # the shared-prefix forward, and the plain full forward
def test_token_logprobs_and_gradients_equal_the_full_forward(tied, attention, monkeypatch):
    """Padded rows (prompts of different lengths, multi-turn action masks), the head in chunks of 3 tokens: the
    action tokens' log-probs and every parameter's gradient (the tied embedding's included) are the full logits'."""
    monkeypatch.setattr(logprobs, "CHUNK_LOGITS", 3 * 64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, pad_token_id=0), attn_implementation=attention)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    g, episodes = torch.Generator().manual_seed(1), []
    for i, prompt in enumerate([5, 9, 5, 2]):
        ep = Episode(seed=i, group=0)
        ep.extend(torch.randint(1, 64, (prompt,), generator=g).tolist())
        for turn in range(1 + i % 2):
            ep.extend(torch.randint(1, 64, (3 + i,), generator=g).tolist(), action=True)
            ep.extend([7, 8])  # env feedback: not an action
        episodes.append(ep)
    batch = collate(episodes, 0)
    mask = batch["action_mask"]
    logp = token_logprobs(model, batch, 0.8)
    (logp[mask] * torch.linspace(0.5, 2, int(mask.sum()))).sum().backward()
    mine = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, :-1] / 0.8
    reference = torch.log_softmax(logits, -1).gather(-1, batch["targets"][..., None])[..., 0]
    (reference[mask] * torch.linspace(0.5, 2, int(mask.sum()))).sum().backward()
    assert (logp[~mask] == 0).all() and (logp[mask] - reference[mask]).abs().max() <= 1e-5
    for a, p in zip(mine, model.parameters()):
        assert (a - p.grad).abs().max() <= 1e-5 * max(1.0, p.grad.abs().max())


def test_a_training_step_with_gradient_checkpointing_gives_the_weights_of_one_without(monkeypatch):
    tok, weights, runs = char_tokenizer(), [], []
    mlp = LlamaMLP.forward  # counted: a checkpointed layer's MLP runs twice, in the forward and in the backward
    monkeypatch.setattr(LlamaMLP, "forward", lambda self, x: runs.append(1) or mlp(self, x))
    for checkpointing in (False, True):
        cfg = RunConfig.model_validate({"env": "max_digit", "loop": {"groups_per_step": 2, "group_size": 4},
                                        "model": {"gradient_checkpointing": checkpointing}})
        model, _ = load_policy(cfg.model, seed=0)
        assert model.model.gradient_checkpointing == checkpointing and not model.training  # dropout stays off
        g, groups = torch.Generator().manual_seed(0), []
        for cursor, prompt in enumerate(["3 1 4=", "9 2="]):
            group = []
            for j in range(4):
                ep = Episode(seed=cursor, group=cursor, reward=float(j % 2 + cursor))
                ep.extend(tok(prompt, add_special_tokens=False)["input_ids"])
                ep.extend(torch.randint(3, len(tok), (2 + j,), generator=g).tolist(), action=True)
                ep.info = {"success": False, "entropy": 0.0, "tool_calls": 0, "turns": 1}
                group.append(ep)
            groups.append(group)
        runs.clear()
        start = {k: v.clone() for k, v in model.state_dict().items()}
        _, published, _, _ = train_step(model, torch.optim.AdamW(model.parameters(), lr=0.01), groups, cfg, step=0,
                                        breaker=Breaker(cfg.breaker), published=start, pad_id=tok.pad_token_id)
        assert len(runs) == len(model.model.layers) * (2 if checkpointing else 1)
        weights.append(published)
    assert max(float((weights[0][k] - start[k]).abs().max()) for k in start) > 1e-3  # it trained
    assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in start) <= 1e-6


def test_the_published_weights_and_a_checkpoint_hold_a_tied_embedding_once(tmp_path):
    """At the end of a step the publishing copy takes the gradients' place: a tied embedding copied once per name
    was the whole step's peak on Qwen2.5-0.5B, and a full checkpoint stored it twice."""
    from safetensors import safe_open

    from molt_engine import checkpoint, dist
    from molt_engine.config import ModelConfig
    model, tokenizer = load_policy(ModelConfig(), seed=0)  # the default preset ties its embedding and head
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights = dist.full_weights(model)
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]
    assert weights["lm_head.weight"].data_ptr() != model.lm_head.weight.data_ptr()  # a copy, not the live weight
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    path = checkpoint.save(tmp_path, 1, model, tokenizer, {}, weights=weights)
    with safe_open(path / "policy" / "model.safetensors", "pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    loaded = type(model).from_pretrained(path / "policy", dtype=torch.float32)
    assert torch.equal(loaded.lm_head.weight, weights["lm_head.weight"])


def test_a_checkpointed_policy_trains_with_a_sampler_process(tmp_path):
    """The sampler's copy leaves checkpointing to the trainer: its input hook, a local function, kept a sampler
    process (which pickles the copy) from starting on every model.path run, where checkpointing is the default."""
    from molt_engine import train
    summary = train({"env": "max_digit", "model": {"gradient_checkpointing": True}, "warm_start": {"steps": 0},
                     "loop": {"steps": 2, "groups_per_step": 2, "group_size": 2, "eval_every": 0,
                              "sampler_process": True}}, out_dir=tmp_path)
    assert summary["status"] == "completed" and summary["step"] == 2
