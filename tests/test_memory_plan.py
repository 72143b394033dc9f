"""The device memory plan (molt_engine/inference/memory_plan.py): Qwen2.5-0.5B and -3B shapes on 80 GB and 141 GB,
full fine-tuning and LoRA, bf16 samplers; the static buffers take its KV share; it decides gradient checkpointing."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from molt_engine.inference.memory_plan import MARGIN, Shape, activation_bytes, plan
from molt_engine.inference.sampler import Sampler
from molt_engine.models import set_checkpointing

# (parameters, layers, hidden, intermediate, kv heads x head_dim); LoRA r=16 on every linear layer of the decoder
QWEN = {"0.5B": (494_032_768, 24, 896, 4864, 2 * 64), "3B": (3_085_938_688, 36, 2048, 11008, 2 * 128)}


def shape(name: str, lora: bool) -> Shape:
    params, layers, hidden, intermediate, kv = QWEN[name]
    widths = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, intermediate),
              (hidden, intermediate), (intermediate, hidden)]  # q k v o gate up down
    adapters = layers * sum(16 * (a + b) for a, b in widths)
    return Shape(params + adapters if lora else params, adapters if lora else params, layers, hidden, intermediate, kv)


@pytest.mark.parametrize("device_gb", [80, 141])
@pytest.mark.parametrize("model", ["0.5B", "3B"])
@pytest.mark.parametrize("lora", [False, True])
def test_weights_gradients_optimizer_kv_and_the_largest_prefill_fit(model, device_gb, lora):
    """Evals on (two bf16 samplers; 3B full on 80 GB: without), no reference. Full fine-tuning counts 16 bytes a parameter of trainer state
    (fp32 weights, gradients, two AdamW moments) and 4 of published weights, LoRA 4 a parameter of the base and 20
    of each adapter parameter (its base is shared). What is left holds each sampler's KV buffers (room for at least 8 rows of 1,024
    positions), its largest prefill (the buffers' worth of tokens: their keys and values again, one layer's
    transients) and a micro-batch of 8 x 1,024 tokens' activations, checkpointed if the plan says so."""
    s, tight = shape(model, lora), (model, device_gb, lora) == ("3B", 80, False)
    if tight:  # 3B full: 24 bytes a parameter with evals' sampler is 74 of the 76 GB planned: evals off
        evals = plan(s, device_gb * 10**9, dtype_bytes=2, samplers=2, reference=False)
        assert evals.states == 24 * s.params and not evals.fits(8 * 1024)
    p = plan(s, device_gb * 10**9, dtype_bytes=2, samplers=1 if tight else 2, reference=False)
    trainable_bytes = 16 * s.trainable / s.params  # gradients 4, AdamW 8, published 4
    assert p.weights + p.gradients + p.optimizer + p.published == pytest.approx((4 + trainable_bytes) * s.params)
    assert p.samplers == len(p.kv) * 2 * s.params
    token_kv = 2 * s.layers * s.kv_width * 2
    assert all(kv >= 8 * 1024 * token_kv for kv in p.kv)
    assert all(prefill >= kv * (1 + (4 * s.hidden + 3 * s.intermediate) / (2 * s.layers * s.kv_width)) - 1e3
               for kv, prefill in zip(p.kv, p.prefill))
    tokens = 8 * 1024
    acts = activation_bytes(s, tokens, 2, p.checkpointing(tokens))
    used = p.weights + p.gradients + p.optimizer + p.published + p.samplers + sum(p.kv) + sum(p.prefill) + acts
    assert used <= device_gb * 10**9 * (1 - MARGIN) and p.fits(tokens)
    # The old reservation, 30% of the memory free when each sampler first admits (before gradients and AdamW's
    # moments exist), does not fit a 3B full fine-tune on 80 GB: the planned one does.
    if tight:
        free = device_gb * 10**9 - p.weights - p.published - p.samplers
        assert p.states + 0.3 * free + 0.3 * 0.7 * free > device_gb * 10**9


