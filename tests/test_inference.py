"""The inference package: the engine imports and trains without the serving stack; the static-shape decode path
decodes exactly as the eager sampler does; the sampler process's run ends as its caller asked."""
import asyncio
import copy
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from molt_engine import NullSink, train
from molt_engine.config import ModelConfig
from molt_engine.inference.sampler import Request, Sampler
from molt_engine.inference.sampler_process import SamplerProcess
from molt_engine.inference.static import StaticDecode, bucket, free_tokens, positions
from molt_engine.models import char_tokenizer, load_policy

SERVING = ("fastapi", "uvicorn", "openai", "httpx")


def test_the_engine_imports_and_trains_a_non_agent_run_without_the_serving_stack():
    script = ("import sys, molt_engine\n"
              f"loaded = [m for m in {SERVING!r} if m in sys.modules]\n"
              "molt_engine.train({'env': 'max_digit', 'loop': {'steps': 1, 'groups_per_step': 2, 'group_size': 2,"
              " 'eval_every': 0}, 'warm_start': {'steps': 0}})\n"
              f"print(loaded, [m for m in {SERVING!r} if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[] []"


def test_a_cancelled_request_stays_cancelled_when_the_sampler_process_is_gone():
    """Cancelling a request tells the child to drop it; a child already dead must not turn the cancellation into
    its own error (the caller awaits a cancellation, e.g. an episode's timeout)."""
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)

    async def main():
        sampler = SamplerProcess(model, stop_ids=[], pad_id=char_tokenizer().pad_token_id, temperature=1.0)
        request = asyncio.create_task(sampler.generate([3, 4, 5], 400, seed=1))
        await asyncio.sleep(0)  # its "generate" is sent
        sampler.process.kill()
        await asyncio.to_thread(sampler.process.join)
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        return request
    assert asyncio.run(main()).cancelled()


def test_a_sampler_process_that_does_not_stop_is_killed_without_blocking_the_event_loop():
    """The run's end joins the child on a thread, for `stop_timeout` seconds, then kills it: the event loop keeps
    serving its other tasks meanwhile, and no child outlives the run."""
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    ticks = []

    async def main():
        sampler = SamplerProcess(model, stop_ids=[], pad_id=char_tokenizer().pad_token_id, temperature=1.0)
        sampler.stop_timeout = 1.0
        run = asyncio.create_task(sampler.run())
        os.kill(sampler.process.pid, signal.SIGSTOP)  # a child that never reads its "stop"

        async def tick():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)
        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.1)
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        ticker.cancel()
        return sampler.process, run
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(asyncio.run(main())), daemon=True)
    thread.start()
    thread.join(60)
    process, run = outcome[0]  # an event loop blocked in join() would never have finished
    assert run.cancelled() and not process.is_alive()
    assert len(ticks) >= 10  # the loop ran its ticker through the second the child had to leave


def decode(model, cuda_graphs, script: dict) -> tuple[dict, Sampler, list]:
    """Drive a sampler step by step through `script` (step -> actions: add a request, publish a version, cancel a
    request) until it is idle: each request's tokens, log-probs and versions, the sampler, the rows of each step."""
    sampler = Sampler(copy.deepcopy(model), [STOP], 0, temperature=1.0, cuda_graphs=cuda_graphs)
    sampler.swap_wait = 2  # a swap while rows decode comes after 2 steps: few steps see everything
    reqs, rows, step = {}, [], 0
    while step <= max(script) or sampler.active or sampler.pending or sampler.new_weights:
        for kind, *args in script.get(step, []):
            if kind == "add":
                name, context, max_tokens, greedy, seed = args
                context = context(reqs) if callable(context) else context
                reqs[name] = Request(list(context), max_tokens, greedy, seed, future=Future())
                sampler.pending.append(reqs[name])
            elif kind == "publish":
                sampler.publish(*args)
            else:  # its caller gave up
                reqs[args[0]].future.cancel()
        sampler.step()
        rows.append(len(sampler.active))
        step += 1
    return {name: (r.ids, r.logprobs, r.versions) for name, r in reqs.items()}, sampler, rows


STOP = 61
PROMPT = [3, 4, 6, 7]


def scenario(model) -> dict:
    """Two requests on one row (same context) that diverge, a greedy one (an eval's), a short one; a version
    published while they decode; two requests joining mid-decode; one cancelled; the first request's next turn (its
    context: the first turn's, its tokens and two more), which starts from the first turn's parked keys/values."""
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    return {0: [("add", "a", PROMPT, 6, False, 1), ("add", "b", PROMPT, 10, False, 2),
                ("add", "greedy", PROMPT + [9], 12, True, 0), ("add", "short", [9, 8], 3, False, 3)],
            2: [("publish", new, 1)],
            4: [("add", "join", [12, 13, 14, 15, 16], 8, False, 4), ("add", "gone", PROMPT, 12, False, 5)],
            6: [("cancel", "gone")],
            8: [("add", "next_turn", lambda reqs: reqs["a"].context + reqs["a"].ids + [20, 21], 6, False, 6)]}


