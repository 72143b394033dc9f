"""Devices and precision: max_digit time to 0.9 per device/dtype, and (on a GPU) a ~0.5B Qwen2 model's sampler vs
`model.generate`, update tokens/s and peak memory. Prints markdown tables for docs/benchmarks.md.

  python bench/gpu.py learn --device cpu --dtype float32 bfloat16        # acceptance on a CPU
  python bench/gpu.py learn --device cuda cpu --dtype bfloat16           # GPU vs CPU
  python bench/gpu.py throughput                                         # needs a GPU
"""
import argparse
import asyncio
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from molt_engine.breaker import Breaker  # noqa: E402
from molt_engine.config import RunConfig  # noqa: E402
from molt_engine.episode import Episode  # noqa: E402
from molt_engine.loop import train  # noqa: E402
from molt_engine.models import char_tokenizer  # noqa: E402
from molt_engine.inference.sampler import Sampler  # noqa: E402
from molt_engine.update import train_step  # noqa: E402


class Watch:
    """A sink that notes when the eval reward first reaches the target, and the mismatch of every step."""

    def __init__(self, target: float):
        self.target, self.t0, self.reached, self.mismatch, self.last = target, time.perf_counter(), None, [], {}

    def metrics(self, step, values):
        if "mismatch_kl" in values:
            self.mismatch.append((values["mismatch_kl"], values["mismatch_abs"]))
        if self.reached is None and values.get("eval_reward", 0) >= self.target:
            self.reached = (step, time.perf_counter() - self.t0)
        self.last.update(values)

    def alert(self, kind, message, **data): pass
    def event(self, kind, message, **data): pass
    def checkpoint(self, step, path, **info): pass


def learn(args):
    print(f"| device | dtype | seed | steps to {args.target} | seconds to {args.target} | final eval | "
          f"mismatch_kl median / max | mismatch_abs median / max | seconds total |")
    print("|---|---|---|---|---|---|---|---|---|")
    for device in args.device:
        for dtype in args.dtype:
            for seed in args.seeds:
                watch, t0 = Watch(args.target), time.perf_counter()
                train({"env": "max_digit", "seed": seed, "model": {"device": device, "dtype": dtype},
                       "loop": {"steps": args.steps, "eval_every": 10, "eval_episodes": 64}}, watch)
                total = time.perf_counter() - t0
                kl, ab = zip(*watch.mismatch)
                step, secs = watch.reached or ("-", "-")
                secs = f"{secs:.0f}" if watch.reached else "-"
                print(f"| {device} | {dtype} | {seed} | {step} | {secs} | {watch.last.get('eval_reward', 0):.3f} | "
                      f"{statistics.median(kl):.2e} / {max(kl):.2e} | {statistics.median(ab):.4f} / {max(ab):.4f} | "
                      f"{total:.0f} |", flush=True)


def qwen2_half_b(vocab: int):
    from transformers import AutoModelForCausalLM, Qwen2Config
    config = Qwen2Config(vocab_size=vocab, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def throughput(args):
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py throughput: torch sees no CUDA device (run `learn` on a CPU instead)")
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype[0])
    tok = char_tokenizer()
    # A real vocabulary size: the logits are a large part of a small model's cost.
    model = qwen2_half_b(151_936).to(device)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    prompt, new = list(range(3, 3 + args.prompt_len)), args.new_tokens
    print(f"GPU: {torch.cuda.get_device_name()}; Qwen2 config, {params:.2f}B parameters, random init, {args.dtype[0]}; "
          f"batch {args.batch}, prompt {args.prompt_len}, {new} new tokens (no early EOS)")
    sampler_model = copy.deepcopy(model).to(dtype)
    sampler = Sampler(sampler_model, stop_ids=[], pad_id=tok.pad_token_id, temperature=1.0)

    async def sample():
        task = asyncio.create_task(sampler.run())
        out = await asyncio.gather(*(sampler.generate(prompt, new, seed=i) for i in range(args.batch)))
        task.cancel()
        return out

    rows = []
    for name, run in (("molt sampler", lambda: asyncio.run(sample())),
                      ("model.generate", lambda: sampler_model.generate(
                          torch.tensor([prompt] * args.batch, device=device), max_new_tokens=new, min_new_tokens=new,
                          do_sample=True, pad_token_id=0))):
        run()  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        rows.append((name, args.batch * new / seconds, torch.cuda.max_memory_allocated() / 1e9))
    episodes = sampled_episodes(asyncio.run(sample()), prompt)
    groups = [episodes[i:i + 8] for i in range(0, len(episodes), 8)]
    for i, e in enumerate(episodes):  # half of each group right: every episode has an advantage
        e.reward = float(i % 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    cfg = _cfg(args)
    published = {k: v.detach().clone() for k, v in model.state_dict().items()}
    step_args = dict(breaker=Breaker(cfg.breaker), published=published, pad_id=tok.pad_token_id,
                     micro_batch_size=args.micro)
    train_step(model, optimizer, groups, cfg, step=0, **step_args)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    train_step(model, optimizer, groups, cfg, step=1, **step_args)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(e.token_ids) for e in episodes)
    rows.append((f"update (micro-batch {args.micro})", tokens / seconds, torch.cuda.max_memory_allocated() / 1e9))
    print("| part | tokens/s | peak GPU memory (GB) |\n|---|---|---|")
    for name, rate, peak in rows:
        print(f"| {name} | {rate:,.0f} | {peak:.1f} |")


def sampled_episodes(requests, prompt) -> list[Episode]:
    return [Episode(token_ids=prompt + r.ids, is_action=[False] * len(prompt) + [True] * len(r.ids),
                    logprobs=[0.0] * len(prompt) + r.logprobs, versions=[-1] * len(prompt) + r.versions, reward=0.0,
                    group=i // 8, seed=i, info={"success": False, "entropy": 0.0, "tool_calls": 0, "turns": 1})
            for i, r in enumerate(requests)]


def _cfg(args):
    return RunConfig.model_validate({"env": "max_digit", "model": {"dtype": args.dtype[0]},
                                     "loop": {"groups_per_step": args.batch // 8, "group_size": 8}})


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["learn", "throughput"])
    p.add_argument("--device", nargs="+", default=["cpu"], help="learn: devices to compare")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=150, help="learn: trainer steps per run")
    p.add_argument("--target", type=float, default=0.9, help="learn: eval reward to reach")
    p.add_argument("--batch", type=int, default=64, help="throughput: sequences per batch (a multiple of 8)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro", type=int, default=16, help="throughput: the update's micro-batch size")
    args = p.parse_args()
    learn(args) if args.part == "learn" else throughput(args)
