"""What chat-native episodes cost: samples/s of the chat calculator (native tool calls through the chat template) vs
the text calculator on the same policy (tiny-chat: same model, same tokenizer), and the time spent rendering the
template and parsing tool calls as a share of the sampler's time.

    python bench/chat_overhead.py --steps 15

Both runs: no warm start (a random policy: every chat turn is rendered and parsed, a few make a tool call),
groups_per_step 8 x group_size 8, max_tokens 32 for both envs. Prints per env: the median samples/s and tokens/s over
the steps after the first, the sampler's busy seconds, and for the chat env the seconds in Template.ids (every
render) and in the tool-call parser, and their share of the sampler's busy time.
"""
import argparse
import statistics
import time

import molt_engine.chat as chat
from molt_engine import NullSink, train
from molt_envs.builtin import Calculator
from molt_engine.inference.sampler import Sampler

SPENT = {"template": 0.0, "parse": 0.0, "sampler": 0.0}


def timed(key, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[key] += time.perf_counter() - t0
    return wrapper


class Rates(NullSink):
    def __init__(self):
        self.rows = []

    def metrics(self, step, values):
        if "samples_per_s" in values:
            self.rows.append(values)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    chat.Template.ids = timed("template", chat.Template.ids)
    chat.PARSERS["hermes"] = timed("parse", chat.hermes)
    Sampler.step = timed("sampler", Sampler.step)
    Calculator.max_tokens = 32  # as the chat calculator's
    for env in ("calculator", "chat_calculator"):
        SPENT.update(dict.fromkeys(SPENT, 0.0))
        sink = Rates()
        train({"env": env, "model": {"preset": "tiny-chat"}, "seed": 0, "warm_start": {"steps": 0},
               "loop": {"steps": args.steps, "groups_per_step": 8, "group_size": 8, "eval_every": 0},
               "checkpoint": {"every": 0}}, sink)
        rows = sink.rows[1:]
        print(f"{env:16s} samples/s {statistics.median(r['samples_per_s'] for r in rows):6.1f}  "
              f"tokens/s {statistics.median(r['tokens_per_s'] for r in rows):7.1f}  "
              f"tool_call_rate {statistics.mean(r['tool_call_rate'] for r in rows):.2f}  "
              f"sampler {SPENT['sampler']:6.1f} s  template {SPENT['template']:5.2f} s  parse {SPENT['parse']:5.3f} s  "
              f"(template + parse = {100 * (SPENT['template'] + SPENT['parse']) / SPENT['sampler']:.1f}% of sampler)",
              flush=True)


if __name__ == "__main__":
    main()
