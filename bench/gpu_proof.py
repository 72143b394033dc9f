"""The GPU proof: one command that shows the engine learns, samples, trains, shares a process and recovers on a GPU.

Each check prints one JSON line, {"check": name, "ok": true|false|null, ...numbers..., "seconds": s}, also written to
--out as it finishes; a check that raises puts its error in its line and the next one runs; the exit code is 1 if any
check failed. ok null = skipped, with the reason in "skipped" (the CUDA-only checks on a CPU).

  setup          versions, device, the model's shape, what "peak_gb" means below
  learn          max_digit on the device in bf16 (engine defaults, --seed) to greedy eval >= 0.9 (then it stops);
                 samples/s
  sampler        a random-init Qwen2 of Qwen2.5-0.5B's shape in bf16; the engine's sampler at 64 and 256 requests
                 (distinct random 256-token prompts, no stop token, 256 new tokens or what 45 s allow) on its decode
                 path ("decoding": CUDA graphs on a GPU, the same static-shape step uncaptured on a CPU): prefill
                 tokens/s (over its first step, which also samples each first token: a lower bound) and decode
                 tokens/s, beside the eager decode steps and transformers' generate on the same model, batch and
                 length; peak memory; the share of requests whose tokens are the eager path's; mismatch_kl of the
                 trainer's log-probs (fp32 weights, bf16 autocast) vs the sampler's (64 requests)
  trainer        train_step (GRPO, AdamW) on those 64 samples, whole batch and micro-batches: tokens/s (all tokens),
                 MFU = (6 N tokens + causal attention 6 L d sum(len^2)) / s / --peak-tflops, peak memory
  two_jobs       the sampler's tokens/s on the 64 prompts alone, then while the trainer updates in the same process
                 (asyncio + worker threads, as in a run; the run's decode path); 45 s at most each
  oom            a real out-of-memory: GPU memory capped (set_per_process_memory_fraction) between what the whole
                 batch and a micro-batch need; train_step_fitting splits the step; its weights vs a step run at the
                 micro-batch size that fit (SGD, lr 1: the weight change is the gradient)
  multiturn      calculator (multi-turn tool use) at max_staleness 2, the sampler in the loop's process, then in its
                 own (loop.sampler_process: published weights cross as CUDA IPC handles); completions/s, staleness_max
  trl            TRL's GRPOTrainer (transformers generation) on the sampler check's shape and batch (8 prompts x 8
                 completions of 256 tokens): seconds/step and rollout tokens/s (medians), against the engine's
                 sampler + update on the same batch; skipped on a CPU or without trl
  ladder         random-init Qwen2.5 shapes 0.5B, 1.5B, 3B and 7B, full fine-tuning (fp32 weights; bf16 weights) and
                 LoRA r=16, activation checkpointing off and on: whether a GRPO step of 64 x 1,024 tokens fits and at
                 which micro-batch size, tokens/s, MFU, peak memory; the sampler's decode tokens/s at 128 requests.
                 On one H200, alone:  python3 bench/gpu_proof.py --checks ladder --out $OUT/ladder.jsonl
  machine_panel  the runs page's GPU numbers (nvidia-ml-py: utilisation, memory), read every 0.5 s during the run

On the GPU machine (an H200: offline, Python 3.12, torch 2.11, transformers 5.17), 201 s on 2026-12-04. The engine needs
transformers 5.24 (models take and return `cache`; 5.17 to 5.23 call it past_key_values) and pydantic beyond the
image's packages: the serving stack (fastapi, uvicorn, openai, httpx) loads only when an agent env runs, and datasets
and math-verify only with the dataset env. The trl check also needs trl and what it lacks there (accelerate,
datasets and theirs); without them it is skipped. Fetch them here and carry .whl:

  echo /.whl/ >> .git/info/exclude; W="--only-binary=:all: --python-version 3.12 --implementation cp -d .whl"
  python3 -m pip download $W --platform manylinux2014_x86_64 pydantic
  python3 -m pip download $W --no-deps transformers==5.24.0
  python3 -m pip download $W --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 trl  # the trl check
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
      export PYTHONPATH=/tmp/site && PYTHONUNBUFFERED=1 python3 bench/gpu_proof.py --out $OUT/gpu_proof.jsonl

(`pip download trl` also fetches torch and transformers for its dependency list: delete those wheels from .whl before
carrying, the image has its own torch.) The decode path's equality tests with capture: `python -m pytest -m gpu
tests/test_inference.py`.

At toy scale on a CPU (tests/test_gpu_proof.py), a minute or two:  python bench/gpu_proof.py --device cpu --tiny
"""
import argparse
import asyncio
import copy
import functools
import json
import platform
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from traceback import extract_tb

