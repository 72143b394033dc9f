"""LLM judges behind an OpenAI-compatible endpoint: a rubric, then one answer (pointwise) or a group's answers
(group, as RULER does) per call; bounded concurrency, a timeout and retries per call, failures counted, never raised."""
import asyncio
import json
import os
import re
import time

import openai

POINTWISE = 'Reply with JSON only: {"score": S}, S a number from 0 (worst) to 1 (best).'
GROUP = ('Score each answer from 0 (worst) to 1 (best), relative to the others. Reply with JSON only: '
         '{"scores": [S1, S2, ...]}, one number per answer, in their order.')
JSON = re.compile(r"\{.*\}", re.DOTALL)


class Judge:
    def __init__(self, cfg):
        self.cfg = cfg
        if cfg.api_key_env and cfg.api_key_env not in os.environ:
            raise ValueError(f"judge {cfg.model!r}: the environment variable {cfg.api_key_env} (its api_key_env) is "
                             f"not set")
        self.key = os.environ[cfg.api_key_env] if cfg.api_key_env else "none"
        self.client = self.slots = None  # made in the run's event loop, which they belong to

    async def __call__(self, texts, counts, latencies) -> list[float | None]:
        """A score per episode: 0-1, or per on_error (0, or None: dropped) where every try failed."""
        if self.client is None:
            self.client = openai.AsyncOpenAI(base_url=self.cfg.base_url, api_key=self.key, max_retries=0,
                                             timeout=self.cfg.timeout_s)
            self.slots = asyncio.Semaphore(self.cfg.concurrency)
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
                    reply = await asyncio.wait_for(self.client.chat.completions.create(
                        model=self.cfg.model, messages=messages, temperature=0.0), self.cfg.timeout_s)
                    return read_scores(reply.choices[0].message.content or "", n), time.perf_counter() - start
                except (TimeoutError, openai.APITimeoutError):
                    counts["judge_timeouts"] += 1
                except (openai.OpenAIError, ValueError):  # refused, failed, or a reply without the scores asked for
                    counts["judge_errors"] += 1
        return None, 0.0


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
