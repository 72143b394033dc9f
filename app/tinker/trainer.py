"""A Tinker training client's model here: a LoRA policy built by the engine, its Adam, and Tinker's built-in losses."""
import io
from pathlib import Path

import numpy as np
import torch

from molt_engine.config import LoraConfig, ModelConfig
from molt_engine.logprobs import Head
from molt_engine.models import PRESETS, load_policy

# Tinker's train_attn / train_mlp / train_unembed as module names (Llama's and Qwen's, which the presets and most
# local checkpoints use)
ATTENTION, MLP, UNEMBED = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"], ["lm_head"]
LORA_ALPHA = 32.0  # fixed, so that a learning rate means the same at every rank (alpha / r scales the adapters)
# Tinker's built-in losses, as its docs define them. Not stable_reinforce: it needs what the hosted sampler records
# for it ("stability info", named by sequence_id), and Tinker publishes neither that nor the loss
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
TEXT_PRESETS = sorted(name for name in PRESETS if name != "tiny-vlm")  # images are not served (docs/tinker.md)


class Refused(ValueError):
    """A request this server cannot serve as asked: the client gets a 400 (or a failed future) saying why."""


def model_config(base_model: str, rank: int, train_attn=True, train_mlp=True, train_unembed=True) -> ModelConfig:
    """The engine's model section for a Tinker base model: a text preset's name, or a local Hugging Face directory."""
    if base_model in TEXT_PRESETS:
        preset, path = base_model, None
    elif Path(base_model).is_dir() and (Path(base_model) / "config.json").exists():
        preset, path = None, base_model
    else:
        raise Refused(f"unknown base model {base_model!r}: name a preset ({', '.join(TEXT_PRESETS)}) or a local "
                      "Hugging Face model directory on the server's machine")
    targets = ATTENTION * train_attn + MLP * train_mlp + UNEMBED * train_unembed
    return ModelConfig(preset=preset, path=path, lora=LoraConfig(r=rank, alpha=LORA_ALPHA, target_modules=targets))