import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from molt_engine import NullSink, RunConfig  # noqa: E402
from molt_engine.algo import kl_penalty  # noqa: E402
from molt_engine.breaker import Breaker  # noqa: E402
from molt_engine.episode import Episode, collate, to_device, token_logprobs  # noqa: E402
from molt_engine.loop import Training  # noqa: E402
from molt_engine.inference.sampler import Request, Sampler  # noqa: E402
from molt_engine.update import train_step, train_step_fitting  # noqa: E402

# Qwen2.5-0.5B's published shape, and a toy one that keeps its proportions (grouped KV heads, tied embeddings).
FULL = dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151_936, prompt=256, new=256,
            requests=(64, 256), micro=8, learn_steps=100, budget_s=45, multiturn_steps=30)
TINY = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=2048, prompt=24, new=24,
            requests=(8, 16), micro=4, learn_steps=20, budget_s=45, multiturn_steps=3)
GROUP = 8  # episodes per prompt in the update (GRPO groups)


def check_setup(args, s):
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    return {"ok": True, "device": str(device), "gpu": torch.cuda.get_device_name(device) if cuda else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "python": platform.python_version(), "torch_threads": torch.get_num_threads(), "tiny": args.tiny,
            "shape": {k: args.scale[k] for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")},
            "peak_tflops": args.peak_tflops,
            "memory": "torch.cuda.max_memory_allocated" if cuda else "the process's max RSS (never reset)"}


class Watch(NullSink):
    """The run's evals (step -> reward, seconds since start) and its training steps' samples/s and mismatch; stops
    the run at the first eval >= 0.9 after RL began (GPU time is scarce)."""

    def __init__(self, stop):
        self.stop, self.t0, self.evals, self.steps = stop, time.perf_counter(), {}, []  # steps: each step's metrics

    def metrics(self, step, values):
        if "eval_reward" in values:
            self.evals[step] = (values["eval_reward"], time.perf_counter() - self.t0)
            if step > 0 and values["eval_reward"] >= 0.9:
                self.stop()
        if "samples_per_s" in values:
            self.steps.append(values)

    def series(self, name: str) -> list[float]:
        return [values[name] for values in self.steps]


def check_learn(args, s):
    cfg = RunConfig.model_validate({"env": "max_digit", "seed": args.seed, "checkpoint": {"every": 0},
                                    "model": {"device": args.device, "dtype": "bfloat16"},
                                    "loop": {"steps": args.scale["learn_steps"], "eval_every": 10, "eval_episodes": 64}})
    watch = Watch(lambda: training.request_stop())
    training = Training(cfg, watch)
    summary = asyncio.run(training.run())
    rewards = {step: r for step, (r, _) in watch.evals.items()}
    reached = [(step, t) for step, (r, t) in sorted(watch.evals.items()) if step > 0 and r >= 0.9]
    best, first = max(rewards.values()), rewards[min(rewards)]
    # At toy scale there are too few steps for 0.9: the proof is that greedy eval improved on the warm start's.
    return {"ok": summary["status"] in ("completed", "stopped") and (best > first if args.tiny else bool(reached)),
            "steps": summary["step"], "eval_reward": rewards, "eval_best": best,
            "steps_to_0.9": reached[0][0] if reached else None, "seconds_to_0.9": reached[0][1] if reached else None,
            "samples_per_s_median": statistics.median(watch.series("samples_per_s")),
            "mismatch_kl_median": statistics.median(watch.series("mismatch_kl")),
            "mismatch_kl_max": max(watch.series("mismatch_kl"))}


def check_multiturn(args, s):
    """calculator at max_staleness 2, the sampler in the loop's process and then in its own (loop.sampler_process:
    published weights cross as CUDA IPC handles on a GPU, as shared memory on a CPU)."""
    runs = {}
    for process in (False, True):
        cfg = RunConfig.model_validate({"env": "calculator", "seed": args.seed, "checkpoint": {"every": 0},
                                        "model": {"device": args.device, "dtype": "bfloat16"},
                                        "loop": {"steps": args.scale["multiturn_steps"], "max_staleness": 2,
                                                 "sampler_process": process, "eval_every": 0}})
        watch = Watch(lambda: None)
        summary = asyncio.run(Training(cfg, watch).run())
        runs["sampler_process" if process else "in_process"] = {
            "status": summary["status"], "steps": len(watch.steps),
            "completions_per_s_median": statistics.median(watch.series("samples_per_s")),
            "reward_mean": statistics.mean(watch.series("reward_mean")),
            "staleness_max": max(watch.series("staleness_max")),
            "mismatch_kl_median": statistics.median(watch.series("mismatch_kl"))}
    return {"ok": all(r["status"] == "completed" and r["steps"] == args.scale["multiturn_steps"] and
                      r["staleness_max"] <= 2 for r in runs.values()),
            "process_vs_in_process": runs["sampler_process"]["completions_per_s_median"] /
                                     runs["in_process"]["completions_per_s_median"], **runs}


def check_sampler(args, s):
    device, sc = torch.device(args.device), args.scale
    config = Qwen2Config(vocab_size=sc["vocab"], hidden_size=sc["hidden"], intermediate_size=sc["intermediate"],
                         num_hidden_layers=sc["layers"], num_attention_heads=sc["heads"],
                         num_key_value_heads=sc["kv_heads"], max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    with device:  # random init where it will run: a 0.5B init on the host takes a while
        s["model"] = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # the trainer's: fp32 weights
    s["sampler_model"] = model = copy.deepcopy(s["model"]).to(torch.bfloat16).eval()  # as the engine makes it
    s["params"] = sum(p.numel() for p in s["model"].parameters())  # tied embeddings counted once
    weights_gb = torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None  # in every peak below
    # The engine's decode path: CUDA graphs on a GPU, the same static-shape step uncaptured on a CPU; and the eager
    # steps beside it. One sampler each for every batch: the graphs (one per bucket) are captured once.
    graphed = Sampler(model, [], 0, temperature=1.0, cuda_graphs=True if device.type == "cuda" else "uncaptured")
    eager = Sampler(model, [], 0, temperature=1.0)
    decode(eager, random_prompts(2, sc), 4, sc["budget_s"])  # warm-up: kernels, allocator
    generate(model, random_prompts(2, sc), 4)
    rows = []
    for n in sc["requests"]:
        prompts = random_prompts(n, sc)
        decode(graphed, prompts, 3, sc["budget_s"])  # captures this batch's bucket: the timed run replays it
        peak_gb(device)
        first_s, decode_s, reqs = decode(graphed, prompts, sc["new"], sc["budget_s"])
        sampler_peak, new = peak_gb(device), len(reqs[0].ids)  # all requests decode in step
        _, eager_s, eager_reqs = decode(eager, prompts, new, sc["budget_s"])
        generate_s = generate(model, prompts, new)
        rows.append({"requests": n, "new_tokens": new, "first_step_seconds": first_s,
                     "prefill_tokens_per_s": n * sc["prompt"] / first_s, "decode_step_seconds": decode_s / (new - 1),
                     "decode_tokens_per_s": n * (new - 1) / decode_s,
                     "eager_decode_tokens_per_s": n * (len(eager_reqs[0].ids) - 1) / eager_s,
                     "sampler_tokens_per_s": n * new / (first_s + decode_s),
                     "generate_tokens_per_s": n * new / generate_s, "sampler_seconds": first_s + decode_s,
                     "generate_seconds": generate_s, "sampler_peak_gb": sampler_peak,
                     "generate_peak_gb": peak_gb(device),
                     # requests whose tokens are the eager path's (in fp32 all are: tests/test_inference.py; in bf16 a
                     # rounding difference may move a sample across a token boundary, and the request diverges there)
                     "same_tokens_as_eager": sum(a.ids[:len(b.ids)] == b.ids[:len(a.ids)]
                                                 for a, b in zip(reqs, eager_reqs)) / n})
        rows[-1]["sampler_vs_generate"] = rows[-1]["sampler_tokens_per_s"] / rows[-1]["generate_tokens_per_s"]
        if n == sc["requests"][0]:  # the batch the trainer checks update on
            s["prompts"], s["episodes"] = prompts, episodes(reqs, prompts)
            s["rollout"] = first_s + decode_s, new  # seconds, new tokens (fewer when the time budget cut it)
    kl, gap = mismatch(s["model"], s["episodes"], device, sc["micro"])
    return {"ok": all(r["decode_tokens_per_s"] > 0 and r["generate_tokens_per_s"] > 0 for r in rows) and kl < 0.05,
            "decoding": graphed.decoding, "params": s["params"], "weights_gb": weights_gb, "prompt": sc["prompt"],
            "max_new_tokens": sc["new"], "batches": rows, "mismatch_kl": kl, "mismatch_abs": gap}


def random_prompts(n: int, sc: dict) -> list[list[int]]:
    """Distinct random prompts: neither the sampler's nor the trainer's sharing of identical prefixes applies."""
    return torch.randint(3, sc["vocab"], (n, sc["prompt"]), generator=torch.Generator().manual_seed(n)).tolist()


def decode(sampler: Sampler, prompts, new: int, budget_s: float) -> tuple[float, float, list[Request]]:
    """`sampler` on `prompts` (all joining at once, no stop token, `new` tokens or as many as `budget_s` allows):
    seconds of its first step (the prefill and every request's first token), seconds of the decode steps after it,
    and the requests."""
    reqs = [Request(p, new, False, i) for i, p in enumerate(prompts)]
    sampler.pending += reqs
    t0 = time.perf_counter()
    sampler.step()  # each step ends in .tolist() of its samples: the device has finished it
    t1 = time.perf_counter()
    while sampler.active and time.perf_counter() - t0 < budget_s:
        sampler.step()
    sampler.active, sampler.cache, sampler.mask = [], None, None  # what the budget cut off ends here
    sampler.parked.clear()  # the finished requests' keys/values, kept for next turns that never come
    return t1 - t0, time.perf_counter() - t1, reqs


def generate(model, prompts, new: int) -> float:
    """Seconds of plain transformers `generate` on the same batch, sampling from the full distribution."""
    ids = torch.tensor(prompts, device=model.device)
    t0 = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                   do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    sync(model.device)
    return time.perf_counter() - t0


def episodes(reqs: list[Request], prompts) -> list[Episode]:
    """The samples as the engine's episodes, groups of GROUP; half of each group rewarded, so all have an advantage."""
    return [Episode(seed=i, group=i // GROUP, token_ids=p + r.ids, is_action=[False] * len(p) + [True] * len(r.ids),
                    logprobs=[0.0] * len(p) + r.logprobs, versions=[-1] * len(p) + r.versions, reward=float(i % 2),
                    info={"success": False, "entropy": 0.0, "tool_calls": 0, "turns": 1})
            for i, (r, p) in enumerate(zip(reqs, prompts))]


@torch.no_grad()
def mismatch(model, eps: list[Episode], device, chunk: int) -> tuple[float, float]:
    """The update's mismatch_kl (k3) and mismatch_abs over all sampled tokens: the trainer's log-probs (fp32 weights,
    bf16 autocast, as train_step computes them) against those the bf16 sampler recorded."""
    kl = gap = tokens = 0.0
    for i in range(0, len(eps), chunk):
        batch = to_device(collate(eps[i:i + chunk], pad_id=0), device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logp = token_logprobs(model, batch, 1.0)
        mask = batch["action_mask"]
        kl += float(torch.where(mask, kl_penalty(batch["behav_logp"], logp, "k3"), 0.0).sum())
        gap += float(torch.where(mask, (logp - batch["behav_logp"]).abs(), 0.0).sum())
        tokens += float(mask.sum())
    return kl / tokens, gap / tokens


def check_trainer(args, s):
    device, sc, model = torch.device(args.device), args.scale, s["model"]
    groups = [s["episodes"][i:i + GROUP] for i in range(0, len(s["episodes"]), GROUP)]
    cfg = RunConfig.model_validate({"env": "max_digit", "model": {"dtype": "bfloat16"},
                                    "loop": {"groups_per_step": len(groups), "group_size": GROUP}})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    published = {k: v.detach().clone() for k, v in model.state_dict().items()}  # reloaded only if the breaker trips
    s["groups"], s["cfg"], s["published"] = groups, cfg, published
    s["update"] = functools.partial(train_step, model, optimizer, groups, cfg, breaker=Breaker(cfg.breaker),
                                    published=published, pad_id=0)
    lengths = [len(e.token_ids) for g in groups for e in g]
    flops = 6 * s["params"] * sum(lengths) + 6 * sc["layers"] * sc["hidden"] * sum(n * n for n in lengths)
    rows, s["need_gb"] = [], {}
    for micro in (None, sc["micro"]):
        s["update"](step=0, micro_batch_size=micro)  # warm-up (AdamW's state appears here)
        sync(device)
        base = torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0
        peak_gb(device)
        t0 = time.perf_counter()
        metrics = s["update"](step=1, micro_batch_size=micro)[0]
        sync(device)
        seconds, peak = time.perf_counter() - t0, peak_gb(device)
        s["need_gb"][micro] = peak - base  # what the step itself takes beyond what was there before it
        s["update_seconds"] = seconds  # the last: micro-batches, as the trl check's engine step
        rows.append({"micro_batch_size": micro, "tokens_per_s": sum(lengths) / seconds, "step_seconds": seconds,
                     "mfu": flops / seconds / (args.peak_tflops * 1e12) if args.peak_tflops else None,
                     "peak_gb": peak, "grad_norm": metrics["grad_norm"], "mismatch_kl": metrics["mismatch_kl"]})
    return {"ok": all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in rows), "episodes": len(lengths),
            "tokens": sum(lengths), "flops_per_step": flops, "runs": rows}


def check_two_jobs(args, s):
    sc = args.scale

    async def sample(with_trainer: bool) -> tuple[float, list[float]]:
        # the run's decode path: on CUDA its graphs are captured while the trainer's thread uses the GPU
        sampler = Sampler(s["sampler_model"], stop_ids=[], pad_id=0, temperature=1.0, cuda_graphs=True)
        stop, steps = [], []
        runner = asyncio.create_task(sampler.run())

        async def trainer():  # the engine's trainer coroutine: each update in a worker thread
            while not stop:
                t0 = time.perf_counter()
                await asyncio.to_thread(s["update"], step=len(steps), micro_batch_size=sc["micro"])
                steps.append(time.perf_counter() - t0)

        job = asyncio.create_task(trainer()) if with_trainer else None
        t0 = time.perf_counter()
        reqs = [asyncio.create_task(sampler.generate(p, sc["new"], seed=i)) for i, p in enumerate(s["prompts"])]
        await asyncio.wait(reqs, timeout=sc["budget_s"])  # all done, or the tokens sampled so far
        seconds, tokens = time.perf_counter() - t0, sampler.stats["tokens"]
        stop.append(True)
        for task in [*reqs, runner]:
            task.cancel()
        if job:
            await job
        return tokens / seconds, steps

    alone, _ = asyncio.run(sample(False))
    shared, steps = asyncio.run(sample(True))
    tokens = sum(len(e.token_ids) for g in s["groups"] for e in g)
    return {"ok": alone > 0 and shared > 0 and len(steps) > 0, "requests": len(s["prompts"]),
            "sampler_tokens_per_s_alone": alone, "sampler_tokens_per_s_with_trainer": shared,
            "slowdown": alone / shared, "trainer_steps_meanwhile": len(steps),
            "trainer_tokens_per_s_meanwhile": tokens / statistics.mean(steps)}


def check_oom(args, s):
    device = torch.device(args.device)
    if device.type != "cuda":
        return {"ok": None, "skipped": "needs CUDA: torch.cuda.set_per_process_memory_fraction caps GPU memory only, "
                                       "and a CPU has no allocator limit to run into"}
    device = torch.device("cuda", torch.cuda.current_device()) if device.index is None else device  # the cap needs one
    model, groups, cfg, published, need = s["model"], s["groups"], s["cfg"], s["published"], s["need_gb"]
    model.load_state_dict(published)
    torch.cuda.empty_cache()
    # Room for the step between what a micro-batch needs and what the whole batch needs: the whole batch can't fit.
    cap = torch.cuda.memory_allocated(device) / 1e9 + (need[None] + need[args.scale["micro"]]) / 2
    total = torch.cuda.get_device_properties(device).total_memory / 1e9
    common = dict(cfg=cfg, step=0, published=published, pad_id=0)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    try:
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)
        (_, split, _, _), fitted = train_step_fitting(model, sgd, groups, breaker=Breaker(cfg.breaker),
                                                      micro_batch_size=None, **common)
        # The step to compare with runs uncapped: `split` (a copy of the weights) now takes some of the room.
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        model.load_state_dict(published)
        _, direct, _, _ = train_step(model, sgd, groups, breaker=Breaker(cfg.breaker), micro_batch_size=fitted,
                                     **common)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        model.load_state_dict(published)
    diff = max(float((split[k] - direct[k]).abs().max()) for k in split)
    update = max(float((direct[k] - published[k]).abs().max()) for k in direct)
    return {"ok": fitted is not None and fitted < len(s["episodes"]) and diff <= 1e-2 * update,
            "cap_gb": cap, "whole_batch_needs_gb": need[None], "micro_batch_needs_gb": need[args.scale["micro"]],
            "episodes": len(s["episodes"]), "micro_batch_that_fit": fitted, "max_abs_diff": diff,
            "max_abs_update": update}


def check_trl(args, s):
    """TRL's GRPOTrainer (its transformers generation: vLLM cannot be installed where this runs) on the sampler
    check's shape and batch: 8 prompts of `prompt` random tokens x 8 completions of exactly `new` tokens, bf16, AdamW,
    no KL; seconds per step and rollout tokens/s, median over steps after the first. The engine's step on the same
    batch: the sampler check's 64 requests (its decode path) plus the trainer check's update (micro-batches)."""
    if torch.device(args.device).type != "cuda":
        return {"ok": None, "skipped": "needs CUDA: TRL's GRPOTrainer is measured on a GPU only"}
    try:
        import trl
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        return {"ok": None, "skipped": f"trl is not installed here ({e})"}
    import tempfile
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, TrainerCallback

    device, sc, steps = torch.device(args.device), args.scale, 4
    # A word per token id ("t0" .. "t151935"): prompts tokenize to exactly the ids the engine's sampler ran on
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(sc["vocab"])}, unk_token="t2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")
    prompts = [" ".join(f"t{i}" for i in p) for p in random_prompts(GROUP * steps, sc)]
    step_s, rollout_s = [], []

    class Steps(TrainerCallback):
        def on_step_begin(self, *_, **__):
            sync(device)
            step_s.append(-time.perf_counter())

        def on_step_end(self, *_, **__):
            sync(device)
            step_s[-1] += time.perf_counter()

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, bf16=True, report_to=[], disable_tqdm=True, save_strategy="no",
                            max_steps=steps, logging_steps=1, per_device_train_batch_size=GROUP * GROUP,
                            num_generations=GROUP, steps_per_generation=1, num_iterations=1, shuffle_dataset=False,
                            max_completion_length=sc["new"], generation_kwargs={"min_new_tokens": sc["new"]},
                            temperature=1.0, top_p=1.0, top_k=0, beta=0.0, learning_rate=1e-6,
                            gradient_checkpointing=False, optim="adamw_torch")
        trainer = GRPOTrainer(model=copy.deepcopy(s["model"]), args=config, processing_class=tokenizer,
                              reward_funcs=lambda completions, **_: [float(i % 2) for i in range(len(completions))],
                              train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[Steps()])
        generate_batch = trainer._generate  # TRL's rollout (a private method: the one place generation happens)

        def timed(*a, **kw):
            sync(device)
            t0 = time.perf_counter()
            result = generate_batch(*a, **kw)
            sync(device)
            rollout_s.append(time.perf_counter() - t0)
            return result
        trainer._generate = timed
        trainer.train()
    tokens = GROUP * GROUP * sc["new"]
    trl_step, trl_rollout = statistics.median(step_s[1:]), statistics.median(rollout_s[1:])
    ours_rollout = s["rollout"][0] * sc["new"] / s["rollout"][1]  # at `new` tokens, had the budget cut it
    ours_step = ours_rollout + s["update_seconds"]
    return {"ok": True, "trl": trl.__version__, "steps": len(step_s), "completions_per_step": GROUP * GROUP,
            "new_tokens": sc["new"], "trl_step_seconds": trl_step, "trl_rollout_tokens_per_s": tokens / trl_rollout,
            "ours_step_seconds": ours_step, "ours_rollout_tokens_per_s": tokens / ours_rollout,
            "step_speedup": trl_step / ours_step, "rollout_speedup": trl_rollout / ours_rollout}


