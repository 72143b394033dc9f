"""The token-first contract's invariants: token, logprob and version consistency, proven on real runs."""
import asyncio
import copy
import multiprocessing
import os
import signal
import threading

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import molt_engine.loop as loop_mod
import molt_engine.update as update_mod
from molt_engine import Env, Observation, Result, register, train
from molt_engine.envs import ENVS
from molt_envs.builtin import Calculator, Shapes
from molt_engine.episode import Episode, _length_chunks, collate, token_logprobs
from molt_engine.models import PRESETS, char_tokenizer, load_policy
from molt_engine.config import ModelConfig
from molt_engine.inference.sampler import Request, Sampler
from molt_engine.inference.sampler_process import SamplerProcess

SMALL = {"groups_per_step": 2, "group_size": 4, "eval_every": 0}


@pytest.fixture
def capture(monkeypatch):
    """Record every batch the trainer collates and every generation the sampler returns."""
    seen = {"batches": [], "generations": [], "losses": [], "advantages": []}
    real_collate, real_generate, real_loss = update_mod.collate, Sampler.generate, update_mod.policy_loss

    def spy_collate(episodes, pad_id):
        batch = real_collate(episodes, pad_id)
        seen["batches"].append((episodes, batch))
        return batch

    async def spy_generate(self, context, max_tokens, **kw):
        req = await real_generate(self, context, max_tokens, **kw)
        seen["generations"].append(req)
        return req

    def spy_loss(logp, prox, behav, adv, mask, **kw):
        seen["losses"].append((logp.detach().clone(), behav.clone(), mask.clone()))
        seen["advantages"].append(adv.clone())
        return real_loss(logp, prox, behav, adv, mask, **kw)

    monkeypatch.setattr(update_mod, "collate", spy_collate)
    monkeypatch.setattr(Sampler, "generate", spy_generate)
    monkeypatch.setattr(update_mod, "policy_loss", spy_loss)
    return seen


@pytest.fixture
def registered():
    """Register test envs for one test: they leave the registry when it ends."""
    names = []
    yield lambda cls: names.append(register(cls).name)
    for name in names:
        del ENVS[name]


class Echo(Env):
    """Two turns; the feedback repeats the action as text, which a merging tokenizer encodes differently."""
    name = "test_echo"
    max_turns = 2
    max_tokens = 6

    async def reset(self, seed):
        return Observation("ab=")

    async def step(self, action):
        self.turn = getattr(self, "turn", 0) + 1
        return Result(reward=float(action.count("a")), observation=action + "=", terminated=self.turn == 2)

    def demonstration(self, seed):
        return ["a", "a"]


