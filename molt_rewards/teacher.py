"""On-policy distillation: a teacher (a local Hugging Face causal LM with the policy's tokenizer) scores every token
the policy sampled; its per-token reverse KL becomes part of each token's advantage."""
import asyncio
import threading

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt_engine.episode import collate, to_device, token_logprobs, uncollated
from molt_engine.tokenizer_files import teacher_mismatch


class Teacher:
    def __init__(self, cfg, tokenizer, device):
        # Its log-probs are read at the policy's token ids: a tokenizer that gives other ids is refused (the config's
        # check at submit reads tokenizer.json only; this one reads any tokenizer transformers can)
        try:
            ids = AutoTokenizer.from_pretrained(cfg.path, local_files_only=True).get_vocab()
        except (OSError, ValueError) as e:
            raise ValueError(f"rewards.teacher: {cfg.path!r} has no tokenizer that transformers reads, so its token "
                             f"ids cannot be checked against the policy's (save the tokenizer beside the model): {e}")
        if why := teacher_mismatch(ids, tokenizer.get_vocab()):
            raise ValueError(why)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.path).to(device).eval().requires_grad_(False)
        self.coef, self.pad_id, self.device = cfg.coef, tokenizer.pad_token_id, torch.device(device)
        self.lock = threading.Lock()  # one forward at a time: groups queue

    def logprobs(self, rows) -> list[list]:
        """The teacher's log-prob of each row's action tokens (None or 0 elsewhere), in the trainer's own forward."""
        batch = to_device(collate(rows, self.pad_id), self.device)
        with self.lock, torch.inference_mode():
            values = token_logprobs(self.model, batch, 1.0).float().cpu()
        return uncollated(values, range(len(rows)), rows, batch["prompt_width"])

    async def __call__(self, rows):
        """Each row's token advantages, coef x (teacher log-prob - behaviour log-prob) on its actions (the negative
        of the reverse KL's per-token estimate), and its mean KL per action token as the metric teacher_kl."""
        for row, teacher in zip(rows, await asyncio.to_thread(self.logprobs, rows)):
            kl = [s - t if a else 0.0 for t, s, a in zip(teacher, row.logprobs, row.is_action)]
            row.info["token_advantages"] = [-self.coef * k for k in kl]
            row.info.setdefault("metrics", {})["teacher_kl"] = sum(kl) / max(row.n_actions, 1)