def watch_panel(readings: list, stop: threading.Event):
    """The machine panel's numbers (app/pages.py machine_gpus) every 0.5 s until `stop`; an error string if none."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as e:  # no driver (a CPU machine), or no nvidia-ml-py
        readings.append(f"{type(e).__name__}: {e}")
        return
    try:
        readings.append({"driver": pynvml.nvmlSystemGetDriverVersion()})
        while not stop.wait(0.5):
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                readings.append({"index": i, "name": pynvml.nvmlDeviceGetName(handle),
                                 "util": pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                                 "used_gb": memory.used / 1e9, "total_gb": memory.total / 1e9})
    finally:
        pynvml.nvmlShutdown()


def check_machine_panel(args, s):
    readings = s["panel"]
    if readings and isinstance(readings[0], str):
        if torch.device(args.device).type == "cuda":
            return {"ok": False, "error": f"nvidia-ml-py read nothing on a GPU run: {readings[0]}"}
        return {"ok": None, "skipped": f"unavailable: no NVIDIA driver on this machine ({readings[0]})"}
    gpus = [r for r in readings if "util" in r]
    return {"ok": len(gpus) > 0, "driver": readings[0]["driver"] if readings else None, "readings": len(gpus),
            "gpus": sorted({r["name"] for r in gpus}), "util_mean": statistics.mean(r["util"] for r in gpus),
            "util_max": max(r["util"] for r in gpus), "used_gb_max": max(r["used_gb"] for r in gpus),
            "total_gb": gpus[0]["total_gb"]}


# Qwen2.5's published shapes (vocabulary, tied embeddings as released) for the ladder, and a toy one for --tiny.
LADDER = {"0.5B": dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151_936, tied=True),
          "1.5B": dict(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151_936, tied=True),
          "3B": dict(layers=36, hidden=2048, intermediate=11008, heads=16, kv_heads=2, vocab=151_936, tied=True),
          "7B": dict(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152_064, tied=False)}
TINY_LADDER = {"toy": dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=2048, tied=True)}


def check_ladder(args, s):
    """For each shape, mode (full: fp32 weights and AdamW, bf16 autocast, as the engine trains; full_bf16: bf16
    weights, AdamW's moments bf16 too, 8 bytes a parameter; lora16: LoRA r=16 on every linear layer of the decoder)
    and activation checkpointing off/on: does one GRPO step of 64 episodes x 1,024 tokens (groups of 8; 256 prompt
    tokens) fit beside the sampler's bf16 copy and the published weights, at which micro-batch size
    (train_step_fitting halves it from the whole batch), its tokens/s, MFU ((6 N, LoRA 4 N) tokens + causal
    attention 6 L d sum(len^2), over --peak-tflops) and peak memory; and, per shape, the sampler's decode tokens/s at
    128 requests (256-token prompts, 128 new tokens or 20 s)."""
    device = torch.device(args.device)
    if device.type != "cuda" and not args.tiny:
        return {"ok": None, "skipped": "needs CUDA (or --tiny: a toy shape)"}
    episodes_n, length, prompt, new = (16, 48, 16, 8) if args.tiny else (64, 1024, 256, 128)
    runs = []
    for name, shape in (TINY_LADDER if args.tiny else {k: LADDER[k] for k in args.ladder}).items():
        for mode in args.ladder_modes:
            for checkpointing in args.ladder_checkpointing:
                run = {"shape": name, "mode": mode, "checkpointing": checkpointing}
                try:
                    run.update(ladder_step(args, shape, mode, checkpointing == "on", episodes_n, length, prompt,
                                           new if not runs or runs[-1]["shape"] != name else 0))  # decode once
                except torch.OutOfMemoryError as e:  # at micro-batches of 1, or before the step
                    run.update(fits=False, error=str(e).splitlines()[0][:200])
                runs.append(run)
                print(json.dumps({"ladder": run}), file=sys.stderr, flush=True)  # a long check: progress
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return {"ok": all(not r["fits"] or r["grad_norm"] > 0 for r in runs) and any(r["fits"] for r in runs),
            "episodes": episodes_n, "tokens_per_episode": length, "runs": runs}


def ladder_step(args, shape, mode, checkpointing, episodes_n, length, prompt, new) -> dict:
    import peft
    device = torch.device(args.device)
    config = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], max_position_embeddings=4096,
                         tie_word_embeddings=shape["tied"], pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if mode == "full_bf16" else torch.float32)
    params = sum(p.numel() for p in model.parameters())
    sampler_model = copy.deepcopy(model).to(torch.bfloat16).eval()  # LoRA's merged copy: the same shape
    row = {}
    if new:
        prompts = random_prompts(128, {"vocab": shape["vocab"], "prompt": prompt})
        sampler = Sampler(sampler_model, [], 0, temperature=1.0,  # the run's decode path, as the sampler check's
                          cuda_graphs=True if device.type == "cuda" else "uncaptured")
        decode(sampler, prompts, 3, 20.0)  # captures the 128-row bucket: the timed run replays it
        _, decode_s, reqs = decode(sampler, prompts, new, 20.0)
        row["decode_tokens_per_s_128"] = 128 * (len(reqs[0].ids) - 1) / decode_s
    if mode == "lora16":
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    if checkpointing:  # as model.gradient_checkpointing does it (no dropout here: train mode changes nothing else)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train(checkpointing)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, shape["vocab"], (episodes_n // GROUP, prompt), generator=g).tolist()
    eps = [Episode(seed=i, group=i // GROUP, token_ids=prompts[i // GROUP] + torch.randint(
        3, shape["vocab"], (length - prompt,), generator=g).tolist(), is_action=[False] * prompt + [True] * (
        length - prompt), logprobs=[0.0] * length, versions=[0] * length, reward=float(i % 2),
        info={"success": False, "entropy": 0.0, "tool_calls": 0, "turns": 1}) for i in range(episodes_n)]
    groups = [eps[i:i + GROUP] for i in range(0, episodes_n, GROUP)]
    cfg = RunConfig.model_validate({"env": "max_digit", "model": {"dtype": "bfloat16"},
                                    "loop": {"groups_per_step": len(groups), "group_size": GROUP}})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    published = {k: v.detach().clone() for k, v in model.state_dict().items()}  # as the loop keeps them
    micro, timed = None, None
    for step in range(2):  # a warm-up (AdamW's state appears, the micro-batch size is found), then the timed one
        peak_gb(device)
        t0 = time.perf_counter()
        (metrics, *_), micro = train_step_fitting(model, optimizer, groups, cfg, step=step, published=published,
                                                  micro_batch_size=micro, breaker=Breaker(cfg.breaker), pad_id=0)
        sync(device)
        timed = time.perf_counter() - t0
    flops = ((4 if mode == "lora16" else 6) * params * episodes_n * length
             + 6 * shape["layers"] * shape["hidden"] * episodes_n * length ** 2)
    return {**row, "fits": True, "params": params, "micro_batch_size": micro, "tokens_per_s": episodes_n * length / timed,
            "mfu": flops / timed / (args.peak_tflops * 1e12) if args.peak_tflops else None,
            "peak_gb": peak_gb(device), "grad_norm": metrics["grad_norm"]}


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def peak_gb(device) -> float:
    """Peak memory: on a GPU, torch's allocated peak since the last call (then reset); on a CPU, the process's max RSS."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux; never reset


CHECKS = {"setup": check_setup, "learn": check_learn, "sampler": check_sampler, "trainer": check_trainer,
          "two_jobs": check_two_jobs, "oom": check_oom, "multiturn": check_multiturn, "trl": check_trl,
          "ladder": check_ladder, "machine_panel": check_machine_panel}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--tiny", action="store_true", help="toy scale: a small model, few tokens and steps (CPU tests)")
    p.add_argument("--out", default="gpu_proof.jsonl", help="where the JSON lines go (also printed)")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak for MFU (default: 989, an "
                   "H200's, on CUDA; none on a CPU)")
    p.add_argument("--seed", type=int, default=0, help="learn: the run's seed")
    p.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS),
                   help="run only these (trainer, two_jobs and oom use what sampler made)")
    p.add_argument("--ladder", nargs="+", choices=list(LADDER), default=list(LADDER), help="ladder: the shapes")
    p.add_argument("--ladder-modes", nargs="+", choices=["full", "full_bf16", "lora16"],
                   default=["full", "full_bf16", "lora16"], help="ladder: the ways to train")
    p.add_argument("--ladder-checkpointing", nargs="+", choices=["off", "on"], default=["off", "on"])
    args = p.parse_args()
    args.scale = TINY if args.tiny else FULL
    torch.set_num_threads(1)  # as in a run, on every thread but the updates' (Training sets it)
    if args.peak_tflops is None and torch.device(args.device).type == "cuda":
        args.peak_tflops = 989.0
    s, stop = {"panel": []}, threading.Event()
    panel = threading.Thread(target=watch_panel, args=(s["panel"], stop), daemon=True)
    panel.start()
    failed = False
    with open(args.out, "w") as out:
        for name in args.checks:
            t0 = time.perf_counter()
            if name == "machine_panel":  # the readings so far
                stop.set()
                panel.join()
            try:
                result = CHECKS[name](args, s)
            except Exception as e:  # the next check still runs
                result = {"ok": False, "error": f"{type(e).__name__}: {e}",  # and where, for a one-shot GPU run
                          "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in extract_tb(e.__traceback__)]}
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            line = json.dumps({"check": name, **result, "seconds": round(time.perf_counter() - t0, 3)})
            print(line, flush=True)
            out.write(line + "\n")
            out.flush()
            failed |= result["ok"] is False
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