def merging_model_dir(tmp_path):
    """A tiny policy whose tokenizer has both 'a','b' and the merged 'ab': sampled [a][b] decodes to "ab",
    which re-encodes as [ab] — so any re-tokenization of generated text would show up."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "a": 3, "b": 4, "ab": 5, "=": 6}
    tok = Tokenizer(models.BPE(vocab, merges=[("a", "b")], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("=", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=7, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, eos_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    fast.save_pretrained(tmp_path)
    return fast



def action_runs(ep):
    """(start, end) of each maximal run of action tokens."""
    runs, p = [], 0
    while p < len(ep.token_ids):
        end = p
        while end < len(ep.token_ids) and ep.is_action[end] == ep.is_action[p]:
            end += 1
        if ep.is_action[p]:
            runs.append((p, end))
        p = end
    return runs


def trained_as_sampled(capture) -> list:
    """Check every row the trainer collated: each maximal run of action tokens is exactly one sampler generation,
    continuing exactly the context before it, with its recorded log-probs; and the batch's trained positions are those
    tokens, with those ids, and nothing else. Returns the rows, in training order."""
    generated = {}  # (context, ids) -> the log-probs of each generation that produced them
    for r in capture["generations"]:
        generated.setdefault((tuple(r.context), tuple(r.ids)), []).append(r.logprobs)
    rows = []
    for episodes, batch in capture["batches"]:
        for row, ep in enumerate(episodes):
            sampled = []
            for start, end in action_runs(ep):
                assert ep.logprobs[start:end] in generated[(tuple(ep.token_ids[:start]), tuple(ep.token_ids[start:end]))]
                sampled += ep.token_ids[start:end]
            assert batch["targets"][row][batch["action_mask"][row]].tolist() == sampled
            assert len(sampled) == ep.n_actions > 0
            rows.append(ep)
    return rows


def test_trained_tokens_are_exactly_the_sampled_tokens(tmp_path, capture, registered):
    registered(Echo)
    tokenizer = merging_model_dir(tmp_path)
    train({"env": "test_echo", "model": {"preset": None, "path": str(tmp_path)}, "loop": {**SMALL, "steps": 3},
           "warm_start": {"steps": 0}})
    rows = trained_as_sampled(capture)
    assert len(rows) == 3 * 2 * 4
    retokenized_differs = 0
    for ep in rows:
        for start, end in action_runs(ep):
            ids = [t for t in ep.token_ids[start:end] if t != tokenizer.eos_token_id]
            retokenized_differs += tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] != ids
    assert retokenized_differs > 0  # the hazard was really there


@pytest.mark.parametrize("process", [False, True], ids=["sampler in the loop's process", "sampler process"])
def test_on_policy_recomputed_logprobs_equal_recorded(capture, process):
    summary = train({"env": "calculator", "loop": {**SMALL, "steps": 4, "max_staleness": 0, "sampler_process": process},
                     "warm_start": {"steps": 3}})
    assert not multiprocessing.active_children()  # a sampler process ends with its run
    assert len(capture["losses"]) == 4
    for logp, behav, mask in capture["losses"]:
        assert mask.any()
        assert (logp[mask] - behav[mask]).abs().max() <= 1e-5
        ratio = torch.exp(logp[mask] - behav[mask])
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5)
    assert summary["staleness_max"] == 0


def test_a_sampler_process_samples_each_published_version_within_the_staleness_bound(capture):
    summary = train({"env": "calculator", "loop": {**SMALL, "steps": 6, "max_staleness": 1, "sampler_process": True},
                     "warm_start": {"steps": 3}})
    versions = [v for episodes, _ in capture["batches"] for e in episodes for v, a in zip(e.versions, e.is_action) if a]
    assert summary["status"] == "completed" and len(capture["batches"]) == 6
    # Batch k is sampled by versions k-1 and k: the child swapped the published weights in as they came
    assert summary["staleness_max"] <= 1 and min(versions) == 0 and max(versions) >= 4


@pytest.mark.parametrize("staleness", [0, 1])
def test_updates_run_on_one_thread_with_the_loops_torch_threads_which_decoding_shares_on_policy(monkeypatch, staleness):
    """One thread runs every update with loop.threads intra-op threads (one OpenMP team); on-policy the decode steps
    take turns on it, off-policy they run elsewhere on one thread; the loop's own thread keeps one."""
    seen, real_update, real_step = [], loop_mod.Training.update, Sampler.step

    def spy(kind, real):
        def call(self, *args):
            seen.append((kind, threading.current_thread().name, torch.get_num_threads()))
            return real(self, *args)
        return call

    monkeypatch.setattr(loop_mod.Training, "update", spy("update", real_update))
    monkeypatch.setattr(Sampler, "step", spy("step", real_step))
    train({"env": "calculator", "loop": {**SMALL, "steps": 3, "max_staleness": staleness, "threads": 2},
           "warm_start": {"steps": 0}})
    updates, steps = ({(name, n) for k, name, n in seen if k == kind} for kind in ("update", "step"))
    assert updates == {("molt-compute_0", 2)} and torch.get_num_threads() == 1
    assert steps == updates if staleness == 0 else all(n == 1 and name != "molt-compute_0" for name, n in steps)


def test_a_sampler_process_only_decodes_and_the_envs_episodes_run_in_the_loops_process(monkeypatch):
    """The child decodes; the training env's episodes run here, beside the trainer: their env steps (this process's
    patched one; a spawned child would run the original) and their injected env errors, counted as without a child."""
    pids, real_step = [], Calculator.step

    async def here(self, action):
        pids.append(os.getpid())
        return await real_step(self, action)

    monkeypatch.setattr(Calculator, "step", here)
    summary = train({"env": "calculator", "loop": {**SMALL, "steps": 3, "max_staleness": 1, "sampler_process": True},
                     "warm_start": {"steps": 0}, "drills": {"env_error_rate": 0.2}})
    assert summary["status"] == "completed" and summary["step"] == 3 and summary["env_errors"] > 0
    assert len(pids) > 0 and set(pids) == {os.getpid()}
    assert not multiprocessing.active_children()


def test_a_published_version_crosses_to_a_sampler_process_as_one_buffer_per_dtype():
    """Each storage crosses the pipe as a file descriptor of its own: the weights go as views of one buffer per dtype,
    equal to what was published (a transposed tensor and an integer buffer included)."""
    sent = []
    parent = type("Parent", (), {"send": lambda self, *message: sent.append(message)})()
    weights = {"a": torch.randn(3, 4), "b": torch.randn(5), "steps": torch.arange(6).view(2, 3),
               "c": torch.randn(2, 2).t()}
    SamplerProcess.publish(parent, weights, 7)
    (kind, views, version), = sent
    assert kind == "publish" and version == 7 and views.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(views[name], tensor) and views[name].dtype == tensor.dtype
    buffers = {(views[name].dtype, views[name].untyped_storage().data_ptr()) for name in weights}
    assert len(buffers) == 2 and {dtype for dtype, _ in buffers} == {torch.float32, torch.int64}  # were 4 storages


