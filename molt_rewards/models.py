"""Reward models: a local Hugging Face AutoModelForSequenceClassification directory scores each episode's text."""
import asyncio
import threading

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer


class RewardModel:
    """Scores a group's episodes in one padded forward, on its own thread so the event loop stays free."""

    def __init__(self, path: str, device):
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval().requires_grad_(False)
        if self.tokenizer.pad_token is None:  # e.g. GPT-2's: padding is masked out, any token will do
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:  # how the model finds each row's last token in a padded batch
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.lock = torch.device(device), threading.Lock()  # one forward at a time: groups queue

    def text(self, prompt: str, completion: str) -> str:
        """The text the model scores: the exchange in its own chat template where it has one, else the plain text."""
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                                       {"role": "assistant", "content": completion}], tokenize=False)
        return prompt + completion

    def scores(self, texts: list[str]) -> list[float]:
        """Each text's first logit (the score of a one-label reward model)."""
        batch = self.tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=not self.tokenizer.chat_template)
        with self.lock, torch.inference_mode():
            logits = self.model(**batch.to(self.device)).logits
        return logits[:, 0].float().tolist()

    async def __call__(self, texts, counts, latencies) -> list[float]:
        return await asyncio.to_thread(self.scores, [self.text(p, c) for p, c, _ in texts])
