"""LLM judges behind an OpenAI-compatible endpoint or a local model sampled by the engine's own sampler: a rubric,
then one answer (pointwise) or a group's answers (group, as RULER does) per call; bounded concurrency, a timeout and
retries per call, failures counted, never raised."""
import asyncio
import contextlib
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import openai
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt_engine.chat import stop_ids
from molt_engine.inference.sampler import Sampler

POINTWISE = 'Reply with JSON only: {"score": S}, S a number from 0 (worst) to 1 (best).'
GROUP = ('Score each answer from 0 (worst) to 1 (best), relative to the others. Reply with JSON only: '
         '{"scores": [S1, S2, ...]}, one number per answer, in their order.')
JSON = re.compile(r"\{.*\}", re.DOTALL)


class LocalChat:
    """A local Hugging Face causal LM that answers chat messages greedily, decoded by the engine's Sampler on a thread
    of its own (its decode steps hold neither the event loop nor the policy's sampler)."""

    def __init__(self, path: str, device, max_tokens: int):
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if not self.tokenizer.chat_template:
            raise ValueError(f"judge {path!r}: its tokenizer has no chat template")
        model = AutoModelForCausalLM.from_pretrained(path).to(device).requires_grad_(False)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.sampler = Sampler(model, stop_ids(self.tokenizer, model.generation_config), pad, temperature=1.0,
                               executor=ThreadPoolExecutor(1, thread_name_prefix="molt-judge"))
        self.max_tokens, self.running = max_tokens, None

    async def __call__(self, messages: list[dict]) -> str:
        if self.running is None:  # the sampler's coroutine, in the run's event loop (which ends it with the run)
            self.running = asyncio.create_task(self.sampler.run())
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        reply = await self.sampler.generate(ids, self.max_tokens, greedy=True)
        return self.tokenizer.decode(reply.ids, skip_special_tokens=True)


class Judge:
    def __init__(self, cfg, device):
        self.cfg = cfg
        if cfg.api_key_env and cfg.api_key_env not in os.environ:
            raise ValueError(f"judge {cfg.model!r}: the environment variable {cfg.api_key_env} (its api_key_env) is "
                             f"not set")
        self.key = os.environ[cfg.api_key_env] if cfg.api_key_env else "none"
        self.local = None if cfg.base_url else LocalChat(cfg.model, device, cfg.max_tokens)
        self.client = self.slots = None  # made in the run's event loop, which they belong to

    async def __call__(self, texts, counts, latencies) -> list[float | None]:
        """A score per episode: 0-1, or per on_error (0, or None: dropped) where every try failed."""
        if self.slots is None:
            if not self.local:
                self.client = openai.AsyncOpenAI(base_url=self.cfg.base_url, api_key=self.key, max_retries=0,
                                                 timeout=self.cfg.timeout_s)
            # Without a bound of its own, the loop's admission bounds the calls: a bound below the episodes in
            # flight would queue a step's calls in waves and keep the trainer waiting beyond max_staleness
            self.slots = asyncio.Semaphore(self.cfg.concurrency) if self.cfg.concurrency else contextlib.nullcontext()
        failed = None if self.cfg.on_error == "drop" else 0.0
        if self.cfg.mode == "group":  # one group is one prompt's answers
            answers = "".join(f"Answer {i + 1}:\n{c}\n\n" for i, (_, c, _) in enumerate(texts))
            scores, seconds = await self.ask(f"Question:\n{texts[0][0]}\n\n{answers}", GROUP, len(texts), counts)
            if scores is None:
                return [failed] * len(texts)
            for row in latencies:
                row.append(seconds)
            return scores
        asked = await asyncio.gather(*(self.ask(f"Question:\n{p}\n\nAnswer:\n{c}", POINTWISE, 0, counts)
                                       for p, c, _ in texts))
        for (scores, seconds), row in zip(asked, latencies):
            if scores is not None:
                row.append(seconds)
        return [scores[0] if scores else failed for scores, _ in asked]

    async def ask(self, content: str, form: str, n: int, counts) -> tuple[list[float] | None, float]:
        """The scores of one call (n of them; 0: one, pointwise) and its latency; None after every try failed."""
        messages = [{"role": "system", "content": f"{self.cfg.rubric}\n\n{form}"}, {"role": "user", "content": content}]
        async with self.slots:
            for _ in range(self.cfg.retries + 1):
                start = time.perf_counter()
                try:
                    reply = await asyncio.wait_for(self.reply(messages), self.cfg.timeout_s)
                    return read_scores(reply, n), time.perf_counter() - start
                except (TimeoutError, openai.APITimeoutError):
                    counts["judge_timeouts"] += 1
                except (openai.OpenAIError, ValueError):  # refused, failed, or a reply without the scores asked for
                    counts["judge_errors"] += 1
        return None, 0.0

    async def reply(self, messages: list[dict]) -> str:
        if self.local:
            return await self.local(messages)
        reply = await self.client.chat.completions.create(model=self.cfg.model, messages=messages, temperature=0.0)
        return reply.choices[0].message.content or ""


def read_scores(text: str, n: int) -> list[float]:
    """The scores of a judge's JSON reply, each clipped to 0-1; ValueError if it holds no such JSON."""
    found = JSON.search(text)
    data = json.loads(found.group()) if found else {}  # json's own error is a ValueError too
    if not isinstance(data, dict):
        data = {}
    scores = data.get("scores") if n else [data.get("score")]
    if not isinstance(scores, list) or len(scores) != max(n, 1) or not all(
            isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores):
        raise ValueError(f"judge reply without {'%d scores' % n if n else 'a score'}: {text[:200]!r}")
    return [min(max(float(s), 0.0), 1.0) for s in scores]
