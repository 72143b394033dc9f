"""The sampler in a process of its own (loop.sampler_process): its decode steps stop sharing one interpreter lock with
the trainer and the episodes' Python, so that with max_staleness > 0 sampling and training keep two cores busy."""
import asyncio
import contextlib
import copy
import itertools
import time
import traceback
from concurrent.futures import Future

import torch
import torch.multiprocessing as mp

from .sampler import Request, Sampler, decoding

RESULTS = ("ids", "logprobs", "versions", "experts", "entropies", "top_logprobs")  # what a finished request brings back


class SamplerProcess:
    """The Sampler's interface (generate, publish, run, stats, model, temperature) for a Sampler in a spawned child:
    requests and results cross pipes, published weights cross as shared memory (torch.multiprocessing's pickling).
    Episodes (an env's, an agent's) stay in the loop's process and only decode in the child. The child decodes and
    nothing else because decoding is the larger half: with the env's episodes beside it the child bounded the rate
    while the trainer waited (docs/benchmarks.md, eleventh pass)."""

    stop_timeout = 10.0  # seconds the child has to leave once told to stop (a decode step is far shorter); then killed

    def __init__(self, model, **kwargs):
        self.model, self.temperature = model, kwargs["temperature"]  # the parent's copy: what checkpoints save through
        self.decoding = decoding(model, kwargs.get("cuda_graphs", False))  # the child's path, as a Sampler's
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
        """As Sampler.publish: the child swaps the newest weights in between two decode steps. The tensors cross as
        views of one buffer per dtype: each storage crosses as a file descriptor, and the child took one from this
        process's resource sharer per tensor (a connection each: ~6% of the child's time) when each had its own."""
        views = {}
        for dtype in {tensor.dtype for tensor in state_dict.values()}:
            same = {name: tensor for name, tensor in state_dict.items() if tensor.dtype == dtype}
            flat = torch.cat([tensor.reshape(-1) for tensor in same.values()])
            parts = flat.split([tensor.numel() for tensor in same.values()])
            views |= {name: part.view(tensor.shape) for (name, tensor), part in zip(same.items(), parts)}
        self.send("publish", views, version)

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
        key = next(self.keys)
        self.waiting[key] = req, asyncio.get_running_loop().create_future()
        self.send("generate", key, req.context, max_tokens, req.images, greedy, seed, top)
        try:
            return await self.waiting[key][1]
        except asyncio.CancelledError:  # an episode's timeout, the run's end: the child drops it
            with contextlib.suppress(RuntimeError):  # a child already gone has nothing to drop: the cancellation stands
                self.send("cancel", key)
            raise
        finally:
            self.waiting.pop(key, None)

    async def run(self):
        """Hand the child's answers to their callers until cancelled; its error fails the run, and every request
        still waiting with it (at once: none waits for an answer that cannot come)."""
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
                    if key in self.waiting and not self.waiting[key][1].done():
                        req, future = self.waiting[key]
                        for name, value in zip(RESULTS, answer):
                            setattr(req, name, value)
                        future.set_result(req)
        except RuntimeError as error:
            for _, future in self.waiting.values():
                if not future.done():
                    future.set_exception(error)
            raise
        finally:  # whatever ends the run (its cancellation, the child's error) stays what propagates
            if self.process.is_alive():  # the child answers "stop" as it leaves, which ends a read still waiting
                with contextlib.suppress(RuntimeError):
                    self.send("stop")
            # Joined on a thread: the event loop (the envs, the agent server) keeps running while the child leaves
            await asyncio.to_thread(self.process.join, self.stop_timeout)
            if self.process.is_alive():  # stuck (a decode step that never ends): it must not outlive the run
                self.process.kill()
                await asyncio.to_thread(self.process.join)


def _serve(model, kwargs: dict, requests, results):
    """The child: one thread, on one intra-op thread (the sampler's steps are too small to split), that reads the
    parent's messages between decode steps and sends back the requests each step finished. Decode steps follow each
    other on this thread without a hop through an event loop and a thread pool (docs/benchmarks.md, sixteenth pass)."""
    torch.set_num_threads(1)
    sampler, waiting = Sampler(model, **kwargs), {}  # request key -> its Request
    try:
        while True:
            t0, idle = time.perf_counter(), not (sampler.pending or sampler.active)
            # Every message that has arrived; with nothing to decode, wait for the next one.
            while requests.poll(0 if sampler.pending or sampler.active else None):
                kind, *args = requests.recv()
                if kind == "stop":
                    results.send(("stopped", [], sampler.stats))
                    return
                if kind == "publish":
                    sampler.publish(*args)
                elif kind == "cancel" and args[0] in waiting:
                    waiting.pop(args[0]).future.cancel()  # the parent no longer waits for it: it leaves the batch
                elif kind == "generate":  # a plain Future: only a flag for Request.cancelled, set by a "cancel"
                    key, context, max_tokens, images, greedy, seed, top = args
                    waiting[key] = Request(context, max_tokens, greedy, seed, images, Future(), top=top)
                    sampler.pending.append(waiting[key])
            if idle:
                sampler.stats["idle_s"] += time.perf_counter() - t0
                continue
            finished = {id(req) for req in sampler.step()}
            sampler.stats["busy_s"] += time.perf_counter() - t0
            done = [(key, [getattr(req, name) for name in RESULTS]) for key, req in waiting.items()
                    if id(req) in finished]
            for key, _ in done:
                del waiting[key]
            if done:
                results.send(("done", done, sampler.stats))
    except Exception:
        results.send(("error", traceback.format_exc(), None))