def test_a_dead_sampler_process_fails_the_run_naming_it():
    class Killer(loop_mod.NullSink):
        def metrics(self, step, values):  # after the first step: SIGKILL, as the kernel's OOM killer sends
            for child in multiprocessing.active_children() if step == 1 else []:
                os.kill(child.pid, signal.SIGKILL)

    with pytest.raises(RuntimeError, match=r"the sampler process exited \(code -9\)"):
        train({"env": "calculator", "loop": {**SMALL, "steps": 50, "sampler_process": True},
               "warm_start": {"steps": 0}}, Killer())
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("long_rows", [0, 5])
def test_shared_prefix_forward_equals_the_full_forward(long_rows):
    """token_logprobs runs each distinct prefix of a prompt's rows once (identical episodes; the columns a group's rows
    share from their start, here a prompt and a 100-token first turn), a tree at most four rows wide, and rows of far
    longer episodes in a chunk of their own: its log-probs and gradients are those of one full forward over the padded
    batch, for multi-turn episodes, prompts of different lengths, and same-length prompts that differ (rows share only
    what is really equal)."""
    tok = char_tokenizer()
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=3)
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    g = torch.Generator().manual_seed(0)
    reply = lambda n: torch.randint(3, tok.vocab_size, (n,), generator=g).tolist()
    first_turn, episodes = reply(100), []
    for group, prompt in enumerate(["Q 12+5\n"] * 4 + ["Q 7*8\n"] * 2 + ["Q 12+6\n"]):
        ep = Episode(seed=group, group=group)
        ep.extend(encode(prompt))
        later = [reply(int(torch.randint(1, 6, (1,), generator=g))) for _ in range(1 + group % 2)]
        turns = [first_turn] * (group < 4) + later  # "Q 12+5" rows all open with the same 100-token call
        for turn, actions in enumerate(turns):  # env feedback after each turn
            ep.extend(actions, action=True, logprobs=[0.0] * len(actions), versions=[0] * len(actions))
            ep.extend(encode(f"={turn}\n"))
        episodes.append(ep)
    episodes.insert(1, copy.deepcopy(episodes[0]))  # a group's episodes often sample the very same tokens
    for _ in range(long_rows):  # a group whose replies are 300 tokens: padding the others to them costs 3,000 positions
        episodes.append(Episode(seed=9, group=9))
        episodes[-1].extend(encode("Q 9*9\n"))
        episodes[-1].extend(reply(300), action=True, logprobs=[0.0] * 300, versions=[0] * 300)
    batch = collate(episodes, tok.pad_token_id)
    rows_seen = []
    hook = model.model.register_forward_pre_hook(lambda m, args, kw: rows_seen.append(tuple(kw["input_ids"].shape)),
                                                 with_kwargs=True)
    logp = token_logprobs(model.train(), batch, 1.0)
    hook.remove()
    mask = batch["action_mask"]
    logp[mask].sum().backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, :-1]
    full = torch.log_softmax(logits, -1).gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
    full[mask].sum().backward()
    # Trees, padded to the widest of their chunk: the "Q 12+5" rows (five episodes, two identical) run their prompt,
    # first turn and its feedback once, then their four distinct continuations; the two "Q 7*8" rows share their
    # prompt; "Q 12+6" shares only "Q 12+" with "Q 12+5", so it is a tree of its own. The 300-token rows: four in a
    # tree (their prompt once), the fifth in a tree of its own, as it would take the tree past four rows' width. Alone,
    # the short trees run as one forward; beside the long ones, "Q 12+5" goes in the chunk of the 306-token tree.
    common, lengths = 7 + 100 + 3, [len(e.token_ids) for e in episodes]
    q125, q78 = common + sum(n - common for n in lengths[1:5]), 6 + sum(n - 6 for n in lengths[5:7])
    assert rows_seen == ([(2, max(q78, lengths[7])), (2, 306), (1, 6 + 4 * 300)] if long_rows else [(3, q125)])
    assert torch.equal(logp[0], logp[1]) and (logp[0] != 0).any()
    split = batch["prompt_width"] - 1
    assert mask.sum() == sum(e.n_actions for e in episodes) and mask[:, :split].sum() == 0
    assert (logp[mask] - full[mask]).abs().max() <= 1e-5
    for shared, p in zip(shared_grads, model.parameters()):
        assert (shared - p.grad).abs().max() <= 1e-5 * p.grad.abs().max()  # float32 summation order only


def test_rows_go_in_the_length_chunks_that_cost_least():
    """Hand-computed, lengths 2, 2, 3 and 10: at 5 positions a forward, [2, 2, 3] and [10] (5 + 9 + 5 + 10 = 29) beat
    one chunk (45) and three (32); without a forward's cost, one chunk per length (17); at 50, one chunk (90)."""
    assert _length_chunks([10, 2, 3, 2], overhead=5) == [[1, 3, 2], [0]]
    assert _length_chunks([10, 2, 3, 2], overhead=0) == [[1, 3], [2], [0]]
    assert _length_chunks([10, 2, 3, 2], overhead=50) == [[1, 3, 2, 0]]


