"""reasoning-gym's procedural tasks by name, as one chat env: `{"env": "reasoning_gym", "env_args": {"task": ...}}`,
scored by the task's own score_answer (the optional extra `.[tasks]`)."""
import asyncio
import dataclasses
import difflib
import functools
import json

from molt_engine import Env, Observation, Result, register
from molt_engine.envs import EVAL_SEEDS

FORMATS = ("tags", "plain")


@functools.lru_cache(maxsize=8)  # the engine makes an env per episode; a task's generator is built once per config
def dataset(task: str, config: str):
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError("the env reasoning_gym needs the package reasoning-gym: "
                         "pip install 'molt-studio[tasks]'") from None
    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=5, cutoff=0.5)
        hint = (f"close names: {', '.join(close)}" if close
                else f"its {len(DATASETS)} tasks: {', '.join(sorted(DATASETS))}")
        raise ValueError(f"reasoning_gym has no task {task!r}; {hint}")
    keys = [f.name for f in dataclasses.fields(DATASETS[task][1])]
    if unknown := sorted(set(json.loads(config)) - set(keys)):
        raise ValueError(f"reasoning_gym task {task!r} has no config key {', '.join(map(repr, unknown))}; its keys: "
                         f"{', '.join(keys)} (and the env's own: task, max_tokens, answer_format, eval_size)")
    try:
        return reasoning_gym.create_dataset(task, **json.loads(config))
    except AssertionError as e:  # the task config's own checks are asserts
        raise ValueError(f"reasoning_gym task {task!r}: {e}") from None


@register
class ReasoningGym(Env):
    """A reasoning-gym task by name (env_args task): one chat turn, the answer scored by the task's own check.

    Evals take the task's first `eval_size` items, training (and warm-start demonstrations) the others, so the two
    never share an item."""

    name = "reasoning_gym"
    chat = True

    def __init__(self, *, task: str, max_tokens: int = 256, answer_format: str = "tags", eval_size: int | None = None,
                 **config):
        # Every other key is the task's own config (reasoning-gym's dataclass rejects an unknown one); seed 0 by
        # default, where reasoning-gym would draw one, so that a run and its resume see the same items.
        self.dataset = dataset(task, json.dumps({"seed": 0, **config}, sort_keys=True))
        size = len(self.dataset)
        self.eval_size = max(1, min(100, size // 5)) if eval_size is None else eval_size
        if not 1 <= self.eval_size < size:
            raise ValueError(f"reasoning_gym: eval_size must be from 1 to the task's size less one ({size - 1}); "
                             f"got {self.eval_size}")
        if answer_format not in FORMATS:
            raise ValueError(f"reasoning_gym: answer_format must be one of {', '.join(FORMATS)}; got {answer_format!r}")
        if max_tokens < 1:
            raise ValueError("reasoning_gym: max_tokens must be >= 1")
        self.task, self.max_tokens, self.answer_format = task, max_tokens, answer_format
        self.notes = (f"reasoning_gym {task}: items 0-{self.eval_size - 1} of {size} held out for evals, "
                      f"{size - self.eval_size} for training",)

    def _entry(self, seed: int) -> dict:
        if seed >= EVAL_SEEDS:
            return self.dataset[(seed - EVAL_SEEDS) % self.eval_size]
        return self.dataset[self.eval_size + seed % (len(self.dataset) - self.eval_size)]

    async def reset(self, seed: int) -> Observation:
        self._current = self._entry(seed)
        messages = [{"role": "user", "content": self._current["question"]}]
        if self.answer_format == "tags":  # reasoning-gym's own instructions: the answer goes in <answer> tags
            from reasoning_gym.utils import SYSTEM_PROMPTS
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPTS["default"]})
        return Observation(messages=messages)

    async def step(self, action: str) -> Result:
        if self.answer_format == "tags":
            from reasoning_gym.utils import extract_answer
            answer = extract_answer(action)
            metrics = {"answer_tag_rate": float(answer is not None)}
        else:
            answer, metrics = action.strip(), {}
        # Some tasks score with sympy or a solver: off the event loop. Some raise on an answer they cannot parse
        # (prime_factorization on "x"): the policy's malformed answer is a wrong one, not an env failure, counted.
        try:
            score = await asyncio.to_thread(self.dataset.score_answer, answer, self._current)
            metrics["score_error_rate"] = 0.0
        except Exception:
            score, metrics["score_error_rate"] = 0.0, 1.0
        return Result(reward=float(score), terminated=True, info={"metrics": metrics})

    def demonstration(self, seed: int) -> list[dict]:
        answer = str(self._entry(seed)["answer"])
        return [{"role": "assistant", "content": f"<answer>{answer}</answer>" if self.answer_format == "tags"
                 else answer}]
