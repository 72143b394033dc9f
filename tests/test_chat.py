"""Chat-native episodes: templates as token deltas, native tool calls, the tiny-chat preset, on real runs."""
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from molt_engine import Env, Observation, Result, RunConfig, train
from molt_engine.chat import Template, hermes, run_tools, stop_ids
from molt_engine.config import ModelConfig
from molt_engine.envs import DEMO_SEEDS
from molt_engine.models import CHAT_TEMPLATE, chat_tokenizer, load_policy
from molt_engine.rollout import Rollout
from molt_envs.builtin import calculator
from molt_envs.word_problems import chat_corpus, train_chat_bpe, word_problems
from test_invariants import action_runs, capture, registered, trained_as_sampled  # noqa: F401  (the fixtures)

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"groups_per_step": 2, "group_size": 4, "eval_every": 0}


class ThreeCalls(Env):
    """Three calculator calls, then the answer: three tool turns and a fourth."""
    name = "test_three_calls"
    chat = True
    tools = (calculator,)
    max_turns = 4
    max_tokens = 32

    async def reset(self, seed):
        self.a, self.b = 10 + seed % 50, 2 + seed % 7
        return Observation(messages=[{"role": "user", "content": f"What is {self.a}*{self.b}? Check three times."}])

    async def step(self, action):
        return Result(reward=float(action.strip() == str(self.a * self.b)), terminated=True)

    def demonstration(self, seed):
        # Always the same call: a warm start of seconds teaches it, so that sampled episodes really make three.
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]}] * 3 + [
            {"role": "assistant", "content": str((10 + seed % 50) * (2 + seed % 7))}]


# The same template, except that an assistant turn with tool calls renders differently once something follows it
# (as Qwen3 drops earlier <think> blocks): every tool turn's delta is then a prefix break.
FORGETFUL = CHAT_TEMPLATE.replace("{% elif message.role == 'assistant' %}",
                                  "{% elif message.role == 'assistant' and not loop.last %}<|im_start|>assistant\\n"
                                  "(called)<|im_end|>\\n{% elif message.role == 'assistant' %}")




@pytest.mark.parametrize("template", ["qwen", "forgetful"])
def test_tool_turns_train_exactly_the_sampled_tokens(tmp_path, capture, registered, template):
    registered(ThreeCalls)
    model, tok = load_policy(ModelConfig(preset="tiny-chat"), seed=0)
    assert tok.chat_template != FORGETFUL
    tok.chat_template = FORGETFUL if template == "forgetful" else CHAT_TEMPLATE
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    summary = train({"env": "test_three_calls", "model": {"preset": None, "path": str(tmp_path)},
                     "loop": {**SMALL, "steps": 2, "max_staleness": 0},
                     "warm_start": {"steps": 40, "batch_size": 8, "lr": 3e-3}})  # a tiny policy: the presets' lr
    three_calls = 0
    for ep in trained_as_sampled(capture):
        assert len(action_runs(ep)) == ep.info["turns"]
        # The prompt the sampler saw is the template's render of the env's messages and tools.
        first = action_runs(ep)[0][0]
        messages = asyncio.run(ThreeCalls().reset(ep.seed)).messages
        assert tok.decode(ep.token_ids[:first]) == tok.apply_chat_template(
            messages, tools=[calculator], add_generation_prompt=True, tokenize=False)
        # The forgetful template re-renders every reply with a well-formed call: each one's delta is a break.
        well_formed = sum(any("error" not in c for c in hermes(tok.decode(ep.token_ids[a:b - 1]))[1])
                          for a, b in action_runs(ep))
        assert ep.info["template_prefix_breaks"] == (well_formed if template == "forgetful" else 0)
        three_calls += ep.info["tool_calls"] == 3
    assert three_calls > 0  # the warm start taught the three calls: the multi-turn case really ran
    assert len(capture["losses"]) == 2
    for logp, behav, mask in capture["losses"]:
        assert mask.any() and (logp[mask] - behav[mask]).abs().max() <= 1e-5
    assert summary["tool_errors"] >= 0 and "template_prefix_breaks" in summary


