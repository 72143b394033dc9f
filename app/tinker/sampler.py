"""Tinker sampling clients here: a frozen copy of a policy (a base model, or a training client's weights when they
were saved for sampling), decoded token by token with its KV cache, num_samples sequences at once."""
import copy

import numpy as np
import torch

from molt_engine.models import load_policy

from .trainer import Refused, TrainedModel, model_config


class Sampler:
    def __init__(self, model, tokenizer, base_model: str, model_path: str | None = None, model_id: str | None = None,
                 step: int = 0):
        self.model, self.tokenizer, self.base_model, self.model_path = model.eval(), tokenizer, base_model, model_path
        self.model_id, self.step = model_id, step  # the training client whose weights these are, after `step` steps
        self.device = next(model.parameters()).device

    @classmethod
    def of_base(cls, base_model: str) -> "Sampler":
        cfg = model_config(base_model, rank=1).model_copy(update={"lora": None})  # refuses an unknown base model
        model, tokenizer = load_policy(cfg, seed=0)  # seed 0, as a training client's base
        return cls(model, tokenizer, base_model)

    @classmethod
    def snapshot(cls, trained: TrainedModel, model_path: str | None = None, model_id: str | None = None,
                 step: int | None = None) -> "Sampler":
        """The training client's weights now: later steps do not change what this sampler decodes with."""
        return cls(copy.deepcopy(trained.model), trained.tokenizer, trained.base_model, model_path, model_id,
                   trained.steps if step is None else step)

    @torch.no_grad()
    def sample(self, prompt: list[int], num_samples: int, max_tokens: int | None, temperature: float,
               stop, seed: int | None, prompt_logprobs: bool, top_k: int = -1,
               top_p: float = 1.0) -> tuple[list[dict], np.ndarray | None]:
        """Sequences {tokens, logprobs, stop}; and the prompt's log-probs if asked (the first is NaN: no token comes
        before it). The log-probs are those of the distribution sampled from (at the temperature, cut to top_k and
        top_p, renormalised): what importance sampling compares."""
        if not prompt:
            raise Refused("sample: an empty prompt")
        if top_k == 0 or top_k < -1 or not 0 < top_p <= 1:
            raise Refused(f"sample: top_k must be -1 (all tokens) or at least 1, and top_p in (0, 1]; got top_k "
                          f"{top_k}, top_p {top_p}")
        context = getattr(self.model.config, "max_position_embeddings", None) or 1 << 30
        max_tokens = min(max_tokens or 64, context - len(prompt))
        if max_tokens < 0:
            raise Refused(f"a prompt of {len(prompt)} tokens is past the model's context of {context}")
        stop_tokens, stop_strings = self._stops(stop)
        generator = torch.Generator(self.device).manual_seed(seed) if seed is not None else None
        ids = torch.tensor([prompt] * num_samples, device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        prompt_lp = None
        if prompt_logprobs:
            lp = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            prompt_lp = np.concatenate([[np.nan], lp.cpu().numpy()]).astype(np.float32)
        sequences = [{"tokens": [], "logprobs": [], "stop": False} for _ in range(num_samples)]
        logits, past, live = out.logits[:, -1].float(), out.cache, torch.ones(num_samples, dtype=torch.bool)
        for _ in range(max_tokens):
            logp = torch.log_softmax(truncated(logits / temperature if temperature > 0 else logits, top_k, top_p), -1)
            token = logp.argmax(-1) if temperature <= 0 else torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
            chosen = logp.gather(-1, token[:, None])[:, 0]
            for i in torch.nonzero(live).flatten().tolist():
                seq = sequences[i]
                seq["tokens"].append(int(token[i]))
                seq["logprobs"].append(float(chosen[i]))
                text = self.tokenizer.decode(seq["tokens"]) if stop_strings else ""
                if int(token[i]) in stop_tokens or any(s in text for s in stop_strings):
                    seq["stop"], live[i] = True, False
            if not live.any():
                break
            out = self.model(input_ids=token[:, None], cache=past, use_cache=True)
            logits, past = out.logits[:, -1].float(), out.cache
        return sequences, prompt_lp

    def _stops(self, stop) -> tuple[set[int], list[str]]:
        """Tinker's stop: None = the end-of-sequence token; a string or strings; token ids; [] = none at all."""
        if stop is None:
            return {self.tokenizer.eos_token_id}, []
        if isinstance(stop, str):
            return set(), [stop]
        return {s for s in stop if isinstance(s, int)}, [s for s in stop if isinstance(s, str)]


def truncated(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The logits with those outside the top_k tokens, or outside the fewest most likely tokens whose probability
    reaches top_p, set to -inf (-1 and 1: no cut). Ties with the k-th token stay."""
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.topk(top_k, -1).values[..., -1:], float("-inf"))
    if top_p < 1:
        probs, order = logits.softmax(-1).sort(-1, descending=True)
        beyond = probs.cumsum(-1) - probs >= top_p  # the mass before this token already reaches top_p
        logits = logits.masked_fill(beyond.scatter(-1, order, beyond), float("-inf"))
    return logits
