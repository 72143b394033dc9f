"""Episodes: policy turns (through the sampler) alternating with env steps, recorded token-first; demonstrations
and the supervised warm start built on them."""
import asyncio
import math
import random
import traceback

import torch

from .algo import masked_mean
from .envs import make_env
from .episode import Episode, collate, to_device, token_logprobs

DEMO_SEEDS = 1 << 61        # warm-start prompts: far from training seeds ((run seed << 32) + cursor) and eval seeds


class EnvError(Exception):
    """An env call raised; this episode is dropped and counted."""


class Rollout:
    """Runs one env's episodes for a policy: owns the env text <-> token conversion; the sampler does the sampling."""

    def __init__(self, cfg, processor, context_limit: int):
        self.cfg, self.processor = cfg, processor
        self.tokenizer = getattr(processor, "tokenizer", processor)  # a VLM's processor wraps it
        self.eos_id = self.tokenizer.eos_token_id
        self.context_limit = context_limit

    async def episode(self, sampler, seed: int, group: int, index: int, greedy: bool = False) -> Episode:
        """Alternate policy turns and env steps. Generated ids go into the record as sampled, never re-encoded;
        only env text is tokenized, and it is never trained."""
        env = make_env(self.cfg.env, self.cfg.env_args)
        drill = random.Random(hash((seed, index))) if self.cfg.drills.env_error_rate else None
        obs = await _env_call(env.reset(seed))
        ep = Episode(seed=seed, group=group)
        self.observe(ep, obs.text, obs.images)
        info = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "truncated": True, "entropy": 0.0}
        for turn in range(env.max_turns):
            if len(ep.token_ids) + env.max_tokens > self.context_limit:
                break
            req = await sampler.generate(ep.token_ids, env.max_tokens, images=ep.images, greedy=greedy,
                                         seed=hash((self.cfg.seed, seed, index, turn)) & (2**62 - 1))
            ep.extend(req.ids, action=True, logprobs=req.logprobs, versions=req.versions, experts=req.experts,
                      entropies=req.entropies)
            info["entropy"] += sum(req.entropies)
            text = self.tokenizer.decode(req.ids[:-1] if req.ids[-1] == self.eos_id else req.ids)
            if drill and drill.random() < self.cfg.drills.env_error_rate:
                raise EnvError("drill: injected env error (drills.env_error_rate)")
            result = await _env_call(env.step(text))
            ep.reward += result.reward
            info["turns"] += 1
            info["tool_calls"] += bool(result.info.get("tool_call"))
            info["tool_errors"] += bool(result.info.get("tool_error"))
            if result.terminated or result.truncated:
                info["truncated"] = result.truncated
                break
            self.observe(ep, result.observation, result.images)
        info["success"] = ep.reward >= env.success_reward
        ep.info = info
        return ep

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def observe(self, ep: Episode, text: str, images: list):
        """Append env text to the episode as non-action tokens. With images, the VLM's processor expands each
        image placeholder of the text into the image's tokens, and the pixel values join ep.images in order."""
        if not images:
            ep.extend(self.encode(text))
            return
        if self.processor is self.tokenizer:
            raise ValueError(f"env {self.cfg.env!r} sends images, but the policy is text-only (use a VLM preset)")
        out = self.processor(text=text, images=images, add_special_tokens=False, return_tensors="pt")
        ep.extend(out["input_ids"][0].tolist())
        ep.images += list(out["pixel_values"])

    async def demonstration(self, seed: int) -> Episode:
        env = make_env(self.cfg.env, self.cfg.env_args)
        obs = await env.reset(seed)
        ep = Episode(seed=seed, group=-1)
        self.observe(ep, obs.text, obs.images)
        for action in env.demonstration(seed):
            ids = self.encode(action) + [self.eos_id]
            ep.extend(ids, action=True, logprobs=[0.0] * len(ids), versions=[0] * len(ids))
            result = await env.step(action)
            if result.terminated or result.truncated:
                break
            self.observe(ep, result.observation, result.images)
        return ep

    async def warm_start(self, model, pad_id: int, stopping) -> float:
        """A few supervised steps on env demonstrations: teaches the format so RL starts from a non-zero reward.
        Stops early when `stopping()` says so (before RL began: nothing worth a checkpoint yet). Returns the last
        loss."""
        ws = self.cfg.warm_start
        optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr)
        loss = math.nan
        for step in range(ws.steps):
            if stopping():
                break
            seeds = range(DEMO_SEEDS + step * ws.batch_size, DEMO_SEEDS + (step + 1) * ws.batch_size)
            batch = to_device(collate(await asyncio.gather(*(self.demonstration(s) for s in seeds)), pad_id),
                              next(model.parameters()).device)

            def sft_step():
                nll = -masked_mean(token_logprobs(model, batch, 1.0), batch["action_mask"])
                optimizer.zero_grad(set_to_none=True)
                nll.backward()
                optimizer.step()
                return nll.item()
            loss = await asyncio.to_thread(sft_step)
        return loss


async def _env_call(awaitable):
    try:
        return await awaitable
    except Exception as e:
        raise EnvError("".join(traceback.format_exception(e))) from e
