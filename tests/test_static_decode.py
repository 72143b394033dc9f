"""The static-shape decode path (the CUDA graphs' step, uncaptured on the CPU) at real lengths: the same tokens as the
eager path, buffers as wide as the cache really grows, and a failing step that fails its requests instead of leaving
them waiting."""
import asyncio
import copy
import threading
import weakref
from concurrent.futures import Future

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from molt_engine.config import ModelConfig
from molt_engine.inference.sampler import Request, Sampler, decoding
from molt_engine.inference.sampler_process import SamplerProcess
from molt_engine.inference.static import bucket
from molt_engine.models import load_policy

# The bound that docs/inference.md states: fp32 log-probs of the two paths differ by rounding only (the static step's
# softmax sums over the whole masked buffer, the eager one over the written positions).
LOGPROB_BOUND = 1e-5
STOP = 7


def tiny_model():
    """A random 2-layer Llama, small enough that contexts of 2k+ tokens prefill and decode in seconds."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=None, eos_token_id=STOP)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def tokens(n: int, seed: int) -> list[int]:
    """n token ids that are neither padding nor the stop token."""
    return (torch.randint(8, 64, (n,), generator=torch.Generator().manual_seed(seed))).tolist()


def drive(model, static: bool, script: dict, after: dict) -> tuple[dict, Sampler, list]:
    """Step a sampler through `script` (step -> requests to add or versions to publish) and `after` (a request's
    name -> requests added once it finished: an episode's next turn) until it is idle. Returns each request's tokens,
    log-probs and versions, the sampler, and the rows of every step."""
    sampler = Sampler(copy.deepcopy(model), [STOP], 0, temperature=1.0, cuda_graphs="uncaptured" if static else False)
    assert sampler.decoding == ("static shapes" if static else "eager")
    sampler.swap_wait = 2
    reqs, rows, step, ready = {}, [], 0, []
    while step <= max(script) or sampler.active or sampler.pending or sampler.new_weights or ready:
        for kind, *args in script.get(step, []) + ready:
            if kind == "publish":
                sampler.publish(*args)
            else:
                name, context, max_tokens, greedy, seed = args
                reqs[name] = Request(context(reqs) if callable(context) else context, max_tokens, greedy, seed,
                                     future=Future())
                sampler.pending.append(reqs[name])
        ready = [action for r in sampler.step() for name, req in reqs.items() if req is r
                 for action in after.get(name, [])]
        rows.append(len(sampler.active))
        step += 1
    return {name: (r.ids, r.logprobs, r.versions) for name, r in reqs.items()}, sampler, rows


def assert_same(eager: dict, static: dict):
    assert eager.keys() == static.keys()
    for name, (ids, logprobs, versions) in eager.items():
        assert static[name][0] == ids and static[name][2] == versions, name
        assert static[name][1] == pytest.approx(logprobs, abs=LOGPROB_BOUND), name


def test_a_parked_turn_joining_beside_a_longer_fresh_prompt_fits_the_static_buffers():
    """The issue's case: a 300-token context decodes 16 tokens; its next turn (those and 100 feedback tokens, 64 to
    decode) starts from its parked row and joins beside a fresh 200-token prompt. The parked row is padded in its
    middle to the fresh prompt's width, so the cache (515 columns, then 64 more) outgrows buffers sized by the longest
    request (416 + 64 -> 512 positions): the static path raised a shape error there."""
    model = tiny_model()
    script = {0: [("add", "first", tokens(300, 1), 16, False, 1)]}
    after = {"first": [("add", "next", lambda reqs: reqs["first"].context + reqs["first"].ids + tokens(100, 2), 64,
                        False, 2), ("add", "fresh", tokens(200, 3), 64, False, 3)]}
    eager, _, _ = drive(model, False, script, after)
    assert len(eager["first"][0]) == 16  # the scenario ran as described: no stop token cut the first turn short
    static, sampler, _ = drive(model, True, script, after)
    assert_same(eager, static)
    assert sampler.static.length >= 515 + 63  # the buffers span the padded row and the tokens it decodes


def test_two_thousand_token_contexts_decode_the_same_tokens_on_both_paths():
    """Contexts of 2k+ tokens: two requests sharing a row then diverging, a greedy one, one whose max_tokens is 1
    (done at its prefill), short ones that stop early; a version published while they decode (their rows
    recomputed); fresh prompts joining mid-decode; each long request's next turn starting from its parked row beside
    a longer fresh prompt (padding in its middle); rows finishing at different steps, so the bucket goes up and down."""
    model = tiny_model()
    long, other = tokens(2100, 10), tokens(2050, 11)
    new = {k: v + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items()}
    script = {0: [("add", "a", long, 24, False, 1), ("add", "b", long, 40, False, 2),
                  ("add", "greedy", other, 30, True, 0), ("add", "one", tokens(2200, 12), 1, False, 3),
                  ("add", "short", tokens(40, 13), 6, False, 4)],
              3: [("publish", new, 1)],
              8: [("add", "join", tokens(2300, 14), 12, False, 5), ("add", "join2", tokens(900, 15), 20, True, 0)]}
    turn = lambda name, seed: lambda reqs: reqs[name].context + reqs[name].ids + tokens(150, seed)  # noqa: E731
    after = {"a": [("add", "a2", turn("a", 20), 30, False, 6), ("add", "wide", tokens(2600, 21), 8, False, 7)],
             "greedy": [("add", "greedy2", turn("greedy", 22), 16, True, 0)]}
    eager, _, rows = drive(model, False, script, after)
    static, sampler, static_rows = drive(model, True, script, after)
    assert_same(eager, static)
    assert static_rows == rows
    # what the scenario must have exercised
    assert min(len(c) for c in (long, other)) > 2000
    # a2's parked row, padded in its middle to the 2,600-token prompt beside it, spans more than 4,096 columns, which
    # neither of them alone would (2,274 + 30, 2,600 + 8)
    assert sampler.static.length == 8192
    assert len(eager["one"][0]) == 1
    assert any(ids[-1] == STOP and len(ids) < n for (ids, _, _), n in zip(eager.values(), (24, 40, 30, 1, 6)))
    assert len(eager["a"][0]) == 24 and eager["a"][0] != eager["b"][0][:24]  # shared a row, then diverged
    assert 0 in eager["b"][2] and 1 in eager["b"][2]  # the swap came in the middle of its decoding
    assert tuple(long + eager["a"][0][:-1]) in sampler.parked  # a2 started from a's parked row
    buckets = [bucket(n) for n in rows if n]
    assert any(x < y for x, y in zip(buckets, buckets[1:])) and any(x > y for x, y in zip(buckets, buckets[1:]))


def test_the_environment_switch_puts_every_dense_sampler_on_the_static_path(monkeypatch):
    """MOLT_STATIC_DECODE=1 (CI's second pass of the rollout tests): the static step uncaptured, whatever
    loop.cuda_graphs says; MoE policies keep their eager steps (their routes are read per step)."""
    dense, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    moe, _ = load_policy(ModelConfig(preset="tiny-moe"), seed=1)
    assert [decoding(dense, flag) for flag in (True, False)] == ["eager", "eager"]
    monkeypatch.setenv("MOLT_STATIC_DECODE", "1")
    assert [decoding(dense, flag) for flag in (True, False)] == ["static shapes", "static shapes"]
    assert decoding(moe, True) == "eager"
    assert Sampler(dense, [], 0, temperature=1.0).static.capture is False


@pytest.mark.parametrize("process", [False, True])
def test_a_failing_step_fails_every_waiting_request_and_the_run_at_once(process):
    """A step that raises (here: a request with a token the model has no embedding for, at its prefill) fails every
    request waiting on the sampler with that error, and the sampler's run with it, instead of leaving the decoding
    ones waiting for tokens that never come."""
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)

    async def main():
        kw = dict(stop_ids=[], pad_id=0, temperature=1.0, cuda_graphs="uncaptured")
        sampler = SamplerProcess(model, **kw) if process else Sampler(copy.deepcopy(model), **kw)
        run = asyncio.create_task(sampler.run())
        decoding = [asyncio.create_task(sampler.generate([3, 4, 5], 2000, seed=i)) for i in range(2)]
        while not (process or sampler.active):  # in-process: they decode (a child's requests cross a pipe first)
            await asyncio.sleep(0.01)
        bad = asyncio.create_task(sampler.generate([3, model.config.vocab_size + 5], 4, seed=9))
        return await asyncio.wait_for(asyncio.gather(run, *decoding, bad, return_exceptions=True), 60)
    outcomes = asyncio.run(main())
    assert all(isinstance(o, Exception) for o in outcomes), outcomes
    assert all("index out of range" in str(o) for o in outcomes), outcomes


def test_a_request_submitted_while_a_step_admits_others_is_decoded_not_lost():
    """generate() appends on the event loop's thread while a step, on another thread, admits the pending requests
    (the static path looks each one up among the parked rows): the request submitted meanwhile still decodes. The step
    once wrote back the requests it had read and dropped this one, whose caller then waited forever (found by the
    multi-turn bench's 2,048 final episodes on the static path, which hung every time)."""
    sampler = Sampler(tiny_model(), [STOP], 0, temperature=1.0, cuda_graphs="uncaptured")
    admitting, submitted, lookup = threading.Event(), threading.Event(), sampler._parked

    def parked(req):  # the first admission waits, inside its step, until the loop has submitted another request
        if not admitting.is_set():
            admitting.set()
            assert submitted.wait(60)
        return lookup(req)
    sampler._parked = parked

    async def main():
        run = asyncio.create_task(sampler.run())
        first = asyncio.create_task(sampler.generate(tokens(20, 1), 8, seed=1))
        await asyncio.to_thread(admitting.wait, 60)
        late = asyncio.create_task(sampler.generate(tokens(20, 2), 8, seed=2))
        while not any(r.seed == 2 for r in sampler.pending):  # the task's first step submits it
            await asyncio.sleep(0)
        submitted.set()
        try:
            return await asyncio.wait_for(asyncio.gather(first, late), 60)
        finally:
            run.cancel()
    first, late = asyncio.run(main())
    assert len(first.ids) >= 1 and len(late.ids) >= 1 and late.context == tokens(20, 2)


def test_larger_buffers_are_allocated_only_after_the_old_ones_are_freed(monkeypatch):
    """On a device, old buffers beside the larger new ones would be the largest moment of the run: every buffer the
    static step made is dead by the time a larger one is made (the issue's case grows them)."""
    from molt_engine.inference import static
    alive_at_growth, allocations = [], []  # allocations: (shape, weak references to its keys and values)

    class Watched(static.StaticLayer):
        def __init__(self, keys, values, column):
            if not allocations or allocations[-1][0] != keys.shape:  # the first layer of a new allocation
                alive_at_growth.append(sum(ref() is not None for _, refs in allocations for ref in refs))
                allocations.append((keys.shape, []))
            allocations[-1][1].extend([weakref.ref(keys), weakref.ref(values)])
            super().__init__(keys, values, column)
    monkeypatch.setattr(static, "StaticLayer", Watched)
    model = tiny_model()
    script = {0: [("add", "first", tokens(300, 1), 16, False, 1)]}
    after = {"first": [("add", "next", lambda reqs: reqs["first"].context + reqs["first"].ids + tokens(100, 2), 64,
                        False, 2), ("add", "fresh", tokens(200, 3), 64, False, 3)]}
    eager, _, _ = drive(model, False, script, after)
    static_run, _, _ = drive(model, True, script, after)
    assert_same(eager, static_run)  # the copies out and back in change no token
    assert len(alive_at_growth) >= 2 and alive_at_growth == [0] * len(alive_at_growth), alive_at_growth
