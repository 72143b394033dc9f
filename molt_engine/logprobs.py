"""Log-probs and entropies of given tokens through a policy's LM head in chunks of tokens, recomputed in the backward:
no [tokens, vocab] tensor of the whole batch exists in the forward or the backward."""
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

CHUNK_LOGITS = 1 << 25  # logits per chunk (128 MB in fp32): 220 tokens of Qwen2.5's 151,936-entry vocabulary


class Head:
    """How a policy's forward gives log-probs of chosen positions' targets at the sampling temperature. A model whose
    logits are a plain linear layer over its backbone's last hidden states (dense, MoE, Llava; peft's adapters inside
    the backbone) gives those hidden states, and the chunked head scores only the positions asked for. Any other (a
    LoRA adapter on the head, scaled or soft-capped logits, FSDP2's sharding) keeps the plain path: its logits, then a
    log-softmax."""

    def __init__(self, model, temperature: float):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.model, self.temperature, self.config = model, temperature, base.config.get_text_config()
        self.linear, self.backbone = base.get_output_embeddings(), getattr(base, "model", None)
        self.separable = type(self.linear) is torch.nn.Linear and self.backbone is not None and not any(
            getattr(self.config, k, None) for k in ("final_logit_softcapping", "logit_scale")) and not isinstance(
            model, FSDPModule)  # FSDP2 gathers the head's weight inside the root's forward only
        self.masked_id = getattr(base.config, "image_token_id", None)  # a VLM's image placeholder: never an action

    def forward(self, logits_to_keep: int = 0, **inputs) -> torch.Tensor:
        """The last `logits_to_keep` positions' (0 = all) hidden states [B, P, d], or logits [B, P, V] on the plain
        path. The root model runs (keeping one position's logits), so that wrappers' hooks (DDP, FSDP2) run too;
        the backbone's output is taken on its way."""
        if not self.separable:
            return self.model(**inputs, logits_to_keep=logits_to_keep).logits
        seen = []
        hook = self.backbone.register_forward_hook(lambda module, args, out: seen.append(out.last_hidden_state))
        try:
            self.model(**inputs, logits_to_keep=1)
        finally:
            hook.remove()
        return seen[0][:, -logits_to_keep:]

    def logprobs(self, states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The log-probs [N] of `targets` [N] from what `forward` gave at their positions [N, d or V]."""
        if self.separable:
            return head_logprobs(states, self.linear, targets, self.temperature, self.masked_id)[0]
        logits = without_placeholder(states.float() / self.temperature, self.model.config)
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def head_logprobs(hidden: torch.Tensor, linear: torch.nn.Linear, targets: torch.Tensor, temperature: float = 1.0,
                  masked_id: int | None = None, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `targets` [N] and entropies [N] (fp32) of the distributions linear(hidden [N, d]) / temperature,
    `chunk` tokens at a time (default: CHUNK_LOGITS logits a chunk); `masked_id` gets probability 0. Under autocast
    the matmuls run in its dtype, as nn.Linear's would. Gradients reach `hidden`, the weight (a tied embedding's
    too: autograd adds them on the shared parameter) and the bias."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    chunk = chunk or max(1, CHUNK_LOGITS // linear.weight.shape[0])
    return _ChunkedHead.apply(hidden, linear.weight, linear.bias, targets, temperature, masked_id, chunk, dtype)


def _cast(weight, bias, dtype) -> tuple:
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _log_softmax(hidden, weight, bias, temperature, masked_id) -> torch.Tensor:
    """One chunk's log-softmax [c, V] in fp32, its matmul in the weight's dtype. The masked id gets the lowest finite
    logit, not -inf: its probability is still exactly 0, and p * log p stays 0 (not nan) in the entropy and its
    gradient."""
    with torch.autocast(hidden.device.type, enabled=False):
        logits = F.linear(hidden.to(weight.dtype), weight, bias).float() / temperature
    if masked_id is not None:
        logits[:, masked_id] = torch.finfo(logits.dtype).min
    return torch.log_softmax(logits, -1)


class _ChunkedHead(torch.autograd.Function):
    """Saves its inputs and the entropies only; the backward recomputes each chunk's log-softmax from them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, masked_id, chunk, dtype):
        logp, entropy = (hidden.new_empty(len(hidden), dtype=torch.float32) for _ in range(2))
        w, b = _cast(weight, bias, dtype)
        for a in range(0, len(hidden), chunk):
            lp = _log_softmax(hidden[a:a + chunk], w, b, temperature, masked_id)
            logp[a:a + chunk] = lp.gather(1, targets[a:a + chunk, None])[:, 0]
            entropy[a:a + chunk] = -(lp.exp() * lp).sum(1)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.temperature, ctx.masked_id, ctx.chunk, ctx.dtype = temperature, masked_id, chunk, dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        w, b = _cast(weight, bias, ctx.dtype)
        for a in range(0, len(hidden), ctx.chunk):
            s = slice(a, a + ctx.chunk)
            lp = _log_softmax(hidden[s], w, b, ctx.temperature, ctx.masked_id)
            p = lp.exp()
            # d log p_t / dz = onehot(t) - p;  d entropy / dz = -(p log p + p entropy); z = logits / temperature.
            # In place, and p log p first: the masked id's log p is the lowest float, p 0, and their product 0 (no nan).
            upstream = grad_logp[s] + grad_entropy[s] * entropy[s]
            grad = lp.mul_(p).mul_(grad_entropy[s, None]).addcmul_(p, upstream[:, None]).neg_()
            grad[torch.arange(len(grad), device=grad.device), targets[s]] += grad_logp[s]
            grad = (grad / ctx.temperature).to(w.dtype)
            if want_hidden:
                grad_hidden[s] = grad @ w
            if want_weight:
                grad_weight += grad.T @ hidden[s].to(w.dtype)
            if want_bias:
                grad_bias += grad.float().sum(0)
        return (grad_hidden, grad_weight if grad_weight is None else grad_weight.to(weight.dtype),
                grad_bias if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None)


def without_placeholder(logits: torch.Tensor, config) -> torch.Tensor:
    """A VLM's image placeholder token is never an action (a generated one would have no image behind it): the
    sampler and the trainer both take it out of the distribution, so their log-probs agree."""
    if (image_token := getattr(config, "image_token_id", None)) is None:
        return logits
    return logits.index_fill(-1, torch.tensor(image_token, device=logits.device), float("-inf"))