def test_the_plan_checkpoints_only_when_the_activations_would_not_fit():
    """0.5B full on 80 GB: a micro-batch of 8 x 512 tokens keeps its activations; 64 x 512 (the whole batch of the
    GPU proof's update) does not, and checkpointed it does. A CPU-sized model never checkpoints."""
    p = plan(shape("0.5B", False), 80 * 10**9, dtype_bytes=2, samplers=2, reference=False)
    assert not p.checkpointing(8 * 512) and p.checkpointing(64 * 512)
    assert activation_bytes(p.shape, 64 * 512, 2, True) < p.activations < activation_bytes(p.shape, 64 * 512, 2, False)
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2))
    assert not plan(Shape.of(tiny), 16 * 10**9, dtype_bytes=4, samplers=1, reference=False).checkpointing(64 * 512)


def test_set_checkpointing_turns_it_on_and_off_and_the_static_buffers_take_the_planned_share():
    """set_checkpointing toggles transformers' checkpointing and the decoder layers' own training flag (dropout stays
    off: the model stays in eval mode); a sampler on the static path sizes its buffers by the planned KV share."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, pad_token_id=0, eos_token_id=1)).eval()
    set_checkpointing(model, True)
    assert model.is_activation_checkpointing and model.model.layers[0].training and not model.training
    set_checkpointing(model, False)
    assert not model.is_activation_checkpointing and not model.model.layers[0].training
    token_bytes = 2 * 2 * 32 * 4  # keys and values, 2 layers, 32 wide, fp32
    sampler = Sampler(model, [1], 0, temperature=1.0, cuda_graphs="uncaptured", kv_planned_gb=1000 * token_bytes / 1e9)
    assert sampler.static.kv_tokens == 1000 and sampler.static.rows(100) == 1000 // 128
    assert sampler.kv_tokens is None  # no budget: requests park their keys for the next turn as before


def test_an_eager_sampler_decodes_on_the_published_tensors_and_the_static_one_on_its_own_buffers():
    """The trainer's copy of a version (dist.full_weights: a tied embedding one tensor) is what an eager sampler of
    the same dtype decodes on after the swap: no copy of its own. Frozen parameters are shared with the trainer's
    model. The static path copies into the parameters its steps read; a state dict tied otherwise is copied too."""
    from molt_engine import dist
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, pad_token_id=0, eos_token_id=1, tie_word_embeddings=True)
    trainer = LlamaForCausalLM(config)
    trainer.model.norm.weight.requires_grad_(False)
    published = dist.full_weights(trainer)
    assert published["model.norm.weight"].data_ptr() == trainer.model.norm.weight.data_ptr()  # frozen: shared
    assert published["model.embed_tokens.weight"].data_ptr() != trainer.model.embed_tokens.weight.data_ptr()
    for cuda_graphs, shared in ((False, True), ("uncaptured", False)):
        sampler = Sampler(LlamaForCausalLM(config).eval(), [1], 0, temperature=1.0, cuda_graphs=cuda_graphs)
        sampler.publish(published, 1)
        sampler.step()  # nothing active: the swap happens at once
        ptr = lambda name: sampler.model.get_parameter(name).data_ptr()  # noqa: E731
        assert (ptr("model.layers.0.mlp.up_proj.weight") == published["model.layers.0.mlp.up_proj.weight"].data_ptr()) == shared
        assert ptr("lm_head.weight") == ptr("model.embed_tokens.weight")  # still tied
        assert sampler.version == 1
    untied = {k: v.clone() for k, v in published.items()}  # the embedding and the head: two tensors
    sampler = Sampler(LlamaForCausalLM(config).eval(), [1], 0, temperature=1.0)
    sampler.publish(untied, 2)
    sampler.step()
    assert sampler.model.get_parameter("lm_head.weight").data_ptr() == sampler.model.get_parameter("model.embed_tokens.weight").data_ptr()
    assert all(p.data_ptr() != v.data_ptr() for p, v in zip(sampler.model.parameters(), untied.values()))
