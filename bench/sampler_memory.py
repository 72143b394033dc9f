"""The sampler's peak memory on a large vocabulary: it must not grow with max_tokens x vocab.

    python bench/sampler_memory.py                             # vocab 150k, 8 requests, max_tokens 64 and 512

A random-init Llama with a 150k vocabulary and a small hidden size (so the weights stay small); each max_tokens
value runs in a fresh process, which decodes `--requests` sampled requests to max_tokens and reports its peak RSS
above the RSS before decoding (the model and the first step's buffers are already there).
"""
import argparse
import json
import resource
import subprocess
import sys
import time


def measure(vocab: int, requests: int, max_tokens: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from molt_engine.inference.sampler import Request, Sampler
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_tokens + 64,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    sampler = Sampler(LlamaForCausalLM(config), stop_ids=[1], pad_id=0, temperature=1.0)
    contexts = torch.randint(2, vocab, (requests, 8)).tolist()
    # One warm-up request, so that allocator pools and one-time buffers are in the baseline.
    sampler.pending.append(Request(contexts[0], 2, False, 0))
    while sampler.pending or sampler.active:
        sampler.step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reqs = [Request(c, max_tokens, False, i) for i, c in enumerate(contexts)]
    sampler.pending += reqs
    t0 = time.perf_counter()
    while sampler.pending or sampler.active:
        sampler.step()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"max_tokens": max_tokens, "tokens": sum(len(r.ids) for r in reqs), "peak_rss_mb": peak / 1024,
            "decode_peak_above_baseline_mb": (peak - before) / 1024, "seconds": seconds}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=150_000)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, nargs="+", default=[64, 512])
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one max_tokens in this process
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.vocab, args.requests, args.one)))
        return
    print(f"vocab {args.vocab}, {args.requests} requests; [max_tokens x vocab] float32 per request would be "
          f"{', '.join(f'{m * args.vocab * 4 / 2**20:.0f} MB at {m}' for m in args.max_tokens)}")
    print("| max_tokens | tokens decoded | peak RSS MB | decode peak above baseline MB | seconds |")
    print("|---|---|---|---|---|")
    for max_tokens in args.max_tokens:
        out = subprocess.run([sys.executable, __file__, "--vocab", str(args.vocab), "--requests", str(args.requests),
                              "--one", str(max_tokens)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {r['max_tokens']} | {r['tokens']} | {r['peak_rss_mb']:.0f} | "
              f"{r['decode_peak_above_baseline_mb']:.0f} | {r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