@pytest.mark.parametrize("turns", [1, 2])
def test_on_policy_recomputed_logprobs_equal_recorded_with_images(capture, turns):
    """The same invariant for a VLM: pixel values go with the prefill and with the trainer's forward, and the
    multi-turn variant's second image (brought by env feedback) travels in the record too."""
    summary = train({"env": "shapes", "env_args": {"turns": turns}, "model": {"preset": "tiny-vlm"},
                     "loop": {**SMALL, "steps": 3, "max_staleness": 0}, "warm_start": {"steps": 3}})
    assert len(capture["losses"]) == 3
    for logp, behav, mask in capture["losses"]:
        assert mask.any()
        assert (logp[mask] - behav[mask]).abs().max() <= 1e-5
    image_token = len(char_tokenizer())  # one past the char vocabulary
    vision = PRESETS["tiny-vlm"](image_token).vision_config
    tokens_per_image = (vision.image_size // vision.patch_size) ** 2
    for episodes, batch in capture["batches"]:
        assert [len(e.images) for e in episodes] == [turns] * len(episodes)  # episodes run every turn
        assert batch["pixel_values"].shape == (turns * len(episodes), 3, 32, 32)
        assert int((batch["input_ids"] == image_token).sum()) == tokens_per_image * len(batch["pixel_values"])
        assert not (batch["targets"][batch["action_mask"]] == image_token).any()
    assert summary["staleness_max"] == 0


class Gated(Env):
    """Group 0's episodes wait until the trainer has moved on by several versions, so they come back stale."""
    name = "test_gated"
    gate: asyncio.Event | None = None

    async def reset(self, seed):
        self.slow = (seed & 0xFFFFFFFF) == 0
        return Observation("7 2=")

    async def step(self, action):
        if self.slow:
            await self.gate.wait()
        return Result(reward=float(action.strip() == "7"), terminated=True)

    def demonstration(self, seed):
        return ["7"]


def test_bounded_staleness_drops_and_counts(capture, monkeypatch, registered):
    registered(Gated)
    k = 1
    real_update = loop_mod.Training.update

    ages = []  # trainer version - token version, for every trained token

    def slow_update(self, groups):
        # A deliberately slow trainer: extra compute per step, so rollouts run ahead as far as admission lets them.
        for _ in range(30):
            token_logprobs(self.model, collate([e for g in groups for e in g], self.pad_id), 1.0)
        ages.extend(self.version - v for g in groups for e in g for v, a in zip(e.versions, e.is_action) if a)
        return real_update(self, groups)
    monkeypatch.setattr(loop_mod.Training, "update", slow_update)

    steps = []

    class Sink(loop_mod.NullSink):
        def metrics(self, step, values):
            steps.append(values)
            if values.get("version", 0) >= k + 2:
                Gated.gate.set()

    async def run():
        Gated.gate = asyncio.Event()
        cfg = loop_mod.RunConfig.model_validate(
            {"env": "test_gated", "loop": {**SMALL, "steps": 8, "max_staleness": k}, "warm_start": {"steps": 0}})
        return await loop_mod.Training(cfg, Sink()).run()
    asyncio.run(run())

    assert len(ages) > 8 * 4 and max(ages) == k and min(ages) >= 0   # every trained token within the bound
    for values in steps:
        assert values["staleness_max"] <= k
    assert max(v["staleness_max"] for v in steps) == k       # rollout really overlapped training
    assert sum(v["stale_episodes_dropped"] for v in steps) == 4       # group 0 (4 episodes) came back too stale
    trained_groups = {ep.group for episodes, _ in capture["batches"] for ep in episodes}
    assert 0 not in trained_groups


def full_forward_logprobs(model, req: Request) -> torch.Tensor:
    """The log-probs of `req`'s sampled tokens in one forward of `model` over its whole sequence."""
    ids = torch.tensor([req.context + req.ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logp[torch.arange(len(req.context) - 1, ids.shape[1] - 1), ids[0, len(req.context):]]


def run_with_swap_after_3_steps(sampler, reqs, new):
    """Generate `reqs` to the end; version 1 (`new`'s weights) is published after 3 decode steps and swapped in 2
    steps later (swap_wait 2), recomputing the rows still active: their 6th token is the first of version 1."""
    sampler.pending += reqs
    sampler.swap_wait = 2
    for _ in range(3):
        sampler.step()
    sampler.publish(new.state_dict(), 1)
    while sampler.active:
        sampler.step()


def test_weight_swap_mid_generation_tags_versions():
    tok = char_tokenizer()
    old, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    new, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=2)
    sampler = Sampler(copy.deepcopy(old), [tok.eos_token_id], tok.pad_token_id, temperature=1.0, version=0)
    context = tok("3 1 4 1 5=", add_special_tokens=False)["input_ids"]
    other = tok("9 2=", add_special_tokens=False)["input_ids"]
    # Never-ending requests (eos cannot stop them before max_tokens because we check the tags, not the text). Four
    # share their context, so the join's prefill runs it once for all; two of those are greedy, generate the same
    # tokens and so share one cache row all the way.
    reqs = [Request(context, 8, False, 0),
            Request(other, 8, False, 1),
            Request(context, 8, False, 2),
            Request(context, 8, True, 3),
            Request(context, 8, True, 4)]
    rows = []
    sampler.model.model.register_forward_pre_hook(lambda m, args, kw: rows.append(kw["input_ids"].shape), with_kwargs=True)
    run_with_swap_after_3_steps(sampler, reqs, new)
    assert rows[0] == (2, len(context))  # the join's prefill: the distinct contexts only
    assert reqs[3].ids == reqs[4].ids
    assert max(n for n, _ in rows[1:]) <= 4 and rows[1][1] == 1  # decode steps: never a row per request
    for req in reqs:
        n = len(req.ids)
        assert n > 5  # the swap really happened mid-generation
        assert req.versions == [0] * 5 + [1] * (n - 5)
        # Each token's recorded log-prob is that of the weights it is tagged with.
        for version, model in [(0, old), (1, new)]:
            full = full_forward_logprobs(model, req)
            for i, v in enumerate(req.versions):
                if v == version:
                    assert abs(float(full[i]) - req.logprobs[i]) <= 1e-5


def test_weight_swap_mid_generation_reprefills_with_images():
    """A VLM's re-prefill after a weight swap passes each row's image again: every token's recorded log-prob is that
    of the weights it is tagged with, as the trainer recomputes it (collate + token_logprobs, pixel values in)."""
    old, processor = load_policy(ModelConfig(preset="tiny-vlm"), seed=1)
    new, _ = load_policy(ModelConfig(preset="tiny-vlm"), seed=2)
    tok = processor.tokenizer
    sampler = Sampler(copy.deepcopy(old), [tok.eos_token_id], tok.pad_token_id, temperature=1.0, version=0)
    reqs = []
    for i, (colour, shape, question) in enumerate([("red", "circle", "color"), ("blue", "triangle", "count?\nsay")]):
        out = processor(text=f"<image>{question}?\n", images=[Shapes.render(colour, shape, [(2, 2), (18, 18)])],
                        add_special_tokens=False, return_tensors="pt")
        reqs.append(Request(out["input_ids"][0].tolist(), 8, False, i,
                            list(out["pixel_values"])))
    run_with_swap_after_3_steps(sampler, reqs, new)
    episodes = []
    for req in reqs:
        assert len(req.ids) > 5  # the swap really happened mid-generation
        assert req.versions == [0] * 5 + [1] * (len(req.ids) - 5)
        ep = Episode(seed=0, group=0, images=req.images)
        ep.extend(req.context)
        ep.extend(req.ids, action=True, logprobs=req.logprobs, versions=req.versions)
        episodes.append(ep)
    batch = collate(episodes, tok.pad_token_id)
    for version, model in [(0, old), (1, new)]:
        with torch.no_grad():
            logp = token_logprobs(model.eval(), batch, 1.0)
        tagged = batch["action_mask"] & (batch["versions"] == version)
        assert tagged.sum() >= 2 and (logp[tagged] - batch["behav_logp"][tagged]).abs().max() <= 1e-5


def test_a_published_version_waits_for_the_active_turns_to_end_and_then_recomputes_nothing():
    """A version published mid-turn waits (up to swap_wait decode steps) for the active rows to end their turns: their
    tokens keep the old version, and a request submitted meanwhile waits too, then joins the new one. The swap finds
    the cache empty, so no forward recomputes a row; every recorded log-prob is that of its tagged version."""
    tok = char_tokenizer()
    old, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    new, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=2)
    sampler = Sampler(copy.deepcopy(old), [], tok.pad_token_id, temperature=1.0)  # no stop ids: max_tokens a reply
    rows = []
    sampler.model.model.register_forward_pre_hook(lambda m, args, kw: rows.append(tuple(kw["input_ids"].shape)),
                                                  with_kwargs=True)
    first = [Request(tok("3 1 4=", add_special_tokens=False)["input_ids"], 6, False, seed) for seed in (0, 1)]
    later = Request(tok("2 7=", add_special_tokens=False)["input_ids"], 4, False, 2)
    sampler.pending += first
    for _ in range(3):
        sampler.step()
    sampler.publish(new.state_dict(), 1)
    sampler.pending.append(later)
    rows.clear()
    while sampler.pending or sampler.active:
        sampler.step()
    assert sampler.swap_wait >= 3 and sampler.version == 1
    assert [r.versions for r in first] == [[0] * 6] * 2 and later.versions == [1] * 4
    # Three decode steps end the first turns (at most 2 rows, 1 position each), then `later` prefills alone: no
    # forward ran the first requests' contexts again.
    assert all(n <= 2 and width == 1 for n, width in rows[:3]) and rows[3] == (1, len(later.context))
    assert all(n == 1 for n, _ in rows[3:])
    for req, model in [(first[0], old), (first[1], old), (later, new)]:
        assert (full_forward_logprobs(model, req) - torch.tensor(req.logprobs)).abs().max() <= 1e-5


def test_a_next_turn_prefills_only_its_new_tokens_and_its_logprobs_stay_exact():
    """A finished request's keys/values wait (parked) for its episode's next turn, whose prefill then runs only the
    tokens after them, beside a first turn that runs in full; its recorded log-probs are those of one forward over the
    whole episode. A weight swap empties the parked rows: the turn after it prefills in full, tagged with the new
    version."""
    tok = char_tokenizer()
    old, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    new, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=2)
    sampler = Sampler(copy.deepcopy(old), [], tok.pad_token_id, temperature=1.0)  # no stop ids: 4 tokens a reply
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    rows = []
    sampler.model.model.register_forward_pre_hook(lambda m, args, kw: rows.append(tuple(kw["input_ids"].shape)),
                                                  with_kwargs=True)

    def turn(*contexts):  # one reply to each context, to its end; `rows` keeps this turn's forwards
        reqs = [Request(c, 4, False, len(c)) for c in contexts]
        sampler.pending += reqs
        rows.clear()
        while sampler.pending or sampler.active:
            sampler.step()
        return reqs

    first, = turn(encode("Q 12*3\n"))
    second, fresh = turn(first.context + first.ids + encode("=36\n"), encode("Q 7+8\n"))
    assert len(second.context) == 15 and rows[0] == (2, 6)  # the last reply token and "=36\n"; "Q 7+8\n" in full
    sampler.publish(new.state_dict(), 1)
    third, = turn(second.context + second.ids + encode("=1\n"))
    assert rows[0] == (1, len(third.context)) and third.versions == [1] * 4
    for req, model in [(first, old), (second, old), (fresh, old), (third, new)]:
        assert (full_forward_logprobs(model, req) - torch.tensor(req.logprobs)).abs().max() <= 1e-5


