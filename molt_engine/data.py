"""Datasets as an env: prompts from JSONL, parquet or `datasets` directories, rewards by name (a generator of small
GSM8K-format files: `python -m molt_envs.word_problems OUT.jsonl --rows 2000`)."""
import asyncio
import functools
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .envs import DEMO_SEEDS, EVAL_SEEDS, Env, Observation, Result, register, resolve

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
STRICT = re.compile(r"####\s*(-?\d[\d,]*(?:\.\d+)?)")


def _number(text: str | None) -> float | None:
    try:
        return float(text.replace(",", "")) if text else None
    except ValueError:
        return None


def exact(completion: str, answer: str, **columns) -> float:
    return float(completion.strip() == str(answer).strip())


def numeric(completion: str, answer: str, **columns) -> float:
    """The last number of the completion equals the answer's."""
    found = NUMBER.findall(completion)
    value = _number(found[-1]) if found else None
    return float(value is not None and value == _number(str(answer)))


def gsm8k(completion: str, answer: str, **columns) -> dict:
    """Strict: the number after `####` equals the answer (the reward); flexible: the last number does (a metric)."""
    strict = STRICT.search(completion)
    score = float(strict is not None and _number(strict.group(1)) == _number(str(answer)))
    return {"reward": score, "accuracy_strict": score, "accuracy_flexible": numeric(completion, answer)}


def math(completion: str, answer: str, **columns) -> float:
    """math-verify: the completion's final expression (LaTeX or plain) is equivalent to the answer's."""
    from math_verify import parse, verify
    # Its own timeouts use SIGALRM, which only works on the main thread: the env's `reward_timeout` bounds it.
    gold = parse(str(answer), parsing_timeout=None)
    return float(verify(gold, parse(completion, parsing_timeout=None), timeout_seconds=None))


REWARDS = {"exact": exact, "numeric": numeric, "gsm8k": gsm8k, "math": math}
# Rewards run here, off the event loop: a slow one stalls neither the sampler nor other episodes. A thread past its
# timeout cannot be stopped; it holds its worker until it returns.
_SCORING = ThreadPoolExecutor(thread_name_prefix="molt-reward")


@functools.lru_cache(maxsize=2)  # a worker's train and eval files: every episode's env reads them
def _load(path: str, mtime: float) -> tuple[list[dict], int]:
    """(rows with a non-empty prompt, rows skipped for an empty one) of a file or `datasets` directory."""
    file = Path(path)
    if file.is_dir():
        from datasets import load_from_disk
        rows = list(load_from_disk(path))
    elif file.suffix == ".parquet":
        from datasets import Dataset
        rows = list(Dataset.from_parquet(path))
    else:
        rows = []
        for number, line in enumerate(file.read_text().splitlines(), 1):
            try:
                rows.append(json.loads(line)) if line.strip() else None
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset: {path}:{number}: not JSON ({e})") from None
    _check_rows(path, rows)
    kept = [r for r in rows if r.get("prompt")]
    if not kept:
        raise ValueError(f"dataset: {path}: every prompt is empty")
    return kept, len(rows) - len(kept)


def _check_rows(path: str, rows: list):
    """Rows are JSON objects, and the first has a prompt."""
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"dataset: {path}: every row must be a JSON object")
    if not rows or "prompt" not in rows[0]:
        raise ValueError(f"dataset: {path} has no 'prompt' column "
                         f"(columns: {', '.join(rows[0] if rows else ()) or 'none'})")


def _existing(path: str) -> Path:
    if not (file := Path(path)).exists():
        raise ValueError(f"dataset: {path!r} does not exist (relative paths are from {Path.cwd()})")
    return file


def load_rows(path: str) -> tuple[list[dict], int]:
    file = _existing(path)
    return _load(str(file.resolve()), file.stat().st_mtime)


def first_row(path: str) -> dict:
    """A dataset's first row, read without loading the rest (a config submitted to the web is checked on it; the
    worker loads the whole file and names any bad row)."""
    if (file := _existing(path)).is_dir():
        from datasets import load_from_disk
        rows = load_from_disk(path)  # memory-mapped: only the row asked for is read
        row = rows[0] if len(rows) else None
    elif file.suffix == ".parquet":
        import pyarrow.parquet as pq
        row = next((batch.to_pylist()[0] for batch in pq.ParquetFile(path).iter_batches(batch_size=1)), None)
    else:
        with open(file) as f:
            line = next((line for line in f if line.strip()), None)
        try:
            row = json.loads(line) if line else None
        except json.JSONDecodeError as e:
            raise ValueError(f"dataset: {path}: the first row is not JSON ({e})") from None
    _check_rows(path, [] if row is None else [row])
    return row


