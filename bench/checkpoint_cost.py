"""Benchmark: checkpoint save time and its share of training time at the default cadence, tiny preset vs ~10M params."""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM

from molt_engine import NullSink, RunConfig, train
from molt_engine.models import char_tokenizer


class Timing(NullSink):
    def __init__(self):
        self.step_ends, self.saves, self.sizes = [], [], []

    def metrics(self, step, values):
        if "reward_mean" in values:
            self.step_ends.append(time.perf_counter())

    def checkpoint(self, step, path, **info):
        self.saves.append(info["seconds"])
        self.sizes.append(info["size_bytes"])


def ten_million_param_model(directory: Path) -> Path:
    tokenizer = char_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
        num_key_value_heads=6, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def measure(model: dict, steps: int, every: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        sink = Timing()
        cfg = {"env": "max_digit", "model": model, "loop": {"steps": steps, "eval_every": 0},
               "warm_start": {"steps": 0}, "checkpoint": {"every": every, "keep": 2}}
        train(cfg, sink, out_dir=out)
    step_s = statistics.median(b - a for a, b in zip(sink.step_ends, sink.step_ends[1:]))
    return {"save_s": statistics.median(sink.saves), "step_s": step_s, "mb": sink.sizes[-1] / 1e6}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="cadence used to take several save samples")
    args = parser.parse_args()
    default_every = RunConfig.model_validate({"env": "max_digit"}).checkpoint.every
    with tempfile.TemporaryDirectory() as d:
        rows = [("tiny-dense (0.87M)", measure({"preset": "tiny-dense"}, args.steps, args.every)),
                ("llama 10.6M", measure({"preset": None, "path": str(ten_million_param_model(Path(d)))},
                                        args.steps, args.every))]
    print(f"| model | checkpoint MB | save s (median) | step s (median) | share of training time at every={default_every} |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        share = r["save_s"] / (default_every * r["step_s"] + r["save_s"])
        print(f"| {name} | {r['mb']:.1f} | {r['save_s']:.3f} | {r['step_s']:.3f} | {share:.2%} |")


if __name__ == "__main__":
    main()
