"""The device's memory plan: the trainer's states (weights, gradients, AdamW moments, published weights, reference)
and the samplers' copies first; the samplers' KV caches (with their largest prefill) and the update's activations
share what is left. It sizes the static decode buffers and decides gradient checkpointing."""
import os
from dataclasses import dataclass

import torch

MARGIN = 0.05  # of the device, never planned: the CUDA context, allocator fragmentation, collectives' buffers
HEAD = 3 * (1 << 25) * 4  # the chunked LM head's transients: a few [chunk, vocab] fp32 tensors (logprobs.CHUNK_LOGITS)


@dataclass
class Shape:
    """What the plan reads of a policy: its parameters (all, and those the optimizer trains) and its text model's
    sizes."""
    params: int
    trainable: int
    layers: int
    hidden: int
    intermediate: int
    kv_width: int  # key/value heads x head_dim

    @classmethod
    def of(cls, model) -> "Shape":
        text = model.config.get_text_config()
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
        return cls(sum(p.numel() for p in model.parameters()),
                   sum(p.numel() for p in model.parameters() if p.requires_grad),
                   text.num_hidden_layers, text.hidden_size, intermediate, heads * head_dim)


def activation_bytes(shape: Shape, tokens: int, dtype_bytes: int, checkpointing: bool) -> int:
    """What the update's forward keeps for the backward over a micro-batch of `tokens` (padded) tokens, forwards in
    `dtype_bytes` (autocast). Per layer and token about 8 hidden + 4 intermediate values (calibrated on the CPU by
    bench/trainer_memory.py: 2.4 MB a token measured on Qwen2.5-0.5B in fp32, 2.6 planned); checkpointing keeps each
    layer's fp32 input and recomputes one layer at a time."""
    layer = (8 * shape.hidden + 4 * shape.intermediate) * dtype_bytes
    kept = shape.layers * 4 * shape.hidden + layer if checkpointing else shape.layers * layer
    return tokens * kept + HEAD


@dataclass
class MemoryPlan:
    """Bytes of each part on one device: `kv` per sampler (the training one first, then the eval one); `activations`:
    the update's share, which decides checkpointing."""
    device: int
    weights: int
    gradients: int
    optimizer: int
    published: int
    reference: int
    samplers: int
    kv: list
    prefill: list
    activations: int
    shape: Shape
    dtype_bytes: int

    def checkpointing(self, tokens: int) -> bool:
        """Checkpoint when a micro-batch of `tokens` would not keep its activations within the update's share."""
        return activation_bytes(self.shape, tokens, self.dtype_bytes, False) > self.activations

    def fits(self, tokens: int) -> bool:
        """Whether every part, with a micro-batch of `tokens` (checkpointed if the plan says so), fits the device."""
        acts = activation_bytes(self.shape, tokens, self.dtype_bytes, self.checkpointing(tokens))
        return self.states + sum(self.kv) + sum(self.prefill) + acts <= self.device * (1 - MARGIN)

    @property
    def states(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.published + self.reference + self.samplers

    def parts(self) -> dict:
        """The plan in bytes, as the device event records it."""
        names = ("device", "weights", "gradients", "optimizer", "published", "reference", "samplers", "activations")
        return {**{k: int(getattr(self, k)) for k in names}, "kv": self.kv, "prefill": self.prefill}

    def describe(self) -> str:
        gb = lambda n: f"{n / 1e9:.2f}"
        per = lambda n: f"{n / self.shape.params:.0f} B/param"
        return (f"memory plan of {gb(self.device)} GB: weights {gb(self.weights)} ({per(self.weights)}), gradients "
                f"{gb(self.gradients)}, AdamW {gb(self.optimizer)} ({self.shape.trainable:,} trainable), published "
                f"{gb(self.published)}, reference {gb(self.reference)}, samplers' weights {gb(self.samplers)}, KV "
                f"{' + '.join(map(gb, self.kv))} with prefill {' + '.join(map(gb, self.prefill))}, activations "
                f"{gb(self.activations)}")


def plan(shape: Shape, device_bytes: int, *, dtype_bytes: int, samplers: int, reference: bool) -> MemoryPlan:
    """Weights (4 bytes/param: the trainer keeps fp32), gradients and AdamW's two moments (4 + 8 a trainable
    parameter), the last published weights (4 a trainable parameter: frozen ones are
    shared, dist.full_weights), a frozen reference (4, with the KL term and no LoRA), each sampler's
    copy (`dtype_bytes`); of the rest, half for the samplers (the eval sampler a third of it) and half for the update's
    activations. A sampler's share holds its KV buffers and its largest prefill: the buffers' worth of tokens at once
    (an empty cache admitting its fill), their keys and values again and one layer's transients."""
    parts = dict(weights=4 * shape.params, gradients=4 * shape.trainable, optimizer=8 * shape.trainable,
                 published=4 * shape.trainable, reference=4 * shape.params if reference else 0,
                 samplers=samplers * dtype_bytes * shape.params)
    room = max(0, int(device_bytes * (1 - MARGIN)) - sum(parts.values()))
    shares = [room / 2] if samplers == 1 else [room / 3, room / 6]
    token_kv = 2 * shape.layers * shape.kv_width * dtype_bytes  # keys and values, every layer
    prefill_token = token_kv + (4 * shape.hidden + 3 * shape.intermediate) * dtype_bytes
    kv = [int(s * token_kv / (token_kv + prefill_token)) for s in shares]
    return MemoryPlan(device_bytes, **parts, kv=kv, prefill=[int(s) - k for s, k in zip(shares, kv)],
                      activations=room // 2, shape=shape, dtype_bytes=dtype_bytes)


def device_bytes(device: torch.device) -> int:
    """The device's memory: a GPU's total, the CPU's physical memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