def check_submitted(path: str, eval_path: str | None = None, reward: str = "exact", max_tokens: int = 256,
                    reward_timeout: float = 10.0):
    """A submitted config's dataset arguments, checked on each file's first row (the web never loads the files)."""
    if eval_path:
        first_row(eval_path)
    check_args(first_row(path), path, reward, max_tokens, reward_timeout)


def check_args(row: dict, path: str, reward: str, max_tokens: int, reward_timeout: float):
    """The dataset env's arguments besides its files, against the first row; its reward function."""
    function = resolve(reward, REWARDS, "reward")
    if reward in REWARDS and "answer" not in row:
        raise ValueError(f"dataset: reward {reward!r} needs an 'answer' column; {path} has none")
    if max_tokens < 1:
        raise ValueError("dataset: max_tokens must be >= 1")
    if not reward_timeout > 0:
        raise ValueError("dataset: reward_timeout must be > 0 (seconds)")
    return function


@functools.cache
def _order(rows: int, run: int, epoch: int) -> list[int]:
    order = list(range(rows))
    random.Random(f"{run}:{epoch}").shuffle(order)
    return order


def reference(answer) -> str:
    """GSM8K's answers end with `#### N`: the reference is N."""
    return str(answer).rsplit("####", 1)[-1].strip() if "####" in str(answer) else str(answer)


@register
class Dataset(Env):
    """One chat turn per row: `prompt` (text, or a list of messages) -> the policy's reply, scored by `reward` against
    the `answer` column; every column reaches the reward function as a keyword argument."""

    name = "dataset"
    chat = True

    def __init__(self, *, path: str, eval_path: str | None = None, reward: str = "exact", max_tokens: int = 256,
                 reward_timeout: float = 10.0, **unknown):
        super().__init__(**unknown)
        self.rows, skipped = load_rows(path)
        self.eval_rows, eval_skipped = load_rows(eval_path) if eval_path else (self.rows, 0)
        self.reward = check_args(self.rows[0], path, reward, max_tokens, reward_timeout)
        self.max_tokens, self.reward_timeout = max_tokens, reward_timeout
        self.notes = [f"dataset: {n} rows of {p} skipped (empty prompt)"
                      for n, p in ((skipped, path), (eval_skipped, eval_path)) if n]

    def _row(self, seed: int) -> dict:
        """Eval seeds walk the eval file; training seeds ((run seed << 32) + cursor) walk a shuffle of the rows
        that is new every epoch, so a resumed cursor finds the same row."""
        if seed >= EVAL_SEEDS:
            return self.eval_rows[(seed - EVAL_SEEDS) % len(self.eval_rows)]
        if seed >= DEMO_SEEDS:
            return self.rows[_order(len(self.rows), -1, 0)[(seed - DEMO_SEEDS) % len(self.rows)]]
        run, cursor = divmod(seed, 1 << 32)
        epoch, index = divmod(cursor, len(self.rows))
        return self.rows[_order(len(self.rows), run, epoch)[index]]

    async def reset(self, seed: int) -> Observation:
        self._current = self._row(seed)
        prompt = self._current["prompt"]
        return Observation(messages=[{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt))

    async def step(self, action: str) -> Result:
        row = self._current
        columns = {**row, "answer": reference(row["answer"])} if "answer" in row else row
        try:
            scored = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                _SCORING, functools.partial(self.reward, action, **columns)), self.reward_timeout)
        except TimeoutError:  # scored 0; the metric's mean is the share of episodes whose reward timed out
            return Result(reward=0.0, terminated=True, info={"metrics": {"reward_timeout_rate": 1.0}})
        scored = dict(scored) if isinstance(scored, dict) else {"reward": scored}
        return Result(reward=float(scored.pop("reward")), terminated=True,
                      info={"metrics": {**scored, "reward_timeout_rate": 0.0}})

    def demonstration(self, seed: int) -> list[dict]:
        row = self._row(seed)
        if "answer" not in row:
            raise ValueError("dataset: a warm start needs an 'answer' column (or set warm_start.steps to 0)")
        return [{"role": "assistant", "content": str(row["answer"])}]