class TrainedModel:
    """One training client's policy and optimizer. Not thread-safe: the API runs one request at a time per model,
    in the order of the client's seq_ids. Gradients add up over forward_backward calls until optim_step."""

    def __init__(self, base_model: str, rank: int, seed: int | None, train_attn=True, train_mlp=True,
                 train_unembed=True, device: str | None = None):
        """`device`: e.g. cuda:1, the GPU the client was given; None = model.device auto (a GPU torch sees, else the
        CPU)."""
        self.base_model, self.rank, self.targets = base_model, rank, (train_attn, train_mlp, train_unembed)
        self.cfg = model_config(base_model, rank, train_attn, train_mlp, train_unembed)
        if device is not None:
            self.cfg = self.cfg.model_copy(update={"device": device})
        # A preset's base weights come from seed 0, whatever the adapters' seed: every client of a preset, and its
        # sampler, share one base model
        self.model, self.tokenizer = load_policy(self.cfg, seed=0)
        if seed is not None:
            torch.manual_seed(seed)
            for module in self.model.modules():
                if hasattr(module, "reset_lora_parameters"):
                    module.reset_lora_parameters("default", True)
        self.device = next(self.model.parameters()).device
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.head = Head(self.model, 1.0)
        self.context = getattr(self.model.config, "max_position_embeddings", None)
        self.steps = 0                       # optim_steps done
        self.loss_since_step, self.tokens_since_step = 0.0, 0.0

    def forward_backward(self, data: list[tuple[list[int], dict[str, np.ndarray]]], loss_fn: str,
                         config: dict[str, float], forward_only: bool) -> tuple[list[dict], dict[str, float]]:
        """Per datum (tokens, loss inputs): its outputs ("logprobs" and "elementwise_loss" per token) and the batch's
        metrics. Tinker's losses are sums over tokens (weights or advantages do any normalising)."""
        if loss_fn not in LOSSES:
            why = ("; stable_reinforce needs what Tinker's sampler records for it (record_stability_info), and "
                   "Tinker publishes neither that nor the loss" if loss_fn == "stable_reinforce" else "")
            raise Refused(f"loss_fn {loss_fn!r} is not supported here; supported: {', '.join(LOSSES)} (a custom loss "
                          f"runs in the client: forward_backward_custom){why}")
        longest = max(len(tokens) for tokens, _ in data)
        if self.context and longest > self.context:
            raise Refused(f"a sequence of {longest} tokens is past the model's context of {self.context}")
        for tokens, inputs in data:
            if "target_tokens" not in inputs or len(inputs["target_tokens"]) != len(tokens):
                raise Refused("each datum needs loss_fn_inputs['target_tokens'], one per input token")
        ids = torch.zeros(len(data), longest, dtype=torch.long)
        mask = torch.zeros(len(data), longest, dtype=torch.long)
        for i, (tokens, _) in enumerate(data):
            ids[i, :len(tokens)], mask[i, :len(tokens)] = torch.tensor(tokens), 1
        with torch.set_grad_enabled(not forward_only):
            states = self.head.forward(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
            outputs, total = [], 0.0
            for i, (tokens, inputs) in enumerate(data):
                n = len(tokens)
                targets = torch.as_tensor(inputs["target_tokens"], dtype=torch.long, device=self.device)
                logprobs = self.head.logprobs(states[i, :n], targets)
                loss = elementwise_loss(loss_fn, logprobs, inputs, config)
                total = total + loss.sum()
                outputs.append({"logprobs": logprobs.detach().float().cpu().numpy(),
                                "elementwise_loss": loss.detach().float().cpu().numpy()})
            if not forward_only:
                total.backward()
                self.loss_since_step += total.item()
                self.tokens_since_step += float(mask.sum())
        return outputs, {"loss:sum": float(total.detach()) if torch.is_tensor(total) else total}

    def optim_step(self, learning_rate: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:
        """One Adam step on the gradients summed since the last step; the metrics that the run's chart shows."""
        for group in self.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        norm = torch.nn.utils.clip_grad_norm_(self.params, grad_clip_norm if grad_clip_norm > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        metrics = {"loss": self.loss_since_step, "grad_norm": float(norm), "learning_rate": learning_rate,
                   "loss_per_token": self.loss_since_step / max(self.tokens_since_step, 1)}
        self.loss_since_step, self.tokens_since_step = 0.0, 0.0
        return metrics

    def save(self, path: Path, optimizer: bool = True):
        """The adapters (and the optimizer's moments): what load restores exactly. Whole or not at all: a write that
        fails (a full disk) leaves no file and the state of that name as it was, and the error reaches the future."""
        path.parent.mkdir(parents=True, exist_ok=True)
        names = {id(p): n for n, p in self.model.named_parameters()}
        state = io.BytesIO()  # a few MB of adapters; torch's own file writer turns ENOSPC into an unreadable error
        torch.save({"base_model": self.base_model, "rank": self.rank, "targets": self.targets, "steps": self.steps,
                    "weights": {names[id(p)]: p.detach().cpu() for p in self.params},
                    "optimizer": self.optimizer.state_dict() if optimizer else None}, state)
        partial = path.with_name(f".{path.name}.partial")  # state names never start with a dot: no state's name
        try:
            partial.write_bytes(state.getbuffer())
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)

    def load(self, path: Path, optimizer: bool):
        state = saved(path)
        if (state["base_model"], state["rank"], tuple(state["targets"])) != (self.base_model, self.rank, self.targets):
            raise Refused(f"the state was saved from {state['base_model']} at rank {state['rank']} (modules "
                          f"{state['targets']}), not {self.base_model} at rank {self.rank} ({self.targets})")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in state["weights"].items():
                params[name].copy_(value)
        if optimizer and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.steps = state["steps"]


def saved(path: Path) -> dict:
    """A state that save wrote (its base model, rank and modules say which model can load it)."""
    if not path.is_file():
        raise Refused(f"no saved state at {path}")
    return torch.load(path, map_location="cpu", weights_only=True)


def elementwise_loss(loss_fn: str, logprobs: torch.Tensor, inputs: dict, config: dict) -> torch.Tensor:
    """A datum's per-token loss under one of Tinker's built-in losses (LOSSES), from the learner's log-probs of its
    target tokens, its loss_fn_inputs and the request's loss_fn_config. The request's loss is this summed."""
    def given(name: str) -> torch.Tensor:
        if name not in inputs:
            raise Refused(f"loss_fn {loss_fn!r} needs loss_fn_inputs[{name!r}]")
        values = np.asarray(inputs[name], dtype=np.float32)
        if values.shape != tuple(logprobs.shape):
            raise Refused(f"loss_fn_inputs[{name!r}] has shape {values.shape}: one value per target token, "
                          f"{tuple(logprobs.shape)}")
        return torch.as_tensor(values, device=logprobs.device)

    if loss_fn == "cross_entropy":
        weights = given("weights") if "weights" in inputs else torch.ones_like(logprobs)
        return -logprobs * weights
    sampled, advantages = given("logprobs"), given("advantages")  # the sampler's log-probs q
    if loss_fn == "dro":  # no ratio: the log-prob weighed by the advantage, less a quadratic penalty on log(p/q)
        if "beta" not in config:
            raise Refused("loss_fn 'dro' needs loss_fn_config['beta'] (the weight of its quadratic penalty)")
        return -(logprobs * advantages - 0.5 * config["beta"] * (logprobs - sampled) ** 2)
    if loss_fn == "gspo":  # GSPO-token: every token's ratio has the sequence's value (the geometric mean of the
        # ratios over the tokens sequence_ratio_mask marks) and the gradient of its own log-prob
        marked = given("sequence_ratio_mask") != 0
        if not marked.any():
            raise Refused("loss_fn 'gspo': a datum's sequence_ratio_mask marks no token")
        sequence = (logprobs.detach() - sampled)[marked].mean()
        ratio = torch.exp(sequence + logprobs - logprobs.detach())
    else:
        ratio = torch.exp(logprobs - sampled)
    if loss_fn == "importance_sampling":
        return -ratio * advantages
    clipped = ratio.clamp(config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2))
    if loss_fn == "cispo":  # the clipped ratio, held constant, weighs the log-prob's gradient
        return -clipped.detach() * logprobs * advantages
    return -torch.minimum(ratio * advantages, clipped * advantages)  # ppo, gspo
