"""The peak memory of one trainer update of the Qwen2.5-0.5B shape on the CPU, before and after the chunked LM head.

    python bench/trainer_memory.py                        # before (git BEFORE), after, after + checkpointing
    python bench/trainer_memory.py --variants after after+gc --tokens 256

Each variant runs in a fresh subprocess (the peak RSS is the process's own): a random-init Qwen2Config of
Qwen2.5-0.5B's shape (vocab 151,936, tied embeddings; fp32 weights, as the trainer keeps them), one GRPO train_step of
4 episodes x --tokens tokens (one group: a 64-token prompt, the rest actions, rewards that differ). "before" imports
molt_engine as it was at --before (git archive), the trainer with the whole [tokens, vocab] log-softmax; "after" this
tree's; AdamW as the loop made it then (foreach) and makes it now (fused). "+gc" turns on transformers' gradient checkpointing (what model.gradient_checkpointing does). Reported apart:
weights (4 bytes/param), gradients (4) and AdamW's two moments (8), computed from the parameter count, and the rest of
the peak above the process's memory before the model was built (activations, logits, temporaries; at its end
train_step copies the weights to publish, once the gradients are freed: a tied embedding once since 57); and the same up to the end of the backward
pass (the first optimizer step's pre-hook: weights and gradients exist, AdamW's moments not yet). glibc's malloc gives blocks over 128 KB
back to the system when freed (MALLOC_MMAP_THRESHOLD_), so the RSS follows what is alive, not what was once used.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BEFORE = "9cb3018"  # the last commit before the chunked LM head (molt_engine/logprobs.py)
ROOT = Path(__file__).resolve().parent.parent
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                  tie_word_embeddings=True)


def child(tokens: int, checkpointing: bool, fused: bool) -> dict:
    rss = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from molt_engine import RunConfig
    from molt_engine.breaker import Breaker
    from molt_engine.episode import Episode
    from molt_engine.update import train_step
    torch.set_num_threads(2)
    start = rss()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN25_05B, pad_token_id=0), dtype=torch.float32)
    if checkpointing:  # as model.gradient_checkpointing does it; train mode changes nothing here (no dropout)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train(checkpointing)
    cfg = RunConfig.model_validate({"env": "max_digit", "loop": {"groups_per_step": 1, "group_size": 4}})
    g, group = torch.Generator().manual_seed(0), []
    prompt = torch.randint(3, 151936, (64,), generator=g).tolist()
    for j in range(4):
        ep = Episode(seed=0, group=0, reward=float(j))
        ep.extend(prompt)
        ep.extend(torch.randint(3, 151936, (tokens - 64,), generator=g).tolist(), action=True)
        ep.info = {"success": False, "entropy": 0.0, "tool_calls": 0, "turns": 1}
        group.append(ep)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused)  # as the loop makes it, then and now
    backward = []  # the peak up to the end of the backward pass: the forward's and backward's own memory
    optimizer.register_step_pre_hook(lambda *args: backward.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
    t0 = time.perf_counter()
    # published: the live weights, not a copy (the loop keeps one copy of its own; no trip here reads it)
    metrics, weights, _, _ = train_step(model, optimizer, [group], cfg, step=0, breaker=Breaker(cfg.breaker),
                                        published=model.state_dict(), pad_id=0)
    seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    states = {"weights": 4 * params, "gradients": 4 * params, "optimizer": 8 * params}
    return {"params": params, "seconds": round(seconds, 1), "peak_gb": (peak - start) / 1e9,
            **{f"{k}_gb": v / 1e9 for k, v in states.items()},
            "rest_gb": (peak - start - sum(states.values())) / 1e9,
            "backward_peak_gb": (backward[0] * 1024 - start) / 1e9,
            "backward_rest_gb": (backward[0] * 1024 - start - states["weights"] - states["gradients"]) / 1e9,
            "grad_norm": metrics["grad_norm"]}


def child_loop(vocab: int, evals: bool, checkpoints: bool) -> dict:
    """A whole short run (model.path, so checkpointing is the plan's) of the tiny-dense body (hidden 128, 4 layers) with
    a `vocab`-entry tied embedding: its peak RSS above the process's before the model was built, with every copy of
    the weights the run keeps (the device event's memory plan) and the bytes they leave unexplained."""
    rss = lambda: int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    import string

    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from molt_engine import train
    torch.set_num_threads(1)
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # the char tokenizer's, then filler words
    words = ["<pad>", "<eos>", "<unk>", *chars] + [f"w{i}" for i in range(vocab - len(chars) - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    events = []

    class Sink:
        def event(self, kind, message, **data):
            events.append((kind, data))

        def __getattr__(self, name):
            return lambda *a, **k: None

    with tempfile.TemporaryDirectory() as out:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                     num_attention_heads=4, max_position_embeddings=512, tie_word_embeddings=True,
                                     pad_token_id=0, eos_token_id=1, bos_token_id=None)).save_pretrained(f"{out}/m")
        PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                unk_token="<unk>").save_pretrained(f"{out}/m")
        start = rss()
        t0 = time.perf_counter()
        train({"env": "max_digit", "model": {"path": f"{out}/m"}, "warm_start": {"steps": 0},
               "loop": {"steps": 4, "groups_per_step": 4, "group_size": 4, "eval_every": 2 if evals else 0,
                        "eval_episodes": 4}, "checkpoint": {"every": 2 if checkpoints else 0}},
              Sink(), f"{out}/run")
        seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start
    return {"params": next(data for kind, data in events if kind == "device")["parameters"],
            "seconds": round(seconds, 1), "peak_gb": peak / 1e9}


# The copies of the weights a full fine-tune in fp32 keeps at its peak (the end of a step), bytes a parameter:
# before, the sampler's weights were a copy of the published ones; now it decodes on them (Sampler.step, eager steps)
COPIES = {"before": dict(weights=4, gradients_or_new_published=4, adamw=8, published=4, sampler=4, eval_sampler=4),
          "after": dict(weights=4, gradients_or_new_published=4, adamw=8, published_and_sampler=4, eval_sampler=4)}


def loop_variant(variant: str, vocab: int, before: str) -> dict:
    """`variant`: before or after (the engine at --before, or this tree), +noeval, +nockpt."""
    with tempfile.TemporaryDirectory() as tree:
        source = str(ROOT)
        if variant.startswith("before"):
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", before, "molt_engine", "molt_envs"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
            source = tree
        out = subprocess.run([sys.executable, __file__, "--loop-child", str(vocab), str("+noeval" not in variant),
                              str("+nockpt" not in variant)],
                             env={**os.environ, "PYTHONPATH": source, "MALLOC_MMAP_THRESHOLD_": "131072"},
                             check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(variant: str, tokens: int, before: str) -> dict:
    with tempfile.TemporaryDirectory() as tree:
        source = str(ROOT)
        if variant.startswith("before"):  # the engine as it was: its files only, this script unchanged
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", before, "molt_engine"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
            source = tree
        out = subprocess.run([sys.executable, __file__, "--child", str(tokens), str(variant.endswith("+gc")),
                              str(not variant.startswith("before"))],
                             env={**os.environ, "PYTHONPATH": source, "MALLOC_MMAP_THRESHOLD_": "131072"},
                             check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["before", "after", "after+gc"],
                   choices=["before", "before+gc", "after", "after+gc"])
    p.add_argument("--tokens", type=int, default=512, help="tokens per episode (4 episodes)")
    p.add_argument("--before", default=BEFORE, help="git revision of the engine 'before' runs")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--loop", nargs="*", metavar="VARIANT", help="whole short runs of a tiny body instead: before, "
                   "after, with +noeval and/or +nockpt (evals, checkpoints off)")
    p.add_argument("--vocab", type=int, nargs="+", default=[151936, 600], help="--loop: vocabulary sizes")
    p.add_argument("--loop-child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.loop_child:
        print(json.dumps(child_loop(int(args.loop_child[0]), args.loop_child[1] == "True",
                                    args.loop_child[2] == "True")))
        return
    if args.loop is not None:
        for vocab in args.vocab:
            for variant in args.loop or ["before", "after"]:
                r, copies = loop_variant(variant, vocab, args.before), COPIES[variant.split("+")[0]]
                counted = sum(copies.values()) * r["params"] / 1e9
                print(f"vocab {vocab:6} {variant:14} peak {r['peak_gb']:5.2f} GB ({r['peak_gb'] * 1e9 / r['params']:.1f}"
                      f" B/param), {r['params']:,} params, {r['seconds']} s; copies {sum(copies.values())} B/param = "
                      f"{counted:.2f} GB ({', '.join(f'{k} {v}' for k, v in copies.items())}), the rest "
                      f"{r['peak_gb'] - counted:.2f} GB", flush=True)
        return
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1] == "True", args.child[2] == "True")))
        return
    results = {}
    for variant in args.variants:
        results[variant] = r = run(variant, args.tokens, args.before)
        print(f"{variant:10} peak {r['peak_gb']:6.2f} GB = weights {r['weights_gb']:.2f} + gradients "
              f"{r['gradients_gb']:.2f} + AdamW {r['optimizer_gb']:.2f} + rest {r['rest_gb']:6.2f} GB; {r['seconds']} s; "
              f"grad_norm {r['grad_norm']:.3g}\n{'':10} up to the end of the backward: peak {r['backward_peak_gb']:6.2f} GB"
              f" = weights + gradients + rest {r['backward_rest_gb']:6.2f} GB", flush=True)
    if "before" in results:
        for variant, r in results.items():
            print(f"{variant:10} before's rest / this rest: whole step {results['before']['rest_gb'] / r['rest_gb']:.2f}x, "
                  f"to the end of the backward {results['before']['backward_rest_gb'] / r['backward_rest_gb']:.2f}x")


if __name__ == "__main__":
    main()