def test_a_qwen2_directory_with_its_own_tokenizer_and_template_trains(tmp_path, capture):
    """Not tiny-chat: a BPE of its own (GPT-2-style pre-tokenizer), a template with a default system prompt and no
    tools, and the dataset env; the prompts the sampler saw decode to that template's render."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    rows = word_problems(50, seed=3)
    bpe.train_from_iterator([r["prompt"] + "\n" + r["answer"] for r in rows], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "<end>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<end>", bos_token="<s>")
    tok.chat_template = ("<s>{% if messages[0].role != 'system' %}[SYS] You help. [/SYS]{% endif %}"
                         "{% for m in messages %}[{{ m.role }}] {{ m.content }}<end>{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    tok.save_pretrained(tmp_path)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                 pad_token_id=0, eos_token_id=2)).save_pretrained(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = train({"env": "dataset", "env_args": {"path": str(data), "reward": "gsm8k", "max_tokens": 12},
                     "model": {"preset": None, "path": str(tmp_path)}, "loop": {**SMALL, "steps": 2},
                     "warm_start": {"steps": 2, "batch_size": 4}})
    assert summary["status"] == "completed" and "accuracy_flexible" in summary
    seen = {tuple(r.context) for r in capture["generations"]}
    for episodes, _ in capture["batches"]:
        for ep in episodes:
            first = action_runs(ep)[0][0]
            assert tuple(ep.token_ids[:first]) in seen
            prompt = next(r["prompt"] for r in rows if r["prompt"] in tok.decode(ep.token_ids[:first]))
            assert tok.decode(ep.token_ids[:first]) == (f"<s>[SYS] You help. [/SYS][user] {prompt}<end>"
                                                        "[assistant] ")
    assert stop_ids(tok) == [tok.eos_token_id]  # its end of turn is its eos


def test_tiny_chat_tokenizer_is_the_one_its_corpus_trains_in_every_process():
    """The shipped file (molt_engine/chat_tokenizer.json) is what its deterministic corpus trains, here and in another
    process: a change to the built-in chat envs' text that changes it fails here, not in a checkpoint's ids."""
    shipped = (ROOT / "molt_engine" / "chat_tokenizer.json").read_text()
    assert train_chat_bpe(chat_corpus()) == shipped
    other = subprocess.run([sys.executable, "-c", "from molt_envs.word_problems import chat_corpus, train_chat_bpe; "
                            "print(train_chat_bpe(chat_corpus()))"], capture_output=True, text=True, check=True)
    assert other.stdout.rstrip("\n") == shipped
    tok = chat_tokenizer()
    text = "Ünïcode and émoji 🙂 encode as bytes"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert [tok.convert_ids_to_tokens(i) for i in stop_ids(tok)] == ["<|im_end|>"]
    # A generation config's list of eos ids (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>) ends turns too.
    assert stop_ids(tok, GenerationConfig(eos_token_id=[2, 0])) == [0, 2]


def test_hermes_parser():
    assert hermes("42") == ("42", [])
    content, calls = hermes('Let me see <tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n'
                            '</tool_call><tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
                            '<tool_call>{"name": "g", "arguments": [1]}</tool_call><tool_call>{"name": "h"')
    assert content == "Let me see"
    assert calls[:2] == [{"name": "calculator", "arguments": {"expression": "2*3"}}, {"name": "f", "arguments": {"x": 1}}]
    assert "arguments an object" in calls[2]["error"] and "malformed" in calls[3]["error"]


def test_tool_failures_become_error_messages():
    gate = asyncio.Event()

    async def hangs(x: int) -> str:
        """Never returns.

        Args:
            x: anything
        """
        await gate.wait()

    def boom() -> str:
        """Raises."""
        raise RuntimeError("no")

    tools = {"calculator": calculator, "hangs": hangs, "boom": boom}
    calls = [{"name": "calculator", "arguments": {"expression": "6*7"}}, {"error": "malformed tool call 'x'"},
             {"name": "nope", "arguments": {}}, {"name": "calculator", "arguments": {"expr": "1"}},
             {"name": "calculator", "arguments": {"expression": "__import__('os')"}}, {"name": "boom", "arguments": {}},
             {"name": "hangs", "arguments": {"x": 1}}]
    results = asyncio.run(run_tools(tools, calls, timeout=0.2))
    assert results[0] == ("calculator", "42", False)
    assert [error for _, _, error in results] == [False] + [True] * 6
    texts = [text for _, text, _ in results]
    assert "malformed" in texts[1] and "unknown tool 'nope'" in texts[2] and "wrong arguments" in texts[3]
    assert "ValueError" in texts[4] and "RuntimeError: no" in texts[5] and "timed out" in texts[6]


def test_template_delta_after_a_tool_turn_is_the_suffix():
    tok = chat_tokenizer()
    template = Template(tok, [calculator], stop_ids(tok))
    history = [{"role": "user", "content": "What is 6*7?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}]}
    reply = template.reply(history, call)
    assert tok.decode(reply) == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call><|im_end|>'
    tail, broke = template.after_reply(history + [call], [{"role": "tool", "content": "42"}], ended=True)
    assert not broke
    whole = template.ids(history, True) + reply + tail
    assert whole == template.ids(history + [call, {"role": "tool", "content": "42"}], True)
    # A reply cut off before its end of turn gets the end-of-turn token as non-action context.
    tail, _ = template.after_reply(history + [call], [{"role": "tool", "content": "42"}], ended=False)
    assert tok.decode(tail).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")


def test_calculator_demonstrations_answer_in_the_head_for_their_mental_share():
    from pydantic import ValidationError

    from molt_engine import RunConfig
    from molt_envs.agents import CalculatorAgent
    from molt_envs.builtin import ChatCalculator

    def calls(demo):
        return any(m.get("tool_calls") for m in demo)
    seeds = range(200)
    for cls in (ChatCalculator, CalculatorAgent):
        assert all(calls(cls(mental_share=0.0).demonstration(s)) for s in seeds)
        assert not any(calls(cls(mental_share=1.0).demonstration(s)) for s in seeds)
        share = sum(not calls(cls().demonstration(s)) for s in seeds) / len(seeds)
        assert 0.45 < share < 0.75
        with pytest.raises(ValidationError, match="mental_share must be in"):
            RunConfig.model_validate({"env": cls.name, "model": {"preset": "tiny-chat"}, "env_args": {"mental_share": 2}})


class TwoAtOnce(ThreeCalls):
    """One reply with two calculator calls, then the answer."""
    name = "test_two_at_once"

    def demonstration(self, seed):
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}
        return [{"role": "assistant", "content": "", "tool_calls": [call, call]},
                {"role": "assistant", "content": str((10 + seed % 50) * (2 + seed % 7))}]


def test_tool_calls_counts_the_calls_and_turns_the_turns(registered):
    """`tool_calls` (an episode's count, the samples' column, `tool_call_rate`) means what OpenAI's `tool_calls` does:
    the calls, two in one turn here; `turns` counts the turns."""
    registered(TwoAtOnce)
    tok = chat_tokenizer()
    rollout = Rollout(RunConfig.model_validate({"env": TwoAtOnce.name, "model": {"preset": "tiny-chat"}}), tok, 1024,
                      stop_ids(tok))
    ep = asyncio.run(rollout.demonstration(DEMO_SEEDS))
    assert ep.info["tool_calls"] == 2 and ep.info["turns"] == 2 and ep.reward == 1.0