def test_decode_steps_write_into_the_caches_room_and_their_logprobs_stay_exact():
    """A decode step writes its token's keys/values into the room its cache layer keeps (RoomyLayer), where
    DynamicLayer copied the whole cache at every step: 39 decode steps of one request use two buffers per layer (the
    prefill's, with 32 positions to spare, then one more), and the recorded log-probs are those of one full forward."""
    tok = char_tokenizer()
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    sampler = Sampler(copy.deepcopy(model), [], tok.pad_token_id, temperature=1.0)  # no stop ids: all 40 tokens
    req = Request(tok("3 1 4 1 5=", add_special_tokens=False)["input_ids"], 40, False, 7)
    sampler.pending.append(req)
    rooms = []  # every buffer seen, kept alive so that none is mistaken for another
    while sampler.pending or sampler.active:
        sampler.step()
        for layer in sampler.cache.layers if sampler.cache else []:
            assert layer.keys.data_ptr() == layer.room[0].data_ptr(), "the keys are the front of the layer's room"
            rooms += [] if any(layer.room[0] is r for r in rooms) else [layer.room[0]]
    assert len(req.ids) == 40 and len(rooms) == 2 * model.config.num_hidden_layers
    assert (full_forward_logprobs(model, req) - torch.tensor(req.logprobs)).abs().max() <= 1e-5


