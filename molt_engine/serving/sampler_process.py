"""The sampler, and the episodes of the envs that run beside it, in a process of their own (loop.sampler_process):
decode steps and env turns stop sharing one interpreter lock with the trainer, so that with max_staleness > 0
sampling and training keep two cores busy."""
import asyncio
import copy
import itertools
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.multiprocessing as mp

from ..envs import load_user_envs
from ..rollout import EnvError, Rollout
from ..sampler import Request, Sampler

RESULTS = ("ids", "logprobs", "versions", "experts", "entropies", "top_logprobs")  # what a finished request brings back


class SamplerProcess:
    """The Sampler's interface (generate, publish, run, stats, model, temperature) for a Sampler in a spawned child:
    requests and results cross pipes, published weights cross as shared memory (torch.multiprocessing's pickling).
    Given the training env's `rollout`, whole episodes run in the child too (`episode`, which Rollout.episode hands
    them to): the loop's process then only admits, trains and keeps the books. An agent's episodes stay in the loop's
    process, beside the server its requests come to; they decode in the child through `generate`."""

    def __init__(self, model, rollout: Rollout | None = None, **kwargs):
        self.model, self.temperature = model, kwargs["temperature"]  # the parent's copy: what checkpoints save through
        self.runs_episodes = rollout is not None and rollout.server is None
        env = (rollout.cfg, rollout.processor, rollout.context_limit, rollout.stops) if self.runs_episodes else None
        context = mp.get_context("spawn")  # a fork would copy the trainer's threads' locks (OpenMP's) into the child
        self.results, results = context.Pipe(duplex=False)
        requests, self.requests = context.Pipe(duplex=False)
        self.process = context.Process(target=_serve, args=(copy.deepcopy(model), kwargs, env, requests, results),
                                       daemon=True, name="molt-sampler")
        self.process.start()
        requests.close()  # the child's ends: once it exits, reading ours raises EOFError instead of waiting forever
        results.close()
        self.keys, self.waiting = itertools.count(), {}  # request key -> (its Request or None, its future)
        self.stats = {"steps": 0, "rows": 0, "busy_s": 0.0, "idle_s": 0.0, "tokens": 0}

    def publish(self, state_dict, version: int):
        """As Sampler.publish: the child swaps the newest weights in between two decode steps."""
        self.send("publish", state_dict, version)

    def send(self, *message):
        try:
            self.requests.send(message)
        except OSError:  # BrokenPipeError: the child is gone
            raise self.exited() from None

    def exited(self) -> RuntimeError:
        self.process.join(5)
        return RuntimeError(f"the sampler process exited (code {self.process.exitcode})")

    async def generate(self, context, max_tokens, *, images=(), greedy=False, seed=0, top=0) -> Request:
        req = Request(list(context), max_tokens, greedy, None, list(images), top=top)
        return await self.ask(req, "generate", req.context, max_tokens, req.images, greedy, seed, top)

    async def episode(self, seed: int, group: int, index: int, greedy: bool = False) -> list:
        """Rollout.episode, run in the child: its rows, or the exception it raised (an EnvError is counted)."""
        return await self.ask(None, "episode", seed, group, index, greedy)

    async def ask(self, req: Request | None, kind: str, *args):
        key = next(self.keys)
        self.waiting[key] = req, asyncio.get_running_loop().create_future()
        self.send(kind, key, *args)
        try:
            return await self.waiting[key][1]
        except asyncio.CancelledError:  # an episode's timeout, the run's end: the child drops it
            self.send("cancel", key)
            raise
        finally:
            self.waiting.pop(key, None)

    async def run(self):
        """Hand the child's answers to their callers until cancelled; its error fails the run."""
        try:
            while True:
                try:
                    kind, payload, stats = await asyncio.to_thread(self.results.recv)
                except EOFError:
                    raise self.exited() from None
                if kind == "error":
                    raise RuntimeError(f"the sampler process failed:\n{payload}")
                self.stats = stats
                for key, answer in payload:
                    if key not in self.waiting or self.waiting[key][1].done():
                        continue
                    req, future = self.waiting[key]
                    if isinstance(answer, BaseException):
                        future.set_exception(answer)
                    elif req is None:  # an episode's rows
                        future.set_result(answer)
                    else:
                        for name, value in zip(RESULTS, answer):
                            setattr(req, name, value)
                        future.set_result(req)
        finally:
            if self.process.is_alive():  # the child answers "stop" as it leaves, which ends a read still waiting
                self.send("stop")
            self.process.join()


def _serve(model, kwargs: dict, env, requests, results):
    """The child, on one intra-op thread (as the sampler's steps are in the parent: they are too small to split)."""
    torch.set_num_threads(1)
    try:
        asyncio.run(_child(model, kwargs, env, requests, results))
    except Exception:
        results.send(("error", traceback.format_exc(), None))


async def _child(model, kwargs: dict, env, requests, results):
    """Decode (Sampler.run, its steps on a thread) and run episodes as the parent's messages ask; answers finished in
    one pass of the event loop go back as one message."""
    loop, sampler = asyncio.get_running_loop(), Sampler(model, **kwargs, executor=ThreadPoolExecutor(1, "molt-decode"))
    rollout = None
    if env:
        load_user_envs()  # the envs the parent knows: built in, $MOLT_ENVS's, the launching script's (spawn imports it)
        rollout = Rollout(*env)
    tasks, outbox, stopped = {}, [], loop.create_future()  # key -> its task; (key, answer) to send

    def flush():
        results.send(("done", outbox[:], sampler.stats))
        outbox.clear()

    async def answer(key, work):
        try:
            value = await work
            value = [getattr(value, name) for name in RESULTS] if isinstance(value, Request) else value
        except asyncio.CancelledError:  # the parent no longer waits for it
            return
        except Exception as e:  # an env error is counted; anything else fails the run with the child's traceback
            value = e if isinstance(e, EnvError) else RuntimeError("".join(traceback.format_exception(e)))
        finally:
            tasks.pop(key, None)
        if not outbox:
            loop.call_soon(flush)
        outbox.append((key, value))

    def read():
        while requests.poll():
            kind, *args = requests.recv()
            if kind == "stop":
                stopped.set_result(None)
                return
            if kind == "publish":
                sampler.publish(*args)
            elif kind == "cancel" and args[0] in tasks:
                tasks[args[0]].cancel()
            elif kind == "generate":
                key, context, max_tokens, images, greedy, seed, top = args
                work = sampler.generate(context, max_tokens, images=images, greedy=greedy, seed=seed, top=top)
                tasks[key] = loop.create_task(answer(key, work))
            elif kind == "episode":
                key, *episode = args
                tasks[key] = loop.create_task(answer(key, rollout.episode(sampler, *episode)))

    loop.add_reader(requests.fileno(), read)
    decoding = loop.create_task(sampler.run())
    await asyncio.wait([stopped, decoding], return_when=asyncio.FIRST_COMPLETED)
    if decoding.done():
        decoding.result()  # its error
    decoding.cancel()
    results.send(("stopped", [], sampler.stats))
