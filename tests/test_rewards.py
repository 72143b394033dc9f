"""Reward terms beyond the env's (molt_rewards): weighted functions (sync and async), a reward model made here, and
LLM judges served over real HTTP (scoring, hanging, failing, bounded in flight), each through a real training run
(the bound through one judge alone). Distillation: tests/test_distillation.py."""
import asyncio
import contextlib
import json
import threading
import time
from collections import Counter

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from molt_engine import RunConfig, config_errors, train
from molt_engine.config import JudgeConfig, ValidationError
from molt_engine.envs import load_user_envs
from molt_engine.models import load_policy
from molt_rewards.judges import Judge

BASE = {"env": "max_digit", "model": {"preset": "tiny-dense"}, "seed": 0, "warm_start": {"steps": 0},
        "checkpoint": {"every": 0}, "record": {"samples_per_step": 2},
        "loop": {"steps": 2, "groups_per_step": 2, "group_size": 4, "eval_every": 0}}


class Recorder:
    """A sink that keeps what the run reports."""

    def __init__(self):
        self.steps, self.records, self.events, self.alerts = {}, [], [], []

    def metrics(self, step, values): self.steps.setdefault(step, {}).update(values)  # evals report apart
    def alert(self, kind, message, **data): self.alerts.append(kind)
    def event(self, kind, message, **data): self.events.append((kind, message))
    def checkpoint(self, step, path, **info): pass
    def samples(self, step, kind, records): self.records += records


def run(config: dict, tmp_path) -> Recorder:
    sink = Recorder()
    train(config, sink, out_dir=tmp_path / "run")
    return sink


def prompt_and_completion(record: dict, tokenizer) -> tuple[str, str]:
    """What the terms score: the recorded episode's text before its first action and from it on."""
    ids, actions = record["tokens"]["id"], record["tokens"]["action"]
    first = actions.index(True)
    return (tokenizer.decode(ids[:first], skip_special_tokens=True),
            tokenizer.decode(ids[first:], skip_special_tokens=True))


@pytest.fixture
def reward_functions(tmp_path, monkeypatch):
    (tmp_path / "fns").mkdir()
    (tmp_path / "fns" / "terms.py").write_text(
        "import asyncio\n"
        "def length(prompt, completion, env_reward):\n"
        "    return float(len(completion))\n"
        "async def digits(prompt, completion, env_reward):\n"
        "    await asyncio.sleep(0.01)  # an async reward awaits (a judge, a sandbox) without holding the loop\n"
        "    return float(sum(c.isdigit() for c in completion)) + env_reward\n")
    monkeypatch.setenv("MOLT_ENVS", str(tmp_path / "fns"))
    load_user_envs()


def test_weighted_terms_sync_and_async_each_recorded(tmp_path, reward_functions):
    config = {**BASE, "rewards": {"env_weight": 2.0, "terms": [
        {"name": "length", "function": "terms:length", "weight": 0.5},
        {"name": "digits", "function": "terms:digits", "weight": -1.0}]}}
    sink = run(config, tmp_path)
    _, tokenizer = load_policy(RunConfig.model_validate(config).model, 0)
    for values in sink.steps.values():
        assert {"reward/env", "reward/length", "reward/digits"} <= set(values)
        combined = 2.0 * values["reward/env"] + 0.5 * values["reward/length"] - values["reward/digits"]
        assert values["reward_mean"] == pytest.approx(combined, abs=1e-5)
    assert len(sink.records) == 2 * 2 * 4
    for record in sink.records:  # each episode's own reward, from its own text
        _, completion = prompt_and_completion(record, tokenizer)
        env = float(record["success"])  # max_digit: 1 for the right digit, else 0
        expected = 2 * env + 0.5 * len(completion) - (sum(c.isdigit() for c in completion) + env)
        assert record["reward"] == pytest.approx(expected)


