"""Episodes: policy turns (through the sampler) alternating with env steps (or tool calls), recorded token-first;
demonstrations and the supervised warm start built on them."""
import asyncio
import math
import random
import traceback
from pathlib import Path

import torch

from .serving.agents import Agent
from .algo import masked_mean
from .chat import PARSERS, Template, run_tools
from .envs import DEMO_SEEDS, EVAL_SEEDS, Env, make_env, resolve
from .episode import Episode, collate, to_device, token_logprobs
from .serving.core import template_message


class EnvError(Exception):
    """An env call raised; this episode is dropped and counted."""


class EnvFailure(RuntimeError):
    """Most recent episodes failed inside the env: the run stops, carrying the env's traceback."""


class PromptTooLong(EnvError):
    """No room in the context for the first reply: the episode is dropped and counted as its own kind of failure
    (an episode without actions would pass for a stale one)."""


class Rollout:
    """Runs one env's episodes for a policy: owns the env text (or messages) <-> token conversion; the sampler does
    the sampling. `stops`: the ids a policy turn ends at."""

    def __init__(self, cfg, processor, context_limit: int, stops: list[int]):
        self.cfg, self.processor, self.stops, self.context_limit = cfg, processor, stops, context_limit
        self.tokenizer = getattr(processor, "tokenizer", processor)  # a VLM's processor wraps it
        self.eos_id = self.tokenizer.eos_token_id
        env = make_env(cfg.env, cfg.env_args)
        self.template = Template(self.tokenizer, env.tools, stops) if env.chat else None
        self.parse = resolve(cfg.model.tool_parser, PARSERS, "tool parser")
        self.notes, self.tools, self.server = list(env.notes), {}, None
        self.demonstrates = type(env).demonstration not in (Env.demonstration, Agent.demonstration)
        if isinstance(env, Agent):  # its requests come to a loopback OpenAI server (Training runs `server.serve`)
            from .serving.server import AgentServer  # here: only agents load the serving stack (fastapi, uvicorn)
            model = Path(cfg.model.path).name if cfg.model.path else cfg.model.preset
            self.server = AgentServer(self.tokenizer, stops, context_limit, self.parse, model, cfg.seed)
        else:
            self.tools = {tool.__name__: tool for tool in env.tools}

    async def episode(self, sampler, seed: int, group: int, index: int, greedy: bool = False) -> list[Episode]:
        """Alternate policy turns and env steps. Generated ids go into the record as sampled, never re-encoded;
        only env text is tokenized, and it is never trained. Returns the episode's rows: one record, or an agent's
        segments."""
        env = make_env(self.cfg.env, self.cfg.env_args)
        if self.server:
            return await _env_call(self.server.episode(env, sampler, seed, group, index, greedy))
        drill = random.Random(hash((seed, index))) if self.cfg.drills.env_error_rate else None
        obs = await _env_call(env.reset(seed))
        ep = Episode(seed=seed, group=group)
        info = ep.info = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "truncated": True, "entropy": 0.0,
                          "metrics": {}}

        async def act(turn: int) -> list[int] | None:
            if len(ep.token_ids) + env.max_tokens > self.context_limit:
                if turn == 0:
                    raise PromptTooLong(f"the prompt is {len(ep.token_ids)} tokens: with a reply of up to "
                                        f"{env.max_tokens} it does not fit the context ({self.context_limit})")
                return None
            req = await sampler.generate(ep.token_ids, env.max_tokens, images=ep.images, greedy=greedy,
                                         seed=hash((self.cfg.seed, seed, index, turn)) & (2**62 - 1))
            ep.sampled(req)
            info["entropy"] += sum(req.entropies)
            if drill and drill.random() < self.cfg.drills.env_error_rate:
                raise EnvError("drill: injected env error (drills.env_error_rate)")
            return req.ids

        if self.template:
            await self.chat_turns(env, obs, ep, lambda turn, history: act(turn))
        else:
            self.observe(ep, obs.text, obs.images)
            for turn in range(env.max_turns):
                ids = await act(turn)
                if ids is None:
                    break
                result = await _env_call(env.step(self.tokenizer.decode(ids[:-1] if ids[-1] in self.stops else ids)))
                info["tool_calls"] += bool(result.info.get("tool_call"))
                info["tool_errors"] += bool(result.info.get("tool_error"))
                if self.scored(ep, result):
                    break
                self.observe(ep, result.observation, result.images)
        info["success"] = ep.reward >= env.success_reward
        return [ep]

    async def evaluate(self, sampler, n: int) -> list[Episode]:
        """n greedy episodes on held-out seeds, the same at every eval; those that failed are left out."""
        results = await asyncio.gather(*(self.episode(sampler, EVAL_SEEDS + i, -1, 0, greedy=True) for i in range(n)),
                                       return_exceptions=True)
        return [e for r in results if isinstance(r, list) for e in r]

    @staticmethod
    def scored(ep: Episode, result) -> bool:
        """Book an env step's reward, turn and metrics on the episode; whether it ended the episode."""
        ep.reward += result.reward
        ep.info["turns"] += 1
        ep.info["metrics"].update(result.info.get("metrics", {}))
        if result.terminated or result.truncated:
            ep.info["truncated"] = result.truncated
        return result.terminated or result.truncated

    async def chat_turns(self, env, obs, ep: Episode, act):
        """A chat env's turns: the template renders the messages; each reply's sampled ids stay as they are, then
        its tool calls run (results as `tool` messages) or, without calls, env.step scores its content; only the
        template's delta of the new messages is appended. `act(turn, history)` appends a reply's action tokens and
        returns them (None: no room left)."""
        info = ep.info
        info.update(tool_errors=0, template_prefix_breaks=0)
        history = list(obs.messages)
        ep.extend(self.template.ids(history, generation=True))
        for turn in range(env.max_turns):
            ids = await act(turn, history)
            if ids is None:
                break
            ended = ids[-1] in self.stops
            text = self.tokenizer.decode(ids[:-1] if ended else ids)
            content, calls = self.parse(text) if self.tools else (text.strip(), [])  # no tools: all of it is content
            reply = {"role": "assistant", "content": content}
            if valid := [{"type": "function", "function": c} for c in calls if "error" not in c]:
                reply["tool_calls"] = valid
            if calls:
                info["turns"] += 1
                info["tool_calls"] += len(calls)
                results = await run_tools(self.tools, calls, env.tool_timeout)
                info["tool_errors"] += sum(error for _, _, error in results)
                new = [{"role": "tool", "name": name, "content": out} for name, out, _ in results]
            else:
                result = await _env_call(env.step(content))
                if self.scored(ep, result):
                    break
                new = [{"role": "user", "content": result.observation}] if result.observation else []
            tail, broke = self.template.after_reply(history + [reply], new, ended)
            info["template_prefix_breaks"] += broke
            ep.extend(tail)
            history += [reply] + new

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
        ep = Episode(seed=seed, group=-1, info={"turns": 0, "tool_calls": 0, "metrics": {}})
        if self.server:  # an agent's demonstration is the whole conversation: each reply after what preceded it
            history, said = [], None
            for message in (template_message(m, i) for i, m in enumerate(env.demonstration(seed))):
                if message["role"] == "assistant":
                    ep.extend(self.template.after_reply(said, history[len(said):], True)[0] if said
                              else self.template.ids(history, generation=True))
                    ep.extend(self.template.reply(history, message), action=True)
                    said = history + [message]
                history.append(message)
            return ep
        obs = await env.reset(seed)
        if self.template:
            replies = iter(env.demonstration(seed))

            async def act(turn, history):
                message = next(replies, None)
                ids = self.template.reply(history, message) if message else None
                ep.extend(ids or [], action=True)
                return ids
            await self.chat_turns(env, obs, ep, act)
            return ep
        self.observe(ep, obs.text, obs.images)
        for action in env.demonstration(seed):
            ep.extend(self.encode(action) + [self.eos_id], action=True)
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
        optimizer, loss = torch.optim.AdamW(model.parameters(), lr=ws.lr, fused=True), math.nan
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