def test_rows_regrouped_or_joined_go_straight_into_new_room_and_every_logprob_stays_exact():
    """Two requests on one prompt share a row, then diverge (a regroup copies rows); a third joins mid-run with a
    shorter prompt (a join left-pads the two caches); the first finishes early (its row goes). After every step each
    layer's keys and values are the front of its room, so the next decode step writes in place, and every request's
    log-probs are those of one full forward."""
    tok = char_tokenizer()
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    sampler = Sampler(copy.deepcopy(model), [], tok.pad_token_id, temperature=1.0)  # no stop ids: max_tokens each
    prompt = tok("3 1 4 1 5 9 2 6=", add_special_tokens=False)["input_ids"]
    reqs = [Request(prompt, 8, False, 1), Request(prompt, 20, False, 2),
            Request(tok("2 7=", add_special_tokens=False)["input_ids"], 12, False, 3)]
    sampler.pending += reqs[:2]
    rows = []
    for step in range(30):
        if step == 3:
            sampler.pending.append(reqs[2])
        sampler.step()
        rows.append(len(sampler.mask) if sampler.active else 0)
        for layer in sampler.cache.layers if sampler.active else []:
            assert layer.keys.data_ptr() == layer.room[0].data_ptr(), f"step {step}: keys outside the room"
            assert layer.values.data_ptr() == layer.room[1].data_ptr(), f"step {step}: values outside the room"
    assert [len(r.ids) for r in reqs] == [8, 20, 12] and max(rows) == 3 and rows[-1] == 0, rows
    for req in reqs:
        assert (full_forward_logprobs(model, req) - torch.tensor(req.logprobs)).abs().max() <= 1e-5