def assert_same_decoding(model, cuda_graphs):
    torch.manual_seed(0)
    script = scenario(model)
    eager, _, _ = decode(model, False, script)
    static, sampler, rows = decode(model, cuda_graphs, script)
    assert sampler.decoding == ("CUDA graphs" if cuda_graphs is True else "static shapes")
    for name, (ids, logprobs, versions) in eager.items():
        assert static[name][0] == ids and static[name][2] == versions, name
        # Equal to rounding: the static step attends over the whole buffer (the mask hides the rest), the eager one
        # over the written positions only, so the softmax sums run in another order (the bound docs/inference.md
        # states, as tests/test_static_decode.py does).
        assert static[name][1] == pytest.approx(logprobs, abs=1e-5), name
    # what the scenario must have exercised
    assert 0 in eager["greedy"][2] and 1 in eager["greedy"][2]  # a swap in the middle of its decoding
    assert len(eager["gone"][0]) < 12 and eager["gone"][0][-1] != STOP  # cancelled in flight
    assert any(ids[-1] == STOP and len(ids) < n for (ids, _, _), n in zip(eager.values(), (6, 10, 12, 3, 8)))
    assert len({bucket(n) for n in rows if n}) >= 3  # rows finishing and joining change the bucket
    first_turn = tuple(PROMPT + eager["a"][0][:-1])
    assert first_turn in sampler.parked  # the next turn found the first one's keys and values there
    return sampler


def test_the_static_decode_step_decodes_exactly_as_the_eager_one_on_the_cpu():
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    assert_same_decoding(model, "uncaptured")


@pytest.mark.gpu
def test_the_captured_decode_step_decodes_exactly_as_the_eager_one_on_cuda():
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    sampler = assert_same_decoding(model.cuda(), True)
    assert sampler.static.graphs  # graphs were captured and replayed


def test_a_decode_step_runs_in_the_smallest_bucket_that_holds_its_rows():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 200, 256, 257, 512)] == [1, 2, 4, 4, 8, 256, 256, 512, 512]
    with pytest.raises(ValueError, match="513 rows are more than the largest decode bucket"):
        bucket(513)


def test_static_buffers_hold_as_many_rows_as_the_budget_allows_at_the_longest_requests_length():
    assert [positions(n) for n in (1, 64, 65, 300, 512, 513)] == [64, 64, 128, 512, 512, 1024]
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    text = model.config
    token_bytes = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 4
    sampler = Sampler(model, [], 0, temperature=1.0, kv_budget_gb=300 * token_bytes / 1e9, cuda_graphs="uncaptured")
    assert sampler.static.kv_tokens == 300
    assert [sampler.static.rows(n) for n in (10, 64, 100, 200, 400)] == [4, 4, 2, 1, 1]  # 300 // 64, 300 // 128, ...
    assert StaticDecode(model, 10**9, token_bytes, capture=False).rows(64) == 512  # the largest bucket at most
    # The sampler admits no more rows than the buffers hold: of 6 requests of 100 tokens, 2 decode, 4 wait
    sampler.pending = [Request([3] * 40, 60, False, seed) for seed in range(6)]
    joining, waiting = sampler._admit(sampler.pending)
    assert (len(joining), len(waiting)) == (2, 4)
    sampler.pending = joining
    sampler.step()  # their prefill
    sampler.step()  # a decode step: the buffers exist, 2 rows of 100 tokens rounded up to 128 positions
    assert [tuple(layer.buffers[0].shape) for layer in sampler.static.cache.layers][0] == \
        (2, text.num_key_value_heads, 128, text.head_dim)
    # Without a budget: a share of the memory free when requests first come
    unbudgeted = StaticDecode(model, None, token_bytes, capture=False)
    assert unbudgeted.kv_tokens is None and unbudgeted.rows(64) >= 1 and unbudgeted.kv_tokens > 0
    assert free_tokens(torch.device("cpu"), token_bytes) > 0
    assert Sampler(model, [], 0, temperature=1.0, cuda_graphs=True).decoding == "eager"  # the CPU: no CUDA graphs


class Events(NullSink):
    def __init__(self):
        self.events, self.steps = [], {}

    def event(self, kind, message, **data):
        self.events.append((kind, message))

    def metrics(self, step, values):
        self.steps[step] = values


@pytest.mark.gpu
@pytest.mark.parametrize("sampler_process", [False, True])
def test_a_run_on_cuda_decodes_with_cuda_graphs_beside_its_trainer(sampler_process):
    """max_staleness 1: the graphs are captured and replayed while the trainer's thread (or, with the sampler in a
    child process, the parent) uses the GPU; published versions reach the graphs in place."""
    sink = Events()
    summary = train({"env": "max_digit", "model": {"device": "cuda", "dtype": "bfloat16"}, "warm_start": {"steps": 5},
                     "loop": {"steps": 4, "groups_per_step": 4, "group_size": 4, "eval_every": 0, "max_staleness": 1,
                              "sampler_process": sampler_process}}, sink)
    assert summary["status"] == "completed"
    assert any(kind == "device" and message.endswith("CUDA graphs decoding") for kind, message in sink.events)
    assert max(v["staleness_max"] for v in sink.steps.values()) <= 1
    assert all(v["mismatch_kl"] < 1e-2 for v in sink.steps.values())  # the graphs sample what the trainer computes
