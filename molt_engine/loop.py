"""The training loop: rollout workers, the sampler, the trainer and the evaluator in one asyncio.TaskGroup."""
import asyncio
import copy
import gc
import importlib
import math
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import checkpoint, dist, drills
from .alerts import Alerts
from .breaker import Breaker
from .chat import stop_ids
from .config import RunConfig
from .episode import Episode
from .evaluation import Evaluation
from .inference.memory_plan import Shape, device_bytes, plan
from .models import load_policy, merged, routers, set_checkpointing
from .recovery import Finished, Recovery
from .rollout import EnvFailure, Rollout  # EnvFailure: re-exported
from .inference.sampler import Sampler
from .scheduling import Scheduling
from .inference.sampler_process import SamplerProcess
from .samples import training_samples
from .sink import NullSink, Sink
from .update import RestartSmaller, batch_metrics, memory_metrics, train_step_fitting

SMALLER = "micro_batch_size"  # in the run's directory: the size the next attempt starts from (a backward's OOM)

def train(config: RunConfig | dict, sink: Sink | None = None, out_dir: str | Path | None = None,
          resume: bool = False) -> dict:
    """Train as `config` says (if invalid: pydantic's ValidationError); `resume`: from out_dir's latest checkpoint."""
    cfg = config if isinstance(config, RunConfig) else RunConfig.model_validate(config)
    dist.init(cfg.dist)  # launched by torchrun: join its group; rank 0 reports, the others only train
    try:
        return asyncio.run(Training(cfg, sink if sink and dist.rank() == 0 else NullSink(), out_dir).run(resume))
    finally:
        dist.close()


