"""The loop's in-run evaluation: greedy episodes of one version on the eval sampler, and the best policy kept."""
import asyncio

from . import checkpoint
from .models import merged
from .samples import record
from .update import eval_metrics


class Evaluation:
    """Training's periodic eval (mixed into loop.Training, whose state it uses)."""

    async def evaluate(self, step: int):
        """Greedy episodes on held-out seeds of the training env and each eval suite, all of one version (on the eval
        sampler), never in the buffer or admission. When eval.best is the best so far, the weights go to OUT/best."""
        weights, version = self.published, self.version
        self.eval_sampler.publish(merged(weights, self.cfg.model.lora), version)  # swapped in before it decodes
        async with asyncio.TaskGroup() as tg:  # its decoding fails the eval; it ends with the eval's episodes
            decoding = tg.create_task(self.eval_sampler.run())
            done = await asyncio.gather(*(rollout.evaluate(self.eval_sampler, n) for _, rollout, n in self.evals))
            decoding.cancel()
        values = {p + k: v for (p, _, _), eps in zip(self.evals, done) if eps for k, v in eval_metrics(eps).items()}
        if values:  # else every episode failed
            self.sink.metrics(step, values)
            if done[0] and hasattr(self.sink, "samples"):  # not a suite's: theirs would reuse its (step, kind, position)
                self.sink.samples(step, "eval", [record(e, self.processor, version)
                                                 for e in done[0][:self.cfg.record.eval_samples]])
            self.summary.update(values)
            best = values.get(self.cfg.eval.best)  # None: this eval's episodes of that env all failed
            if best is not None and (self.best is None or best > self.best[0]):
                self.best = (best, step)
                if self.out_dir:
                    await asyncio.to_thread(checkpoint.save_policy, self.out_dir / "best", self.sampler.model,
                                            self.processor, weights, self.cfg.model.lora)
                    self.summary.update(best_path=str(self.out_dir / "best"), best_step=step)
