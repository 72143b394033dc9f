"""The dataset env: files and directories of prompts, rewards by name or from a user's file, rows per seed, and bad
input refused at submit."""
import asyncio
import json
import threading

import pytest

from molt_engine import RunConfig, config_errors
from molt_engine.config import ValidationError
from molt_engine.data import Dataset, gsm8k, math, numeric, reference
from molt_envs.word_problems import word_problems
from molt_engine.envs import EVAL_SEEDS, load_user_envs


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def errors(config: dict) -> str:
    with pytest.raises(ValidationError) as e:
        RunConfig.model_validate(config)
    return "\n".join(config_errors(e.value))


def test_rewards():
    assert reference("She has 3 + 4 = 7 apples.\n#### 7") == "7" and reference("12") == "12"
    assert gsm8k("3 + 4 = 7\n#### 7", "7") == {"reward": 1.0, "accuracy_strict": 1.0, "accuracy_flexible": 1.0}
    assert gsm8k("3 + 4 = 7", "7") == {"reward": 0.0, "accuracy_strict": 0.0, "accuracy_flexible": 1.0}
    assert gsm8k("#### 1,000", "1000")["reward"] == 1.0 and gsm8k("#### 8\nor 7", "7")["accuracy_flexible"] == 1.0
    assert numeric("so 3.0", "3") == 1.0 and numeric("none", "3") == 0.0
    assert math("The answer is $\\frac{1}{2}$", "0.5") == 1.0 and math("The answer is $3$", "0.5") == 0.0


def test_rows_follow_a_seeded_shuffle_per_epoch(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]
    env = Dataset(path=write_jsonl(tmp_path / "t.jsonl", rows),
                  eval_path=write_jsonl(tmp_path / "e.jsonl", [{"prompt": "held out", "answer": "1"}]))
    run = 5 << 32
    first = [env._row(run + cursor)["prompt"] for cursor in range(10)]
    second = [env._row(run + cursor)["prompt"] for cursor in range(10, 20)]
    assert sorted(first) == sorted(second) == sorted(r["prompt"] for r in rows)  # each epoch sees every row once
    assert first != second and first != [r["prompt"] for r in rows]
    fresh = Dataset(path=str(tmp_path / "t.jsonl"))  # a resumed run maps the same cursor to the same row
    assert [fresh._row(run + cursor)["prompt"] for cursor in range(20)] == first + second
    assert env._row(EVAL_SEEDS + 3)["prompt"] == "held out"
    obs = asyncio.run(env.reset(run))
    assert obs.messages == [{"role": "user", "content": first[0]}]


def test_parquet_datasets_directory_messages_and_extra_columns(tmp_path, monkeypatch):
    from datasets import Dataset as HFDataset
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "answer": "4", "unit": "apples"}]
    HFDataset.from_list(rows).to_parquet(str(tmp_path / "t.parquet"))
    HFDataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "scoring.py").write_text(
        "def with_unit(completion, answer, unit, prompt, **rest):\n"
        "    return float(completion == f'{answer} {unit}')\n")
    monkeypatch.setenv("MOLT_ENVS", str(tmp_path / "agents"))
    load_user_envs()
    for path in ("t.parquet", "saved"):
        env = Dataset(path=str(tmp_path / path), reward="scoring:with_unit")
        obs = asyncio.run(env.reset(0))
        assert obs.messages == rows[0]["prompt"]
        assert asyncio.run(env.step("4 apples")).reward == 1.0
        assert asyncio.run(env.step("4")).reward == 0.0


def test_bad_datasets_are_refused_at_submit_naming_the_problem(tmp_path):
    base = {"env": "dataset", "model": {"preset": "tiny-chat"}}
    assert "does not exist" in errors({**base, "env_args": {"path": str(tmp_path / "missing.jsonl")}})
    no_prompt = write_jsonl(tmp_path / "q.jsonl", [{"question": "2+2?", "answer": "4"}])
    assert "no 'prompt' column (columns: question, answer)" in errors({**base, "env_args": {"path": no_prompt}})
    good = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "2+2?", "answer": "4"}])
    message = errors({**base, "env_args": {"path": good, "reward": "fuzzy"}})
    assert "unknown reward 'fuzzy'" in message and "gsm8k" in message
    message = errors({**base, "model": {"preset": "tiny-dense"}, "env_args": {"path": good}})
    assert "no chat template" in message and "tiny-chat" in message
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")
    assert "no chat template" in errors({"env": "chat_calculator", "model": {"path": str(tmp_path / "model")}})
    RunConfig.model_validate({**base, "env_args": {"path": good, "reward": "gsm8k"}})


def test_empty_prompts_are_skipped_and_counted(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "", "answer": "1"}, {"prompt": "2+2?", "answer": "4"},
                                               {"prompt": [], "answer": "0"}])
    env = Dataset(path=path)
    assert [r["prompt"] for r in env.rows] == ["2+2?"]
    assert env.notes == [f"dataset: 2 rows of {path} skipped (empty prompt)"]


def test_word_problems_are_gsm8k_format():
    rows = word_problems(200, seed=0)
    assert rows == word_problems(200, seed=0) and rows != word_problems(200, seed=1)
    for row in rows:
        work, _, value = row["answer"].partition("\n#### ")
        a, op, b, _, result = work.split()
        assert int(result) == int(value) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert row["prompt"].endswith("?")


def test_a_reward_that_blocks_runs_off_the_loop_times_out_scores_0_and_is_counted(tmp_path):
    """Rewards run in threads of their own: while one blocks (math-verify on a pathological answer), the event loop
    scores other episodes; past `reward_timeout` it scores 0 and the episode says so (`reward_timeout_rate`)."""
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "2+2?", "answer": "4"}])
    release, order = threading.Event(), []

    def stuck(completion, answer, **columns):
        release.wait(10)
        return 1.0
    slow, fast = Dataset(path=path, reward_timeout=0.3), Dataset(path=path, reward="numeric")
    slow.reward = stuck

    async def score(env, action):
        await env.reset(0)
        result = await env.step(action)
        order.append(env)
        return result

    async def both():
        return await asyncio.gather(score(slow, "4"), score(fast, "so 4"))
    try:
        timed_out, scored = asyncio.run(both())
    finally:
        release.set()
    assert order == [fast, slow]  # the loop went on while the reward blocked
    assert timed_out.reward == 0.0 and timed_out.info["metrics"] == {"reward_timeout_rate": 1.0}
    assert scored.reward == 1.0 and scored.info["metrics"] == {"reward_timeout_rate": 0.0}
    assert "reward_timeout must be > 0" in errors({"env": "dataset", "model": {"preset": "tiny-chat"},
                                                   "env_args": {"path": path, "reward_timeout": 0}})