def test_requests_join_decoding_rows_at_every_fourth_step_in_one_prefill_and_at_once_when_none_decode():
    """A join (its prefill and the merge into the cache) costs about two decode steps whatever its size: while rows
    decode, requests wait for the sampler's next 4th step and join together; with no row decoding, a request joins at
    the step it arrives. Every log-prob stays that of one full forward."""
    tok = char_tokenizer()
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    sampler = Sampler(copy.deepcopy(model), [], tok.pad_token_id, temperature=1.0)  # no stop ids: max_tokens each
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    prefills = []  # the forwards of more than one position: the joins'
    sampler.model.model.register_forward_pre_hook(
        lambda m, args, kw: prefills.append(len(kw["input_ids"])) if kw["input_ids"].shape[1] > 1 else None,
        with_kwargs=True)
    first, alone = Request(encode("3 1 4="), 9, False, 1), Request(encode("5="), 3, False, 4)
    late = [Request(encode("2 7="), 6, False, 2), Request(encode("1 8 2 8="), 6, False, 3)]
    sampler.pending.append(first)
    sampler.step()  # step 0
    sampler.pending.append(late[0])
    sampler.step()  # step 1: it waits
    sampler.pending.append(late[1])
    sampler.step()
    sampler.step()  # steps 2 and 3: both wait
    assert len(first.ids) == 4 and [len(r.ids) for r in late] == [0, 0] and prefills == [1]
    sampler.step()  # step 4: both join, in one prefill of two rows
    assert [len(r.ids) for r in late] == [1, 1] and prefills == [1, 2]
    while sampler.active:
        sampler.step()
    assert sampler.stats["steps"] % 4 and [len(r.ids) for r in [first, *late]] == [9, 6, 6]
    sampler.pending.append(alone)
    sampler.step()  # not a 4th step, but nothing decodes: it joins at once
    assert len(alone.ids) == 1 and prefills == [1, 2, 1]
    while sampler.active:
        sampler.step()
    for req in [first, *late, alone]:
        assert (full_forward_logprobs(model, req) - torch.tensor(req.logprobs)).abs().max() <= 1e-5


def test_a_cancelled_request_stops_at_once_and_frees_its_kv_budget():
    """A request whose caller gave up (an agent's timeout, the run's end) is decoded no further from the next step
    on, and the KV budget it held goes to the next request at once; one cancelled while it waits is never decoded."""
    tok = char_tokenizer()
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    context = tok("3 1 4 1 5=", add_special_tokens=False)["input_ids"]
    sampler = Sampler(model, [], tok.pad_token_id, temperature=1.0)  # no stop ids: each runs to its max_tokens
    sampler.kv_tokens = len(context) + 40  # room for one request at a time
    loop = asyncio.new_event_loop()
    reqs = [Request(context, 40, False, i) for i in range(3)]
    for req in reqs:
        req.future = loop.create_future()
    sampler.pending += reqs
    for _ in range(3):
        sampler.step()
    assert sampler.active == [reqs[0]] and len(reqs[0].ids) == 3 and sampler.pending == reqs[1:]
    reqs[0].future.cancel()
    sampler.step()
    assert len(reqs[0].ids) == 3  # nothing more decoded for it
    assert sampler.active == [reqs[1]] and len(reqs[1].ids) == 1 and len(sampler.mask) == 1  # its row went to the next
    reqs[2].future.cancel()
    while sampler.active:
        sampler.step()
    assert len(reqs[1].ids) == 40 and reqs[2].ids == [] and sampler.pending == []
    loop.close()


CONTEXT = char_tokenizer()("3 1 4 1 5=", add_special_tokens=False)["input_ids"]


def sample_in_process(model, seeds: list[int]) -> list[list[int]]:
    """12 tokens an in-process Sampler gives requests of these seeds to CONTEXT, in one batch."""
    async def sample():
        sampler = Sampler(model, [], char_tokenizer().pad_token_id, temperature=1.0)
        task = asyncio.create_task(sampler.run())
        reqs = await asyncio.gather(*(sampler.generate(CONTEXT, 12, seed=s) for s in seeds))
        task.cancel()
        return [r.ids for r in reqs]
    return asyncio.run(sample())


