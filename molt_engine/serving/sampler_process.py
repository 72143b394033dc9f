"""The sampler in a process of its own (loop.sampler_process): its decode steps stop sharing one interpreter lock with
the trainer and the envs, so that with max_staleness > 0 sampling and training keep two cores busy."""
import asyncio
import copy
import itertools
import time
import traceback
from concurrent.futures import Future

import torch
import torch.multiprocessing as mp

from ..sampler import Request, Sampler

RESULTS = ("ids", "logprobs", "versions", "experts", "entropies", "top_logprobs")  # what a finished request brings back


class SamplerProcess:
    """The Sampler's interface (generate, publish, run, stats, model, temperature) for a Sampler in a spawned child:
    requests and results cross pipes, published weights cross as shared memory (torch.multiprocessing's pickling)."""

    def __init__(self, model, **kwargs):
        self.model, self.temperature = model, kwargs["temperature"]  # the parent's copy: what checkpoints save through
        context = mp.get_context("spawn")  # a fork would copy the trainer's threads' locks (OpenMP's) into the child
        self.results, results = context.Pipe(duplex=False)
        requests, self.requests = context.Pipe(duplex=False)
        self.process = context.Process(target=_serve, args=(copy.deepcopy(model), kwargs, requests, results),
                                       daemon=True, name="molt-sampler")
        self.process.start()
        requests.close()  # the child's ends: once it exits, reading ours raises EOFError instead of waiting forever
        results.close()
        self.keys, self.waiting = itertools.count(), {}  # request key -> (its Request, its future)
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
        key, req = next(self.keys), Request(list(context), max_tokens, greedy, None, list(images), top=top)
        self.waiting[key] = req, asyncio.get_running_loop().create_future()
        self.send("generate", key, req.context, max_tokens, req.images, greedy, seed, top)
        try:
            return await self.waiting[key][1]
        except asyncio.CancelledError:  # an episode's timeout, the run's end: the child drops it at its next step
            self.send("cancel", key)
            raise
        finally:
            self.waiting.pop(key, None)

    async def run(self):
        """Hand the child's finished requests to their callers until cancelled; its error fails the run."""
        try:
            while True:
                try:
                    kind, payload, stats = await asyncio.to_thread(self.results.recv)
                except EOFError:
                    raise self.exited() from None
                if kind == "error":
                    raise RuntimeError(f"the sampler process failed:\n{payload}")
                self.stats = stats
                for key, values in payload:
                    if key in self.waiting and not self.waiting[key][1].done():
                        req, future = self.waiting[key]
                        for name, value in zip(RESULTS, values):
                            setattr(req, name, value)
                        future.set_result(req)
        finally:
            if self.process.is_alive():  # the child answers "stop" as it leaves, which ends a read still waiting
                self.send("stop")
            self.process.join()


def _serve(model, kwargs: dict, requests, results):
    """The child: decode while there is work, taking the parent's messages between two steps (on one intra-op thread,
    as the sampler's steps are in the parent: they are too small to split)."""
    torch.set_num_threads(1)
    sampler, reqs = Sampler(model, **kwargs), {}  # key -> its request, until it finishes or is cancelled
    try:
        while True:
            if not (sampler.pending or sampler.active):
                t0 = time.perf_counter()
                requests.poll(None)
                sampler.stats["idle_s"] += time.perf_counter() - t0
            while requests.poll():
                kind, *args = requests.recv()
                if kind == "stop":
                    results.send(("stopped", [], sampler.stats))
                    return
                if kind == "publish":
                    sampler.publish(*args)
                elif kind == "cancel" and args[0] in reqs:
                    reqs.pop(args[0]).future.cancel()
                elif kind == "generate":
                    key, context, max_tokens, images, greedy, seed, top = args
                    reqs[key] = Request(context, max_tokens, greedy, torch.Generator(sampler.device).manual_seed(seed),
                                        images, future=Future(), top=top)
                    sampler.pending.append(reqs[key])
            if sampler.pending or sampler.active:
                t0 = time.perf_counter()
                finished = {id(r) for r in sampler.step()}
                sampler.stats["busy_s"] += time.perf_counter() - t0
                done = [(key, [getattr(r, name) for name in RESULTS]) for key, r in reqs.items() if id(r) in finished]
                for key, _ in done:
                    del reqs[key]
                if done:
                    results.send(("done", done, sampler.stats))
    except Exception:
        results.send(("error", traceback.format_exc(), None))