class Training(Scheduling, Recovery, Evaluation):
    """One training run: schedules rollout, sampling, updates, evals and checkpoints, and keeps their books."""

    def __init__(self, cfg: RunConfig, sink: Sink, out_dir=None):
        self.cfg, self.sink = dist.local_config(cfg), sink  # more than one process: this rank's share of the loop
        # Torch threads: on-policy, decode steps and updates take turns on one thread with every core; else updates get
        # a core less, decoding one. One OpenMP team: more team threads than cores made 2 threads slower than 1.
        cores = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = cfg.loop.threads or max(1, cores - (cfg.loop.max_staleness > 0))
        self.compute = ThreadPoolExecutor(1, "molt-compute", lambda: torch.get_num_threads() and torch.set_num_threads(threads))
        self.compute.submit(int).result()  # started now; `get` first, as a thread's first torch call sets its count
        torch.set_num_threads(1)  # the process's count, which every other thread starts with
        self.out_dir = Path(out_dir) if out_dir else None
        self.model, self.processor = load_policy(cfg.model, cfg.seed)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)  # a VLM's processor wraps it
        for router in routers(self.model) if cfg.algo.router_freeze else []:  # no gradient: AdamW never touches them
            router.requires_grad_(False)
        self.pad_id = self.tokenizer.pad_token_id
        self.stops = stop_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        limit = self.model.config.get_text_config().max_position_embeddings
        self.rollout = Rollout(cfg, self.processor, limit, self.stops)
        self.evals = [("", self.rollout, cfg.loop.eval_episodes)] + [  # each eval's (metric prefix, rollout, episodes)
            (f"{s.name}/", Rollout(cfg.model_copy(update={"env": s.env, "env_args": s.env_args}), self.processor,
                                   limit, self.stops), s.episodes or cfg.loop.eval_episodes) for s in cfg.eval.suites]
        # fused: one kernel a step and no parameter-sized temporaries, the step's peak (docs/trainer-memory.md)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.algo.lr, weight_decay=cfg.algo.weight_decay,
                                           fused=True)
        self.reference = None                    # frozen initial policy, only when the KL term is on
        self.sampler: Sampler | None = None      # made after the warm start, from a copy of the weights
        self.published: dict = {}                # the weights the sampler has now: the trainer's own copy
        self.step = 0                            # trainer steps done, applied or skipped by the breaker
        self.version = 0                         # weights published to the sampler so far
        self.cursor = 0                          # next training prompt; the only source of prompt seeds
        self.requeued: list[int] = []            # prompts cut off by a stop or crash, to run again first
        self.in_flight: set[int] = set()
        self.dropped_groups = 0                  # groups started but never trained: they free admission
        self.buffer: list[list[Episode]] = []    # finished groups, not yet trained
        self.breaker, self.alerts = Breaker(cfg.breaker), Alerts(cfg.alerts)
        self.stopping = False
        self.best: tuple[float, int] | None = None  # (value of cfg.eval.best, step) of the best eval so far
        self.saved_at: int | None = None         # step of the newest checkpoint written or restored
        self.ckpt_dir = self.out_dir / "checkpoints" if self.out_dir else None
        self.changed = asyncio.Condition()       # buffer, version or drop counts changed
        self.recent_env_errors, self.last_env_traceback = deque(maxlen=cfg.loop.env_error_window), ""
        self.errors = "agent_errors" if self.rollout.server else "env_errors"  # the counter a failed episode adds to
        self.counts = {self.errors: 0, "prompt_too_long": 0, "stale_episodes_dropped": 0, "groups_filtered": 0}
        # Reward terms and judges (molt_rewards): a package of their own, loaded by name only when a run has them
        rewards, device = cfg.rewards, next(self.model.parameters()).device
        self.scoring = (importlib.import_module("molt_rewards").Scoring(rewards, self.tokenizer, device)
                        if rewards.terms or rewards.env_weight != 1 or rewards.teacher else None)
        self.counts.update(dict.fromkeys(self.scoring.counters if self.scoring else (), 0))
        self.eval_task: asyncio.Task | None = None
        self.summary: dict = {}                  # what train() returns: the last metrics, status, paths
        self.micro_batch_size = cfg.algo.micro_batch_size  # halved by each OOM in an update, for the rest of the run

    # ---- the loop -------------------------------------------------------------------------------------------------

    async def run(self, resume: bool = False) -> dict:
        # SIGTERM (the daemon's stop) and Ctrl-C: checkpoint, then leave cleanly. Only the main thread may handle them.
        signals = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
        for sig in signals:
            asyncio.get_running_loop().add_signal_handler(sig, self.request_stop)
        try:
            await self.prepare(resume)
            # What lives all run (~500k objects) leaves the collector's books: a full collection walked all of it
            # (0.26 s holding the GIL, the sampler stalled) whenever requests' garbage piled up, as an agent's does.
            gc.freeze()
            loop = self.cfg.loop
            workers = loop.workers or loop.groups_per_step * (loop.max_staleness + 1)
            self.capacity = workers * loop.group_size
            async with asyncio.TaskGroup() as tg:
                self.tasks = tg  # the reward stage scores each group in a task of its own (scheduling.py)
                tg.create_task(self.sampler.run())
                if self.rollout.server:  # an agent's requests: before the workers, which need its port
                    tg.create_task(self.rollout.server.serve())
                tg.create_task(self.heartbeat())
                for _ in range(workers):
                    tg.create_task(self.rollout_worker())
                tg.create_task(self.trainer())
        except* Finished:
            pass
        except* Exception as group:  # a task failed: raise its own exception, not the TaskGroup's wrapper
            raise group.exceptions[0] from None
        finally:
            gc.unfreeze()
            for sig in signals:
                asyncio.get_running_loop().remove_signal_handler(sig)
        return self.summary

    async def prepare(self, resume: bool):
        """Restore the latest checkpoint, or start fresh (warm start, reference policy); then make the samplers."""
        found = dist.agreed(checkpoint.latest(self.ckpt_dir) if resume and self.ckpt_dir else None)
        if not found:  # a fresh run's first event: which defaults it got (config.py, _run_defaults)
            profile, a, w = "checkpoint" if self.cfg.model.path else "preset", self.cfg.algo, self.cfg.warm_start
            self.sink.event("defaults", f"{profile} defaults where the config sets none: algo.lr {a.lr:g}, clip "
                            f"{a.clip_low:g}/{a.clip_high:g}, warm start {w.steps} at lr {w.lr:g}", profile=profile)
        for note in self.rollout.notes:
            self.sink.event("env", note)
        # The KL term's reference: the policy RL starts from, frozen. LoRA: the base with its adapters disabled
        # (update.py) while that is it; a copy too once a warm start moves the policy, or biases train (peft keeps them)
        lora, warm = self.cfg.model.lora, self.cfg.warm_start.steps and self.rollout.demonstrates
        if self.cfg.algo.kl_coef > 0 and (not lora or warm or lora.bias != "none"):
            policy = copy.deepcopy(self.model)
            self.reference = (policy.merge_and_unload() if lora else policy).eval().requires_grad_(False)
        if found:
            self.restore(found)
        elif self.cfg.warm_start.steps and not self.rollout.demonstrates:  # optional for agents and envs
            self.sink.event("warm_start", f"{self.cfg.env} has no demonstrations: no warm start", steps=0)
        elif self.cfg.warm_start.steps:
            loss = await self.rollout.warm_start(self.model, self.pad_id, lambda: self.stopping)
            self.sink.event("warm_start", f"{self.cfg.warm_start.steps} supervised steps on demonstrations, final "
                            f"loss {loss:.3f}", steps=self.cfg.warm_start.steps, loss=loss)
            if self.reference is not None:
                self.reference.load_state_dict(merged(self.model.state_dict(), lora))
        # A rank's backward ran out of memory in an earlier attempt (update): every rank starts from the size it left
        noted = self.out_dir / SMALLER if self.out_dir else None
        smaller = dist.all_max([-float(noted.read_text()) if noted and noted.exists() else -math.inf])[0]
        if -smaller < (self.micro_batch_size or math.inf):
            self.micro_batch_size = int(-smaller)
            self.sink.event("oom", f"an earlier attempt ran out of memory in a backward: micro-batches of "
                            f"{self.micro_batch_size} episodes from step {self.step} on", step=self.step,
                            micro_batch_size=self.micro_batch_size)
        device, dtype, count = next(self.model.parameters()).device, self.cfg.model.dtype, self.model.num_parameters
        name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
        self.published = dist.full_weights(self.model)
        # The sampler's own copy in model.dtype on the same device: publishing casts into it, device to device. Evals
        # decode on a copy of their own, so that one eval is one policy while training publishes (more memory).
        loop, policy = self.cfg.loop, copy.deepcopy(self.model)  # LoRA: the sampler's is a plain model, merged weights
        policy = (policy.merge_and_unload() if self.cfg.model.lora else policy).to(getattr(torch, dtype))
        if policy.is_activation_checkpointing:  # the trainer's; its input hook, a local function, would also keep
            policy.activation_checkpointing_disable()  # a sampler process from pickling the copy
            policy.disable_input_require_grads()
        # The device's memory, planned before the trainer's gradients and AdamW's moments exist (memory_plan.py): the
        # samplers' static buffers take its KV shares, and each update checkpoints when its activations would not fit
        evals = bool(loop.eval_every and dist.rank() == 0)  # more than one process: rank 0 evaluates
        self.plan = plan(Shape.of(self.model), device_bytes(device), dtype_bytes=policy.dtype.itemsize,
                         samplers=1 + evals + loop.sampler_process, reference=self.reference is not None)
        kw = dict(stop_ids=self.stops, pad_id=self.pad_id, version=self.version, temperature=loop.temperature,
                  kv_budget_gb=loop.kv_budget_gb, cuda_graphs=loop.cuda_graphs)
        self.sampler = (SamplerProcess(policy, **kw, kv_planned_gb=self.plan.kv[0] / 1e9) if loop.sampler_process else
                        Sampler(policy, **kw, kv_planned_gb=self.plan.kv[0] / 1e9,
                                executor=None if loop.max_staleness else self.compute))
        self.eval_sampler = Sampler(copy.deepcopy(policy), **kw, kv_planned_gb=self.plan.kv[-1] / 1e9) if evals else None
        self.sink.event("device", f"training on {device}{name} in {dtype}, {self.sampler.decoding} decoding; "
                        f"{self.plan.describe()}", device=str(device), dtype=dtype, decoding=self.sampler.decoding,
                        trainable=count(only_trainable=True), parameters=count(), memory_plan=self.plan.parts())
        self.model, self.optimizer = dist.wrap(self.model, self.optimizer, self.cfg.dist)  # samplers: plain copies

    def request_stop(self):
        self.stopping = True
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self):
        async with self.changed:
            self.changed.notify_all()

    async def heartbeat(self):
        """From the event loop itself, so a blocked loop stops it; so does a stuck group (dist.stalled)."""
        beat = getattr(self.sink, "heartbeat", None)  # optional: a terminal needs no liveness signal
        while beat:
            if not dist.stalled(self.cfg.dist):
                beat()
            await asyncio.sleep(1.0)

    async def trainer(self):
        loop, last, sampler_last = self.cfg.loop, time.perf_counter(), dict(self.sampler.stats)
        # More than one process: a rank's stop request waits for the ranks to agree (below), so all stop together
        while self.step < loop.steps and not (self.stopping and dist.world() == 1):
            step = self.step
            if (loop.eval_every and step % loop.eval_every == 0 and not (self.eval_task and not self.eval_task.done())
                    and dist.rank() == 0):
                self.eval_task = asyncio.create_task(self.evaluate(step))  # never awaited here: eval never blocks
            drills.crash_or_hang(self.cfg.drills, step, self.out_dir)
            batch = await self.next_batch()
            if await self.agree_stop(batch):  # stop requested while waiting for rollouts
                break
            (groups, waited), micro = batch, self.micro_batch_size
            dist.mark()  # in the step: the update marks each micro-batch, the heartbeat watches (dist.stalled)
            metrics, weights, samples = await asyncio.wrap_future(self.compute.submit(self.update, groups))
            self.step += 1
            if self.micro_batch_size != micro:
                self.sink.event("oom", f"step {step}: out of memory in the update; retried with micro-batches of "
                                f"{self.micro_batch_size} episodes, kept for the rest of the run", step=step,
                                micro_batch_size=self.micro_batch_size)
            if weights is None:
                weights = await self.on_trip(step, groups, metrics)
            version = self.version + (weights is not None)
            metrics["version"] = float(version)
            now = time.perf_counter()
            metrics.update(self.throughput(groups, now - last, waited, sampler_last))
            if dist.world() > 1:
                metrics = await asyncio.to_thread(dist.reduce_metrics, metrics)
            dist.mark(False)
            last, sampler_last = now, dict(self.sampler.stats)
            for kind, message, data in self.alerts.check(step, metrics, sum(len(g) for g in groups)):
                self.sink.alert(kind, message, **data)
            self.sink.metrics(step, metrics)  # before the checkpoint: a checkpoint never gets ahead of the records
            if samples and hasattr(self.sink, "samples"):
                self.sink.samples(step, "train", samples)
            self.summary.update(metrics, step=self.step, version=version)
            every = self.cfg.checkpoint.every
            # A stop checkpoints here with one process. With more, only once the ranks agree (after the loop): a
            # rank asked mid-step must not start the checkpoint's collectives while the others start the next step.
            if self.ckpt_dir and ((every and self.step % every == 0) or (self.stopping and dist.world() == 1)):
                # Before publishing: admission is still closed, so (on-policy) nothing is in flight.
                await self.save_checkpoint(version, weights or self.published)
            async with self.changed:
                if weights is not None:
                    self.version, self.published = version, weights
                    self.sampler.publish(merged(weights, self.cfg.model.lora), version)
                self.changed.notify_all()
        if self.stopping:
            if self.ckpt_dir and self.step > 0 and self.saved_at != self.step:
                await self.save_checkpoint(self.version, self.published)
            self.sink.event("stopped", f"stopped at step {self.step}; resume continues from here", step=self.step)
            self.summary.update(status="stopped", step=self.step, version=self.version)
            raise Finished
        await self.finish()

    def update(self, groups: list[list[Episode]]) -> tuple[dict, dict | None, list[dict]]:
        """The update (on the trainer's thread): its and the batch's metrics, the weights to publish and the batch's
        samples' records (record.samples_per_step groups). The micro-batch size that fit is kept. Unless
        model.gradient_checkpointing says, the plan checkpoints when the largest micro-batch's activations would not
        fit (every rank decides on the largest over the ranks)."""
        checkpointing = self.cfg.model.gradient_checkpointing
        if checkpointing is None and not routers(self.model):
            episodes = [e for g in groups for e in g]
            micro = self.micro_batch_size or -(-len(episodes) // self.cfg.algo.minibatches)
            checkpointing = self.plan.checkpointing(int(dist.all_max([micro * max(len(e.token_ids) for e in episodes)])[0]))
            set_checkpointing(self.model, checkpointing)
        try:
            (metrics, weights, adv, trainer_logprobs), self.micro_batch_size = train_step_fitting(
                self.model, self.optimizer, groups, self.cfg, step=self.step, breaker=self.breaker,
                published=self.published, reference=self.reference, pad_id=self.pad_id,
                micro_batch_size=self.micro_batch_size)
        except RestartSmaller as e:  # for the next attempt (prepare): the checkpoints still say the size that failed
            if self.out_dir:
                (self.out_dir / SMALLER).write_text(str(e.size))
            raise
        metrics.update(memory_metrics(next(self.model.parameters()).device), gradient_checkpointing=float(bool(checkpointing)))
        samples = training_samples(groups, adv, trainer_logprobs, self.cfg.record.samples_per_step, self.processor,
                                   self.version)
        return {**batch_metrics(groups, self.version), **metrics}, weights, samples

    def throughput(self, groups, seconds: float, waited: float, sampler_last: dict) -> dict:
        """Rates over the wall time since the previous step, and counters since then (reset after reporting)."""
        s = {k: self.sampler.stats[k] - sampler_last[k] for k in self.sampler.stats}
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return {"samples_per_s": sum(len(g) for g in groups) / seconds, "tokens_per_s": s["tokens"] / seconds,
                "trainer_idle_ratio": waited / seconds, "sampler_idle_ratio": min(1.0, s["idle_s"] / seconds),
                "sampler_occupancy": s["rows"] / max(s["steps"], 1) / self.capacity, **counts}

    async def finish(self):
        """Final eval on the final weights, then save them where plain transformers can load them."""
        if self.eval_task:
            await self.eval_task
        if self.cfg.loop.eval_every and dist.rank() == 0:  # more than one process: rank 0 evaluates and saves
            await self.evaluate(self.step)
        self.summary["status"] = "completed"
        if self.out_dir and dist.rank() == 0:
            final = self.out_dir / "final"
            await asyncio.to_thread(checkpoint.save_policy, final, self.sampler.model, self.processor, self.published,
                                    self.cfg.model.lora)
            self.sink.event("saved", f"final policy saved to {final}", path=str(final))
            self.summary["final_path"] = str(final)
        raise Finished