def test_a_requests_samples_follow_its_seed_not_its_batch():
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    first, second, alone = (sample_in_process(model, seeds) for seeds in ([5, 6], [6, 5], [6]))
    assert first == second[::-1] and first[0] != first[1]  # a request's tokens follow its seed, not its batch
    assert alone == first[1:]


def test_a_sampler_process_answers_as_the_sampler_does_and_stops_a_request_its_caller_gave_up():
    """The child reads requests between its decode steps, on its one thread: it answers with the tokens the sampler
    gives in process for the same seeds, stops decoding a request cancelled in flight, and answers the next one."""
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)

    async def main():
        sampler = SamplerProcess(model, stop_ids=[], pad_id=char_tokenizer().pad_token_id, temperature=1.0)
        answers = asyncio.create_task(sampler.run())
        given_up = asyncio.create_task(sampler.generate(CONTEXT, 480, seed=9))
        first = await sampler.generate(CONTEXT, 12, seed=5)  # decoded beside the long one
        given_up.cancel()
        second = await sampler.generate(CONTEXT, 12, seed=6)
        answers.cancel()
        await asyncio.gather(answers, given_up, return_exceptions=True)
        return [first.ids, second.ids], sampler.stats
    ids, stats = asyncio.run(main())
    assert ids == sample_in_process(model, [5, 6])
    assert stats["tokens"] < 12 + 12 + 240  # the cancelled request's 480 tokens were never all decoded
    assert stats["busy_s"] > 0 and stats["steps"] >= 24 and not multiprocessing.active_children()


def test_sampled_tokens_follow_the_softmax_independently_and_never_take_a_token_of_probability_0():
    """The sampler's inverse CDF over each request's hashed uniform numbers: 200 requests x 100 tokens from fixed
    probabilities (the last token, 0, is where a rounding error would land), one logits row for all of them. A
    request's consecutive tokens, and the same token of requests with consecutive seeds (a group's episodes), are
    independent draws: equal as often as the sum of the squared probabilities."""
    model, _ = load_policy(ModelConfig(preset="tiny-dense"), seed=1)
    sampler = Sampler(model, [], 0, temperature=1.0)
    probs = torch.zeros(model.config.vocab_size)
    probs[[3, 5, 8]] = torch.tensor([0.5, 0.3, 0.2])
    reqs = [Request([1], 100, False, seed) for seed in range(200)]
    for req in reqs:
        req.row = 0
    for _ in range(100):
        sampler._sample(reqs, probs.log()[None], None)
    ids = torch.tensor([r.ids for r in reqs])
    tokens = ids.flatten()
    counts = torch.bincount(tokens, minlength=len(probs)) / len(tokens)
    assert set(tokens.tolist()) == {3, 5, 8}
    assert torch.allclose(counts[[3, 5, 8]], torch.tensor([0.5, 0.3, 0.2]), atol=0.01), counts[[3, 5, 8]]
    same = 0.5**2 + 0.3**2 + 0.2**2
    assert (ids[:, 1:] == ids[:, :-1]).float().mean() == pytest.approx(same, abs=0.015)
    assert (ids[1:] == ids[:-1]).float().mean() == pytest.approx(same, abs=0.015)
    assert all(r.logprobs[0] == pytest.approx(float(probs[r.ids[0]].log())) for r in reqs)


class Verbose(Env):
    """Every `every`-th prompt is longer than tiny-dense's context (512): no room for a reply."""
    name = "test_verbose"

    def __init__(self, every: int = 3):
        super().__init__()
        self.every = every

    async def reset(self, seed):
        return Observation(text="1 " * (300 if seed % self.every == 0 else 2) + "=")

    async def step(self, action):
        return Result(reward=float(action.strip() == "1"), terminated=True)

    def demonstration(self, seed):
        return ["1"]


def test_a_prompt_without_room_for_a_reply_is_counted_as_too_long_not_as_stale(registered):
    registered(Verbose)

    class Sink(loop_mod.NullSink):
        rows, alerts = [], []

        def metrics(self, step, values):
            self.rows.append(values)

        def alert(self, kind, message, **data):
            self.alerts.append(kind)
    summary = train({"env": "test_verbose", "loop": {**SMALL, "steps": 4}, "warm_start": {"steps": 0}}, Sink())
    assert summary["status"] == "completed"
    assert sum(r["prompt_too_long"] for r in Sink.rows) >= 4  # prompt 0's group at least: 4 episodes
    assert sum(r["stale_episodes_dropped"] for r in Sink.rows) == 0 and "staleness" not in Sink.alerts
    assert all(r["env_errors"] == 0 for r in Sink.rows)
    with pytest.raises(loop_mod.EnvFailure, match=r"the prompt is \d+ tokens: .* does not fit the context \(512\)"):
        train({"env": "test_verbose", "env_args": {"every": 1}, "loop": {**SMALL, "steps": 4},
               "warm_start": {"steps": 0}})