def test_bad_reward_terms_are_refused_naming_the_field(tmp_path, reward_functions):
    def errors(rewards):
        with pytest.raises(ValidationError) as e:
            RunConfig.model_validate({**BASE, "rewards": rewards})
        return "\n".join(config_errors(e.value))
    assert "exactly one of function, model, judge (got none)" in errors({"terms": [{"name": "x"}]})
    assert "unknown reward function 'terms:nope'" in errors({"terms": [{"name": "x", "function": "terms:nope"}]})
    assert "not a Hugging Face model directory" in errors({"terms": [{"name": "x", "model": str(tmp_path)}]})
    assert "must be unique" in errors({"terms": [{"name": "x", "function": "terms:length"}] * 2})
    assert "api_key_env" in errors({"terms": [{"name": "j", "judge": {"base_url": "http://x", "model": "m",
                                                                     "api_key_env": "not a name"}}]})


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A tiny sequence-classification model saved as a Hugging Face directory, with the chat tokenizer (a template)."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig
    _, tokenizer = load_policy(RunConfig.model_validate({**BASE, "model": {"preset": "tiny-chat"}}).model, 0)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("rm")
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_reward_model_scores_each_episode_as_transformers_does_alone(tmp_path, reward_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    config = {**BASE, "rewards": {"env_weight": 0.0, "terms": [{"name": "rm", "model": reward_model}]}}
    sink = run(config, tmp_path)
    _, policy_tokenizer = load_policy(RunConfig.model_validate(config).model, 0)
    tokenizer = AutoTokenizer.from_pretrained(reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    assert tokenizer.chat_template and len(sink.records) == 16
    for record in sink.records:
        prompt, completion = prompt_and_completion(record, policy_tokenizer)
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": completion}], tokenize=False)
        with torch.no_grad():
            alone = model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
        assert record["reward"] == pytest.approx(alone, abs=1e-4)
    assert len({r["reward"] for r in sink.records}) > 1  # the texts differ, and so do their scores
    for values in sink.steps.values():
        assert values["reward_mean"] == pytest.approx(values["reward/rm"], abs=1e-5)


def test_reward_model_normalised_per_group(tmp_path, reward_model):
    config = {**BASE, "rewards": {"env_weight": 0.0, "terms": [{"name": "rm", "model": reward_model, "device": "cpu",
                                                               "normalize": "group"}]}}
    sink = run(config, tmp_path)
    groups = {}
    for record in sink.records:
        groups.setdefault((record["version"], record["group"]), []).append(record["reward"])
    assert len(groups) == 4
    for rewards in groups.values():  # each group's rewards standardised among themselves
        assert len(rewards) == 4 and abs(sum(rewards)) < 1e-4
        assert sum(r * r for r in rewards) / 4 == pytest.approx(1.0, abs=1e-2)  # std 1 (less a tiny epsilon)


class JudgeServer:
    """A real OpenAI-compatible chat endpoint on localhost (uvicorn in a thread), one route per judge behaviour:
    /good scores (pointwise: 1 when the answer holds a 9; group: by position), /hang never answers, /fail answers
    500, /flaky fails every other call, /crowd scores as /good once a third call is in flight (or after 1 s), keeping
    the peak of calls in flight. It checks the bearer key and keeps the requests it got."""

    def __init__(self):
        app, self.requests, self.calls = FastAPI(), [], 0
        self.in_flight, self.peak, crowded = 0, 0, asyncio.Condition()

        @app.post("/{kind}/v1/chat/completions")
        async def chat(kind: str, request: Request):
            body = await request.json()
            self.requests.append((kind, request.headers.get("authorization"), body))
            self.calls += 1
            if kind == "crowd":  # held while fewer than 3 are in flight: an unbounded client shows its 3rd call
                async with crowded:
                    self.in_flight += 1
                    self.peak = max(self.peak, self.in_flight)
                    crowded.notify_all()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(crowded.wait_for(lambda: self.in_flight > 2), 1.0)
                    self.in_flight -= 1
            if request.headers.get("authorization") != "Bearer judge-secret":
                return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
            if kind == "hang":
                await asyncio.sleep(600)
            if kind == "fail" or (kind == "flaky" and self.calls % 2):
                return JSONResponse({"error": {"message": "judge down"}}, status_code=500)
            content = body["messages"][1]["content"]
            if '"scores"' in body["messages"][0]["content"]:
                n = content.count("\nAnswer ") + content.startswith("Answer ")
                reply = {"scores": [(i + 1) / n for i in range(n)]}
            else:
                reply = {"score": float("9" in content.split("\nAnswer:\n", 1)[1])}
            return {"id": "j", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": json.dumps(reply)}}]}

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the judge server did not start"
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def judge(self, kind: str, **settings) -> dict:
        return {"base_url": f"http://127.0.0.1:{self.port}/{kind}/v1", "model": "judge", "api_key_env": "JUDGE_KEY",
                **settings}

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def judges():
    server = JudgeServer()
    yield server
    server.close()


def judged(judge: dict) -> dict:
    return {**BASE, "rewards": {"env_weight": 0.0, "terms": [{"name": "judge", "judge": judge}]}}


def test_pointwise_judge_scores_each_answer_with_the_key_from_the_environment(tmp_path, judges, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "judge-secret")
    judges.requests.clear()
    config = judged(judges.judge("good", rubric="Prefer answers with a nine."))
    sink = run(config, tmp_path)
    assert "judge-secret" not in json.dumps(RunConfig.model_validate(config).model_dump())  # only its variable's name
    _, tokenizer = load_policy(RunConfig.model_validate(config).model, 0)
    assert len(sink.records) == 16 and len(judges.requests) == 16  # one call per episode
    assert all(auth == "Bearer judge-secret" and body["messages"][0]["content"].startswith("Prefer answers with a nine.")
               for _, auth, body in judges.requests)
    for record in sink.records:
        assert record["reward"] == float("9" in prompt_and_completion(record, tokenizer)[1])
    for values in sink.steps.values():
        assert values["judge_errors"] == values["judge_timeouts"] == 0 and values["judge_latency_s"] > 0
        assert values["reward_mean"] == pytest.approx(values["reward/judge"])


def test_group_judge_scores_a_group_in_one_call(tmp_path, judges, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "judge-secret")
    judges.requests.clear()
    sink = run(judged(judges.judge("good", mode="group")), tmp_path)
    assert len(judges.requests) == 4  # 2 steps x 2 groups
    for _, _, body in judges.requests:
        assert body["messages"][1]["content"].count("\nAnswer ") == 4  # the group's four answers
    groups = {}
    for record in sink.records:
        groups.setdefault((record["version"], record["group"]), []).append(record["reward"])
    assert [sorted(g) for g in groups.values()] == [[0.25, 0.5, 0.75, 1.0]] * 4


def test_hanging_and_failing_judges_are_counted_and_the_run_completes(tmp_path, judges, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "judge-secret")
    start = time.monotonic()
    hang = run(judged(judges.judge("hang", timeout_s=0.5, retries=1)), tmp_path / "hang")
    assert time.monotonic() - start < 300  # a call hangs 600 s; each try gives up after 0.5 s: never a stall
    assert [v["judge_timeouts"] for v in hang.steps.values()] == [16, 16]  # 8 episodes x 2 tries a step
    assert all(r["reward"] == 0.0 for r in hang.records)  # on_error "zero"
    fail = run(judged(judges.judge("fail", retries=2)), tmp_path / "fail")
    assert [v["judge_errors"] for v in fail.steps.values()] == [24, 24]
    assert all(v["reward_mean"] == 0.0 and v["judge_timeouts"] == 0 for v in fail.steps.values())


def test_a_failed_judge_may_drop_the_episode(tmp_path, judges, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "judge-secret")
    sink = run(judged(judges.judge("flaky", retries=0, on_error="drop")), tmp_path)
    assert sum(v["judge_errors"] for v in sink.steps.values()) >= 8  # every other call failed
    # each trained group holds only the episodes its judge scored: fewer than it sampled
    assert len(sink.records) < 16 and all(r["reward"] in (0.0, 1.0) for r in sink.records)


def test_judge_concurrency_bounds_the_calls_in_flight_over_the_run(judges, monkeypatch):
    """Two groups' 8 pointwise calls pending at once, through one judge (a run's): concurrency 2 keeps at most 2 at
    the endpoint (each call then waits out the server's 1 s hold); without the bound, a group's 4 are in flight."""
    monkeypatch.setenv("JUDGE_KEY", "judge-secret")

    def peak(**settings) -> tuple[int, list]:
        judge, counts = Judge(JudgeConfig.model_validate(judges.judge("crowd", **settings)), "cpu"), Counter()
        groups = [[("Q", f"answer {g}{i}", 0.0) for i in range(4)] for g in (1, 9)]

        async def both():
            return await asyncio.gather(*(judge(texts, counts, [[] for _ in texts]) for texts in groups))
        judges.peak = 0
        scores = asyncio.run(both())
        assert not counts["judge_errors"] and not counts["judge_timeouts"]
        return judges.peak, scores
    assert peak(concurrency=2) == (2, [[0.0] * 4, [1.0] * 4])  # every call answered: the group with a 9 scores 1
    assert peak()[0] > 2  # so the bound above is the judge's own


def test_a_judge_key_that_is_not_set_stops_the_run_naming_the_variable(tmp_path, judges, monkeypatch):
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match="environment variable JUDGE_KEY"):
        run(judged(judges.judge("good")), tmp_path)


def digit_reward_model(path) -> str:
    """A reward model built by hand, with tiny-dense's character tokenizer (no chat template: it scores the plain
    prompt + completion): its one layer adds nothing to the residual stream, so the score is read off the last
    token's embedding, made to be d/9 for a digit d and 0 for any other character. It prefers high digits."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig
    _, tokenizer = load_policy(RunConfig.model_validate(BASE).model, 0)
    hidden = 16
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        score = torch.zeros(len(tokenizer))
        for d in range(10):
            score[tokenizer.convert_tokens_to_ids(str(d))] = d / 9
        # each embedding has an RMS of 1, so the final RMSNorm keeps it: the head reads its second coordinate
        embedding = torch.zeros(len(tokenizer), hidden)
        embedding[:, 0], embedding[:, 1] = (1 - score ** 2).sqrt(), score
        model.model.embed_tokens.weight.copy_(embedding * hidden ** 0.5)
        model.score.weight.zero_()
        model.score.weight[0, 1] = hidden ** -0.5
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_rl_on_a_fixed_reward_model_raises_its_mean_score(tmp_path):
    """max_digit's warm start makes the policy answer digits (the right one about half the time, so the reward
    model's mean is about 0.5); RL on the reward model alone, which prefers 9 to any other digit, raises its mean
    score toward 1 (measured: 0.60 over the first 5 steps, 0.98 over the last 5; 2.5 min on 2 loaded cores)."""
    model = digit_reward_model(tmp_path / "rm")
    sink = run({**BASE, "warm_start": {"steps": 70}, "record": {"samples_per_step": 0},
                "loop": {"steps": 30, "groups_per_step": 8, "group_size": 8, "eval_every": 0},
                "rewards": {"env_weight": 0.0, "terms": [{"name": "rm", "model": model}]}}, tmp_path)
    scores = [v["reward/rm"] for _, v in sorted(sink.steps.items()) if "reward/rm" in v]
    assert len(scores) == 30
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    print(f"reward/rm: first 5 steps {first:.3f}, last 5 {last:.3f}")
    assert last > first + 0.15 and last > 0.8


def scripted_judge(path, reply: str) -> str:
    """A local chat model built by hand that always replies `reply` (greedy): with the tiny-chat tokenizer, each of the
    reply's tokens appears once, so a bigram model is enough. Its layer adds nothing to the residual stream; each
    token of the chain (the generation prompt's last, then the reply's) has an embedding of its own, and the head maps
    it to the next one, the reply's last to the end of turn."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    _, tokenizer = load_policy(RunConfig.model_validate({**BASE, "model": {"preset": "tiny-chat"}}).model, 0)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tokenize=False,
                                           add_generation_prompt=True)
    chain = [tokenizer(prompt, add_special_tokens=False)["input_ids"][-1],
             *tokenizer(reply, add_special_tokens=False)["input_ids"], tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert len(set(chain)) == len(chain)  # a bigram can say it
    hidden = 32
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
                         eos_token_id=chain[-1], pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for k, (token, following) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, k] = hidden ** 0.5  # an RMS of 1: the final norm keeps it
            model.lm_head.weight[following, k] = 10.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_local_judge_is_sampled_by_the_engines_sampler(tmp_path):
    """A judge without base_url is a local model: its greedy reply (here always {"score": 0.5}) scores each episode;
    one whose reply holds no score is counted in judge_errors, one slower than timeout_s in judge_timeouts."""
    judge = scripted_judge(tmp_path / "judge", '{"score": 0.5}')
    sink = run(judged({"model": judge, "max_tokens": 16}), tmp_path / "a")
    assert len(sink.records) == 16 and all(r["reward"] == 0.5 for r in sink.records)
    for values in sink.steps.values():
        assert values["reward/judge"] == 0.5 and values["judge_errors"] == 0 and values["judge_latency_s"] > 0
    mute = scripted_judge(tmp_path / "mute", "fine")
    sink = run(judged({"model": mute, "retries": 0}), tmp_path / "b")
    assert [v["judge_errors"] for v in sink.steps.values()] == [8, 8] and all(r["reward"] == 0 for r in sink.records)
    # a reply slower than timeout_s: the call is given up (its decoding cancelled), counted, and the run goes on
    sink = run(judged({"model": judge, "retries": 0, "timeout_s": 1e-4}), tmp_path / "c")
    assert [v["judge_timeouts"] for v in sink.steps.values()] == [8, 8] and all(r["reward"] == 0 for r in sink.records)
    with pytest.raises(ValidationError, match="must be a local Hugging Face model directory"):
        RunConfig.model_validate(judged({"model": "Qwen/Qwen3-8B"}))  # a name at an endpoint needs its base_url
